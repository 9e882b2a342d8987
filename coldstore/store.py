"""The LMDB layout: KV blocks, their reference counts, session records.

Durability order, the one rule everything else leans on: an LMDB write transaction's commit
is the commit point. A block becomes restorable only when the transaction that wrote it
committed, and a session record names a block only in that same transaction or a later one.
So kill -9 at any moment leaves a store whose records name whole, correct blocks.

The layout (named databases, keys) and the read side are shared with the worker:
kvbank/contracts/store_layout.py. This module adds the writes.
"""

from __future__ import annotations

import logging
import struct
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import lmdb
import numpy as np

from kvbank.blocks import (BlockId, common_prefix_len, decode_header, is_anonymous,
                           is_head_block, is_quantized_block, next_block_id, tail_block_id)
from kvbank.contracts.store_layout import (BLOCK_BYTES_KEY, FORMAT_KEY, HEAD_STORE_FORMAT,
                                           QUANTIZED_KEY, QUANTIZED_STORE_FORMAT,
                                           RESPONSE_BYTES_KEY, SessionMeta, StoreReader,
                                           session_key)

logger = logging.getLogger(__name__)

__all__ = ["ColdStore", "SessionMeta", "StoreFull", "session_key"]

MAX_ANCHORS = 8  # a record's anchors: its first, then the newest
MAP_RESERVE_BYTES = 1 << 20  # past the map's ceiling, for a write that is not KV


class StoreFull(RuntimeError):
    """A KV block the map has no room for at its ceiling (`map_max_bytes`)."""

    def __init__(self, map_bytes: int, used_bytes: int):
        super().__init__(f"LMDB's map is full: {used_bytes} of its {map_bytes} bytes hold pages")
        self.map_bytes, self.used_bytes = map_bytes, used_bytes


class ColdStore(StoreReader):
    """The store with its writes: the coldstore process's only. `map_max_bytes`: the map's
    ceiling (None: it doubles as the store grows, from INITIAL_MAP_BYTES)."""

    def __init__(self, path: Path, *, readonly: bool = False, map_max_bytes: int | None = None):
        super().__init__(path, readonly=readonly)
        self.map_max_bytes = map_max_bytes
        if map_max_bytes is not None and not readonly:
            self.env.set_mapsize(map_max_bytes)  # never below what the file holds

    # -- writes (coldstore only) ----------------------------------------------------------

    def _write(self, fn, *, kv: bool = False):
        """Run fn(txn) in one write transaction. A full map doubles, up to `map_max_bytes`.
        At the ceiling a KV write (`kv`) raises StoreFull, once one more commit has let the
        pages freed just before it be reused (LMDB reuses a page two commits after the one
        that freed it); any other write (a record, a deletion) takes MAP_RESERVE_BYTES more
        for itself, so a full store still records turns and can still shrink."""
        settled, grew = False, False
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    out = fn(txn)
                break
            except lmdb.MapFullError:
                size, ceiling = self.env.info()["map_size"], self.map_max_bytes
                if ceiling is None or size < ceiling:
                    new = size * 2 if ceiling is None else min(size * 2, ceiling)
                    logger.info("LMDB map full, growing to %d bytes", new)
                    self.env.set_mapsize(new)
                elif kv and settled:
                    raise StoreFull(size, self.stats()["used_bytes"]) from None
                elif kv:
                    self._write(lambda txn: self._add_block_bytes(txn, 0))
                    settled = True
                else:
                    logger.log(logging.WARNING if size == ceiling else logging.DEBUG,
                               "LMDB map full at its ceiling of %d bytes: a write that is not "
                               "KV (a record, a deletion) passes it", ceiling)
                    self.env.set_mapsize(size + MAP_RESERVE_BYTES)
                    grew = True
        if grew:
            self.env.set_mapsize(self.map_max_bytes)  # back: no KV past it
        return out

    def put_session_tokens(self, tenant: str, session_id: str, tokens: np.ndarray,
                           block_tokens: int) -> SessionMeta:
        """Commit a session's token history (durable on return).

        Blocks the record named stay only where the new history still starts with the tokens
        they cover (a client that edited its history invalidates the rest).
        """
        tokens = np.ascontiguousarray(tokens, dtype=np.uint32)
        key = session_key(tenant, session_id)
        now = time.time()

        def fn(txn):
            raw = txn.get(key, db=self._db[b"sessions"])
            if raw is None:
                meta = SessionMeta(session_id, tenant, block_tokens=block_tokens, created_at=now)
                old = np.zeros(0, np.uint32)
            else:
                meta = SessionMeta.from_json(raw)
                old = np.frombuffer(txn.get(key, db=self._db[b"tokens"]) or b"", dtype=np.uint32)
            common = common_prefix_len(old, tokens)
            if meta.durable_tokens > common or any(a[1] + a[2] > common for a in meta.anchors):
                self._truncate_blocks(txn, meta, common)
            meta.token_count = len(tokens)
            meta.updated_at = now
            raw_tokens = tokens.tobytes()
            meta.seal(raw_tokens)
            txn.put(key, raw_tokens, db=self._db[b"tokens"])
            txn.put(key, meta.to_json(), db=self._db[b"sessions"])
            return meta

        return self._write(fn)

    def commit_block(self, tenant: str, session_id: str, root: BlockId, block_id: BlockId,
                     start: int, payload: bytes | memoryview) -> SessionMeta | None:
        """Store one block and extend the session record over it, in one transaction.

        The block must be the next one the record lacks, and its id must be the one the
        record's own tokens give (so a stale job for an edited history writes nothing).
        Returns the new meta, or None when the record no longer wants this block;
        `last_written_bytes` says what reached the disk (0: stored already, by anyone).
        """
        key = session_key(tenant, session_id)
        self.last_written_bytes = 0

        def fn(txn):
            meta = self._meta(txn, key)
            if meta is None:
                return None
            B = meta.block_tokens
            if start < len(meta.blocks) * B:  # already committed (a job that overlaps)
                return meta if meta.blocks[start // B] == block_id.hex() else None
            if start != len(meta.blocks) * B:
                return None
            toks = np.frombuffer(txn.get(key, db=self._db[b"tokens"]) or b"", dtype=np.uint32)
            parent = BlockId(bytes.fromhex(meta.blocks[-1])) if meta.blocks else root
            if len(toks) >= start + B and next_block_id(parent, toks[start : start + B]) == block_id:
                is_tail, n = False, B
            else:
                n = min(len(toks) - start, B)
                if n <= 0 or tail_block_id(parent, toks[start : start + n]) != block_id:
                    return None
                is_tail = True
            if is_tail and meta.tail == block_id.hex():
                return meta
            self._keep_block(txn, block_id, payload)
            if meta.tail:
                self._decref(txn, BlockId(bytes.fromhex(meta.tail)))
                meta.tail, meta.tail_tokens = None, 0
            if is_tail:
                meta.tail, meta.tail_tokens = block_id.hex(), n
            else:
                meta.blocks.append(block_id.hex())
            txn.put(key, meta.to_json(), db=self._db[b"sessions"])
            return meta

        return self._write(fn, kv=True)

    def commit_anchor(self, tenant: str, session_id: str, root: BlockId, block_id: BlockId,
                      start: int, payload: bytes | memoryview) -> SessionMeta | None:
        """Store a partial block that carries a checkpoint where a conversation comes back
        (the end of a system prompt, a prompt's end before its generation prompt) and name it
        in the record, in one transaction: a record keeps its first and its newest
        MAX_ANCHORS - 1. Its id must be the one the record's tokens give from `start` on,
        after the record's own blocks up to `start`; it is stored once, whoever else names
        it. None when the record does not want it."""
        key = session_key(tenant, session_id)
        n = decode_header(payload)[0].n_tokens
        self.last_written_bytes = 0

        def fn(txn):
            meta = self._meta(txn, key)
            if meta is None:
                return None
            B = meta.block_tokens
            if start % B or start > len(meta.blocks) * B:
                return None
            if any(a[0] == block_id.hex() for a in meta.anchors):
                return meta
            toks = np.frombuffer(txn.get(key, db=self._db[b"tokens"]) or b"", dtype=np.uint32)
            parent = BlockId(bytes.fromhex(meta.blocks[start // B - 1])) if start else root
            if len(toks) < start + n or tail_block_id(parent, toks[start:start + n]) != block_id:
                return None
            self._keep_block(txn, block_id, payload)
            meta.anchors.append([block_id.hex(), start, n])
            while len(meta.anchors) > MAX_ANCHORS:  # the first (a system prompt's), the newest
                self._decref(txn, BlockId(bytes.fromhex(meta.anchors.pop(1)[0])))
            txn.put(key, meta.to_json(), db=self._db[b"sessions"])
            return meta

        return self._write(fn, kv=True)

    def put_salvaged(self, meta: SessionMeta, tokens: np.ndarray,
                     block: Callable[[BlockId], bytes | None]) -> SessionMeta:
        """A record read from a damaged store, in one transaction, with the blocks `block`
        gives (bytes that verified; None: lost): cut short at its first lost block, its tail
        kept only after all of them, its anchors only where its kept blocks reach. A block
        stored already is counted, not asked for again."""
        key = session_key(meta.tenant, meta.session_id)

        def fn(txn):
            def keep(hexid: str) -> bool:
                bid = BlockId(bytes.fromhex(hexid))
                stored = self._holds_block(txn, bid)
                payload = b"" if stored else block(bid)
                if payload is not None:
                    self._keep_block(txn, bid, payload)
                return payload is not None

            n = 0
            while n < len(meta.blocks) and keep(meta.blocks[n]):
                n += 1
            tail = n == len(meta.blocks) and meta.tail is not None and keep(meta.tail)
            out = replace(meta, blocks=meta.blocks[:n], tail=meta.tail if tail else None,
                          tail_tokens=meta.tail_tokens if tail else 0)
            out.anchors = [a for a in meta.anchors if a[1] <= n * meta.block_tokens and keep(a[0])]
            raw_tokens = np.ascontiguousarray(tokens, dtype=np.uint32).tobytes()
            out.seal(raw_tokens)
            txn.put(key, raw_tokens, db=self._db[b"tokens"])
            txn.put(key, out.to_json(), db=self._db[b"sessions"])
            return out

        return self._write(fn)

    def truncate_session(self, tenant: str, session_id: str,
                         keep_tokens: int) -> SessionMeta | None:
        """Forget the session's blocks past `keep_tokens` (its token history stays)."""
        key = session_key(tenant, session_id)

        def fn(txn):
            raw = txn.get(key, db=self._db[b"sessions"])
            if raw is None:
                return None
            meta = SessionMeta.from_json(raw)
            if meta.durable_tokens > keep_tokens:
                self._truncate_blocks(txn, meta, keep_tokens)
                txn.put(key, meta.to_json(), db=self._db[b"sessions"])
            return meta

        return self._write(fn)

    def delete_session(self, tenant: str, session_id: str) -> bool:
        key = session_key(tenant, session_id)

        def fn(txn):
            raw = txn.get(key, db=self._db[b"sessions"])
            if raw is None:
                return False
            meta = SessionMeta.from_json(raw)
            self._truncate_blocks(txn, meta, 0)
            txn.delete(key, db=self._db[b"sessions"])
            txn.delete(key, db=self._db[b"tokens"])
            return True

        return self._write(fn)

    def retire_lru(self, target_bytes: int, *,
                   keep: tuple[str, str] | None = None) -> list[SessionMeta]:
        """Drop the KV of least recently used sessions until the stored blocks fit in
        target_bytes; blocks no record names any more are collected. A named session keeps
        its token history; an anonymous one is deleted whole (nothing could name it again).
        Returns the records retired, as they were."""
        retired: list[SessionMeta] = []
        for meta in sorted(self.list_sessions(), key=lambda m: m.updated_at):
            if self.block_bytes() <= target_bytes:
                break
            if not meta.durable_tokens or (meta.tenant, meta.session_id) == keep:
                continue
            if is_anonymous(meta.session_id):
                self.delete_session(meta.tenant, meta.session_id)
            else:
                self.truncate_session(meta.tenant, meta.session_id, 0)
            retired.append(meta)
        return retired

    def drop_block(self, block_id: BlockId) -> list[SessionMeta]:
        """A block that failed its checksum goes, in one transaction: every record naming it
        keeps only the blocks before it, and the block's value is deleted whatever its count
        says. Returns those records as they are now. A rare event: records are scanned."""
        hexid = bytes(block_id).hex()

        def fn(txn):
            cut = []
            for _, raw in txn.cursor(db=self._db[b"sessions"]):
                meta = SessionMeta.from_json(bytes(raw))
                if hexid in meta.blocks:
                    self._truncate_blocks(txn, meta, meta.blocks.index(hexid) * meta.block_tokens)
                elif meta.tail == hexid:
                    self._truncate_blocks(txn, meta, len(meta.blocks) * meta.block_tokens)
                elif any(a[0] == hexid for a in meta.anchors):
                    meta.anchors = [a for a in meta.anchors if a[0] != hexid]
                else:
                    continue
                txn.put(session_key(meta.tenant, meta.session_id), meta.to_json(),
                        db=self._db[b"sessions"])
                cut.append(meta)
            old = txn.get(block_id, db=self._db[b"blocks"])
            if old is not None:
                self._add_block_bytes(txn, -len(old))
                txn.delete(block_id, db=self._db[b"blocks"])
            txn.delete(block_id, db=self._db[b"refs"])
            return cut

        return self._write(fn)

    def expire_anonymous(self, before: float) -> list[SessionMeta]:
        """Delete the anonymous conversations last used before `before` (unix s)."""
        expired = [m for m in self.list_sessions()
                   if is_anonymous(m.session_id) and m.updated_at < before]
        for meta in expired:
            self.delete_session(meta.tenant, meta.session_id)
        return expired

    # -- stored responses (the Responses API's `store`) ------------------------------------

    def put_response(self, tenant: str, response_id: str, created_at: float,
                     body: bytes | memoryview) -> None:
        """Keep a response (durable on return), replacing one of the same id."""
        key = session_key(tenant, response_id)
        value = struct.pack("<Q", int(created_at * 1000)) + bytes(body)

        def fn(txn):
            old = txn.get(key, db=self._db[b"responses"])
            txn.put(key, value, db=self._db[b"responses"])
            self._add_bytes(txn, RESPONSE_BYTES_KEY, len(value) - (len(old) if old else 0))

        self._write(fn)

    def delete_response(self, tenant: str, response_id: str) -> bool:
        key = session_key(tenant, response_id)

        def fn(txn):
            old = txn.get(key, db=self._db[b"responses"])
            if old is None:
                return False
            txn.delete(key, db=self._db[b"responses"])
            self._add_bytes(txn, RESPONSE_BYTES_KEY, -len(old))
            return True

        return self._write(fn)

    def response_bytes(self) -> int:
        with self._read_txn() as txn:
            raw = txn.get(RESPONSE_BYTES_KEY, db=self._db[b"meta"])
        return struct.unpack("<Q", raw)[0] if raw else 0

    def retire_responses(self, *, before: float | None = None,
                         target_bytes: int | None = None) -> list[tuple[str, str]]:
        """Delete the responses created before `before` (unix s), and then the oldest until
        the stored ones fit in `target_bytes`; their (tenant, id)s, oldest first."""
        with self._read_txn() as txn:
            found = sorted((struct.unpack("<Q", bytes(v[:8]))[0] / 1000, len(v), bytes(k))
                           for k, v in txn.cursor(db=self._db[b"responses"]))
        total, gone = self.response_bytes(), []
        for created, size, key in found:
            if not ((before is not None and created < before)
                    or (target_bytes is not None and total > target_bytes)):
                continue
            tenant, _, rid = key.partition(b"\0")
            if self.delete_response(tenant.decode(), rid.decode()):
                total -= size
                gone.append((tenant.decode(), rid.decode()))
        return gone

    # -- reference counts: a block lives while a record names it ---------------------------

    def _meta(self, txn, key: bytes) -> SessionMeta | None:
        raw = txn.get(key, db=self._db[b"sessions"])
        return None if raw is None else SessionMeta.from_json(raw)

    def _keep_block(self, txn, block_id: BlockId, payload) -> None:
        """A record names the block: stored if no one had (`last_written_bytes`), counted."""
        if not self._holds_block(txn, block_id):
            if is_quantized_block(payload):
                self._stamp_quantized(txn)
            if self.format_version < HEAD_STORE_FORMAT and is_head_block(payload):
                self._stamp(txn, HEAD_STORE_FORMAT)
            txn.put(block_id, payload, db=self._db[b"blocks"])
            self._add_block_bytes(txn, len(payload))
            self.last_written_bytes = len(payload)
        self._incref(txn, block_id)

    def _stamp_quantized(self, txn) -> None:
        """The store holds a quantized block: a kvbank that cannot read one refuses it, and
        this one warns a worker without --kv-bits (`StoreReader.holds_quantized`)."""
        if txn.get(QUANTIZED_KEY, db=self._db[b"meta"]) is None:
            txn.put(QUANTIZED_KEY, b"1", db=self._db[b"meta"])
        self._stamp(txn, QUANTIZED_STORE_FORMAT)

    def _stamp(self, txn, version: int) -> None:
        """The store's format raised to `version` (never lowered), in the write's txn."""
        raw = txn.get(FORMAT_KEY, db=self._db[b"meta"])
        if (struct.unpack("<I", raw)[0] if raw else 1) < version:
            txn.put(FORMAT_KEY, struct.pack("<I", version), db=self._db[b"meta"])
            self.format_version = version

    def _truncate_blocks(self, txn, meta: SessionMeta, keep_tokens: int) -> None:
        keep_full = keep_tokens // meta.block_tokens if meta.block_tokens else 0
        for anchor in [a for a in meta.anchors if a[1] + a[2] > keep_tokens]:
            self._decref(txn, BlockId(bytes.fromhex(anchor[0])))
            meta.anchors.remove(anchor)
        for h in meta.blocks[keep_full:]:
            self._decref(txn, BlockId(bytes.fromhex(h)))
        meta.blocks = meta.blocks[:keep_full]
        if meta.tail:
            self._decref(txn, BlockId(bytes.fromhex(meta.tail)))
            meta.tail, meta.tail_tokens = None, 0

    def _add_block_bytes(self, txn, delta: int) -> None:
        self._add_bytes(txn, BLOCK_BYTES_KEY, delta)

    def _add_bytes(self, txn, key: bytes, delta: int) -> None:
        raw = txn.get(key, db=self._db[b"meta"])
        total = (struct.unpack("<Q", raw)[0] if raw else 0) + delta
        txn.put(key, struct.pack("<Q", max(0, total)), db=self._db[b"meta"])

    def _incref(self, txn, bid: BlockId) -> None:
        raw = txn.get(bid, db=self._db[b"refs"])
        n = struct.unpack("<I", raw)[0] if raw else 0
        txn.put(bid, struct.pack("<I", n + 1), db=self._db[b"refs"])

    def _decref(self, txn, bid: BlockId) -> None:
        raw = txn.get(bid, db=self._db[b"refs"])
        n = struct.unpack("<I", raw)[0] if raw else 0
        if n <= 1:
            txn.delete(bid, db=self._db[b"refs"])
            old = txn.get(bid, db=self._db[b"blocks"])
            if old is not None:
                self._add_block_bytes(txn, -len(old))
                txn.delete(bid, db=self._db[b"blocks"])
        else:
            txn.put(bid, struct.pack("<I", n - 1), db=self._db[b"refs"])

