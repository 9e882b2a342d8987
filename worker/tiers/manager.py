"""The KV manager: the one owner of the worker's KV tiers, behind the few calls the engine makes.

It holds the RAM bank (worker/tiers/bank.py) and the rules of who leaves it
(worker/tiers/eviction.py), the conversation records (conversations.py, lineage.py), restore
from RAM or SSD (restore.py) and its threads (restore_threads.py), prefix sharing
(sharing.py), prefetch hints (prefetch.py), and the KV writer and the coldstore link
(worker/link/). The engine (worker/compute/engine.py) asks it, on its own thread, and nothing
else about KV:

    admit(job, tokens, ids, ...)  room for a request, or why it waits (make_room's receipt)
    start(admission, decoding)    its restore begins: RAM, else SSD inline or on a thread
    ready()                       reads on a thread that ended
    take(restoring)               the request's own cache, and what it was restored from
    commit(session, tokens, cache, ...)   a finished turn: record, entry, write-behind
    leave(running)                a request is done with the bank
    pump()                        the coldstore's word, applied (its acknowledgements)

and the commands (release, trim, flush, pressure, tick, probe, hint, history, delete). It
needs no model, only the model's cache kinds and fingerprint, so a test builds one over a fake
cache kind and a real coldstore process and drives the engine's own commit, restore and
release (tests/coldstore_rig.py).

What LMDB holds of a conversation is one number, its record's durable extent
(`Conversations`): a commit sets it from the coldstore's answer, the coldstore's word moves
it, and the bank's entries take theirs from it, each clipped to its own tokens (`_durable`).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbank import events, metrics
from kvbank.blocks import BlockId, chain_block_ids, chain_root
from kvbank.config import Layout
from kvbank.contracts import coldstore_wire as wire
from kvbank.contracts.failures import ColdstoreUnavailable, Refused
from kvbank.contracts.pricing import Pricing
from kvbank.contracts.receipts import FlushReceipt, PressureReceipt, ReleaseReceipt, ShrinkReceipt
from kvbank.contracts.vocabulary import (Decision, Outcome, PressureLevel, PressureSource,
                                         TrimReason)
from kvbank.worker.commands import PrefetchReport, SessionInfo
from kvbank.worker.kv.cache_kinds import CacheKinds
from kvbank.worker.link.client import ColdstoreClient
from kvbank.worker.link.kv_events import KVEvents, Publisher
from kvbank.worker.link.writer import KVWriter
from kvbank.worker.memory.pricing import held_bytes
from kvbank.worker.tiers import sharing
from kvbank.worker.tiers.bank import MAX_CHECKPOINTS, BankEntry, SessionBank, SessionKey
from kvbank.worker.tiers.conversations import Conversations
from kvbank.worker.tiers.eviction import EvictionPolicy
from kvbank.worker.tiers.lineage import is_anonymous
from kvbank.worker.tiers.receipts import visible as visible_receipts
from kvbank.worker.tiers.prefetch import Hints, Prefetcher
from kvbank.worker.tiers.restore import Restorer
from kvbank.worker.tiers.restore_threads import Restores, Restoring

logger = logging.getLogger(__name__)

RECORD_TIMEOUT_S = 3.0
RETRY_WRITES_EVERY_S = 5.0


class Start(enum.Enum):
    """What `admit` says of a request: admitted, or still waiting, for memory held by
    requests in flight (it stops the line) or for a prefix a running request is computing, or
    a prefetch hint is reading from SSD (it does not)."""

    STARTED = "started"
    WAIT_MEMORY = "wait_memory"
    WAIT_PREFIX = "wait_prefix"


@dataclass(frozen=True)
class Admission:
    """A request `admit` let in: its conversation, that conversation's committed tokens
    before this turn (None: none), and its admission receipt."""

    job: Any
    tokens: np.ndarray
    ids: list[BlockId]
    session: SessionKey
    history: Any
    receipt: Any


@dataclass(frozen=True)
class Taken:
    """A request's restored cache: how many tokens it holds, from where (api_pb2's
    CacheSource), the bank entry handed over to it (its commit supersedes it; `leave` gives
    it back), and the prompt tokens held in RAM or on SSD that no checkpoint let it reach."""

    cache: list
    cached: int
    source: int
    handed: BankEntry | None
    lost: int


class KVManager:
    def __init__(self, layout: Layout, *, kinds: CacheKinds, fingerprint: bytes,
                 block_tokens: int, bank_bytes: int, staging_max_bytes: int | None = None,
                 restore_via: str = "direct", active_pin_s: float = 600.0,
                 max_checkpoints: int = MAX_CHECKPOINTS,
                 write_out_deadline_s: float | None = None,
                 publisher: Publisher | None = None, wake: Callable[[], None] = lambda: None,
                 pricing: Pricing | None = None, budget: Callable[[], int] | None = None,
                 chain_shed: bool = False, kv_bytes_per_token: int = 0,
                 waiting: Callable[[], bool] = lambda: False):
        """Connects to the coldstore at `layout` and loads its records. `wake`: the owner's
        loop turns once (the writer's inbox has mail, a read on a thread ended). `pricing` and
        `budget()`: the engine's memory (worker/memory/pricing.py), for admission and a
        hint's room (None: this manager admits nothing). `kv_bytes_per_token`: what a
        running request's cache holds of a token (a read from SSD worth a thread).
        `waiting()`: requests wait for memory (a hint takes none then). `publisher`: where the
        KV events go (several machines behind a router), told what the RAM bank and LMDB
        hold."""
        self.layout = layout.ensure()
        kv_events = None
        if publisher is not None:  # several machines behind a router: say what we hold
            kv_events = KVEvents(publisher, block_size=publisher.config.block_size,
                                 salt_for=lambda tenant: bytes(self.root_for(tenant)),
                                 ssd_tokens=lambda session: self.conversations.history(session))
        self.kinds, self.fingerprint, self.block_tokens = kinds, fingerprint, block_tokens
        self.pricing, self.budget, self.chain_shed = pricing, budget, chain_shed
        self._waiting = waiting
        self.coldstore = ColdstoreClient(layout, on_event=self._deliver)
        self.bank = SessionBank(block_tokens=block_tokens, root_for=self.root_for,
                                max_bytes=bank_bytes, active_pin_s=active_pin_s,
                                staged_bytes=lambda: self.writer.staged_bytes,
                                listener=kv_events, restore_point=kinds.restore_point,
                                max_checkpoints=max_checkpoints)
        self.writer = KVWriter(self.coldstore, block_tokens=block_tokens, root_for=self.root_for,
                               records=self.bank, kinds=kinds,
                               staging_max_bytes=staging_max_bytes,
                               on_message=self._on_coldstore_message, wake=wake)
        self.coldstore.start()
        self.hints = Hints()
        self.eviction = EvictionPolicy(self.bank, writer=self.writer,
                                       hinted_at=self.hints.hinted_at,
                                       hint_came_at=self.hints.came_at,
                                       write_out_deadline_s=write_out_deadline_s)
        self.restorer = Restorer(kinds=kinds, bank=self.bank, client=self.coldstore,
                                 store_dir=self.layout.store_dir, root_for=self.root_for,
                                 block_tokens=block_tokens, restore_via=restore_via)
        self.conversations = Conversations(root_for=self.root_for, block_tokens=block_tokens,
                                           store=self.restorer.store)
        self.conversations.load()
        self.reads = Restores(wake, kv_bytes_per_token)  # requests' reads on a thread
        rest = kinds.rest_bytes_per_token  # what the bank holds of a token
        self.prefetcher = Prefetcher(
            bank=self.bank, restorer=self.restorer, conversations=self.conversations,
            hints=self.hints, eviction=self.eviction, root_for=self.root_for,
            block_tokens=block_tokens, kv_bytes_per_token=rest,
            room=self.room_for_hints, reads=Restores(wake, rest))
        self.kv_events = kv_events
        if kv_events is not None:  # what LMDB holds, announced from the start
            for key in self.conversations.records:
                self._ssd_changed(key)
            kv_events.announce_all()
        self.admissions: deque = deque(maxlen=1024)  # admission receipts, newest last
        self.ram_bytes: dict[SessionKey, int] = {}  # per conversation, for the Snapshot
        self.checkpoint_bytes: dict[SessionKey, int] = {}  # the checkpoints' part of it
        self.bank_peak = 0  # kvbank_bank_peak_bytes: a benchmark reads it once, not polls
        self._retried_at = 0.0

    def root_for(self, tenant: str) -> BlockId:
        return chain_root(self.fingerprint, tenant)

    def _deliver(self, msg) -> None:
        """The link's thread: into the writer's inbox, which the owner pumps."""
        self.writer.deliver(msg)

    def _room(self) -> int:
        """What the bank may take without anything leaving: what its cap leaves, and what
        the memory budget does."""
        room = self.bank.effective_max_bytes - self.bank.total_nbytes
        free = self._free()
        return room if free is None else min(room, free)

    def _free(self) -> int | None:
        """What the memory budget leaves beyond every byte held (None: no budget)."""
        if self.pricing is None or self.budget is None:
            return None
        return self.budget() - held_bytes(self.pricing, self)

    def _fits_a_copy(self, n_tokens: int) -> bool:
        """Whether the budget has room for a copy of a turn's n_tokens of KV beside its cache
        (a request is priced at its cache once: the tight copy a commit may make is not in
        its price)."""
        free = self._free()
        return free is None or free >= self.pricing.kv_bytes_per_token * n_tokens

    def room_for_hints(self) -> int | None:
        """What a prefetch hint or a pre-render may take (`_room`); None while requests wait
        for memory: they come first."""
        return None if self._waiting() else self._room()

    # -- a request: admit, start, take, leave ------------------------------------------------

    def admit(self, job, tokens: np.ndarray, ids: list[BlockId], *, need: int,
              solo_need: int, batch, running: int) -> Admission | Start:
        """Room for the request (`need` bytes in the batch as it is, `solo_need` alone), or
        why it waits: a running request (`batch`) is computing a prefix it shares, a hint is
        reading its conversation back, or memory is held by requests in flight. Raises
        Refused when it never fits (its receipt logged)."""
        req = job.request
        tenant = req.tenant
        if not req.no_cache:  # a running request's prompt: wait for it, or take it
            if sharing.wait_for_prefix(job, tokens, ids, batch, self.restorer,
                                       self.block_tokens):
                return Start.WAIT_PREFIX
            if sharing.share_answered_prefix(tokens, ids, tenant, batch, self.bank,
                                             self.restorer, self.block_tokens,
                                             self.kinds.rest_bytes_per_token):
                self.refresh()
        session = self.conversations.resolve(
            tokens, ids, tenant, req.session_id, busy=self.bank.is_busy,
            in_ram=lambda k: bool(self.bank.session_entries(k)))
        if self.prefetcher.reading_for(session):  # its hint's read lands first: a RAM hit
            return Start.WAIT_PREFIX
        try:
            receipt = self.make_room(tokens, ids, tenant, session, need=need,
                                     solo_need=solo_need, running=running,
                                     no_cache=req.no_cache)
        except Refused as e:
            self._log_admission(req, session, e.receipt)
            raise
        if receipt.decision == Decision.WAIT:
            return Start.WAIT_MEMORY
        self._log_admission(req, session, receipt)
        return Admission(job, tokens, ids, session, self.conversations.history(session),
                         receipt)

    def make_room(self, tokens: np.ndarray, ids: list[BlockId], tenant: str,
                  session: SessionKey, *, need: int, solo_need: int, running: int,
                  no_cache: bool = False):
        """Admission's memory step for a request of `need` bytes (`EvictionPolicy.make_room`):
        the conversation's entry it takes as its own cache counts once (`Restorer.takes_over`).
        Returns the receipt (admitted, or wait); raises Refused."""
        hit = self.bank.lookup(tokens, tenant, ids, limit=len(tokens) - 1)
        taken_over = (hit.entry.nbytes if hit and not no_cache and self.restorer.takes_over(
            hit.entry, hit.n_tokens, session, len(tokens)) else 0)
        try:
            return self.eviction.make_room(
                pricing=self.pricing, budget=self.budget(), need=need, solo_need=solo_need,
                tokens=tokens, tenant=tenant, session_id=session[1], running=running,
                chain_shed=self.chain_shed, taken_over=taken_over, hit=hit)
        finally:
            self.refresh()

    def start(self, a: Admission, own: int, forward: int, decoding
              ) -> tuple[Restoring, bool]:
        """The admitted request's restore begins: its memory reserved, RAM looked at, and a
        read from SSD worth a thread started on one (the batch steps on while it reads; the
        engine takes it when `ready` says). Returns it, and whether it reads on a thread."""
        req = a.job.request
        self.prefetcher.started(a.session)
        self.bank.begin_request(a.session)
        self.bank.reserve_active(a.session, own, forward)
        t0 = time.monotonic()
        try:
            look = self.restorer.look(a.tokens, a.ids, req.tenant, req.no_cache)
            restoring = Restoring(job=a.job, tokens=a.tokens, ids=a.ids, session=a.session,
                                  history=a.history, decoding=decoding, look=look, t0=t0)
            read = lambda on_corrupt: self.restorer.read_ssd(  # noqa: E731
                look, a.tokens, a.ids, req.tenant, a.session, req.shared_checkpoint_at,
                on_corrupt)
            if self.reads.worth_a_thread(look.ssd_more):
                self.reads.start(restoring, read)
                restoring.stall_s = time.monotonic() - t0
                return restoring, True
            restoring.ssd = read(None)
        except Exception:
            self.bank.end_request(a.session)
            raise
        return restoring, False

    def restore(self, tokens: np.ndarray, tenant: str, session: SessionKey,
                no_cache: bool = False, anchor_at: int = 0) -> Taken:
        """A cache over the longest prefix RAM or SSD holds, read on this thread: the steps
        `start` and `take` make for an admitted request, without its admission (a rig's)."""
        ids = chain_block_ids(tokens, self.root_for(tenant), self.block_tokens)
        look = self.restorer.look(tokens, ids, tenant, no_cache)
        ssd = self.restorer.read_ssd(look, tokens, ids, tenant, session, anchor_at)
        return self._taken(look, ssd, session, tokens, ids, tenant, no_cache)

    def ready(self) -> list[Restoring]:
        """Requests whose read on a thread ended, the corrupt blocks it found reported (the
        link is this thread's); one that found nothing beyond RAM looks at RAM again (the bank
        may have changed while it read)."""
        done = []
        for r in self.reads.take_done():
            for block, e in r.corrupt:
                self.restorer.corrupt(block, e, r.job.request.tenant, r.session)
            if r.ssd is None and r.error is None and not r.job.cancelled.is_set():
                r.look = self.restorer.look(r.tokens, r.ids, r.job.request.tenant, False)
            done.append(r)
        return done

    def take(self, r: Restoring) -> Taken:
        """The request's own cache, from what SSD read, else RAM's hit (the bank hands a
        conversation's whole entry over to its next turn). Raises, the request's hold on the
        bank ended, when it cannot."""
        req = r.job.request
        try:
            taken = self._taken(r.look, r.ssd, r.session, r.tokens, r.ids, req.tenant,
                                req.no_cache)
        except Exception:
            self.bank.end_request(r.session)
            raise
        r.ssd = None  # the cache holds it now
        return taken

    def _taken(self, look, ssd, session, tokens, ids, tenant, no_cache) -> Taken:
        cache, cached, source, handed = self.restorer.take(look, ssd, session)
        lost = 0 if no_cache else self.restorer.lost(tokens, ids, tenant, cached)
        return Taken(cache, cached, source, handed, lost)

    def abandon(self, session: SessionKey, handed: BankEntry | None = None) -> None:
        """A request that ends before it ran (it could not join the batch, its client went
        away, its read failed): what it took comes back, its reservation goes."""
        if handed is not None:
            self.bank.take_back(handed)
        self.bank.end_request(session)

    def leave(self, r) -> None:
        """A request is done with the bank (answered, failed or cancelled): a conversation's
        entry that it took and did not commit over comes back."""
        sharing.withdraw_shared(r, self.bank)  # gone already when its commit superseded it
        if r.handed is not None:
            if self.conversations.deleted_since(r.bank_key, r.started):
                self.bank.let_go(r.handed)
            else:
                self.bank.take_back(r.handed)
        r.handed = None
        self.bank.end_request(r.bank_key)

    def copies_history(self, session: SessionKey, handed, n_tokens: int) -> None:
        """A request handed its conversation's entry, whose buffers have no room for its
        prompt of `n_tokens`, is about to copy the history into buffers of its own
        (`CacheKinds.with_room`). An entry all on SSD lets go of its arrays, so that copy is
        the only one in RAM (a turn that ends without a commit leaves its conversation on SSD
        alone). One still to be written stays whole, for its write and to come back if the
        turn is not committed, and is counted in the request's reservation."""
        if handed is None or self.kinds.has_room(handed.layers, n_tokens):
            return
        if handed.durable:
            self.bank.drop_layers(handed)
        else:
            self.bank.reserve_active(session, handed.nbytes)

    def forward_bytes(self) -> int:
        """The forward working memory held for running requests (the largest of theirs)."""
        return self.bank.forward_bytes()

    def prompt_read(self, session: SessionKey, decode_bytes: int) -> None:
        """A running request read its prompt: it holds a decode step's working memory now."""
        self.bank.settle_forward(session, decode_bytes)

    def reserve(self, session: SessionKey, nbytes: int) -> None:
        """More bytes for a running request, held until it ends or `unreserve` (its batch
        join's copy and padding)."""
        self.bank.reserve_active(session, nbytes)

    def unreserve(self, session: SessionKey, nbytes: int) -> None:
        """Bytes `reserve` held that the request no longer needs (its join's copy, made)."""
        self.bank.unreserve_active(session, nbytes)

    def hold_leave(self, nbytes: int) -> None:
        """What members of mlx-lm's batch take as they leave it (SessionBank.hold_leave)."""
        self.bank.hold_leave(nbytes)

    def share(self, r, batch) -> None:
        """`r` has read its prompt and others wait for it: its prompt's KV into the bank."""
        sharing.share_prefix(r, batch, self.bank)
        self.refresh()

    @property
    def reading(self) -> int:
        """Requests admitted whose KV is being read on a thread."""
        return len(self.reads)

    def reading_of(self, tenant: str) -> int:
        """`tenant`'s part of `reading`."""
        return sum(r.job.request.tenant == tenant for r in self.reads)

    # -- commit ------------------------------------------------------------------------------

    def commit(self, session: SessionKey, full: np.ndarray, cache: list,
               started: float = 0.0, handed=None, checkpoints=None, at_rest=None) -> bool:
        """The conversation's record (durable), then the bank entry, then the write-behind job.
        `checkpoints`: those its request took on the way (prompt splits, the prompt's end).
        `at_rest`: the quantized KV its cache was restored from, kept as it is. Whether the
        record is durable.

        A conversation deleted while its turn ran stays deleted: the turn is answered, not
        kept."""
        if self.conversations.deleted_since(session, started):
            if handed is not None:
                self.bank.let_go(handed)
            return False
        layers, end = self.kinds.freeze(cache, len(full), at_rest,
                                        tight=self._fits_a_copy(len(full)))
        checkpoints = dict(checkpoints or {})
        if end is not None:
            checkpoints[len(full)] = end
        durable, durable_tokens = False, 0
        try:
            durable_tokens = self._put_record(session, full)
            durable = True
        except ColdstoreUnavailable as e:
            logger.warning("session %s: turn not durable: %s", session[1], e)
        anonymous = is_anonymous(session[1])
        entry = self.bank.insert(
            session, full, layers, checkpoints=checkpoints, durable_tokens=durable_tokens,
            supersede_slack=self.conversations.lineages.slack if anonymous else 0,
            handed=handed)
        # The entry's own tokens: the record reads them there while the entry lives. Its
        # durable extent is the entry's (what LMDB held of it, and what the record adds).
        self.conversations.committed(session, entry.tokens, entry.durable_tokens, durable,
                                     entry.block_ids)
        self._ssd_changed(session)
        events.emit("kv_resident", tenant=session[0], session_id=session[1],
                    tokens=len(full), bytes=entry.nbytes, durable_tokens=durable_tokens)
        if durable:
            self.writer.write_behind(entry)
        else:  # the coldstore is away: record and KV go when it is back
            self.bank.write_deferred(entry)
        # Over --bank-bytes: entries on SSD leave first, unwritten ones are written out first.
        self.eviction.keep_within_cap(protect_keys=(entry.key,), keep_sessions=(session,))
        self.eviction.write_ahead()  # what the next commit's release would wait for
        self.refresh()
        return durable

    def _put_record(self, key: SessionKey, tokens, timeout_s: float = RECORD_TIMEOUT_S) -> int:
        """A conversation's record, committed by the coldstore: its durable extent."""
        return self.coldstore.put_session(key[0], key[1], self.block_tokens, tokens.tobytes(),
                                          timeout_s=timeout_s)

    def turns_ended(self) -> None:
        """Requests finished: the memory they held may let live hints read back."""
        if self.hints.live and self.prefetcher.retry():
            self.refresh()

    # -- the snapshot's figures --------------------------------------------------------------

    def refresh(self) -> None:
        """Per conversation, the bytes RAM holds (the Snapshot's), and the bank's gauges."""
        self.ram_bytes = {s: self.bank.session_nbytes(s) for s in self.bank.sessions()}
        self.checkpoint_bytes = {s: self.bank.session_nbytes(s, checkpoints_only=True)
                                 for s in self.bank.sessions()}
        metrics.BANK_BYTES.set(self.bank.total_nbytes)
        self.bank_peak = max(self.bank_peak, self.bank.total_nbytes)
        metrics.BANK_PEAK_BYTES.set(self.bank_peak)
        metrics.BANK_ENTRIES.set(len(self.bank.entries))

    def ledger(self) -> dict[str, int]:
        """Every byte the tiers answer for (SessionBank.ledger)."""
        return self.bank.ledger()

    def published(self) -> dict:
        """What the engine's Snapshot shows of the tiers."""
        return dict(sessions=self.conversations.records, ram_bytes=self.ram_bytes,
                    checkpoint_bytes=self.checkpoint_bytes, busy=self.bank.busy_sessions(),
                    bank_bytes=self.bank.total_nbytes, bank_entries=len(self.bank.entries))

    def stats(self) -> dict:
        """The bank's figures for the Status command."""
        ledger = self.bank.ledger()
        return {"bank_bytes": ledger["entries_bytes"],
                "running_bytes": self.bank.running_bytes(),
                "staged_bytes": ledger["staged_bytes"], "bank_max_bytes": self.bank.max_bytes,
                "bank_ceiling_bytes": self.bank.ceiling_bytes or 0,
                "bank_entries": len(self.bank.entries)}

    def tenant_stats(self, tenant: str) -> dict:
        """A tenant's own figures: its conversations' bank entries and bytes, its requests
        reading from SSD. Nothing of the whole bank: from that one tenant could read the size
        of another's prompts and answers."""
        mine = [e for e in self.bank.entries.values() if e.session[0] == tenant]
        return {"bank_bytes": sum(e.nbytes for e in mine), "bank_entries": len(mine),
                "reading_requests": self.reading_of(tenant)}

    def receipts(self, tenant: str | None, n: int = 20) -> tuple[list[dict], list[dict]]:
        """The last receipts of every policy and the eviction log, as `tenant` (None: the
        operator) may see them (worker/tiers/receipts.py)."""
        return visible_receipts(self.admissions, self.bank.receipts, self.bank.eviction_log,
                                tenant, n)

    def _log_admission(self, req, session: SessionKey, receipt) -> None:
        """Every decision but a wait is a receipt (the Status RPC, the event log)."""
        receipt.tenant, receipt.session_id = session
        metrics.ADMISSIONS.labels(receipt.decision).inc()
        if receipt.decision != Decision.WAIT:
            self.admissions.append(receipt)
            events.emit(prompt_tokens=len(req.token_ids), max_tokens=req.max_tokens,
                        **dataclasses.asdict(receipt))
        if (receipt.decision != Decision.ADMITTED or receipt.lru_evicted
                or receipt.released_sessions):
            logger.info("admission %s for %s: need %.0f MB, free %.0f -> %.0f MB, lru %d, "
                        "shed %d+%d, released %d (%d written out) %s %s", receipt.decision,
                        session[1], receipt.need_bytes / 1e6,
                        receipt.free_before / 1e6, receipt.free_after / 1e6,
                        receipt.lru_evicted, receipt.shed_non_terminal, receipt.shed_terminal,
                        receipt.released_sessions, receipt.written_out, receipt.reason,
                        receipt.verdict)

    # -- the engine's loop -------------------------------------------------------------------

    def pump(self) -> int:
        """The coldstore's acknowledgements so far, applied (they free staging and mark what is
        durable); how many."""
        return self.writer.pump()

    def set_busy(self, busy: bool, write_now: bool = False) -> None:
        """Tell the coldstore whether requests run (it writes idle-lane jobs when quiet), or
        that the memory its queued writes hold is needed now (`write_now`)."""
        self.coldstore.set_busy(busy or bool(self.reads) or bool(self.prefetcher.reading),
                                write_now)

    def land(self) -> None:
        """Hints' reads that ended, into the bank."""
        if self.prefetcher.land():
            self.refresh()

    def stop(self, timeout_s: float) -> list[Restoring]:
        """The worker stops: reads not begun never begin, those under way end; the requests'
        reads, for their end."""
        gone = self.reads.stop(timeout_s=timeout_s)
        self.prefetcher.stop(timeout_s=timeout_s / 2)
        return gone

    def close(self) -> None:
        self.writer.close(timeout_s=5)  # what was handed over leaves before the link closes
        self.coldstore.close()
        self.restorer.close()
        if self.kv_events is not None:
            self.kv_events.publisher.close()

    # -- commands (engine thread) ------------------------------------------------------------

    def release(self, session: SessionKey, write_out: bool) -> ReleaseReceipt:
        """Admin: one conversation's KV leaves RAM (written out first with `write_out`)."""
        return self.eviction.release_sessions(None, only_sessions=[session],
                                              reason=TrimReason.ADMIN_RELEASE,
                                              write_out_before_release=write_out)

    def trim(self, tenant: str | None = None) -> ShrinkReceipt:
        """Admin: every idle conversation already on SSD leaves RAM; a tenant's call, its own
        only (None: the operator's, every tenant's)."""
        return self.eviction.trim(tenant)

    def flush(self, tenant: str | None = None) -> FlushReceipt:
        """Admin: write every conversation not on SSD yet, now; they stay in RAM. A tenant's
        call, its own only (None: every tenant's)."""
        t0 = time.monotonic()
        give_up_at = self.eviction.give_up_at()
        written = failed = 0
        for e in [e for e in self.bank.entries.values() if e.awaits_queued_write
                  and (tenant is None or e.session[0] == tenant)]:
            if self.writer.write_out(e, give_up_at) == Outcome.WRITTEN:
                written += 1
            else:
                failed += 1
        r = FlushReceipt(reason=TrimReason.ADMIN_FLUSH, written_entries=written,
                         failed_entries=failed, seconds=round(time.monotonic() - t0, 4))
        if written or failed:
            self.bank.record(r)
        return r

    def pressure(self, level: PressureLevel, source: PressureSource,
                 deferred_s: float) -> PressureReceipt:
        return self.eviction.pressure_trim(level, source, deferred_s)

    def tick(self) -> None:
        """The guard's tick: the dynamic ceiling, writes sent again (every
        RETRY_WRITES_EVERY_S), hints read back where room allows."""
        self.eviction.apply_dynamic_ceiling(self.pricing, self.budget())
        now = time.monotonic()
        if now - self._retried_at >= RETRY_WRITES_EVERY_S:
            self._retried_at = now
            self.retry_writes()
        self.turns_ended()

    def retry_writes(self) -> int:
        """Send again what the coldstore refused, lost (it restarted) or never got (it was
        down): the record first if it missed turns, then the KV. Returns entries sent."""
        pending = [e for e in self.bank.entries.values()
                   if e.session in self.conversations and e.awaits_queued_write]
        if not pending:
            return 0
        try:
            live = set(self.coldstore.ping(timeout_s=2.0).jobs)
        except ColdstoreUnavailable:
            return 0
        self.writer.forget_lost_jobs(live)
        sent = 0
        for e in pending:
            if e.write_job in live or self.writer.unsent(e.write_job):
                continue
            info = self.conversations.get(e.session)
            if info is None:
                continue
            if not info.recorded:  # the record holds its history until the store does
                try:
                    durable = self._put_record(e.session, info.held, timeout_s=2.0)
                except ColdstoreUnavailable:
                    continue
                self.conversations.recorded_again(e.session, info, durable)
            if self.writer.write_behind(e) is not None:
                sent += 1
        if sent:
            logger.info("sent %d conversations' KV to the coldstore again", sent)
        return sent

    def probe(self, tokens: np.ndarray, tenant: str) -> tuple[int, int]:
        """How much of `tokens` RAM and LMDB hold, nothing restored."""
        return self.restorer.held(
            tokens, chain_block_ids(tokens, self.root_for(tenant), self.block_tokens), tenant)

    def hint(self, tenant: str, session_id: str, tokens: np.ndarray) -> PrefetchReport:
        """A client's prefetch hint (worker/tiers/prefetch.py)."""
        report = self.prefetcher.hint(tenant, session_id, tokens)
        self.refresh()
        return report

    def history(self, session: SessionKey) -> tuple[SessionInfo | None, Any]:
        """A conversation's record and its committed tokens (LMDB's, if RAM holds none)."""
        return self.conversations.get(session), self.conversations.history(session)

    def flush_events(self) -> None:
        """This turn's KV events out (several machines behind a router)."""
        if self.kv_events is not None:
            self.kv_events.flush()

    def announce(self) -> None:
        """A new KV-event subscriber: everything this worker holds, announced again."""
        if self.kv_events is not None:
            self.kv_events.announce_all()

    def delete(self, session: SessionKey) -> bool:
        """Gone from the bank, the records and the store; whether it existed."""
        self.prefetcher.started(session)  # a deleted conversation never comes back
        existed = session in self.conversations or bool(self.bank.session_entries(session))
        self.eviction.drop_session(session, reason=TrimReason.SESSION_DELETED)
        self.conversations.deleted(session, while_running=self.bank.is_busy(session))
        self.coldstore.delete_session(*session)
        self._ssd_changed(session)
        return existed

    # -- the coldstore's word (applied by the writer's pump, on the owner's thread) ----------

    def _on_coldstore_message(self, msg) -> None:
        """A write job's progress or end, or a conversation the coldstore retired."""
        kind = msg.WhichOneof("kind")
        if kind == "retired":
            r = msg.retired
            key = (r.tenant, r.session_id)
            if self.conversations.retired(key, r.removed, r.at, r.durable_tokens):
                self._durable(key, r.durable_tokens, lowered=True, recorded=True)
                logger.info("the coldstore retired %s (%s)", r.session_id, r.reason)
            return
        if kind == "progress":
            p = msg.progress
            self._durable((p.tenant, p.session_id), p.durable_tokens)
            return
        d = msg.done
        if not d.session_id:  # an unknown job's answer names no conversation
            return
        key, outcome = (d.tenant, d.session_id), wire.outcome_of(d)
        # A write-out is all or nothing: a failed one's blocks were taken back.
        self._durable(key, d.durable_tokens,
                      lowered=outcome == Outcome.DEADLINE or d.taken_back)
        self.bank.write_ended(key, d.job, outcome)
        if outcome == Outcome.WRITTEN:
            events.emit("kv_durable", tenant=key[0], session_id=key[1],
                        durable_tokens=d.durable_tokens)
        elif outcome not in (Outcome.SUPERSEDED, Outcome.CANCELLED):
            logger.warning("write of %s ended %s (%s): %s", key[1], outcome, d.reason, d.error)

    def _durable(self, key: SessionKey, n: int, lowered: bool = False,
                 recorded: bool = False) -> None:
        """What LMDB holds of a conversation moved to `n` (`lowered`: it may shrink): its
        record keeps the extent, and the bank's entries take theirs from the record (each
        clipped to its own tokens). `recorded`: the record was set already (a retirement)."""
        if not recorded:
            self.conversations.durable(key, n, lowered=lowered)
        info = self.conversations.get(key)
        self.bank.mark_durable(key, info.durable_tokens if info is not None else n,
                               lowered=lowered)
        self._ssd_changed(key)

    def _ssd_changed(self, key: SessionKey) -> None:
        """What LMDB holds of a conversation changed: the KV events follow."""
        if self.kv_events is not None:
            info = self.conversations.get(key)
            tokens = self.conversations.history(key) if info and info.durable_tokens else None
            self.kv_events.ssd_holds(key, tokens[:info.durable_tokens]
                                     if tokens is not None else None)
