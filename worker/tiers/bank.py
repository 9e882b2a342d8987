"""SessionBank: every conversation's KV that the worker holds in RAM.

An entry is one session's KV for one token prefix. Entries are found by prefix, never by
session id alone: the index maps each chained block id (kvbank.blocks) to the entries that
contain that block, so a lookup walks the prompt's blocks (O(blocks in the prompt)) and then
verifies the chosen entry token by token.

Each field of an entry has one writer, the bank: an entry is frozen to every other module, and
the bank records what the others report (the writer's jobs and their outcomes, the
coldstore's durable extent, a request taking the entry and giving it back). Who leaves RAM is
decided in worker/tiers/eviction.py; the bank takes an entry out when told (`evict`).

The bank owns one byte ledger (`total_nbytes`), changed only in `_add` and `_remove`.
The bank runs on the worker's engine thread: no locks.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

import numpy as np

from kvbank import events, metrics
from kvbank.blocks import BlockId, chain_block_ids, common_prefix_len
from kvbank.contracts.receipts import Eviction
from kvbank.contracts.vocabulary import RETRY_OUTCOMES, Outcome, TrimReason
from kvbank.worker.kv.cache_kinds import Checkpoint
from kvbank.worker.kv.arrays import Layers, layers_nbytes

logger = logging.getLogger(__name__)

SessionKey = tuple[str, str]  # (tenant, session_id)
MAX_TAIL_CANDIDATES = 256
MAX_CHECKPOINTS = 8  # an entry's checkpoints (its end always among them): --max-checkpoints


def any_prefix(checkpoints, n_tokens: int) -> int:
    """The restore point of a model with full-attention caches only: any prefix."""
    return n_tokens


@dataclass(frozen=True, eq=False)
class BankEntry:
    """One session's KV for one prefix. Frozen: the bank alone writes its fields (`_set`)."""

    key: int
    session: SessionKey
    tokens: np.ndarray  # uint32, the prefix this KV covers
    block_ids: list[BlockId]  # chained ids of its full blocks
    layers: Layers  # K and V of its full-attention caches (worker/kv/cache_kinds.py)
    nbytes: int
    last_used: float
    checkpoints: dict[int, Checkpoint] = field(default_factory=dict)  # position -> the rest
    durable_tokens: int = 0  # KV committed in LMDB up to here
    write_job: int | None = None  # id of its queued coldstore write, if any
    write_pending: bool = False  # its write must be sent again (refused, lost, no record)
    prefetched: bool = False  # brought from SSD on a hint, not used since: the first to go
    # Computed in idle time for a query not asked yet (worker/compute/prerender.py): the first
    # to go, and superseded by any commit that covers it (its next turn's).
    prerendered: bool = False
    in_bank: bool = False  # in the bank's ledger now (not taken over by a request, not gone)
    # Handed over, and its arrays let go: the request copied them (KVManager.copies_history)
    layers_dropped: bool = False

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def awaits_queued_write(self) -> bool:
        """Its SSD write is queued (or waits to be sent again) and not committed: RAM holds
        the only copy."""
        return ((self.write_job is not None or self.write_pending)
                and self.durable_tokens < self.n_tokens)

    @property
    def durable(self) -> bool:
        return self.durable_tokens >= self.n_tokens


def _set(e: BankEntry, **fields) -> None:
    """The one way an entry's fields change: the bank's, in this module."""
    for name, value in fields.items():
        object.__setattr__(e, name, value)


def _inherit(into: dict[int, Checkpoint], old: BankEntry, shared: int) -> None:
    """`old`'s checkpoints that stand on the `shared` tokens, where `into` has none."""
    for p, c in old.checkpoints.items():
        if p <= shared:
            into.setdefault(p, c)


def _newest(checkpoints: dict[int, Checkpoint], end: int, cap: int) -> dict[int, Checkpoint]:
    """At most `cap` checkpoints: the one at `end`, then those ending a prefix other
    conversations share (as a block many conversations name, they go last), then the
    newest."""
    order = sorted(checkpoints, key=lambda p: (p != end, not checkpoints[p].shared, -p))
    order = order[:max(1, cap)]
    return {p: checkpoints[p] for p in sorted(order)}


@dataclass(frozen=True, slots=True)
class Hit:
    entry: BankEntry
    n_tokens: int


class SessionBank:
    def __init__(self, *, block_tokens: int, root_for: Callable[[str], BlockId],
                 max_bytes: int, active_pin_s: float = 600.0, log_size: int = 1024,
                 staged_bytes: Callable[[], int] = lambda: 0, listener=None,
                 restore_point: Callable[[Iterable[int], int], int] = any_prefix,
                 max_checkpoints: int = MAX_CHECKPOINTS,
                 clock: Callable[[], float] = time.monotonic):
        """`restore_point(checkpoint positions, n)`: the longest prefix <= n an entry with
        those checkpoints restores (CacheKinds.restore_point; any prefix without one).
        `staged_bytes()`: KV handed to the coldstore and not committed yet (the writer's),
        which the ledger counts. `listener`: told of every entry added and removed
        (worker/link/kv_events.py)."""
        self.restore_point = restore_point
        self.max_checkpoints = max_checkpoints
        self.clock = clock  # monotonic seconds: recency and the active pin (tests inject one)
        self.listener = listener
        self.block_tokens = block_tokens
        self.staged_bytes = staged_bytes
        self.root_for = root_for
        self.max_bytes = max_bytes
        self.ceiling_bytes: int | None = None  # a dynamic ceiling below max_bytes (`set_ceiling`)
        self.active_pin_s = active_pin_s
        self.entries: dict[int, BankEntry] = {}
        self.total_nbytes = 0
        self.eviction_log: deque[Eviction] = deque(maxlen=log_size)
        self.receipts: deque = deque(maxlen=256)  # every policy receipt that did something
        self._index: dict[BlockId, set[int]] = {}
        self._by_session: dict[SessionKey, set[int]] = {}
        self._prerendered: set[int] = set()  # keys of entries with `prerendered`
        self._in_flight: dict[SessionKey, int] = {}
        self._active_nbytes: dict[SessionKey, int] = {}  # caches of running requests
        self._forward_nbytes: dict[SessionKey, int] = {}  # their forwards' working memory
        self._leave_nbytes = 0  # members leaving mlx-lm's batch (`hold_leave`)
        self._last_use: dict[SessionKey, float] = {}
        self._ids = itertools.count(1)

    @property
    def indexed_block_ids(self) -> int:
        """How many block ids the prefix index holds (a benchmark's measure of its size)."""
        return len(self._index)

    @property
    def effective_max_bytes(self) -> int:
        return min(self.max_bytes, self.ceiling_bytes or self.max_bytes)

    def set_ceiling(self, nbytes: int) -> None:
        """The dynamic ceiling the guard's tick sets (worker/tiers/eviction.py)."""
        self.ceiling_bytes = nbytes

    # -- lookup -----------------------------------------------------------------------------

    def lookup(self, tokens: np.ndarray, tenant: str,
               ids: list[BlockId] | None = None, limit: int | None = None,
               restore_point: Callable[[Iterable[int], int], int] | None = None) -> Hit | None:
        """The entry that restores the longest token-verified prefix of `tokens`, at most
        `limit` tokens (`ids`: their chained block ids, when the caller has them already).

        Without a limit a full hit is returned as such; a restore leaves the last token to
        compute (the model needs one input to produce the next token's logits).
        `restore_point=any_prefix`: what the bank holds, restorable or not.
        """
        root = self.root_for(tenant)
        if ids is None:
            ids = chain_block_ids(tokens, root, self.block_tokens)
        level = self._index.get(root, set())  # every entry of the tenant
        depth = 0
        for i, bid in enumerate(ids):
            nxt = self._index.get(bid)
            if not nxt:
                break
            level, depth = nxt, i + 1
        if not level:
            return None
        best, best_n = None, 0
        base = depth * self.block_tokens
        # The walk stopped at the first block no entry holds, so no candidate shares more than
        # one block past `base`: compare that far, not the rest of the prompt.
        end = base + self.block_tokens
        query = tokens[base:end]
        for key in itertools.islice(level, MAX_TAIL_CANDIDATES):
            e = self.entries[key]
            n = base + common_prefix_len(e.tokens[base:end], query)
            n = (restore_point or self.restore_point)(e.checkpoints,
                                                       n if limit is None else min(n, limit))
            if n > best_n or (n == best_n and best is not None and e.last_used > best.last_used):
                best, best_n = e, n
        if best is None or best_n == 0:
            return None
        if not np.array_equal(best.tokens[:best_n], tokens[:best_n]):
            raise RuntimeError("bug: block index and tokens disagree")
        return Hit(best, best_n)

    # -- ledger: the only two places that change total_nbytes -------------------------------

    def _add(self, e: BankEntry) -> None:
        self.entries[e.key] = e
        _set(e, in_bank=True)
        self.total_nbytes += e.nbytes
        self._by_session.setdefault(e.session, set()).add(e.key)
        if e.prerendered:
            self._prerendered.add(e.key)
        for bid in self._index_keys(e):
            self._index.setdefault(bid, set()).add(e.key)
        if self.listener is not None:
            self.listener.ram_added(e)

    def _remove(self, e: BankEntry, *, announce: bool = True) -> None:
        del self.entries[e.key]
        _set(e, in_bank=False)
        self.total_nbytes -= e.nbytes
        self._prerendered.discard(e.key)
        keys = self._by_session[e.session]
        keys.discard(e.key)
        if not keys:
            del self._by_session[e.session]
        for bid in self._index_keys(e):
            s = self._index.get(bid)
            if s is not None:
                s.discard(e.key)
                if not s:
                    del self._index[bid]
        if announce:
            self._unannounce(e)

    def _unannounce(self, e: BankEntry) -> None:
        if self.listener is not None:
            self.listener.ram_removed(e)

    def _index_keys(self, e: BankEntry) -> list[BlockId]:
        # Under the tenant's root too, so a shared prefix shorter than one block is found.
        return [self.root_for(e.session[0]), *e.block_ids]

    # -- commit -----------------------------------------------------------------------------

    def insert(self, session: SessionKey, tokens: np.ndarray, layers: Layers,
               *, checkpoints: dict[int, Checkpoint] | None = None,
               durable_tokens: int = 0, supersede_slack: int = 0,
               prefetched: bool = False, prerendered: bool = False,
               handed: BankEntry | None = None) -> BankEntry:
        """Add a finished turn's KV. Entries of the same session that are a prefix of it are
        superseded (the new entry serves every prefix of its own) and leave; entries of a
        branch stay, as non-terminal. With `supersede_slack`, an entry the new one covers up
        to its last `supersede_slack` tokens is superseded too (a client that re-rendered the
        end of the previous answer differently continues, not branches). A `prefetched`
        entry (read back from SSD on a hint) does not make its session active, nor does a
        `prerendered` one (computed ahead of a query); a pre-rendered entry of the tenant that
        the new one covers whole is superseded too, whatever its session. `handed`: the
        entry this turn took out of the bank when it started (`hand_over`): what LMDB held of
        it counts as for a superseded one.

        `checkpoints`: the entry's window and recurrent caches at its end and wherever else
        its request stood (worker/kv/cache_kinds.py). Those of the entries it supersedes that
        stand on its tokens come along, newest first, up to `max_checkpoints`."""
        tokens = np.ascontiguousarray(tokens, dtype=np.uint32)
        now = self.clock()
        superseded = []
        checkpoints = dict(checkpoints or {})
        if handed is not None:
            shared = common_prefix_len(handed.tokens, tokens)
            durable_tokens = max(durable_tokens, min(handed.durable_tokens, shared))
            _inherit(checkpoints, handed, shared)
        for old in self.session_entries(session):
            shared = common_prefix_len(old.tokens, tokens)
            if shared == old.n_tokens or (supersede_slack and old.n_tokens <= len(tokens)
                                          and shared >= old.n_tokens - supersede_slack):
                durable_tokens = max(durable_tokens, min(old.durable_tokens, shared))
                superseded.append(old)
                _inherit(checkpoints, old, shared)
        for old in self.prerendered_entries(session[0]):
            if old.session != session and common_prefix_len(old.tokens, tokens) == old.n_tokens:
                superseded.append(old)  # its query came: this turn holds all of it
        checkpoints = _newest(checkpoints, len(tokens), self.max_checkpoints)
        e = BankEntry(
            key=next(self._ids),
            session=session,
            tokens=tokens,
            block_ids=chain_block_ids(tokens, self.root_for(session[0]), self.block_tokens),
            layers=layers,
            checkpoints=checkpoints,
            nbytes=layers_nbytes(layers) + sum(c.nbytes for c in checkpoints.values()),
            last_used=now,
            durable_tokens=min(durable_tokens, len(tokens)),
            prefetched=prefetched,
            prerendered=prerendered,
        )
        self._add(e)  # before the superseded leave: the blocks they share are never unheld
        for old in superseded:
            self._remove(old)
        if handed is not None:
            self._unannounce(handed)
        if not (prefetched or prerendered):
            self._last_use[session] = now
        return e

    def prerendered_entries(self, tenant: str) -> list[BankEntry]:
        """The tenant's pre-rendered entries (few: one per conversation whose user reads)."""
        return [self.entries[k] for k in self._prerendered
                if self.entries[k].session[0] == tenant]

    # -- a running request's own KV ------------------------------------------------------------

    def hand_over(self, e: BankEntry) -> None:
        """A request that continues the whole of its conversation's entry takes it out of the
        bank: its KV is now the request's working memory (counted as active, not as the bank's,
        as in every server's prompt cache), and the request may write past its tokens in place
        (worker/kv/arrays.py). Its queued SSD write goes on, and its blocks stay announced (KV
        events): the machine still holds them. The turn's commit supersedes it; a request that
        fails or is cancelled gives it back (`take_back`), or lets it go (`let_go`)."""
        self._remove(e, announce=False)

    def take_back(self, e: BankEntry) -> None:
        """A handed-over entry returns (its request ended without a commit): its tokens' KV
        is as it was. Left out when an entry of its session covers it already, or when it let
        go of its arrays (`drop_layers`: SSD holds them)."""
        if e.layers_dropped or any(common_prefix_len(o.tokens, e.tokens) == e.n_tokens
                                   for o in self.session_entries(e.session)):
            self.let_go(e)
            return
        self._add(e)  # a write that ended meanwhile is sent again (KVManager.retry_writes)

    def drop_layers(self, e: BankEntry) -> None:
        """A handed-over entry, all on SSD, lets go of its arrays: its request holds the only
        copy in RAM (KVManager.copies_history)."""
        _set(e, layers=[], layers_dropped=True)

    def let_go(self, e: BankEntry) -> None:
        """A handed-over entry nobody will commit over or give back (its conversation was
        deleted, or another entry covers it): its blocks leave RAM for the KV events."""
        self._unannounce(e)

    def withdraw(self, e: BankEntry) -> None:
        """An entry that was never its conversation's to keep (a running request's prompt,
        shared with others, whose turn was not committed) leaves, if it is still here: no
        eviction, nothing of it was the conversation's."""
        if self.entries.get(e.key) is e:
            self._remove(e)

    def sessions(self) -> list[SessionKey]:
        """The conversations with at least one entry in RAM."""
        return list(self._by_session)

    def session_entries(self, session: SessionKey) -> list[BankEntry]:
        return [self.entries[k] for k in self._by_session.get(session, ())]

    def terminal(self, session: SessionKey) -> BankEntry | None:
        entries = self.session_entries(session)
        return max(entries, key=lambda e: (e.n_tokens, e.last_used)) if entries else None

    def session_nbytes(self, session: SessionKey, checkpoints_only: bool = False) -> int:
        if checkpoints_only:
            return sum(c.nbytes for e in self.session_entries(session)
                       for c in e.checkpoints.values())
        return sum(e.nbytes for e in self.session_entries(session))

    # -- activity ---------------------------------------------------------------------------

    def begin_request(self, session: SessionKey) -> None:
        self._in_flight[session] = self._in_flight.get(session, 0) + 1
        self._last_use[session] = self.clock()

    def end_request(self, session: SessionKey) -> None:
        n = self._in_flight.get(session, 0) - 1
        if n > 0:
            self._in_flight[session] = n
        else:
            self._in_flight.pop(session, None)
            self._active_nbytes.pop(session, None)
            self._forward_nbytes.pop(session, None)
        self._last_use[session] = self.clock()

    def reserve_active(self, session: SessionKey, nbytes: int, forward_bytes: int = 0) -> None:
        """Bytes a running request's own cache will reach (prompt + max_tokens), or a
        prefetch hint's read (until `unreserve_active`: it runs no request); and the working
        memory of the request's forwards (`forward_bytes`): the engine runs one forward at a
        time, so the ledger holds the largest of the running requests', not their sum."""
        self._active_nbytes[session] = self._active_nbytes.get(session, 0) + nbytes
        if forward_bytes:
            self._forward_nbytes[session] = max(self._forward_nbytes.get(session, 0),
                                                forward_bytes)

    def settle_forward(self, session: SessionKey, nbytes: int) -> None:
        """A request past its prompt: it runs decode steps from now on, and holds their
        working memory (`nbytes`) instead of its prompt forward's. Where two of the session's
        requests run, the other may still read its prompt: nothing changes."""
        if self._in_flight.get(session, 0) == 1:
            self._forward_nbytes[session] = nbytes

    def forward_bytes(self) -> int:
        """The forward working memory the ledger holds (`reserve_active`)."""
        return max(self._forward_nbytes.values(), default=0)

    def hold_leave(self, nbytes: int) -> None:
        """What members of mlx-lm's batch take as they leave it (`Pricing.leave_bytes`), beside
        the members' own caches."""
        self._leave_nbytes = nbytes

    def running_bytes(self) -> int:
        """What running requests hold: their caches and the largest forward's memory."""
        return sum(self._active_nbytes.values()) + self._leave_nbytes + self.forward_bytes()

    def unreserve_active(self, session: SessionKey, nbytes: int) -> None:
        if (left := self._active_nbytes.get(session, 0) - nbytes) > 0:
            self._active_nbytes[session] = left
        else:
            self._active_nbytes.pop(session, None)

    def ledger(self) -> dict[str, int]:
        """Every byte the bank answers for: entries, running requests' caches, and KV handed
        to the coldstore but not committed yet."""
        active = sum(self._active_nbytes.values()) + self._leave_nbytes
        forward = self.forward_bytes()
        staged = self.staged_bytes()
        return {"entries_bytes": self.total_nbytes, "active_bytes": active,
                "forward_bytes": forward, "staged_bytes": staged,
                "held_bytes": self.total_nbytes + active + forward + staged}

    def is_busy(self, session: SessionKey) -> bool:
        return session in self._in_flight

    def busy_sessions(self) -> frozenset[SessionKey]:
        """Conversations with a request in flight (for the engine's snapshot)."""
        return frozenset(self._in_flight)

    def is_active(self, session: SessionKey, now: float | None = None) -> bool:
        if session in self._in_flight:
            return True
        now = self.clock() if now is None else now
        return now - self._last_use.get(session, -1e18) < self.active_pin_s

    def last_use(self, session: SessionKey) -> float:
        """When a request last began or ended on the session (0: never)."""
        return self._last_use.get(session, 0.0)

    def touch(self, e: BankEntry) -> None:
        _set(e, last_used=self.clock(), prefetched=False)  # used: an entry like any other now
        if not e.prerendered:  # a pre-render stays first to go: its next turn's commit holds it
            self._last_use[e.session] = e.last_used

    # -- what the writer and the coldstore report (the bank records it) -------------------

    def mark_durable(self, session: SessionKey, durable_tokens: int,
                     lowered: bool = False) -> None:
        """What LMDB holds of the session (its record's durable extent, each entry's clipped
        to its own tokens); `lowered` when a write-out's deadline took back blocks (it can only
        grow otherwise)."""
        for e in self.session_entries(session):
            n = min(durable_tokens, e.n_tokens)
            _set(e, durable_tokens=n if lowered else max(e.durable_tokens, n))

    def write_queued(self, e: BankEntry, job: int) -> None:
        """The writer handed the entry's unwritten blocks to the coldstore as `job`."""
        _set(e, write_job=job, write_pending=False)

    def write_deferred(self, e: BankEntry) -> None:
        """The writer could not hand it over (staging at its cap, the coldstore away): it
        waits to be sent again, protected."""
        _set(e, write_pending=True)

    def write_stopped(self, e: BankEntry, job: int) -> None:
        """The job's stream stopped (the entry left the bank meanwhile): what it committed
        stays; an entry given back later is sent again."""
        if e.write_job == job:
            _set(e, write_job=None, write_pending=not e.durable)

    def write_cancelled(self, e: BankEntry) -> None:
        """Its queued job was cancelled, or the coldstore lost it."""
        _set(e, write_job=None)

    def written(self, e: BankEntry) -> None:
        """A write-out committed all of the entry's tokens (its own job said so)."""
        _set(e, durable_tokens=e.n_tokens)

    def write_ended(self, session: SessionKey, job_id: int, outcome: Outcome) -> None:
        """The job ended; refused, failed or out of time (RETRY_OUTCOMES), its entries still
        in RAM wait to be sent again, protected."""
        for e in self.session_entries(session):
            if e.write_job == job_id:
                _set(e, write_job=None,
                     write_pending=outcome in RETRY_OUTCOMES and not e.durable)

    # -- leaving RAM (worker/tiers/eviction.py decides who) -------------------------------

    def record(self, receipt) -> None:
        """A policy's receipt leaves the process: the Status RPC reads `receipts`, and the
        event log gets it as one line."""
        self.receipts.append(receipt)
        events.emit(**asdict(receipt))

    def evict(self, e: BankEntry, reason: TrimReason, *, write_out: Outcome | None = None,
              write_out_s: float | None = None) -> None:
        """Out of the ledger and the index, into the eviction log (a queued write is the
        caller's to cancel: EvictionPolicy.evict)."""
        self._remove(e)
        durable = e.durable_tokens >= e.n_tokens
        self.eviction_log.append(Eviction(
            at=time.time(), reason=reason, session_id=e.session[1], prefix_tokens=e.n_tokens,
            nbytes=e.nbytes, durable=durable, release_write_out=write_out,
            write_out_s=write_out_s, tenant=e.session[0],
        ))
        metrics.EVICTIONS.labels(reason).inc()
        if write_out is not None:
            metrics.WRITE_OUTS.labels(write_out).inc()
        if e.awaits_queued_write:
            metrics.UNWRITTEN_DROPPED.inc()
        events.emit("kv_evicted", tenant=e.session[0], session_id=e.session[1], reason=reason,
                    tokens=e.n_tokens, bytes=e.nbytes, durable_tokens=e.durable_tokens,
                    now="cold" if durable else "gone", write_out=write_out)
        if e.awaits_queued_write:
            logger.warning("%s: dropped %s (%d tokens) before its SSD write",
                           reason, e.session[1], e.n_tokens)
