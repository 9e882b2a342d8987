"""The LMDB layout both sides agree on, and its read side.

Named databases:
    blocks    block id (16 B)          -> encoded block (kvbank.blocks.encode_block)
    refs      block id                 -> u32 number of session records naming it
    sessions  tenant \\0 session id     -> JSON meta (block list, durable extent, timestamps)
    tokens    tenant \\0 session id     -> committed token ids, uint32 little-endian (their
                                          xxh3-64 is in the meta: `tokens_xxh3`)
    responses tenant \\0 response id    -> a stored Responses API response: u64 created_at
                                          (unix ms) then its JSON (apps/shim/responses_store.py)
    meta      b"block_bytes"           -> u64 total bytes of stored blocks (the size cap's measure)
              b"response_bytes"        -> u64 total bytes of stored responses
              b"format_version"        -> u32 STORE_FORMAT (none: a store from before it, whose
                                          blocks are KVB1 and still read as they are);
                                          QUANTIZED_STORE_FORMAT once a quantized block
                                          (KVB3, --kv-bits) is in it, HEAD_STORE_FORMAT
                                          once a block that carries the MTP head's history
              b"quantized_blocks"      -> b"1" once a quantized block is in it (a store at
                                          HEAD_STORE_FORMAT says so only here)

Only the coldstore process writes (coldstore/store.py: `ColdStore`, which adds the writes and
the durability rule). The worker reads with a `StoreReader` (`readonly=True`): LMDB serves
many reader processes beside one writer, and a restore decodes blocks straight from the map.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import struct
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path

import logging

import lmdb
import numpy as np

from kvbank.blocks import BlockId, checksum

logger = logging.getLogger(__name__)

INITIAL_MAP_BYTES = 1 << 30
DBS = (b"blocks", b"refs", b"sessions", b"tokens", b"meta", b"responses")
BLOCK_BYTES_KEY = b"block_bytes"  # meta: total size of stored blocks, kept in the same txns
RESPONSE_BYTES_KEY = b"response_bytes"  # meta: total size of stored responses
FORMAT_KEY = b"format_version"
STORE_FORMAT = 2  # blocks with per-layer shapes, checkpoints and checksums (kvbank/blocks.py)
# Stamped by the write of the first quantized block (`--kv-bits`), so that a kvbank from before
# quantized blocks refuses the store as newer than it knows instead of taking its KVB3 blocks
# for damaged ones; a full-precision store keeps STORE_FORMAT.
QUANTIZED_STORE_FORMAT = 3
QUANTIZED_KEY = b"quantized_blocks"
# Stamped by the write of the first block that carries the MTP head's history
# (kvbank/blocks.py `carries_head`). Such blocks share their ids with the model's own (a store
# written with --mtp off is read with it on, and the other way); a kvbank from before reads
# their extra layer as damage where a chain mixes both, so it refuses the store instead.
HEAD_STORE_FORMAT = 4
READ_FORMAT = HEAD_STORE_FORMAT  # the newest this kvbank reads


class StoreFormatError(RuntimeError):
    """A store written by a newer kvbank: never read, so never misread."""


def session_key(tenant: str, session_id: str) -> bytes:
    return tenant.encode() + b"\0" + session_id.encode()


@dataclass
class SessionMeta:
    """A session record without its tokens. `blocks`/`tail` name only committed blocks."""

    session_id: str
    tenant: str = ""
    token_count: int = 0
    blocks: list[str] = field(default_factory=list)  # hex ids of full blocks, in order
    tail: str | None = None  # hex id of the partial block after them
    tail_tokens: int = 0
    block_tokens: int = 0
    created_at: float = 0.0
    updated_at: float = 0.0
    # Partial blocks inside the conversation that carry a checkpoint other conversations
    # share (the end of a system prompt): [hex id, start, tokens] each.
    anchors: list[list] = field(default_factory=list)
    # xxh3-64 of the tokens value, hex (None: a record written before token checksums)
    tokens_xxh3: str | None = None

    def seal(self, tokens: bytes) -> None:
        """The record's checksum of `tokens`, its tokens value as stored."""
        self.tokens_xxh3 = f"{checksum(tokens):016x}"

    def tokens_ok(self, tokens: bytes | memoryview) -> bool:
        """The stored tokens are the ones the record was sealed with (unsealed: unchecked)."""
        return self.tokens_xxh3 is None or int(self.tokens_xxh3, 16) == checksum(tokens)

    @property
    def durable_tokens(self) -> int:
        return len(self.blocks) * self.block_tokens + (self.tail_tokens if self.tail else 0)

    def block_ids(self) -> list[BlockId]:
        ids = [BlockId(bytes.fromhex(h)) for h in self.blocks]
        if self.tail:
            ids.append(BlockId(bytes.fromhex(self.tail)))
        return ids

    def to_json(self) -> bytes:
        # Fields as they are, not `asdict`: its deep copy of every block id took 8 % of the
        # coldstore's thread while it commits a 32K-token conversation (py-spy).
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "SessionMeta":
        return cls(**json.loads(raw))


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_MADV_DONTNEED = 4  # Linux and macOS: drop the pages from this mapping (shared: no data lost)


class MissingBlock(LookupError):
    """A block a restore asked for is not in the store (collected since it looked)."""


class Reading:
    """Blocks being got, one by one, by `get_all` on a thread of its own: `[i]` waits for
    block i. The last block is got first (a restore reads where its checkpoint stands in the
    last block's header), then the others in order. `read_s`: how long the gets took, the
    read phase a benchmark compares with the disk's (set once they end)."""

    def __init__(self, n: int):
        self.views: list = [None] * n
        self._got = [threading.Event() for _ in range(n)]
        self.stop = False  # the reader is done with them: get no more
        self.read_s: float | None = None
        self.nbytes = 0

    def get_all(self, get) -> None:
        t0 = time.perf_counter()
        try:
            n = len(self.views)
            for i in ([n - 1, *range(n - 1)] if n else []):
                if self.stop:
                    break
                view = self.views[i] = get(i)
                self._got[i].set()
                if view is None:
                    break
                self.nbytes += len(view)
        finally:
            self.read_s = time.perf_counter() - t0
            for got in self._got:  # none left waiting: a block not got is missing
                got.set()

    def __len__(self) -> int:
        return len(self.views)

    def __getitem__(self, i: int | slice):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self.views)))]
        if not -len(self.views) <= i < len(self.views):
            raise IndexError(i)
        self._got[i].wait()
        view = self.views[i]
        if view is None:
            raise MissingBlock(i)
        return view

    def __iter__(self):
        return (self[i] for i in range(len(self.views)))


class StoreReader:
    """Reads (any process). `readonly=False` only for the coldstore's `ColdStore`.

    Several threads may read at once, each in a read txn of its own (the worker's engine, and
    a restore read on a thread beside it, worker/tiers/restore_threads.py); `_read_txn` counts them,
    because adopting the writer's larger map (`set_mapsize`) is only safe while no txn of
    this process is open, and so is `close`."""

    def __init__(self, path: Path, *, readonly: bool = False):
        self.path = Path(path)
        self.readonly = readonly
        self.last_written_bytes = 0  # by the last commit_block
        if not readonly:
            self.path.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(
            str(self.path),
            map_size=INITIAL_MAP_BYTES,
            max_dbs=len(DBS),
            readonly=readonly,
            readahead=True,
            sync=True,
            metasync=True,
            create=not readonly,
        )
        self._txns = 0  # read txns open in this process, under _txns_changed's lock
        self._txns_changed = threading.Condition()
        self._db = {}
        for name in DBS:
            try:
                self._db[name] = self.env.open_db(name, create=not readonly)
            except lmdb.NotFoundError:  # a reader of a store no writer has opened since
                pass
        try:
            self.format_version = self._check_format()
        except StoreFormatError:
            self.env.close()
            raise

    def _check_format(self) -> int:
        """The store's format; a newer one than this kvbank knows is refused. A writer stamps
        a store that has none (new, or from before formats were stamped: its KVB1 blocks
        read as they are, and new blocks are written in the current format beside them)."""
        with self._read_txn() as txn:
            raw = txn.get(FORMAT_KEY, db=self._db[b"meta"])
        version = struct.unpack("<I", raw)[0] if raw else 1
        if version > READ_FORMAT:
            raise StoreFormatError(
                f"the store in {self.path} has format {version}, newer than this kvbank's "
                f"{READ_FORMAT}: upgrade kvbank, or start with another --data-dir")
        if not self.readonly and version < STORE_FORMAT:
            with self.env.begin(write=True) as txn:
                txn.put(FORMAT_KEY, struct.pack("<I", STORE_FORMAT), db=self._db[b"meta"])
        return version

    def holds_quantized(self) -> bool:
        """Whether a quantized block (--kv-bits) was ever written to the store."""
        if self.format_version == QUANTIZED_STORE_FORMAT:
            return True
        with self._read_txn() as txn:
            return txn.get(QUANTIZED_KEY, db=self._db[b"meta"]) is not None

    def close(self, timeout_s: float = 10.0) -> None:
        """Once the read txns open in other threads end (a restore's read, at most
        `timeout_s`; past it the environment stays open: the process is ending)."""
        with self._txns_changed:
            if self._txns_changed.wait_for(lambda: self._txns == 0, timeout_s):
                self.env.close()

    @contextmanager
    def _read_txn(self):
        """A read txn; the writer's larger map adopted first when it grew, once no other
        txn of this process is open (LMDB's rule for `set_mapsize`): a read that began with
        the smaller map waits for the others to end, a restore's read at the longest."""
        with self._txns_changed:
            try:
                txn = self.env.begin(buffers=True)
            except lmdb.MapResizedError:
                self._txns_changed.wait_for(lambda: self._txns == 0)
                self.env.set_mapsize(0)  # adopt the writer's larger map
                txn = self.env.begin(buffers=True)
            self._txns += 1
        try:
            with txn:
                yield txn
        finally:
            with self._txns_changed:
                self._txns -= 1
                self._txns_changed.notify_all()

    def get_response(self, tenant: str, response_id: str) -> bytes | None:
        """A stored Responses API response's JSON, or None."""
        if b"responses" not in self._db:
            return None
        with self._read_txn() as txn:
            raw = txn.get(session_key(tenant, response_id), db=self._db[b"responses"])
            return None if raw is None else bytes(raw[8:])

    def get_session(self, tenant: str, session_id: str) -> tuple[SessionMeta, np.ndarray] | None:
        """The record and its tokens; None when there is none, or when its tokens fail their
        checksum (logged): the conversation is then found as a new one, and its stored blocks
        still restore by their content (block ids chain the prompt's own tokens)."""
        key = session_key(tenant, session_id)
        with self._read_txn() as txn:
            raw = txn.get(key, db=self._db[b"sessions"])
            if raw is None:
                return None
            meta = SessionMeta.from_json(bytes(raw))
            raw_tokens = bytes(txn.get(key, db=self._db[b"tokens"]) or b"")
        if not meta.tokens_ok(raw_tokens):
            logger.error("session %s: its stored token record failed its checksum; it is "
                         "treated as absent (its KV blocks still restore by content)", session_id)
            return None
        return meta, np.frombuffer(raw_tokens, dtype=np.uint32)

    def list_sessions(self) -> list[SessionMeta]:
        with self._read_txn() as txn:
            return [SessionMeta.from_json(bytes(v)) for _, v in txn.cursor(db=self._db[b"sessions"])]

    def get_blocks(self, ids: list[BlockId], decode=None):
        """The blocks' bytes (None where missing), read in one snapshot.

        With `decode(views, done_with=...)`, its result is returned instead (None when a block
        is missing): `views` are `Reading`'s, straight into the map (zero-copy), got by a
        thread of their own while `decode` copies the ones got so far. py-lmdb reads a value
        whole when it is got (it faults every page in, without the GIL), so the reads and the
        copies overlap; each view is `unmap`ped once got, and decode calls `done_with`
        (`unmap`) on a block once it has copied it: the page cache keeps them, and a multi-GB
        read counts in this process's RSS a few blocks at a time, not all together. Without
        `decode`, copies."""
        with self._read_txn() as txn:
            if decode is None:
                views = [txn.get(bid, db=self._db[b"blocks"]) for bid in ids]
                return [None if v is None else bytes(v) for v in views]
            reading = Reading(len(ids))
            getter = threading.Thread(target=reading.get_all, name="kv-get", daemon=True,
                                      args=(lambda i: self._got_unmapped(
                                          txn.get(ids[i], db=self._db[b"blocks"])),))
            getter.start()
            try:
                return decode(reading, done_with=self.unmap)
            except MissingBlock:
                return None
            finally:
                reading.stop = True
                getter.join()  # the txn (and the map's views) end after its last get

    @staticmethod
    def unmap(view: memoryview) -> None:
        """A block read from the map (a `get_blocks` view) and copied out: its whole pages leave
        this process's resident set (the page cache keeps them; a later read maps them again).
        A multi-GB restore then holds its map pages only while it copies them, not all at
        once: the worker's RSS stays its budget's. Pages the block shares with a neighbour
        stay mapped (another lane may be reading it)."""
        a = np.frombuffer(view, np.uint8)
        start = -(-a.ctypes.data // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (a.ctypes.data + a.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)

    def _got_unmapped(self, view: memoryview | None) -> memoryview | None:
        if view is not None:
            self.unmap(view)
        return view

    def iter_blocks(self):
        """(block id, payload view) of every stored block, in key order, in one read
        snapshot (views are valid until the generator ends)."""
        with self._read_txn() as txn:
            for key, value in txn.cursor(db=self._db[b"blocks"]):
                yield BlockId(bytes(key)), value

    def block_bytes(self) -> int:
        with self._read_txn() as txn:
            raw = txn.get(BLOCK_BYTES_KEY, db=self._db[b"meta"])
            return struct.unpack("<Q", raw)[0] if raw else 0

    def session_block_bytes(self, tenant: str, session_id: str) -> int:
        got = self.get_session(tenant, session_id)
        if got is None:
            return 0
        with self._read_txn() as txn:
            return sum(len(txn.get(bid, db=self._db[b"blocks"]) or b"")
                       for bid in got[0].block_ids())

    def has_block(self, block_id: BlockId) -> bool:
        with self._read_txn() as txn:
            return self._holds_block(txn, block_id)

    def _holds_block(self, txn: lmdb.Transaction, block_id: BlockId) -> bool:
        """Whether the store holds the block, its bytes unread: py-lmdb's `get` reads a value
        whole (from the disk, when cold), a cursor's `set_key` only the tree."""
        return txn.cursor(db=self._db[b"blocks"]).set_key(block_id)

    def stats(self) -> dict:
        with self._read_txn() as txn:
            blocks = txn.stat(self._db[b"blocks"])
            sessions = txn.stat(self._db[b"sessions"])
        info = self.env.info()
        st = self.env.stat()
        return {
            "blocks": blocks["entries"],
            "sessions": sessions["entries"],
            "block_bytes": self.block_bytes(),
            "map_bytes": info["map_size"],
            "used_bytes": (info["last_pgno"] + 1) * st["psize"],
        }
