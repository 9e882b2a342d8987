"""An entry's layers: the FULL caches' K and V as the bank keeps them, and their views.

A bank entry holds, per layer, K and V of its n tokens: (1, kv_heads, m >= n, head_dim),
contiguous, so its `nbytes` is what RAM really holds: m > n when the entry kept the buffer its
turn wrote, room and all (at most 1/KEEP_ROOM of it), instead of copying it.

A returning turn whose prompt continues the whole of its conversation's entry takes the entry
out of the bank (`SessionBank.hand_over`) and its arrays with it (`FullKind.restore(...,
owned=True)`, worker/kv/kinds.py), and writes its new tokens in place, past n. MLX writes in
place only into a buffer no other array holds, and copies it first otherwise, so a writer never
disturbs a reader (a write-out's views, another request's slices). Every other request gets
slices, copied before the first write.

Buffers come in sizes of whole `ROOM_STEP` tokens, a conversation's the same size for many
turns, so that the buffers a turn frees are the ones the next turn takes from MLX's cache (it
reuses a buffer only of nearly the same size): fresh memory costs a page fault per 4 KiB, more
than the copy itself.

Quantized at rest (`--kv-bits`, worker/kv/quant.py): an entry's K and V are each a tuple
`QArray` (packed uint32 words, scales, biases), what `mx.quantize` makes of each token's
head_dim vector on its own, so the first n tokens of an entry are the first n of each of its
arrays, and a turn's commit quantizes only the tokens it added: a token is quantized once,
when its turn commits, never again. A request restores them dequantized into an ordinary
KVCache and runs in full precision.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kvbank.contracts.pricing import ROOM_STEP_TOKENS as ROOM_STEP
from kvbank.worker.kv.quant import QArray

Layers = list[tuple[mx.array, mx.array]] | list[tuple[QArray, QArray]]
KEEP_ROOM = 8  # an entry keeps its turn's buffer when the room is at most 1/KEEP_ROOM of it


def cut(a, n_tokens: int):
    """The first n_tokens of one K or V (an array, or a QArray's three)."""
    if isinstance(a, tuple):
        return tuple(x[..., :n_tokens, :] for x in a)
    return a[..., :n_tokens, :]


def tokens_held(a) -> int:
    return int((a[0] if isinstance(a, tuple) else a).shape[2])


def tight(layers: Layers, n_tokens: int) -> Layers:
    """The first n_tokens of every layer, each in an array of its own (a bank entry's)."""
    out = [tuple(tuple(mx.contiguous(x) for x in cut(a, n_tokens)) if isinstance(a, tuple)
                 else mx.contiguous(cut(a, n_tokens)) for a in pair) for pair in layers]
    mx.eval(out)
    return out




def capacity(n_tokens: int) -> int:
    """The buffer size, in tokens, for a cache that must hold n_tokens and then grow."""
    return (n_tokens // ROOM_STEP + 1) * ROOM_STEP








def layers_nbytes(layers: Layers) -> int:
    return sum(sum(int(x.nbytes) for x in a) if isinstance(a, tuple) else int(a.nbytes)
               for pair in layers for a in pair)


def numpy_views(arrays: list[mx.array]) -> list[np.ndarray]:
    """Zero-copy NumPy views of MLX arrays (bf16 as its uint16 bits: NumPy has no bf16).

    Each view is of a new array over the same buffer: that array keeps the buffer alive (a
    NumPy view keeps only its Python object), and while it lives a borrower's write copies
    rather than writes into the buffer being read. One `mx.eval` for them all: one each took
    45 us an array, 1.4 ms for Qwen3.6-27B's 32 K and V arrays on every block a write sends,
    against 0.1 ms together."""
    views = [a.view(mx.uint16 if a.dtype == mx.bfloat16 else a.dtype) for a in arrays]
    mx.eval(views)
    return [np.array(v, copy=False) for v in views]


def layer_views(layers: Layers) -> list[tuple[np.ndarray, np.ndarray]]:
    """Zero-copy NumPy views of an entry's K and V. Take them on the engine thread; reading
    them is then plain NumPy, safe on any thread."""
    flat = [x for pair in layers for a in pair for x in (a if isinstance(a, tuple) else (a,))]
    views = iter(numpy_views(flat))
    return [tuple(tuple(next(views) for _ in a) if isinstance(a, tuple) else next(views)
                  for a in pair) for pair in layers]


def dtype_name(layers: Layers) -> str:
    """The K/V dtype (a quantized entry's: its scales' and biases')."""
    if not layers:
        return "float32"
    a = layers[0][0]
    return str((a[1] if isinstance(a, tuple) else a).dtype).split(".")[-1]
