"""The CPU's cores between the model's forwards and the grammar compiles (MLX on a CPU, with
OpenBLAS).

A compile (llguidance, on a thread of the worker's server: worker/compute/grammar_compile.py)
takes a core for up to seconds. OpenBLAS's threads wait for each other at every matmul, so
with one of them sharing its core with a compile every forward waited for it: another API
key's answer, alone in the engine, took 0.20-0.40 s a token against 0.06 s (`bench tenants`
`slow_schema`, 2 cores). While compiles run, the forwards use the cores they leave (at least
one). On a GPU the forwards use no BLAS, and nothing here changes.
"""

from __future__ import annotations

import ctypes
from typing import Callable

import mlx.core as mx

from kvbank.config import preload_openblas


def openblas() -> ctypes.CDLL | None:
    """The OpenBLAS MLX's CPU matmuls use in this process (None on a GPU, or without it)."""
    path = preload_openblas() if mx.default_device().type == mx.DeviceType.cpu else None
    return ctypes.CDLL(path) if path else None


class Cores:
    """The engine thread's: OpenBLAS's thread count, set before each step. `stream`: where
    the engine's forwards run."""

    def __init__(self, stream=None) -> None:
        self.stream = stream
        # Compiles running now: the worker's server sets it (GrammarCompiles.running).
        self.compiling: Callable[[], int] = lambda: 0
        self._blas = openblas()  # the library MLX already uses
        self.all = self._blas.openblas_get_num_threads() if self._blas else 0
        self.now = self.all

    def threads(self) -> int:
        """OpenBLAS's own count of its threads now (0: no OpenBLAS here)."""
        return self._blas.openblas_get_num_threads() if self._blas else 0

    def share(self) -> None:
        """Before a step: the forwards get the cores the running compiles leave them."""
        if self._blas is None:
            return
        want = max(1, self.all - self.compiling())
        if want != self.now:
            mx.synchronize(self.stream)  # no matmul in flight while OpenBLAS's pool changes
            self._blas.openblas_set_num_threads(want)
            self.now = want
