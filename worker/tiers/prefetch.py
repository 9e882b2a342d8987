"""Prefetch: an agent in a tool call will come back, so its KV should be in RAM when it does.

A hint names the conversation (by name, or by the prompt it will send). If its KV is only on
SSD, it is read back into the bank now; if it is in RAM, the hint stays live, and should the
conversation be pushed out before it returns, it is read back as soon as there is room. While
the hint is live the bank keeps the conversation longer than those without one, and of two
hinted ones lets the one hinted last go first (worker/tiers/eviction.py, its ranking); a
hint never keeps memory from a request.

Room comes from free memory first. When there is too little, a hint may take RAM from
conversations that will be back later than its own: hinted after it (its tool call started
later, so it ends later) or idle with no hint at all. Such a conversation leaves only once all
of it is on SSD (its unwritten tail is written first, within DISPLACE_WRITE_OUT_S): nothing is
lost, only a read later. A hint never takes memory from a request, running or waiting.

A read of `THREAD_MIN_BYTES` or more (worker/tiers/restore_threads.py) runs on a thread while
the batch decodes, and lands in the bank on the engine's turn after it ends: the hint answers
`restoring` at once; its conversation's next request waits for the read, then finds its KV in
RAM. The memory is reserved from the start (`reserve_active`). Everything else runs on the
engine thread, like everything it touches.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvbank import metrics
from kvbank.blocks import chain_block_ids
from kvbank.worker.commands import PrefetchReport
from kvbank.worker.tiers.bank import SessionBank, SessionKey
from kvbank.worker.tiers.conversations import Conversations
from kvbank.worker.tiers.eviction import EvictionPolicy
from kvbank.worker.tiers.restore import Restorer
from kvbank.worker.tiers.restore_threads import Read, Restores

logger = logging.getLogger(__name__)

DISPLACE_WRITE_OUT_S = 2.0  # a hint (or a retry of all) waits this long at most for writes
HINT_TTL_S = 300.0  # a hint outlives the tool calls agents make; then it is forgotten


@dataclass
class _Hint:
    tokens: np.ndarray
    ids: list
    at: float  # when it came: an older hint's conversation is back sooner
    until: float


class Hints:
    """The live hints, oldest first (engine thread). The prefetcher adds and forgets them; the
    eviction policy reads when each came (`hinted_at`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.live: dict[SessionKey, _Hint] = {}

    def add(self, key: SessionKey, tokens: np.ndarray, ids: list) -> _Hint:
        """A new hint for the conversation: its place in line is now."""
        self.live.pop(key, None)
        now = self.clock()
        h = self.live[key] = _Hint(tokens, ids, now, now + HINT_TTL_S)
        return h

    def forget(self, key: SessionKey) -> None:
        self.live.pop(key, None)

    def hinted_at(self, key: SessionKey) -> float | None:
        """When the conversation's live hint came (None: none, or it lapsed)."""
        h = self.live.get(key)
        return h.at if h is not None and self.clock() <= h.until else None

    def came_at(self, key: SessionKey) -> float | None:
        """When its hint came, lapsed or not, until it is forgotten."""
        h = self.live.get(key)
        return h.at if h is not None else None


@dataclass(kw_only=True)
class _Fetch(Read):
    """A hint's read on a thread (worker/tiers/restore_threads.py); what `_bring_back` knew
    of it."""

    key: SessionKey
    hint: _Hint  # the tokens it reads (a newer hint of the conversation may name others)
    ram: int  # tokens RAM held, and LMDB, when it began
    ssd_tokens: int
    need: int  # bytes reserved for it
    later: bool  # a retry's


class Prefetcher:
    def __init__(self, *, bank: SessionBank, restorer: Restorer, conversations: Conversations,
                 hints: Hints, eviction: EvictionPolicy, root_for: Callable[[str], bytes],
                 block_tokens: int, kv_bytes_per_token: int, room: Callable[[], int | None],
                 reads: Restores | None = None):
        """`hints`: the live hints, which the eviction policy reads too (hinted conversations
        stay longest). `room`: the bytes the bank may take without anything leaving (the
        smaller of what its cap and the memory budget leave); None while requests wait for
        memory (they come first: a hint takes nothing then). `reads`: where a long read runs
        on a thread (the engine's loop calls `land` when one ends); None: every read inline."""
        self.bank, self.restorer, self.conversations = bank, restorer, conversations
        self.hints, self.eviction = hints, eviction
        self.root_for, self.block_tokens = root_for, block_tokens
        self.kv_bytes_per_token = kv_bytes_per_token
        self.room, self.clock = room, hints.clock
        self.reads = reads
        self.reading: dict[SessionKey, _Fetch] = {}  # reads on a thread, by conversation

    def hint(self, tenant: str, session_id: str, tokens: np.ndarray) -> PrefetchReport:
        """A hint from a client: read the KV back now if it is on SSD only, and keep the hint
        live until the conversation's next turn starts (or HINT_TTL_S)."""
        if not len(tokens) and session_id:
            history = self.conversations.history((tenant, session_id))
            tokens = history if history is not None else tokens
        if not len(tokens):
            return self._counted(PrefetchReport("unknown"))
        ids = chain_block_ids(tokens, self.root_for(tenant), self.block_tokens)
        key = (tenant, session_id) if session_id else self.conversations.lineages.find(
            tokens, ids, tenant, self.conversations.records, self.bank.is_busy)
        if key is None:  # tokens that continue no conversation kvbank knows
            return self._counted(PrefetchReport("unknown"))
        h = self.hints.add(key, tokens, ids)
        return self._counted(self._bring_back(key, h,
                                              time.time() + DISPLACE_WRITE_OUT_S))

    def started(self, key: SessionKey) -> None:
        """The conversation came back (or was deleted): its hint has done its work. An admin
        release does not end a hint: it is about memory now, and the hint waits for room."""
        self.hints.forget(key)

    def retry(self) -> int:
        """Live hints whose conversation left RAM since, read back where room allows (after
        requests finish and on the guard's tick). Returns the tokens brought back."""
        now = self.clock()
        brought = 0
        give_up_at = time.time() + DISPLACE_WRITE_OUT_S  # one wait for all: the engine waits
        for key, h in list(self.hints.live.items()):  # oldest hint first: it is back soonest
            if now > h.until:
                self.hints.forget(key)
                continue
            report = self._bring_back(key, h, give_up_at, later=True)
            if report.status == "restored":
                metrics.PREFETCHES.labels("restored_later").inc()
                brought += report.restored_tokens
        return brought

    def _bring_back(self, key: SessionKey, h: _Hint, give_up_at: float, *,
                    later: bool = False) -> PrefetchReport:
        """`give_up_at` (unix s): when waiting for displaced conversations' writes stops.
        `later`: a retry's, not a client's (counted as `restored_later` when it lands)."""
        tenant = key[0]
        ram, ssd = self.restorer.held(h.tokens, h.ids, tenant)
        if key in self.reading:
            return PrefetchReport("restoring", ram, ssd)
        busy = self.bank.is_busy(key)  # a request of it runs: its KV is in that cache
        if ssd <= ram or busy:
            return PrefetchReport("in_ram" if ram or busy else "not_held", ram, ssd)
        need = (ssd + self.block_tokens) * self.kv_bytes_per_token  # whole blocks and a tail
        room = self.room()
        if room is not None:  # what reads in flight will take (counted once more: prudent)
            room -= sum(f.need for f in self.reading.values())
        if room is None or (need > room and not self.eviction.displace(key, h.at, need - room,
                                                                       give_up_at)):
            return PrefetchReport("no_room", ram, ssd)
        read = lambda on_corrupt: self.restorer.ssd_prefix(  # noqa: E731
            h.tokens, h.ids, tenant, key, better_than=ram, limit=len(h.tokens),
            on_corrupt=on_corrupt)
        if self.reads is not None and self.reads.worth_a_thread(ssd - ram):
            f = self.reading[key] = _Fetch(key=key, hint=h, ram=ram, ssd_tokens=ssd,
                                           need=need, later=later)
            self.bank.reserve_active(key, need)  # admission counts it until it lands
            self.reads.start(f, read)
            return PrefetchReport("restoring", ram, ssd)
        return self._landed(key, h, ram, ssd, read(None))

    def _landed(self, key: SessionKey, h: _Hint, ram: int, ssd: int,
                found) -> PrefetchReport:
        """What a read found, into the bank."""
        if found is None:
            return PrefetchReport("in_ram" if ram else "not_held", ram, ssd)
        layers, checkpoint, n = found
        layers = self.restorer.kinds.cut(layers, n)  # the bank keeps tight arrays
        self.bank.insert(key, h.tokens[:n], layers, durable_tokens=n, prefetched=True,
                         checkpoints={n: checkpoint} if checkpoint is not None else None)
        metrics.PREFETCHED_TOKENS.inc(n)
        return PrefetchReport("restored", ram, ssd, n)

    def land(self) -> int:
        """Reads on a thread that ended: into the bank, if their hint is still live (it ends
        when its conversation is deleted; a request of it waits for the read, `reading`).
        Engine thread. Returns the tokens brought back."""
        brought = 0
        for f in self.reads.take_done() if self.reads is not None else []:
            del self.reading[f.key]
            self.bank.unreserve_active(f.key, f.need)
            for block, e in f.corrupt:  # the link is the engine thread's
                self.restorer.corrupt(block, e, f.key[0], f.key)
            found, f.ssd = f.ssd, None
            if f.error is not None:
                logger.error("prefetch of session %s failed: %s", f.key[1], f.error)
            elif f.key in self.hints.live:
                report = self._landed(f.key, f.hint, f.ram, f.ssd_tokens, found)
                if report.status == "restored" and f.later:
                    metrics.PREFETCHES.labels("restored_later").inc()
                brought += report.restored_tokens
        return brought

    def reading_for(self, key: SessionKey) -> bool:
        """A hint's read of this conversation is in flight: its request waits for it, then
        finds it in RAM, rather than read it a second time."""
        return key in self.reading

    def stop(self, timeout_s: float) -> None:
        if self.reads is not None:
            self.reads.stop(timeout_s)  # what they read is dropped with them

    @staticmethod
    def _counted(report: PrefetchReport) -> PrefetchReport:
        metrics.PREFETCHES.labels(report.status).inc()
        return report
