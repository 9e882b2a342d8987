"""Linear layers over two or three rows, in the form OpenBLAS splits well between threads.

A verify at depth 1 or 2 (2 or 3 tokens) and a batched decode step of 2 or 3 requests
multiply a few rows by each weight matrix. MLX on a CPU hands `x @ W.T` to OpenBLAS, which
with two threads ran it slower than the same product written `(W @ x.T).T`: qwen3_5's MLP
shapes at SmolLM2-135M's size, 90 matrices, 3 rows, 35-43 ms against 26-30 (2 rows: 31 against
23); a depth-2 verify went from 0.22-0.24 to 0.20-0.21 CPU-s (OpenBLAS 0.3.21, a 2-core EPYC
VM, Dec 2026). At 4 rows and more the new form was as fast in some processes and 1.2-1.4x
slower in others, so it stops at 3. Both forms give the same bits (tests/test_few_rows.py):
each output is the same dot product over the same blocks of the inner dimension; only the
split between threads differs.

Only on a CPU, and only where OpenBLAS runs more than one thread (with one there was nothing
to gain): on Metal and CUDA a matmul's split is the GPU's, and nothing is installed.
"""

from __future__ import annotations

import ctypes

import mlx.core as mx
import mlx.nn as nn

FEW_ROWS = range(2, 4)  # rows where the form was faster in every process measured


class _FewRowsLinear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1] if x.ndim > 1 else 1
        if rows not in FEW_ROWS:
            return super().__call__(x)
        w, cols = self["weight"], x.reshape(rows, x.shape[-1]).T
        if "bias" in self:  # into the product, as mlx's addmm: `y + bias` rounds otherwise
            y = mx.addmm(self["bias"][:, None], w, cols)
        else:
            y = w @ cols
        return y.T.reshape(*x.shape[:-1], w.shape[0])


def openblas_threads() -> int:
    """OpenBLAS's thread count in this process (0 where MLX's BLAS is not OpenBLAS)."""
    try:
        return int(ctypes.CDLL(None).openblas_get_num_threads())
    except AttributeError:
        return 0


def wanted(device=None) -> bool:
    """Whether the form pays here: a CPU device and OpenBLAS with more than one thread."""
    device = mx.default_device() if device is None else device
    return device.type == mx.DeviceType.cpu and openblas_threads() > 1


def install(module: nn.Module, *, force: bool = False) -> int:
    """Give every float `nn.Linear` under `module` the few-rows form, where it pays (`wanted`)
    or `force`d (tests); its parameters and results are unchanged. Returns how many."""
    if not (force or wanted()):
        return 0
    n = 0
    for _, child in module.named_modules():
        if type(child) is nn.Linear:
            child.__class__ = _FewRowsLinear
            n += 1
    return n
