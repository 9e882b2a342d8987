"""Moving KV between mlx-lm caches, bank entries and stored blocks.

A bank entry holds, per layer, K and V of exactly its tokens: (1, kv_heads, n, head_dim),
contiguous, so its `nbytes` is what RAM really holds. A request never gets the entry's arrays
to write into: `restore` hands out fresh `KVCache` objects over slices, and mlx-lm's cache
reallocates before it writes past them, so two requests never share mutable state.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from kvbank.blocks import BlockHeader, decode_block, encode_block

Layers = list[tuple[mx.array, mx.array]]
BLOCK_LAYOUT = "kv-block-layout:token-major"  # part of the model fingerprint: never mixed


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


def _to_numpy(a: mx.array) -> np.ndarray:
    a = mx.contiguous(a)
    if a.dtype == mx.bfloat16:  # numpy has no bfloat16: carry its bits
        a = a.view(mx.uint16)
    return np.array(a)


def encode_range(layers: Layers, start: int, end: int) -> bytes:
    """The stored form of tokens [start, end) of an entry: one block.

    Each layer's K and V are stored token-major, (n, kv_heads, head_dim), so the blocks of a
    conversation concatenate by appending bytes: a restore makes one contiguous copy."""
    parts = [(_to_numpy(k[0, :, start:end, :].transpose(1, 0, 2)),
              _to_numpy(v[0, :, start:end, :].transpose(1, 0, 2))) for k, v in layers]
    k0, v0 = parts[0]
    header = BlockHeader(
        dtype=str(layers[0][0].dtype).split(".")[-1],
        n_layers=len(layers),
        n_tokens=end - start,
        k_shape=tuple(k0.shape),
        v_shape=tuple(v0.shape),
    )
    return encode_block(header, parts)


def decode_blocks(payloads: list[bytes]) -> Layers:
    """Stored blocks (in order) back into per-layer (1, H, n, D) arrays: per layer, the blocks'
    token-major bytes are joined in one copy, and read through a transposed view."""
    decoded = [decode_block(raw) for raw in payloads]
    header = decoded[0][0]
    dt = getattr(mx, header.dtype)
    out = []
    for i in range(header.n_layers):
        kv_pair = []
        for j in (0, 1):
            joined = np.concatenate([layers[i][j] for _, layers in decoded], axis=0)
            a = mx.array(joined)
            if header.dtype == "bfloat16":
                a = a.view(dt)
            kv_pair.append(a.transpose(1, 0, 2)[None])
        out.append(tuple(kv_pair))
    mx.eval(out)
    return out
