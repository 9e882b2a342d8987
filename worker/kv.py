"""Moving KV between mlx-lm caches, bank entries and stored blocks.

A bank entry holds, per layer, K and V of its n tokens: (1, kv_heads, m >= n, head_dim),
contiguous, so its `nbytes` is what RAM really holds: m > n when the entry kept the buffer its
turn wrote, room and all (at most 1/8 of it), instead of copying it.

A returning turn whose prompt continues the whole of its conversation's entry takes the entry
out of the bank (`SessionBank.hand_over`) and its arrays with it (`restore(..., owned=True)`),
and writes its new tokens in place, past n. MLX writes in place only into a buffer no other
array holds, and copies it first otherwise, so a writer never disturbs a reader (a write-out's
views, another request's slices). Every other request gets slices, copied before the first
write.

Buffers come in sizes of whole `ROOM_STEP` tokens, a conversation's the same size for many
turns, so that the buffers a turn frees are the ones the next turn takes from MLX's cache (it
reuses a buffer only of nearly the same size): fresh memory costs a page fault per 4 KiB, more
than the copy itself.

Quantized at rest (`--kv-bits`, worker/cache_kinds.py): an entry's K and V are each a tuple
`QArray` (packed uint32 words, scales, biases), what `mx.quantize` makes of each token's
head_dim vector on its own, so the first n tokens of an entry are the first n of each of its
arrays, and a turn's commit quantizes only the tokens it added (`freeze(..., prefix=)`): a
token is quantized once, when its turn commits, never again. A request restores them
dequantized into an ordinary KVCache and runs in full precision.
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import mlx.core as mx
import numpy as np
import xxhash
from mlx_lm.models.cache import KVCache

from kvbank.blocks import (BlockHeader, CorruptBlock, decode_block, decode_header, encode_block,
                           encoded_nbytes, quantized_specs,
                           kv_data_end as data_end)
from kvbank.blocks import decode_state as decode_state_views

QArray = tuple[mx.array, mx.array, mx.array]  # mx.quantize's words, scales, biases
Layers = list[tuple[mx.array, mx.array]] | list[tuple[QArray, QArray]]
BLOCK_LAYOUT = "kv-block-layout:token-major"  # part of the model fingerprint: never mixed
RESTORE_LANES = max(1, min(4, os.cpu_count() or 1))  # threads and streams a restore uses
ROOM_STEP = 256  # tokens; mlx-lm's KVCache grows by as many
KEEP_ROOM = 8  # an entry keeps its turn's buffer when the room is at most 1/KEEP_ROOM of it
_POOL: ThreadPoolExecutor | None = None
_STREAMS = threading.local()


QUANT_GROUP_SIZES = (64, 32)  # along head_dim: the largest that divides it


def group_size(head_dim: int) -> int:
    """The quantization group for a head_dim (MLX quantizes in groups of 32, 64 or 128)."""
    for g in QUANT_GROUP_SIZES:
        if head_dim % g == 0:
            return g
    raise ValueError(f"head_dim {head_dim} is not a multiple of 32: --kv-bits cannot "
                     f"quantize it")


def quantize(x: mx.array, bits: int) -> QArray:
    """Each token's vectors (the last axis) quantized on their own."""
    return tuple(mx.quantize(x, group_size=group_size(int(x.shape[-1])), bits=bits))


def dequantize(q: QArray, bits: int) -> mx.array:
    head_dim = int(q[0].shape[-1]) * 32 // bits
    return mx.dequantize(*q, group_size=head_dim // int(q[1].shape[-1]), bits=bits)


def is_quantized(layers: Layers) -> bool:
    return bool(layers) and isinstance(layers[0][0], tuple)


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


def freeze_quantized(cache: list[KVCache], n_tokens: int, bits: int,
                     prefix: tuple[Layers, int] | None = None) -> Layers:
    """`freeze`, quantized: tokens past `prefix` (quantized layers for its first m tokens,
    which this cache was restored from) are quantized here; the prefix's are kept as they
    are, never quantized again (quantize(dequantize(q)) is not q)."""
    held, m = prefix if prefix is not None else ([], 0)
    m = min(m, n_tokens)
    layers = []
    for i, c in enumerate(cache):
        if c.offset < n_tokens:
            raise RuntimeError(f"bug: cache holds {c.offset} tokens, entry wants {n_tokens}")
        pair = []
        for j, a in enumerate((c.keys, c.values)):
            new = quantize(a[..., m:n_tokens, :], bits) if n_tokens > m else None
            old = cut(held[i][j], m) if m else None
            if old is None or new is None:
                parts = old if new is None else new
                pair.append(tuple(mx.contiguous(x) for x in parts))
            else:
                pair.append(tuple(mx.concatenate([o, x], axis=2) for o, x in zip(old, new)))
        layers.append(tuple(pair))
    mx.eval(layers)
    return layers


def capacity(n_tokens: int) -> int:
    """The buffer size, in tokens, for a cache that must hold n_tokens and then grow."""
    return (n_tokens // ROOM_STEP + 1) * ROOM_STEP


def freeze(cache: list[KVCache], n_tokens: int) -> Layers:
    """The first n_tokens of a request's cache as arrays for the bank: the cache's own buffers
    when their room is small, else a tight copy."""
    layers = []
    for c in cache:
        if c.offset < n_tokens:
            raise RuntimeError(f"bug: cache holds {c.offset} tokens, entry wants {n_tokens}")
        k, v = c.keys, c.values
        if k.shape[2] - n_tokens > n_tokens // KEEP_ROOM:
            k, v = k[..., :n_tokens, :], v[..., :n_tokens, :]
        layers.append((mx.contiguous(k), mx.contiguous(v)))  # no copy when already so
    mx.eval(layers)
    return layers


def restore(layers: Layers, n_tokens: int, owned: bool = False,
            bits: int | None = None) -> list[KVCache]:
    """A request's own cache over the first n_tokens of `layers` (no copy until written).

    `owned`: the request may write past n_tokens (arrays decoded from SSD for it, or a bank
    entry handed over to it): the cache takes them whole, room included, and writes its new tokens in
    place (MLX reuses a buffer that only one array holds). Otherwise it gets slices, and its
    first write copies them. Quantized layers (`bits`) are dequantized into arrays of the
    request's own."""
    out = []
    for k, v in layers:
        c = KVCache()
        if isinstance(k, tuple):
            c.keys, c.values = (dequantize(cut(a, n_tokens), bits) for a in (k, v))
        elif owned:
            c.keys, c.values = k, v
        else:
            c.keys = k[..., :n_tokens, :]
            c.values = v[..., :n_tokens, :]
        c.offset = n_tokens
        out.append(c)
    return out


def with_room(cache: list, n_tokens: int) -> None:
    """A restored cache without room for its request's prompt (n_tokens) and a first answer
    token gets its own buffer of `capacity(n_tokens)` now: the copy its first write would
    make, at a size that MLX's cache can serve again."""
    for c in cache:
        if type(c) is KVCache and c.keys is not None and c.keys.shape[2] <= n_tokens:
            pad = [(0, 0), (0, 0), (0, capacity(n_tokens) - c.offset), (0, 0)]
            c.keys = mx.pad(c.keys[..., :c.offset, :], pad)
            c.values = mx.pad(c.values[..., :c.offset, :], pad)


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


def dtype_name(layers: Layers) -> str:
    """The K/V dtype (a quantized entry's: its scales' and biases')."""
    if not layers:
        return "float32"
    a = layers[0][0]
    return str((a[1] if isinstance(a, tuple) else a).dtype).split(".")[-1]


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


def decode_blocks(payloads: list[bytes], capacity: int = 0, done_with=None, *,
                  verify: bool = True) -> Layers:
    """Stored blocks (in order) back into per-layer (1, H, n, D) arrays, in one copy.

    MLX copies outside memory in (it refuses a CPU buffer without a copy), so each layer's K
    and V is allocated by MLX and filled through a NumPy view of it (documented: writing to the
    view writes the array). The lanes take every n-th block and check each block's checksum as
    they copy it (the reads happened as the blocks were got: py-lmdb reads a value whole). The
    arrays are head-major, as a request's cache is, with room for `capacity` tokens: the
    request that restores them (`restore(..., owned=True)`) appends in place, no second copy.
    Quantized blocks come back as QArrays, tight (a request dequantizes them anyway).
    `done_with(payload)`: called by a lane once a block is copied and checked (for the LMDB
    map's views, `StoreReader.get_blocks` passes its `unmap`). `verify=False` only for the
    yardstick of what checking costs (`kvbank bench coldstore`): a restore always checks."""
    decoded = [decode_block(raw, verify=False) for raw in payloads]
    kv_end = [data_end(raw, h) for raw, (h, _) in zip(payloads, decoded)]
    header = decoded[0][0]
    if any(h.quant != header.quant for h, _ in decoded):
        raise CorruptBlock("blocks of one conversation quantized differently")
    starts = list(itertools.accumulate((h.n_tokens for h, _ in decoded), initial=0))
    pool, streams = _restore_lanes()
    # Quantized blocks are read tight: the request dequantizes them into its own buffer.
    cap = max(starts[-1], capacity) if header.quant is None else starts[-1]

    def specs(shape):  # the arrays one K or V is stored as
        if header.quant is None:
            return [(header.dtype, shape)]
        return quantized_specs(header.dtype, shape, *header.quant)

    # bf16 is filled as its uint16 bits, viewed as bf16 after
    arrays = [tuple(tuple(mx.zeros((s[1], cap, *s[2:]),
                                   dtype=mx.uint16 if d == "bfloat16" else getattr(mx, d),
                                   stream=streams[i % len(streams)])
                          for d, s in specs(shape))
                    for shape in pair)
              for i, pair in enumerate(header.kv_shapes)]
    mx.eval(arrays)
    targets = [[np.array(x, copy=False) for a in pair for x in a] for pair in arrays]

    def fill(blocks: range) -> None:
        for b in blocks:
            block_header, kv_arrays = decoded[b]
            h = xxhash.xxh3_64() if verify and block_header.checksum is not None else None
            s, e = starts[b], starts[b + 1]
            for pair, dsts in zip(kv_arrays, targets):
                srcs = [x for a in pair for x in (a if isinstance(a, tuple) else (a,))]
                # Each array hashed just before it is copied, while the cache still holds it:
                # checking the block first reads every byte twice from memory (+22 % here).
                for src, dst in zip(srcs, dsts):
                    if h is not None:
                        h.update(src)
                    dst[:, s:e] = src.transpose(1, 0, 2)
            if h is not None:
                h.update(memoryview(payloads[b])[kv_end[b]:])  # the checkpoint's arrays
                if h.intdigest() != block_header.checksum:
                    raise CorruptBlock(f"block {b}: block checksum mismatch", index=b)
            if done_with is not None:
                done_with(payloads[b])

    lanes = len(streams)
    done, _ = wait([pool.submit(fill, range(i, len(decoded), lanes)) for i in range(lanes)])
    for f in done:  # every lane has stopped reading the blocks before an error is raised
        f.result()
    del targets
    bf16 = header.dtype == "bfloat16"

    def as_read(a: mx.array) -> mx.array:
        return (a.view(mx.bfloat16) if bf16 and a.dtype == mx.uint16 else a)[None]

    out = [tuple(tuple(as_read(x) for x in a) if header.quant is not None else as_read(a[0])
                 for a in pair) for pair in arrays]
    mx.eval(out)
    return out
