"""Block ids and the on-wire / on-disk layout of one KV block.

A block is `block_tokens` consecutive tokens of one conversation. Its id chains over every
token before it, the model fingerprint and the tenant:

    h_0 = H(CHAIN_SEED, fingerprint, tenant)
    h_i = H(h_{i-1}, tokens of block i)

so equal ids mean equal prefixes (content addressing: a system prompt shared by many sessions
of a tenant is one chain), and no id can collide across models or tenants. The seed is a fixed,
versioned constant because ids are LMDB keys that outlive processes.

A *tail* block holds the tokens past the last full block; its id hashes a length tag too, so a
partial block never shares an id with a full one.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import NewType, Sequence

import numpy as np
import xxhash

BlockId = NewType("BlockId", bytes)

# A conversation that came with no name is recorded under an id of this form: `~` and 12 hex
# digits of a hash of its first prompt (worker/tiers/lineage.py). Every process tells them apart so.
ANONYMOUS_PREFIX = "~"


def is_anonymous(session_id: str) -> bool:
    return session_id.startswith(ANONYMOUS_PREFIX)

CHAIN_SEED = b"kvbank/block-chain/v1"
ID_BYTES = 16
_ALIGN = 16


def _h(*parts: bytes) -> BlockId:
    h = hashlib.blake2b(digest_size=ID_BYTES)
    for p in parts:
        h.update(p)
    return BlockId(h.digest())


def tokens_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(tokens, dtype=np.uint32).tobytes()


def chain_root(fingerprint: bytes, tenant: str = "") -> BlockId:
    return _h(CHAIN_SEED, fingerprint, b"\0tenant:", tenant.encode())


def chain_block_ids(
    tokens: Sequence[int] | np.ndarray, root: BlockId, block_tokens: int
) -> list[BlockId]:
    """Ids of the full blocks of `tokens` (the partial tail has none here)."""
    arr = np.asarray(tokens, dtype=np.uint32)
    ids: list[BlockId] = []
    parent = root
    for i in range(len(arr) // block_tokens):
        parent = next_block_id(parent, arr[i * block_tokens : (i + 1) * block_tokens])
        ids.append(parent)
    return ids


def next_block_id(parent: BlockId, block: Sequence[int] | np.ndarray) -> BlockId:
    """Id of the full block `block` that follows `parent`."""
    return _h(parent, np.asarray(block, dtype=np.uint32).tobytes())


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Number of leading tokens two token arrays share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def tail_block_id(parent: BlockId, tail_tokens: Sequence[int] | np.ndarray) -> BlockId:
    """Id of a partial block after `parent` (the last full block, or the root)."""
    arr = np.asarray(tail_tokens, dtype=np.uint32)
    return _h(parent, b"\0tail:", struct.pack("<I", len(arr)), arr.tobytes())


FORMAT_VERSION = 3  # of a stored block: KVB1 (one shape for every layer) and KVB2 still read
_MAGIC_V1, _MAGIC, _MAGIC_Q = b"KVB1", b"KVB2", b"KVB3"
# KVB3: a KVB2 block whose K/V are quantized (`--kv-bits`): written only then, so a
# full-precision store's blocks are byte for byte what they were, and a reader that does not
# know quantized blocks refuses them (bad magic) rather than misreads them as floats.
QUANT_WORD_BITS = 32  # mx.quantize packs into uint32 words


def is_quantized_block(buf: bytes | memoryview) -> bool:
    """A KVB3 block (--kv-bits): its store is stamped QUANTIZED_STORE_FORMAT."""
    return bytes(memoryview(buf)[:4]) == _MAGIC_Q


# The tags of the MTP head's two slots (worker/kv/kinds.py HeadKind, HiddenKind), last in a
# block's `layout` when it carries the head's history: its attention layer's rows (the block's
# last K/V pair) and the hidden state it pairs with the next token (its checkpoint's last array).
HEAD_TAG, HIDDEN_TAG = "mtp", "mtp-hidden"
HEAD_LAYOUT = f",{HEAD_TAG},{HIDDEN_TAG}"


def carries_head(header: "BlockHeader") -> bool:
    """Whether a block holds the MTP head's history after the model's own caches (a store
    holding one is stamped HEAD_STORE_FORMAT). Blocks with and without it share ids: the
    model's caches are the same, and a reader keeps the layers it has slots for."""
    return header.layout.endswith(HEAD_LAYOUT)


def is_head_block(buf: bytes | memoryview) -> bool:
    """`carries_head` of a stored block's bytes (False for bytes that are not one: the
    restore that reads them says so)."""
    try:
        return carries_head(decode_header(buf)[0])
    except CorruptBlock:
        return False


class CorruptBlock(ValueError):
    """A stored block whose bytes are not what was written: never used, always recomputed.
    `index`: its place among the blocks being read, where the reader knows it."""

    def __init__(self, message: str, index: int | None = None):
        super().__init__(message)
        self.index = index


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """What a stored block says about itself, so a reader needs nothing else to rebuild it.

    A block holds, for tokens [start, start + n_tokens) of a conversation, the K and V of each
    full-attention cache (`kv_shapes`, token-major: (n_tokens, kv_heads, head_dim)), and, when
    a checkpoint stands at its last token, that checkpoint's window and recurrent arrays
    (`state`: dtype and shape per array, None for one the model had not written). `layout`
    names the model's cache kinds (worker/kv/cache_kinds.py). `checksum` is the xxh3-64 of
    everything after the header."""

    dtype: str  # MLX dtype name of the K/V arrays, e.g. "float32", "bfloat16"
    n_tokens: int
    kv_shapes: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    state: tuple[tuple[str, tuple[int, ...]] | None, ...] = ()
    layout: str = ""
    checksum: int | None = None  # None: a KVB1 block, written before checksums
    # (bits, group_size): K and V quantized per token vector (mx.quantize along head_dim),
    # each stored as its packed uint32 words, then its scales and biases (in `dtype`).
    # `kv_shapes` stay the logical (n_tokens, kv_heads, head_dim). None: full precision.
    quant: tuple[int, int] | None = None

    @property
    def n_layers(self) -> int:
        return len(self.kv_shapes)

    @property
    def has_state(self) -> bool:
        return bool(self.state)

    def kv_specs(self) -> list[tuple[str, tuple[int, ...]]]:
        """The K/V arrays of the payload in order: each layer's K then V (quantized: each of
        them as three arrays, words, scales, biases)."""
        if self.quant is None:
            return [(self.dtype, s) for pair in self.kv_shapes for s in pair]
        return [spec for pair in self.kv_shapes for s in pair
                for spec in quantized_specs(self.dtype, s, *self.quant)]

    @property
    def arrays_per_kv(self) -> int:
        return 1 if self.quant is None else 3

    def array_specs(self) -> list[tuple[str, tuple[int, ...]] | None]:
        """Every array of the payload in order: each layer's K and V, then the state's."""
        return self.kv_specs() + list(self.state)

    @property
    def data_nbytes(self) -> int:
        return sum(math.prod(s) * _itemsize(d) for d, s in filter(None, self.array_specs()))


def quantized_specs(dtype: str, shape: tuple[int, ...], bits: int, group_size: int
                    ) -> list[tuple[str, tuple[int, ...]]]:
    """The arrays `mx.quantize(x, group_size, bits)` makes of an x of `shape` (last axis
    quantized): packed words, scales, biases."""
    *lead, d = shape
    return [("uint32", (*lead, d * bits // QUANT_WORD_BITS)), (dtype, (*lead, d // group_size)),
            (dtype, (*lead, d // group_size))]


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int32": 4,
            "uint32": 4, "int64": 8, "uint16": 2, "int8": 1, "uint8": 1}[dtype]


def _np_dtype(dtype: str) -> np.dtype:
    return np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(dtype)  # bf16 as its bits


def checksum(data: bytes | memoryview | bytearray) -> int:
    return xxhash.xxh3_64_intdigest(data)


def encode_block(header: BlockHeader, arrays: Sequence[np.ndarray | None],
                 out: bytearray | memoryview | None = None) -> bytearray | memoryview:
    """One value holding every array of `header.array_specs()` (its `checksum` is computed
    here): magic, header length, JSON header, data. Each array is copied once, straight into
    its place in the value (strided views welcome); the header, whose length does not depend
    on the checksum, is written in front last, so the data is never copied again. Into `out`
    where given (a writable buffer of `encoded_nbytes(header)`), else a new bytearray."""
    start = len(_head(header, 0))
    if out is None:
        out = bytearray(start + header.data_nbytes)
    elif len(out) != start + header.data_nbytes:
        raise ValueError(f"bug: a buffer of {len(out)} bytes for a block of "
                         f"{start + header.data_nbytes}")
    at = start
    for a in arrays:
        if a is None:
            continue
        a = np.asarray(a)
        np.frombuffer(out, dtype=a.dtype, count=a.size, offset=at).reshape(a.shape)[...] = a
        at += a.nbytes
    if at != len(out):
        raise ValueError(f"bug: arrays of {at - start} bytes for a header of "
                         f"{header.data_nbytes}")
    out[:start] = _head(header, checksum(memoryview(out)[start:]))
    return out


def encoded_nbytes(header: BlockHeader) -> int:
    """The size `encode_block` will give, known before any array is copied (a write announces
    each block's size and streams the payloads behind)."""
    return len(_head(header, 0)) + header.data_nbytes


def _head(header: BlockHeader, digest: int) -> bytes:
    """Magic, length and JSON header, padded so the data starts aligned."""
    fields = {
        "dtype": header.dtype, "n_tokens": header.n_tokens, "layout": header.layout,
        "kv": [[list(k), list(v)] for k, v in header.kv_shapes],
        "state": [None if s is None else [s[0], list(s[1])] for s in header.state],
        "xxh3": f"{digest:016x}",  # fixed width: equal blocks have equal sizes
    }
    if header.quant is not None:
        fields["quant"] = list(header.quant)
    meta = json.dumps(fields).encode()
    magic = _MAGIC if header.quant is None else _MAGIC_Q
    pad = (-(len(magic) + 4 + len(meta))) % _ALIGN
    return magic + struct.pack("<I", len(meta) + pad) + meta + b" " * pad


def decode_header(buf: bytes | memoryview) -> tuple[BlockHeader, int]:
    """The header of a stored block and the offset where its data starts (KVB1 or KVB2)."""
    mv = memoryview(buf)
    magic = bytes(mv[:4])
    if magic not in (_MAGIC, _MAGIC_V1, _MAGIC_Q):
        raise CorruptBlock("not a kvbank block (bad magic)")
    (meta_len,) = struct.unpack("<I", mv[4:8])
    try:
        meta = json.loads(bytes(mv[8 : 8 + meta_len]))
        if magic == _MAGIC_V1:
            header = BlockHeader(dtype=meta["dtype"], n_tokens=meta["n_tokens"],
                                 kv_shapes=((tuple(meta["k_shape"]),
                                             tuple(meta["v_shape"])),) * meta["n_layers"])
        else:
            header = BlockHeader(
                dtype=meta["dtype"], n_tokens=meta["n_tokens"], layout=meta["layout"],
                kv_shapes=tuple((tuple(k), tuple(v)) for k, v in meta["kv"]),
                state=tuple(None if s is None else (s[0], tuple(s[1])) for s in meta["state"]),
                checksum=int(meta["xxh3"], 16),
                quant=tuple(meta["quant"]) if magic == _MAGIC_Q else None)
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptBlock(f"unreadable block header: {e}") from None
    data_start = 8 + meta_len
    expected = data_start + header.data_nbytes
    if len(mv) != expected:
        raise CorruptBlock(f"truncated block: {len(mv)} bytes, header says {expected}")
    return header, data_start


def kv_data_end(buf: bytes | memoryview, header: BlockHeader) -> int:
    """Where a block's K/V arrays end in `buf` (its checkpoint's arrays follow)."""
    kv = sum(math.prod(s) * _itemsize(d) for d, s in header.kv_specs())
    return len(buf) - (header.data_nbytes - kv)


def verify_block(buf: bytes | memoryview) -> tuple[BlockHeader, int]:
    """`decode_header`, once the payload's checksum matches (CorruptBlock otherwise)."""
    header, off = decode_header(buf)
    if header.checksum is not None and checksum(memoryview(buf)[off:]) != header.checksum:
        raise CorruptBlock("block checksum mismatch")
    return header, off


def decode_block(buf: bytes | memoryview, *, verify: bool = True
                 ) -> tuple[BlockHeader, list[tuple[np.ndarray, np.ndarray]]]:
    """NumPy views (no copy) of each layer's K and V; bfloat16 comes back as uint16 bits;
    a quantized block's K and V each as a tuple (words, scales, biases).
    The state's arrays: `decode_state`."""
    header, arrays = _decode_arrays(buf, verify)
    if header.quant is not None:
        arrays = [tuple(arrays[3 * i:3 * i + 3]) for i in range(2 * header.n_layers)]
    return header, [(arrays[2 * i], arrays[2 * i + 1]) for i in range(header.n_layers)]


def decode_state(buf: bytes | memoryview, *, verify: bool = True) -> list[np.ndarray | None]:
    """The checkpoint stored with a block (empty: none), as NumPy views."""
    header, arrays = _decode_arrays(buf, verify)
    return arrays[len(header.kv_specs()):] if header.has_state else []


def _decode_arrays(buf, verify: bool) -> tuple[BlockHeader, list[np.ndarray | None]]:
    header, at = verify_block(buf) if verify else decode_header(buf)
    out: list[np.ndarray | None] = []
    for spec in header.array_specs():
        if spec is None:
            out.append(None)
            continue
        dtype, shape = _np_dtype(spec[0]), spec[1]
        count = math.prod(shape)
        out.append(np.frombuffer(buf, dtype=dtype, count=count, offset=at).reshape(shape))
        at += count * dtype.itemsize
    return header, out
