"""Linear layers over a few rows on a CPU, written `(W @ x.T).T`: each row rounds as it does
alone, and two or three rows run faster.

A verify multiplies k+1 rows (the last token and k drafts) by each weight matrix where plain
decoding multiplies one; a batched decode step multiplies one row per request. MLX on a CPU
hands `x @ W.T` to OpenBLAS, and two things were measured about that form (OpenBLAS 0.3.21, a
2-core AMD EPYC with AVX2, Dec 2026):

- **Rows round apart.** At 4 rows some widths round differently from the same row alone (up to
  2e-6), so a depth-3 verify's logprobs came 1.2e-4 and 2.2e-4 from plain decoding's on the
  tiny trained test model, past the 1e-4 bound. Written `(W @ x.T).T`, every row of 2-4 equaled
  the row alone there, bit for bit, at one and two threads, at every width the models use.
- **Speed.** With two threads, 3 rows took 35-43 ms against 26-30 (the default size's MLP
  matrices, 90 of them; 2 rows 31 against 23), and a depth-2 verify 0.22-0.24 against
  0.20-0.21 CPU-s. At 4 rows the new form was as fast in some processes and 1.2-1.4x slower in
  others (the cause was not found).

So 2-3 rows take the new form, and 4 rows only inside a verify (`verifying`), where its
exactness is what counts. Which bits a BLAS gives depends on its kernels for the CPU (the tests
passed on another CPU without the form, and fail on this one without it), so `install` checks
both properties on the machine, for each weight shape, at one thread and at the current count,
and gives a layer the form only where they hold: 2-3 rows where the bits equal `x @ W.T`'s
(mlx-lm's answers are unchanged), a verify's rows where each equals the row alone.

Half-precision weights run MLX's own CPU matmul, not OpenBLAS: there both forms gave the same
bits and took the same time. On Metal and CUDA a matmul is the GPU's: nothing is installed.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import mlx.core as mx
import mlx.nn as nn

from kvbank.worker.compute.cores import openblas

FAST_ROWS = range(2, 4)  # faster in every process measured
VERIFY_ROWS = range(2, 5)  # a verify's k+1 rows, up to depth 3 (mtp/decode.py MAX_DEPTH)

_VERIFYING: ContextVar[bool] = ContextVar("few_rows_verifying", default=False)


def _transposed(w: mx.array, bias: mx.array | None, x: mx.array) -> mx.array:
    """x [rows, in] times w [out, in], written (W @ x.T).T; a bias goes into the product, as
    mlx's addmm puts it (`y + bias` rounds otherwise)."""
    y = w @ x.T if bias is None else mx.addmm(bias[:, None], w, x.T)
    return y.T


def _mlx(w: mx.array, bias: mx.array | None, x: mx.array) -> mx.array:
    """nn.Linear's own product."""
    return x @ w.T if bias is None else mx.addmm(bias, x, w.T)


class _FewRowsLinear(nn.Linear):
    """`fast`: 2-3 rows take the form (its bits are `x @ W.T`'s here); `alone`: a verify's rows
    do (each row's bits are its own alone here). Both set by `install`."""

    fast = alone = False

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1] if x.ndim > 1 else 1
        use = (self.fast if rows in FAST_ROWS
               else self.alone if rows in VERIFY_ROWS and _VERIFYING.get() else False)
        if not use:
            return super().__call__(x)
        w = self["weight"]
        y = _transposed(w, self["bias"] if "bias" in self else None, x.reshape(rows, -1))
        return y.reshape(*x.shape[:-1], w.shape[0])


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
    blas = openblas()
    return int(blas.openblas_get_num_threads()) if blas else 0


def _holds(w: mx.array, bias: mx.array | None) -> tuple[bool, bool]:
    """(fast, alone) for a weight like w, on this machine (see `_FewRowsLinear`)."""
    x = mx.random.normal((max(VERIFY_ROWS), w.shape[1]), key=mx.random.key(0)).astype(w.dtype)
    fast = all(mx.array_equal(_transposed(w, bias, x[:r]), _mlx(w, bias, x[:r])).item()
               for r in FAST_ROWS)
    alone = all(mx.array_equal(_transposed(w, bias, x[:r]), mx.concatenate(
        [_mlx(w, bias, x[i:i + 1]) for i in range(r)])).item() for r in VERIFY_ROWS)
    return fast, alone


def _probe(w: mx.array, bias: mx.array | None) -> tuple[bool, bool]:
    """`_holds` at one OpenBLAS thread and at the current count (the engine runs both: one
    while a grammar compiles, worker/compute/cores.py); each must hold at both."""
    blas = openblas()
    now = int(blas.openblas_get_num_threads()) if blas else 0
    if now <= 1:
        return _holds(w, bias)
    try:
        blas.openblas_set_num_threads(1)
        one = _holds(w, bias)
    finally:
        blas.openblas_set_num_threads(now)
    many = _holds(w, bias)
    return one[0] and many[0], one[1] and many[1]


def install(module: nn.Module, *, force: bool = False) -> int:
    """Give the float `nn.Linear` layers under `module` the few-rows form, where MLX runs on a
    CPU (or `force`d: tests) and where it holds on this machine (`_probe`, once per weight
    shape); their parameters are unchanged. Returns how many were given it now."""
    if not (force or mx.default_device().type == mx.DeviceType.cpu) or not VERIFY_ROWS:
        return 0  # not a CPU, or `off`
    seen: dict[tuple, tuple[bool, bool]] = {}
    n = 0
    for _, child in module.named_modules():
        if type(child) is not nn.Linear:
            continue
        w, bias = child["weight"], child["bias"] if "bias" in child else None
        key = (tuple(w.shape), w.dtype, bias is not None)
        if key not in seen:
            seen[key] = _probe(w, bias)
        fast, alone = seen[key]
        if fast or alone:
            child.__class__ = _FewRowsLinear
            child.fast, child.alone = fast, alone
            n += 1
    return n
