"""Moving KV between mlx-lm caches, bank entries and stored blocks.

A bank entry holds, per layer, K and V of exactly its tokens: (1, kv_heads, n, head_dim),
contiguous, so its `nbytes` is what RAM really holds. A request never gets the entry's arrays
to write into: `restore` hands out fresh `KVCache` objects over slices, and mlx-lm's cache
reallocates before it writes past them, so two requests never share mutable state.
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from kvbank.blocks import BlockHeader, decode_block, encode_block

Layers = list[tuple[mx.array, mx.array]]
BLOCK_LAYOUT = "kv-block-layout:token-major"  # part of the model fingerprint: never mixed
RESTORE_LANES = max(1, min(4, os.cpu_count() or 1))  # threads and streams a restore uses
_POOL: ThreadPoolExecutor | None = None
_STREAMS = threading.local()


def freeze(cache: list[KVCache], n_tokens: int) -> Layers:
    """Copy the first n_tokens of a request's cache into tight arrays for the bank."""
    layers = []
    for c in cache:
        if c.offset < n_tokens:
            raise RuntimeError(f"bug: cache holds {c.offset} tokens, entry wants {n_tokens}")
        k = mx.contiguous(c.keys[..., :n_tokens, :])
        v = mx.contiguous(c.values[..., :n_tokens, :])
        layers.append((k, v))
    mx.eval(layers)
    return layers


def restore(layers: Layers, n_tokens: int) -> list[KVCache]:
    """A request's own cache over the first n_tokens of `layers` (no copy until written)."""
    out = []
    for k, v in layers:
        c = KVCache()
        c.keys = k[..., :n_tokens, :]
        c.values = v[..., :n_tokens, :]
        c.offset = n_tokens
        out.append(c)
    return out


def layers_nbytes(layers: Layers) -> int:
    return sum(int(k.nbytes) + int(v.nbytes) for k, v in layers)


def layer_views(layers: Layers) -> list[tuple[np.ndarray, np.ndarray]]:
    """Zero-copy NumPy views of an entry's K and V (bf16 as its uint16 bits). Take them on the
    engine thread; reading them is then plain NumPy, safe on any thread, and the views keep
    the arrays alive."""
    def view(a: mx.array) -> np.ndarray:
        if a.dtype == mx.bfloat16:  # numpy has no bfloat16: carry its bits
            a = a.view(mx.uint16)
        mx.eval(a)
        return np.array(a, copy=False)

    return [(view(k), view(v)) for k, v in layers]


def encode_views(views: list[tuple[np.ndarray, np.ndarray]], dtype: str, start: int,
                 end: int) -> bytearray:
    """The stored form of tokens [start, end) of an entry: one block, one copy.

    Each layer's K and V are stored token-major, (n, kv_heads, head_dim), so the blocks of a
    conversation concatenate by appending bytes: a restore makes one contiguous copy."""
    parts = [(k[0, :, start:end, :].transpose(1, 0, 2), v[0, :, start:end, :].transpose(1, 0, 2))
             for k, v in views]
    k0, v0 = parts[0]
    header = BlockHeader(dtype=dtype, n_layers=len(parts), n_tokens=end - start,
                         k_shape=tuple(k0.shape), v_shape=tuple(v0.shape))
    return encode_block(header, parts)


def dtype_name(layers: Layers) -> str:
    return str(layers[0][0].dtype).split(".")[-1]


def encode_range(layers: Layers, start: int, end: int) -> bytearray:
    """`encode_views` of an entry's arrays (engine thread)."""
    return encode_views(layer_views(layers), dtype_name(layers), start, end)


def _restore_lanes() -> tuple[ThreadPoolExecutor, list]:
    """Threads and MLX CPU streams that a restore spreads over, made on first use.

    Page faults on fresh memory cost as much as the copy itself, so a restore uses the
    machine's cores for both: the engine waits on it anyway. MLX streams belong to the thread
    that made them, so each restoring thread has its own."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(RESTORE_LANES, thread_name_prefix="kv-restore")
    streams = getattr(_STREAMS, "streams", None)
    if streams is None:
        streams = _STREAMS.streams = [mx.default_stream(mx.cpu)] + [
            mx.new_stream(mx.cpu) for _ in range(RESTORE_LANES - 1)]
    return _POOL, streams


def decode_blocks(payloads: list[bytes]) -> Layers:
    """Stored blocks (in order) back into per-layer (1, H, n, D) arrays, in one copy.

    MLX copies outside memory in (it refuses a CPU buffer without a copy), so each layer's K
    and V is allocated by MLX and filled through a NumPy view of it (documented: writing to the
    view writes the array). The lanes
    take every n-th block, so a cold read still moves front to back through the file. The
    arrays are token-major and read through a transposed view."""
    decoded = [decode_block(raw) for raw in payloads]
    header = decoded[0][0]
    starts = list(itertools.accumulate((h.n_tokens for h, _ in decoded), initial=0))
    bf16 = header.dtype == "bfloat16"  # filled as its uint16 bits, viewed as bf16 after
    alloc = mx.uint16 if bf16 else getattr(mx, header.dtype)
    pool, streams = _restore_lanes()
    arrays = [tuple(mx.zeros((starts[-1], *shape[1:]), dtype=alloc,
                             stream=streams[i % len(streams)])
                    for shape in (header.k_shape, header.v_shape))
              for i in range(header.n_layers)]
    mx.eval(arrays)
    targets = [tuple(np.array(a, copy=False) for a in pair) for pair in arrays]

    def fill(blocks: range) -> None:
        for b in blocks:
            s, e = starts[b], starts[b + 1]
            for (k, v), (tk, tv) in zip(decoded[b][1], targets):
                tk[s:e] = k
                tv[s:e] = v

    lanes = len(streams)
    done, _ = wait([pool.submit(fill, range(i, len(decoded), lanes)) for i in range(lanes)])
    for f in done:  # every lane has stopped reading the blocks before an error is raised
        f.result()
    out = [tuple((a.view(mx.bfloat16) if bf16 else a).transpose(1, 0, 2)[None] for a in pair)
           for pair in arrays]
    mx.eval(out)
    return out
