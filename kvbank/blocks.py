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

BlockId = NewType("BlockId", bytes)

# A conversation that came with no name is recorded under an id of this form: `~` and 12 hex
# digits of a hash of its first prompt (worker/lineage.py). Every process tells them apart so.
ANONYMOUS_PREFIX = "~"


def is_anonymous(session_id: str) -> bool:
    return session_id.startswith(ANONYMOUS_PREFIX)

CHAIN_SEED = b"kvbank/block-chain/v1"
ID_BYTES = 16
_MAGIC = b"KVB1"
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


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """What a stored block says about itself, so a reader needs nothing else to rebuild it."""

    dtype: str  # MLX dtype name, e.g. "float32", "bfloat16"
    n_layers: int
    n_tokens: int
    k_shape: tuple[int, ...]  # one layer's keys: (kv_heads, n_tokens, head_dim)
    v_shape: tuple[int, ...]

    @property
    def k_nbytes(self) -> int:
        return math.prod(self.k_shape) * _itemsize(self.dtype)

    @property
    def v_nbytes(self) -> int:
        return math.prod(self.v_shape) * _itemsize(self.dtype)


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}[dtype]


def encode_block(header: BlockHeader,
                 layers: Sequence[tuple[np.ndarray, np.ndarray]]) -> bytearray:
    """One value holding every layer's K and V: magic, header length, JSON header, data.

    Each array is copied once, straight into the value (strided views welcome)."""
    meta = json.dumps(
        {
            "dtype": header.dtype,
            "n_layers": header.n_layers,
            "n_tokens": header.n_tokens,
            "k_shape": list(header.k_shape),
            "v_shape": list(header.v_shape),
        }
    ).encode()
    pad = (-(len(_MAGIC) + 4 + len(meta))) % _ALIGN
    head = _MAGIC + struct.pack("<I", len(meta) + pad) + meta + b" " * pad
    out = bytearray(len(head) + header.n_layers * (header.k_nbytes + header.v_nbytes))
    out[: len(head)] = head
    at = len(head)
    for k, v in layers:
        for a in (k, v):
            a = np.asarray(a)
            np.frombuffer(out, dtype=a.dtype, count=a.size, offset=at).reshape(a.shape)[...] = a
            at += a.nbytes
    return out


def decode_header(buf: bytes | memoryview) -> tuple[BlockHeader, int]:
    """The header of a stored block and the offset where its data starts."""
    mv = memoryview(buf)
    if bytes(mv[:4]) != _MAGIC:
        raise ValueError("not a kvbank block (bad magic)")
    (meta_len,) = struct.unpack("<I", mv[4:8])
    meta = json.loads(bytes(mv[8 : 8 + meta_len]))
    header = BlockHeader(
        dtype=meta["dtype"],
        n_layers=meta["n_layers"],
        n_tokens=meta["n_tokens"],
        k_shape=tuple(meta["k_shape"]),
        v_shape=tuple(meta["v_shape"]),
    )
    data_start = 8 + meta_len
    expected = data_start + header.n_layers * (header.k_nbytes + header.v_nbytes)
    if len(mv) != expected:
        raise ValueError(f"truncated block: {len(mv)} bytes, header says {expected}")
    return header, data_start


def decode_block(buf: bytes | memoryview) -> tuple[BlockHeader, list[tuple[np.ndarray, np.ndarray]]]:
    """Numpy views (no copy) of each layer's K and V; bfloat16 comes back as uint16 bits."""
    header, off = decode_header(buf)
    np_dtype = np.uint16 if header.dtype == "bfloat16" else np.dtype(header.dtype)
    k_count, v_count = math.prod(header.k_shape), math.prod(header.v_shape)
    data = np.frombuffer(buf, dtype=np_dtype, offset=off)  # one view, sliced per layer
    layers = []
    for i in range(header.n_layers):
        k0 = i * (k_count + v_count)
        layers.append((data[k0:k0 + k_count].reshape(header.k_shape),
                       data[k0 + k_count:k0 + k_count + v_count].reshape(header.v_shape)))
    return header, layers
