"""The stored form of an entry's KV: blocks (kvbank/blocks.py) of tokens [start, end), each
layer's K and V token-major, with the checkpoint that stands at the block's end; and back, in
one copy, on a restore's lanes (threads with MLX streams of their own).
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import mlx.core as mx
import numpy as np
import xxhash

from kvbank.blocks import (BlockHeader, CorruptBlock, decode_block, decode_header, encode_block,
                           encoded_nbytes, quantized_specs,
                           kv_data_end as data_end)
from kvbank.blocks import decode_state as decode_state_views
from kvbank.worker.kv.arrays import Layers, dtype_name, layer_views

BLOCK_LAYOUT = "kv-block-layout:token-major"  # part of the model fingerprint: never mixed
RESTORE_LANES = max(1, min(4, os.cpu_count() or 1))  # threads and streams a restore uses
_POOL: ThreadPoolExecutor | None = None
_STREAMS = threading.local()


StateViews = list[tuple[str, np.ndarray] | None]  # a checkpoint's arrays: (dtype name, view)


def _token_major(a, start: int, end: int):
    """Tokens [start, end) of one K or V view, (n, kv_heads, last) (a QArray's each)."""
    if isinstance(a, tuple):
        return tuple(x[0, :, start:end, :].transpose(1, 0, 2) for x in a)
    return a[0, :, start:end, :].transpose(1, 0, 2)


def encode_views(views: list, dtype: str, start: int, end: int, *, layout: str = "",
                 state: StateViews | None = None, bits: int | None = None,
                 out=None) -> bytearray | memoryview:
    """The stored form of tokens [start, end) of an entry: one block, one copy (into `out`
    where given: `encoded_views_nbytes` of it); with `state`, the checkpoint that stands at
    `end` goes in it too.

    Each layer's K and V are stored token-major, (n, kv_heads, head_dim), so the blocks of a
    conversation concatenate by appending bytes: a restore makes one contiguous copy. A
    quantized entry's (`bits`) go as they are in RAM: words, scales, biases, each token-major."""
    parts = [tuple(_token_major(a, start, end) for a in pair) for pair in views]
    arrays = [x for pair in parts for a in pair for x in (a if isinstance(a, tuple) else (a,))]
    arrays += [None if s is None else s[1] for s in state or []]
    return encode_block(_header(parts, dtype, end - start, layout, state, bits), arrays, out)


def encoded_views_nbytes(views: list, dtype: str, start: int, end: int, *, layout: str = "",
                         state: StateViews | None = None, bits: int | None = None) -> int:
    """`len(encode_views(...))` from the shapes alone: nothing is copied."""
    parts = [tuple(_token_major(a, start, end) for a in pair) for pair in views]
    return encoded_nbytes(_header(parts, dtype, end - start, layout, state, bits))


def _logical(a, bits: int | None) -> tuple[tuple[int, ...], int]:
    """(n, kv_heads, head_dim) of one token-major K or V, and its quantization group."""
    if not isinstance(a, tuple):
        return tuple(a.shape), 0
    *lead, words = a[0].shape
    head_dim = words * 32 // bits
    return (*lead, head_dim), head_dim // a[1].shape[-1]


def _header(parts, dtype: str, n_tokens: int, layout: str, state,
            bits: int | None = None) -> BlockHeader:
    shapes = [tuple(_logical(a, bits) for a in pair) for pair in parts]
    groups = {g for pair in shapes for _, g in pair}
    if bits is not None and len(groups) > 1:
        raise ValueError(f"bug: layers quantized in groups of {sorted(groups)}")
    return BlockHeader(dtype=dtype, n_tokens=n_tokens, layout=layout,
                       kv_shapes=tuple((k[0], v[0]) for k, v in shapes),
                       state=tuple(None if s is None else (s[0], tuple(s[1].shape))
                                   for s in state or []),
                       quant=(bits, groups.pop()) if bits is not None and groups else None)


def encode_range(layers: Layers, start: int, end: int, bits: int | None = None) -> bytearray:
    """`encode_views` of an entry's arrays (engine thread)."""
    return encode_views(layer_views(layers), dtype_name(layers), start, end, bits=bits)


def decode_state(payload: bytes | memoryview) -> list[mx.array | None]:
    """The checkpoint a block carries (empty: none), as MLX arrays of their own."""
    header = decode_header(payload)[0]
    out = []
    for spec, a in zip(header.state, decode_state_views(payload)):
        if a is None:
            out.append(None)
            continue
        m = mx.array(a)
        out.append(m.view(mx.bfloat16) if spec[0] == "bfloat16" else m)
    mx.eval([a for a in out if a is not None])
    return out


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


def decode_blocks(payloads, capacity: int = 0, done_with=None, *,
                  layers: int | None = None, verify: bool = True) -> Layers:
    """Stored blocks (in order) back into per-layer (1, H, n, D) arrays, in one copy
    (`decode_stream` over blocks all at hand, laid out as the widest of them).

    `verify=False` only for the yardstick of what checking costs (`kvbank bench coldstore`):
    a restore always checks."""
    headers = [decode_header(p)[0] for p in payloads]
    like = max(headers, key=lambda h: len(h.kv_shapes))
    return decode_stream(payloads.__getitem__, [h.n_tokens for h in headers], like, capacity,
                         done_with, layers=layers, verify=verify)[0]


def decode_stream(get, counts: list[int], like: BlockHeader, capacity: int = 0,
                  done_with=None, *, layers: int | None = None, verify: bool = True
                  ) -> tuple[Layers, list[BlockHeader]]:
    """Blocks of `counts` tokens each, `get(i)` giving block i (it may wait while the block
    is read: a restore copies the blocks read so far while the next are read), back into
    per-layer (1, H, n, D) arrays laid out as `like` says, in one copy; and each block's
    header.

    MLX copies outside memory in (it refuses a CPU buffer without a copy), so each layer's K
    and V is allocated by MLX and filled through a NumPy view of it (documented: writing to the
    view writes the array). The lanes take every n-th block and check each block's checksum as
    they copy it. The arrays are head-major, as a request's cache is, with room for `capacity`
    tokens: the request that restores them (`restore(..., owned=True)`) appends in place, no
    second copy. Quantized blocks come back as QArrays, tight (a request dequantizes them
    anyway). `done_with(payload)`: called by a lane once a block is copied and checked (for the
    LMDB map's views, `StoreReader.get_blocks` passes its `unmap`).

    `layers`: how many K/V pairs the reader keeps (None: all). Blocks of one chain may carry
    the MTP head's layer after the model's or not (kvbank/blocks.py `carries_head`): a block
    without a layer leaves its rows zero, and a layer past `layers` (or past `like`'s) is
    checked, never copied. A block whose tokens, dtype or bits are not `like`'s is corrupt."""
    starts = list(itertools.accumulate(counts, initial=0))
    headers: list[BlockHeader | None] = [None] * len(counts)
    pool, streams = _restore_lanes()
    # Quantized blocks are read tight: the request dequantizes them into its own buffer.
    cap = max(starts[-1], capacity) if like.quant is None else starts[-1]

    def specs(shape):  # the arrays one K or V is stored as
        if like.quant is None:
            return [(like.dtype, shape)]
        return quantized_specs(like.dtype, shape, *like.quant)

    # bf16 is filled as its uint16 bits, viewed as bf16 after
    arrays = [tuple(tuple(mx.zeros((s[1], cap, *s[2:]),
                                   dtype=mx.uint16 if d == "bfloat16" else getattr(mx, d),
                                   stream=streams[i % len(streams)])
                          for d, s in specs(shape))
                    for shape in pair)
              for i, pair in enumerate(like.kv_shapes[:layers])]
    mx.eval(arrays)
    targets = [[np.array(x, copy=False) for a in pair for x in a] for pair in arrays]

    def fill(blocks: range) -> None:
        for b in blocks:
            raw = get(b)
            block_header, kv_arrays = decode_block(raw, verify=False)
            if (block_header.n_tokens, block_header.dtype, block_header.quant) != (
                    counts[b], like.dtype, like.quant):
                raise CorruptBlock(f"block {b}: {block_header.n_tokens} {block_header.dtype} "
                                   f"tokens at {block_header.quant}, not the chain's "
                                   f"{counts[b]} {like.dtype} at {like.quant}", index=b)
            headers[b] = block_header
            h = xxhash.xxh3_64() if verify and block_header.checksum is not None else None
            s, e = starts[b], starts[b + 1]
            for i, pair in enumerate(kv_arrays):
                srcs = [x for a in pair for x in (a if isinstance(a, tuple) else (a,))]
                dsts = targets[i] if i < len(targets) else [None] * len(srcs)  # not kept
                # Each array hashed just before it is copied, while the cache still holds it:
                # checking the block first reads every byte twice from memory (+22 % here).
                for src, dst in zip(srcs, dsts):
                    if h is not None:
                        h.update(src)
                    if dst is not None:
                        dst[:, s:e] = src.transpose(1, 0, 2)
            if h is not None:
                h.update(memoryview(raw)[data_end(raw, block_header):])  # the checkpoint's
                if h.intdigest() != block_header.checksum:
                    raise CorruptBlock(f"block {b}: block checksum mismatch", index=b)
            if done_with is not None:
                done_with(raw)

    lanes = len(streams)
    done, _ = wait([pool.submit(fill, range(i, len(counts), lanes)) for i in range(lanes)])
    for f in sorted(done, key=lambda f: f.exception() is None):  # every lane has stopped
        f.result()  # reading the blocks before an error is raised (a damaged block's first)
    del targets
    bf16 = like.dtype == "bfloat16"

    def as_read(a: mx.array) -> mx.array:
        return (a.view(mx.bfloat16) if bf16 and a.dtype == mx.uint16 else a)[None]

    out = [tuple(tuple(as_read(x) for x in a) if like.quant is not None else as_read(a[0])
                 for a in pair) for pair in arrays]
    mx.eval(out)
    return out, headers
