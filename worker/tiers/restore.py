"""Restore: a request's own cache over the longest prefix kvbank holds, from the RAM bank or
from SSD, whichever covers more, in three steps (engine thread, but for the read): `look` at
what RAM and LMDB hold, `read_ssd` (any thread: worker/tiers/restore_threads.py runs a long
one on its own), `take` the request's cache. The KV manager (worker/tiers/manager.py) takes
them for an admitted request."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvbank import events, metrics
from kvbank.blocks import (BlockId, CorruptBlock, carries_head, common_prefix_len,
                           decode_header, tail_block_id)
from kvbank.contracts import coldstore_wire as wire
from kvbank.contracts.store_layout import StoreReader
from kvbank.v1 import api_pb2
from kvbank.worker.kv import arrays, codec
from kvbank.worker.tiers.bank import BankEntry, SessionBank, SessionKey, any_prefix
from kvbank.worker.kv.cache_kinds import CacheKinds, Checkpoint
from kvbank.worker.link.client import ColdstoreClient

logger = logging.getLogger(__name__)

READ_TIMEOUT_S = 3.0
RAM = api_pb2.CACHE_SOURCE_RAM


@dataclass
class Look:
    """`Restorer.look`: RAM's hit over the prompt (None: none, or no_cache), its tokens, the
    prompt's restorable limit (0: no_cache), and how many more tokens LMDB holds in whole
    blocks (what a read from SSD may add, before checkpoints and anchors)."""

    hit: Any
    ram_n: int
    limit: int
    ssd_more: int


class Restorer:
    def __init__(self, *, kinds: CacheKinds, bank: SessionBank, client: ColdstoreClient,
                 store_dir: Path, root_for, block_tokens: int, restore_via: str = "direct"):
        self.kinds, self.bank, self.client = kinds, bank, client
        self.store_dir = store_dir
        self.root_for = root_for
        self.block_tokens = block_tokens
        self.restore_via = restore_via
        self._store: StoreReader | None = None

    def store(self) -> StoreReader | None:
        """The store, read-only (the coldstore is its only writer); None until it exists."""
        if self._store is None and (self.store_dir / "data.mdb").exists():
            try:
                self._store = StoreReader(self.store_dir, readonly=True)
            except Exception as e:
                logger.warning("cannot open the store read-only yet: %s", e)
            else:
                if self._store.holds_quantized() and not self.kinds.kv_bits:
                    logger.warning(
                        "the store in %s holds KV written with --kv-bits; this worker runs "
                        "without it, so that KV is never read: those conversations are "
                        "recomputed (start with the same --kv-bits to restore them)",
                        self.store_dir)
        return self._store

    def close(self) -> None:
        """The read-only view goes (one process opens an LMDB environment once)."""
        if self._store is not None:
            self._store.close()
            self._store = None

    def look(self, tokens: np.ndarray, ids: list[BlockId], tenant: str,
             no_cache: bool) -> Look:
        """What RAM holds of the prompt, and how much more LMDB may add (engine thread)."""
        if no_cache:
            return Look(None, 0, 0, 0)
        limit = len(tokens) - 1  # leave one token to compute: its logits give the next token
        hit = self.bank.lookup(tokens, tenant, ids, limit=limit)
        ram_n = hit.n_tokens if hit else 0
        store = self.store() if ram_n < limit else None  # SSD adds only when RAM leaves some
        n_full = _stored_blocks(store, ids)
        return Look(hit, ram_n, limit, max(0, min(n_full * self.block_tokens, limit) - ram_n))

    def read_ssd(self, look: Look, tokens: np.ndarray, ids: list[BlockId], tenant: str,
                 session: SessionKey, anchor_at: int = 0, on_corrupt=None
                 ) -> tuple[arrays.Layers, Checkpoint | None, int] | None:
        """What LMDB restores beyond RAM's hit (None: nothing better). Any thread: it touches
        neither the bank nor the coldstore link; a corrupt block found goes to `on_corrupt`
        (None: reported here, `corrupt`), which a thread hands to the engine's."""
        if look.limit == 0 or look.ram_n >= look.limit:
            return None
        # Room for the rest of the prompt and the first answer tokens (as a cache grows): the
        # request appends in place to the arrays it reads from SSD, no second copy.
        return self.ssd_prefix(tokens, ids, tenant, session, better_than=look.ram_n,
                               capacity=arrays.capacity(len(tokens)), anchor_at=anchor_at,
                               on_corrupt=on_corrupt)

    def take(self, look: Look, ssd, session: SessionKey
             ) -> tuple[list, int, int, BankEntry | None]:
        """`restore`'s answer from what SSD read (`read_ssd`) or else RAM's hit (engine
        thread: the bank hands its entry over)."""
        if ssd is not None:
            layers, checkpoint, n = ssd
            return (self.kinds.restore(layers, checkpoint, n, owned=True), n,
                    api_pb2.CACHE_SOURCE_SSD, None)
        ram_n = look.ram_n
        if ram_n > 0:
            e = look.hit.entry
            self.bank.touch(e)
            checkpoint = e.checkpoints.get(ram_n)
            if self.hands_over(e, ram_n, session):
                self.bank.hand_over(e)
                return self.kinds.restore(e.layers, checkpoint, ram_n, owned=True), ram_n, RAM, e
            return self.kinds.restore(e.layers, checkpoint, ram_n), ram_n, RAM, None
        return self.kinds.new_cache(), 0, api_pb2.CACHE_SOURCE_NONE, None

    def hands_over(self, e: BankEntry, n_tokens: int, session: SessionKey) -> bool:
        """Whether a RAM hit of `n_tokens` on `e` gives the request `e` itself: the
        conversation's next turn (or the query a pre-render was computed for) continuing all
        of it. Its KV then goes with the request, which writes its new tokens in place when the
        buffer has room (no copy of the history; else `KVManager.copies_history`). Not when
        kept quantized: the request dequantizes into a buffer of its own, and the entry stays
        in the bank, counted, until the commit supersedes it."""
        return ((e.session == session or e.prerendered) and n_tokens == e.n_tokens
                and not self.kinds.kv_bits)

    def takes_over(self, e: BankEntry, n_tokens: int, session: SessionKey,
                   prompt_tokens: int) -> bool:
        """Whether a request handed `e` (`hands_over`) holds its history once: written in
        place (the buffers have room for its prompt of `prompt_tokens`), or copied with the
        entry letting go of its arrays (all on SSD: `KVManager.copies_history`)."""
        return self.hands_over(e, n_tokens, session) and (
            self.kinds.has_room(e.layers, prompt_tokens) or e.durable)

    def lost(self, tokens: np.ndarray, ids: list[BlockId], tenant: str, cached: int) -> int:
        """Prompt tokens RAM or LMDB hold past `cached` that no checkpoint let a restore reach
        (0 for a model without window or recurrent caches: any prefix restores)."""
        if not self.kinds.checkpointed:
            return 0
        limit = len(tokens) - 1
        hit = self.bank.lookup(tokens, tenant, ids, limit=limit, restore_point=any_prefix)
        ssd = min(self.held(tokens, ids, tenant)[1], limit)
        return max(0, max(hit.n_tokens if hit else 0, ssd) - cached)

    def held(self, tokens: np.ndarray, ids: list[BlockId], tenant: str) -> tuple[int, int]:
        """How much of `tokens` RAM and LMDB hold (whole blocks on SSD), nothing restored."""
        hit = self.bank.lookup(tokens, tenant, ids)
        store = self.store()
        return (hit.n_tokens if hit else 0), _stored_blocks(store, ids) * self.block_tokens

    def ssd_prefix(self, tokens: np.ndarray, ids: list[BlockId], tenant: str,
                   session: SessionKey, better_than: int, capacity: int = 0,
                   limit: int | None = None, anchor_at: int = 0, on_corrupt=None
                   ) -> tuple[arrays.Layers, Checkpoint | None, int] | None:
        """The longest prefix LMDB can restore, up to `limit` (None: short of the prompt's
        last token, whose logits a request needs), if it beats `better_than`: its blocks
        (arrays with room for `capacity` tokens; 0: tight) and, for a model with checkpoints,
        the one stored with the last of them, or with an anchor (a checkpoint inside a block,
        worker/link/writer.py): the conversation's own, named by its record, or the one at
        `anchor_at` (a shared system prompt's end, stored once by whichever conversation
        wrote it)."""
        store = self.store()
        if store is None:
            return None
        B = self.block_tokens
        root = self.root_for(tenant)
        n_full = _stored_blocks(store, ids)
        want = list(ids[:n_full])
        n = n_full * B
        got = store.get_session(*session)
        marks = [anchor_at]
        limit = len(tokens) - 1 if limit is None else limit
        if got is not None:
            meta = got[0]
            marks += [s + k for _, s, k in meta.anchors]
            shared = self._tail_shared(meta, got[1], tokens,
                                       ids[n_full - 1] if n_full else root, n_full)
            if shared:
                want.append(BlockId(bytes.fromhex(meta.tail)))
                n += shared
        # The furthest anchor this prompt can stand on (its chain and its tokens LMDB's):
        # one its conversation's record names, the shared system prompt's, or any that
        # another conversation stored right after the blocks this prompt shares with it,
        # found by its tokens alone (a few hundred hashes: at most a block's positions).
        if self.kinds.checkpointed:
            marks += range(n_full * B + 1, n_full * B + B)
        at, anchored = next(((p, a) for p in sorted(set(marks), reverse=True)
                             if better_than < p <= limit
                             and (a := self._anchored(store, tokens, ids, root, p, n_full))),
                            (0, None))
        if min(max(n, at), limit) <= better_than:
            return None
        report = on_corrupt or (lambda block, e: self.corrupt(block, e, tenant, session))
        # the tail's tokens past `n` are not the prompt's: read no further
        got = self._read_checked(store, want, min(limit, n), better_than, capacity, report)
        if anchored and (got is None or got[2] < at):
            got = self._read_checked(store, anchored, limit, better_than, capacity,
                                     report) or got
        return got

    def _tail_shared(self, meta, record: np.ndarray, tokens: np.ndarray, parent: BlockId,
                     n_full: int) -> int:
        """How many of the prompt's tokens past its `n_full` stored blocks the conversation's
        stored tail (its partial last block) restores: the whole tail when the prompt goes on
        past it, else the tokens the two share, as a RAM hit would (the same request sent
        again is shorter than the history its answer made). 0 when the record's chain is not
        the prompt's."""
        if not meta.tail or len(meta.blocks) != n_full:
            return 0
        start = n_full * self.block_tokens
        tail = record[start:start + meta.tail_tokens]
        if len(tail) != meta.tail_tokens or tail_block_id(parent, tail).hex() != meta.tail:
            return 0
        return common_prefix_len(tail, tokens[start:start + len(tail)])

    def _anchored(self, store: StoreReader, tokens: np.ndarray, ids: list[BlockId],
                  root: BlockId, anchor_at: int, n_full: int) -> list[BlockId] | None:
        """The blocks up to an anchor ending at `anchor_at` and the anchor, when LMDB has
        them for these tokens."""
        B = self.block_tokens
        if not (self.kinds.checkpointed and anchor_at % B) or n_full * B < anchor_at // B * B:
            return None
        s = anchor_at // B * B
        anchor = tail_block_id(ids[s // B - 1] if s else root, tokens[s:anchor_at])
        return list(ids[:s // B]) + [anchor] if store.has_block(anchor) else None

    def _read_checked(self, store: StoreReader, want: list[BlockId], limit: int,
                      better_than: int, capacity: int, report):
        """`_read_blocks`, read around each corrupt block, which goes to `report(block id or
        None, error)`."""
        while True:
            try:
                # None: a block was collected since we looked, or no checkpoint beats it
                return self._read_blocks(store, want, limit, better_than, capacity)
            except CorruptBlock as e:  # never restored from: computed again from there on
                report(want[e.index] if e.index is not None else None, e)
                if not e.index:
                    return None
                want = want[:e.index]

    def corrupt(self, block: BlockId | None, e: CorruptBlock, tenant: str,
                session: SessionKey) -> None:
        """A corrupt block a restore found: counted, told, and the coldstore deletes it
        (engine thread: the link is not thread-safe)."""
        metrics.CORRUPT_BLOCKS.inc()
        events.emit("kv_corrupt_block", tenant=tenant, session_id=session[1],
                    block_id=bytes(block).hex() if block is not None else "", error=str(e))
        logger.error("session %s: a stored block failed its check (%s); what follows "
                     "it is recomputed, and the coldstore deletes it", session[1], e)
        if self.client is not None and block is not None:
            self.client.send(drop_blocks=wire.pb.DropBlocks(ids=[bytes(block)]))

    def _read_blocks(self, store: StoreReader, ids: list[BlockId], limit: int,
                     better_than: int, capacity: int = 0
                     ) -> tuple[arrays.Layers, Checkpoint | None, int] | None:
        """The blocks' KV up to the last restore point <= `limit`: decoded straight from the
        read-only LMDB map (zero-copy; the default, `kvbank bench coldstore` measured it
        faster), or fetched through the coldstore process. None when a block is missing."""
        if self.restore_via == "direct":
            return store.get_blocks(ids, decode=lambda views, done_with: self._decode(
                views, limit, better_than, capacity, done_with))
        frames = self.client.get_blocks([bytes(b) for b in ids], timeout_s=READ_TIMEOUT_S)
        if len(frames) != len(ids) or not all(len(f) for f in frames):
            return None
        return self._decode(frames, limit, better_than, capacity)

    def _decode(self, payloads, limit: int, better_than: int, capacity: int,
                done_with=None) -> tuple[arrays.Layers, Checkpoint | None, int] | None:
        """Blocks up to the restore point <= limit that the kinds find over them
        (`CacheKinds.restore_point`): any token for a model without checkpoints (the request
        writes past it), else the end of a block that carries one.

        Every block but the last is a whole block (`ssd_prefix` asks for no other), so the
        last one's header alone says where the restore stops when it carries the checkpoint
        (or the model has none): the blocks are then copied as they are read
        (`StoreReader.get_blocks`); else every header is read first."""
        last = len(payloads) - 1
        tail = self._header(payloads, last)
        counts = [self.block_tokens] * last + [tail.n_tokens]
        n = sum(counts)
        checkpointed = self.kinds.checkpointed
        if checkpointed and not (tail.has_state and n <= limit
                                 and self.kinds.restore_point([n], n) == n):
            return self._decode_at_a_checkpoint(payloads, limit, better_than, capacity,
                                                done_with)
        n = min(n, limit)
        if n <= better_than:
            return None
        layers, headers = (codec.decode_stream(
            payloads.__getitem__, counts, tail, capacity, done_with,
            layers=self.kinds.full_count) if self.kinds.has_full else ([], []))
        self._count_missing_head(headers, n)
        if not checkpointed:
            return layers, None, n
        return layers, self._checkpoint(payloads, last), n

    def _decode_at_a_checkpoint(self, payloads, limit: int, better_than: int, capacity: int,
                                done_with=None):
        """`_decode` where the last block does not say: every header read, the restore point
        found among the blocks that carry a checkpoint, the blocks up to it decoded."""
        headers = [self._header(payloads, i) for i in range(len(payloads))]
        ends = list(itertools.accumulate(h.n_tokens for h in headers))
        stated = [i for i, h in enumerate(headers) if h.has_state]
        n = self.kinds.restore_point([ends[i] for i in stated], min(ends[-1], limit))
        if n <= better_than:
            return None
        i = max(i for i in stated if ends[i] == n)
        self._count_missing_head(headers[:i + 1], n)
        layers = (codec.decode_blocks(payloads[:i + 1], capacity, done_with,
                                      layers=self.kinds.full_count)
                  if self.kinds.has_full else [])
        return layers, self._checkpoint(payloads, i), n

    def _header(self, payloads, i: int):
        try:
            header = decode_header(payloads[i])[0]
            self.kinds.check_block(header)
        except CorruptBlock as e:
            raise CorruptBlock(str(e), index=i) from None
        return header

    def _checkpoint(self, payloads, i: int) -> Checkpoint:
        try:
            return self.kinds.checkpoint_from_arrays(codec.decode_state(payloads[i]))
        except CorruptBlock as e:
            raise CorruptBlock(str(e), index=i) from None

    def _count_missing_head(self, headers: list, n: int) -> None:
        """Tokens of the first n restored from blocks written with --mtp off: the head
        drafts over zeros there (kvbank_mtp_history_missing_tokens_total)."""
        if not self.kinds.has_head:
            return
        start, missing = 0, 0
        for h in headers:
            if not carries_head(h):
                missing += max(0, min(start + h.n_tokens, n) - start)
            start += h.n_tokens
        metrics.MTP_HISTORY_MISSING.inc(missing)


def _stored_blocks(store: StoreReader | None, ids: list[BlockId]) -> int:
    """How many of the chain's first blocks LMDB holds (0 without a store)."""
    n = 0
    while store is not None and n < len(ids) and store.has_block(ids[n]):
        n += 1
    return n
