"""Linear layers over a few rows on a CPU, written `(W @ x.T).T`: each row rounds as it does
alone, and two or three rows run faster.

A verify multiplies k+1 rows (the last token and k drafts) by each weight matrix where plain
decoding multiplies one; a batched decode step multiplies one row per request. MLX on a CPU
hands `x @ W.T` to OpenBLAS, and two things were measured about that form (OpenBLAS 0.3.21, a
2-core AMD EPYC with AVX2, Dec 2026):

- **Rows round apart.** At 4 rows some widths round differently from the same row alone (up to
  2e-6), so a depth-3 verify's logprobs came 1.2e-4 and 2.2e-4 from plain decoding's on the
  tiny trained test model, past the 1e-4 bound. Written `(W @ x.T).T`, every row of 2-4 equals
  the row alone, bit for bit, at one and two threads, at every width the models use.
- **Speed.** With two threads, 3 rows took 35-43 ms against 26-30 (the default size's MLP
  matrices, 90 of them; 2 rows 31 against 23), and a depth-2 verify 0.22-0.24 against
  0.20-0.21 CPU-s. At 4 rows the new form was as fast in some processes and 1.2-1.4x slower in
  others (the cause was not found).

So 2-3 rows always take the new form, and 4 rows only inside a verify (`verifying`), where
its exactness is what counts. At 2-3 rows both forms give the same bits
(tests/test_few_rows.py compares a model's logits both ways, biases included): mlx-lm's
answers are unchanged. Half-precision weights run MLX's own CPU matmul, not OpenBLAS: there
both forms gave the same bits and took the same time. On Metal and CUDA a matmul is the GPU's,
and nothing is installed.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from contextvars import ContextVar

import mlx.core as mx
import mlx.nn as nn

FAST_ROWS = range(2, 4)  # faster in every process measured, and exact
VERIFY_ROWS = range(2, 5)  # a verify's k+1 rows, up to depth 3 (mtp/decode.py MAX_DEPTH)

_VERIFYING: ContextVar[bool] = ContextVar("few_rows_verifying", default=False)


class _FewRowsLinear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1] if x.ndim > 1 else 1
        if rows not in FAST_ROWS and not (rows in VERIFY_ROWS and _VERIFYING.get()):
            return super().__call__(x)
        w, cols = self["weight"], x.reshape(rows, x.shape[-1]).T
        if "bias" in self:  # into the product, as mlx's addmm: `y + bias` rounds otherwise
            y = mx.addmm(self["bias"][:, None], w, cols)
        else:
            y = w @ cols
        return y.T.reshape(*x.shape[:-1], w.shape[0])


@contextmanager
def verifying():
    """Inside: a verify's forward, whose rows must round as plain decoding's."""
    token = _VERIFYING.set(True)
    try:
        yield
    finally:
        _VERIFYING.reset(token)


def off() -> None:
    """Every installed layer multiplies as MLX's `x @ W.T` from now on, in this process: for
    `bench decode --few-rows off`, which measures what the form gives. Never in the worker."""
    global FAST_ROWS, VERIFY_ROWS
    FAST_ROWS = VERIFY_ROWS = range(0)


def openblas_threads() -> int:
    """OpenBLAS's thread count in this process (0 where MLX's BLAS is not OpenBLAS)."""
    try:
        return int(ctypes.CDLL(None).openblas_get_num_threads())
    except AttributeError:
        return 0


def install(module: nn.Module, *, force: bool = False) -> int:
    """Give every float `nn.Linear` under `module` the few-rows form where MLX runs on a CPU
    (or `force`d: tests); its parameters are unchanged. Returns how many were given it now."""
    if not (force or mx.default_device().type == mx.DeviceType.cpu):
        return 0
    n = 0
    for _, child in module.named_modules():
        if type(child) is nn.Linear:
            child.__class__ = _FewRowsLinear
            n += 1
    return n
