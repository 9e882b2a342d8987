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
    """The stored form of tokens [start, end) of an entry: one block."""
    parts = [(_to_numpy(k[0, :, start:end, :]), _to_numpy(v[0, :, start:end, :])) for k, v in layers]
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
    """Concatenate stored blocks (in order) back into per-layer (1, H, n, D) arrays."""
    per_layer_k: list[list[mx.array]] = []
    per_layer_v: list[list[mx.array]] = []
    for raw in payloads:
        header, layers = decode_block(raw)
        dt = getattr(mx, header.dtype)
        for i, (k, v) in enumerate(layers):
            kk, vv = mx.array(k), mx.array(v)
            if header.dtype == "bfloat16":
                kk, vv = kk.view(dt), vv.view(dt)
            if i == len(per_layer_k):
                per_layer_k.append([])
                per_layer_v.append([])
            per_layer_k[i].append(kk)
            per_layer_v[i].append(vv)
    out = [
        (mx.concatenate(ks, axis=1)[None], mx.concatenate(vs, axis=1)[None])
        for ks, vs in zip(per_layer_k, per_layer_v)
    ]
    mx.eval(out)
    return out
