"""Who leaves RAM: every rule that takes conversations' KV out of the bank, with one ranking.

The ranking (`EvictionPolicy.rank`), who leaves first:
  1. pre-rendered entries (the history a conversation's next query will carry, computed while
     its user reads: worker/compute/prerender.py) and prefetched entries whose hint has
     lapsed, not used since: both are guesses, and a guess is worth less than any turn;
  2. conversations without a hint: entries of idle sessions before entries of active ones (a
     session is active while a request runs on it, and for `active_pin_s` after its last
     use), least recently used first;
  3. conversations an agent said it will come back to (a live prefetch hint): the one hinted
     last goes first, since its tool call started last. Least recently used would be exactly
     wrong here: agents that think alike come back in the order they left.
A release ranks whole conversations by the same recency (`session_rank`), those all on SSD
first. Protections are filters on top of the ranking, never reorderings: `protect_active`
skips active sessions, `protect_unwritten` skips entries whose own SSD write is still queued,
`protect_keys` (entries) / `protect_sessions` (tenant, session id) skip what the caller names.

The seeds' policies are the entry points: `shrink_to_bytes`, `shrink_for_admission`,
`release_sessions` (each with its `protect_active` / `protect_unwritten`); and the rules
built on them, each returning its receipt: `make_room` (admission, steps 3-6),
`keep_within_cap` and `write_ahead` (after a commit), `apply_dynamic_ceiling`, `pressure_trim`,
`trim` (the operator's), `displace` (room for a prefetch hint). The bank only keeps entries
and takes one out when told (`SessionBank.evict`); the writer writes out what a release needs
first. Engine thread only.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

import mlx.core as mx
import numpy as np

from kvbank.contracts.failures import Refused
from kvbank.contracts.pricing import Pricing
from kvbank.contracts.receipts import (AdmissionReceipt, PressureReceipt, ReleaseReceipt,
                                       ReleaseRow, ShedReceipt, ShrinkReceipt)
from kvbank.contracts.vocabulary import (Decision, Outcome, Policy, PressureLevel,
                                         PressureSource, RefusalReason, TrimReason, Verdict)
from kvbank.worker.link.writer import RELEASE_WRITE_OUT_MAX_S, KVWriter
from kvbank.worker.memory.allocator import give_back_freed_memory
from kvbank.worker.memory.pricing import held_bytes
from kvbank.worker.tiers.bank import BankEntry, Hit, SessionBank, SessionKey

logger = logging.getLogger(__name__)

WRITE_AHEAD_MAX_S = 120.0  # later than a release's write-out (30 s) made soon after: it goes first


def _no_hint(session: SessionKey) -> float | None:
    return None


class EvictionPolicy:
    """The rules over one bank (and its writer: None, nothing is ever written)."""

    def __init__(self, bank: SessionBank, *, writer: KVWriter | None = None,
                 hinted_at: Callable[[SessionKey], float | None] = _no_hint,
                 hint_came_at: Callable[[SessionKey], float | None] | None = None,
                 write_out_deadline_s: float | None = None):
        """`hinted_at(session)`: when a live prefetch hint came for it (None: none;
        worker/tiers/prefetch.py keeps the hints); `hint_came_at`: the same for any hint not
        yet forgotten, lapsed or not (who is back later, for `displace`).
        `write_out_deadline_s`: how long a release waits for its writes (None:
        RELEASE_WRITE_OUT_MAX_S)."""
        self.bank, self.writer, self.hinted_at = bank, writer, hinted_at
        self.hint_came_at = hint_came_at or hinted_at
        self.write_out_deadline_s = write_out_deadline_s

    # -- the ranking -------------------------------------------------------------------------

    @staticmethod
    def _recency(hinted: float | None, last_used: float) -> tuple:
        """The part of the ranking entries and conversations share: no hint first, least
        recently used first; hinted last, the last hinted first."""
        return (hinted is not None, -hinted if hinted is not None else last_used)

    def rank(self, e: BankEntry, now: float) -> tuple:
        """An entry's place in the ranking (the module docstring's order)."""
        hinted = self.hinted_at(e.session)
        active = hinted is None and self.bank.is_active(e.session, now)
        guess = e.prerendered or (e.prefetched and hinted is None)
        return (not guess, hinted is not None, active,
                *self._recency(hinted, e.last_used)[1:])

    def session_rank(self, s: SessionKey) -> tuple:
        """A conversation's place in a release: all on SSD first, then the same recency."""
        return (not all(e.durable for e in self.bank.session_entries(s)),
                *self._recency(self.hinted_at(s), self.bank.last_use(s)))

    def order(self) -> list[BankEntry]:
        """Every entry, who leaves first first."""
        now = self.bank.clock()
        return sorted(self.bank.entries.values(), key=lambda e: self.rank(e, now))

    def give_up_at(self, max_s: float | None = None) -> float:
        """When a release's (or a flush's) writes stop being waited for (unix s): one
        deadline for all the writes of one call."""
        budget_s = next(s for s in (max_s, self.write_out_deadline_s, RELEASE_WRITE_OUT_MAX_S)
                        if s is not None)
        return time.time() + budget_s

    # -- taking one out ----------------------------------------------------------------------

    def evict(self, e: BankEntry, reason: TrimReason, *, write_out: Outcome | None = None,
              write_out_s: float | None = None) -> None:
        """Out of the bank, logged; a write still queued for it is cancelled (its staged
        bytes go too: the memory is wanted back, in the coldstore as well)."""
        unwritten = e.awaits_queued_write
        self.bank.evict(e, reason, write_out=write_out, write_out_s=write_out_s)
        if unwritten and self.writer is not None:
            self.writer.cancel(e)

    def drop_session(self, session: SessionKey, reason: TrimReason) -> int:
        """Evict every entry of one session, whatever its state (the session is gone)."""
        entries = self.bank.session_entries(session)
        for e in entries:
            self.evict(e, reason)
        return len(entries)

    # -- the seeds' policies -----------------------------------------------------------------

    def shrink_to_bytes(self, target_bytes: int, *, reason: TrimReason,
                        protect_active: bool = False, protect_unwritten: bool = False,
                        protect_keys: Iterable[int] = (),
                        protect_sessions: Iterable[SessionKey] = ()) -> ShrinkReceipt:
        """Evict in the ranking's order until the bank holds <= target_bytes.

        With protect_active the bank may stay above target (dynamic ceiling: an active session
        never re-prefills because of a trim). With protect_unwritten an entry whose own SSD
        write is still queued is never taken; when only such entries remain it stops above
        target and counts them in `unwritten_kept`.
        """
        bank = self.bank
        r = ShrinkReceipt(reason=reason, target_bytes=target_bytes)
        protect_keys, protect_sessions = set(protect_keys), set(protect_sessions)
        now = bank.clock()
        for e in sorted(bank.entries.values(), key=lambda e: self.rank(e, now)):
            if bank.total_nbytes <= target_bytes:
                break
            if e.key in protect_keys or e.session in protect_sessions or bank.is_busy(e.session):
                continue
            if protect_active and bank.is_active(e.session, now):
                continue
            if protect_unwritten and e.awaits_queued_write:
                r.unwritten_kept += 1
                continue
            if e.awaits_queued_write:
                r.unwritten_dropped += 1
            r.evicted_entries += 1
            r.evicted_bytes += e.nbytes
            self.evict(e, reason)
        r.bytes_after = bank.total_nbytes
        if r.evicted_entries or r.unwritten_kept:
            bank.record(r)
        return r

    def shrink_for_admission(self, target_bytes: int, *, protect_tokens: np.ndarray | None,
                             reason: TrimReason, tenant: str = "",
                             protect_sessions: Iterable[SessionKey] = (),
                             protect_unwritten: bool = False) -> ShedReceipt:
        """Make room before a prefill: non-terminal entries first (in the ranking's order),
        then any entry of a session with no request running. The entries `protect_tokens`
        would restore from are never taken, nor, with protect_unwritten, one whose SSD write is
        still queued (the release step writes those out first)."""
        bank = self.bank
        protected: set[int] = set()
        if protect_tokens is not None and len(protect_tokens):
            protect_tokens = np.asarray(protect_tokens, dtype=np.uint32)
            hit = bank.lookup(protect_tokens, tenant, limit=len(protect_tokens) - 1)
            if hit is not None:
                protected.add(hit.entry.key)
        keep = set(protect_sessions)
        terminals = {t.key for t in (bank.terminal(s) for s in bank.sessions()) if t}
        order = self.order()
        r = ShedReceipt(reason=reason, target_bytes=target_bytes)
        for terminal_phase in (False, True):
            for e in order:
                if bank.total_nbytes <= target_bytes:
                    break
                if (e.key not in bank.entries or e.key in protected or e.session in keep
                        or bank.is_busy(e.session) or (e.key in terminals) != terminal_phase
                        or (protect_unwritten and e.awaits_queued_write)):
                    continue
                self.evict(e, reason)
                r.evicted_bytes += e.nbytes
                if terminal_phase:
                    r.terminal_evicted += 1
                else:
                    r.non_terminal_evicted += 1
        r.bytes_after = bank.total_nbytes
        if r.evicted_bytes:
            bank.record(r)
        return r

    def release_sessions(self, target_bytes: int | None, *,
                         keep_sessions: Iterable[SessionKey] = (),
                         protect_keys: Iterable[int] = (),
                         reason: TrimReason, write_out_before_release: bool = False,
                         only_sessions: Iterable[SessionKey] | None = None,
                         max_write_out_s: float | None = None) -> ReleaseReceipt:
        """Release whole idle conversations until the bank holds <= target_bytes (None: all).

        Conversations already durable go first, then those without a prefetch hint (least
        recently used first), then hinted ones (hinted last, first: `session_rank`). With
        write-out, an entry whose SSD write is still queued is written first; all writes of
        one call share one deadline (`give_up_at`). A write that runs out of time, is refused
        or fails leaves the entry dropped, as without write-out; without it the queued write
        is cancelled. A session with a request running is skipped whole.
        """
        bank = self.bank
        give_up_at = self.give_up_at(max_write_out_s)
        keep, protected = set(keep_sessions), set(protect_keys)
        only = None if only_sessions is None else set(only_sessions)
        r = ReleaseReceipt(reason=reason, kind=(Policy.RELEASE_WRITE_OUT
                                                if write_out_before_release
                                                else Policy.IDLE_RELEASE))
        candidates = [s for s in bank.sessions() if s not in keep and (only is None or s in only)]
        candidates.sort(key=self.session_rank)
        for session in candidates:
            if target_bytes is not None and bank.total_nbytes <= target_bytes:
                break
            if bank.is_busy(session):
                r.skipped_busy_sessions += 1
                continue
            row = ReleaseRow(session_id=session[1], tenant=session[0])
            for e in sorted(bank.session_entries(session), key=lambda e: e.n_tokens):
                if e.key in protected:  # the incoming prompt restores from it
                    continue
                if bank.is_busy(session):  # a request started while we wrote: keep the rest
                    r.skipped_busy_sessions += 1
                    break
                outcome, took = None, None
                if write_out_before_release and e.awaits_queued_write and self.writer is not None:
                    t0 = time.monotonic()
                    outcome = self.writer.write_out(e, give_up_at)
                    took = time.monotonic() - t0
                    r.write_out_s += took
                    if outcome == Outcome.WRITTEN:
                        row.written_out_entries += 1
                row.entries += 1
                row.held_bytes += e.nbytes
                if e.durable:
                    row.on_ssd_entries += 1
                else:
                    row.dropped_entries += 1
                self.evict(e, reason, write_out=outcome, write_out_s=took)
            if row.entries:  # a conversation whose every entry was protected: no row
                r.add(row)
        r.write_out_s = round(r.write_out_s, 4)
        if r.rows or r.skipped_busy_sessions:
            bank.record(r)
        return r

    # -- admission (steps 3-6; the router did 1-2: ceilings and the queue) -------------------

    def make_room(self, *, pricing: Pricing, budget: int, need: int, solo_need: int, tokens,
                  tenant: str, session_id: str, running: int,
                  chain_shed: bool = False, taken_over: int = 0,
                  hit: Hit | None | bool = False) -> AdmissionReceipt:
        """Room for one request, each step re-measuring and stopping as soon as it fits:
        3. `shrink_to_bytes` of idle entries (protect_active, and the prompt's restore source);
        4. `shrink_for_admission` of prefill-shed candidates (the chain-derived target with
           `--admission-chain-shed`);
        5. `release_sessions(write_out_before_release=True)` of idle conversations, the
           prompt's restore source last;
        6. refuse before any prefill work, naming the holders of memory and a retry verdict.

        `need` prices the request as it would start now (its cache, and its forward's working
        memory beyond the one held); `solo_need` alone. `taken_over`: the bytes of the bank
        entry the request will take as its own cache, holding it once
        (`Restorer.takes_over`). `need` prices that history already, and from the hand-over
        on the ledger counts it there alone, so it is free for this request.
        `hit`: the prompt's RAM hit short of its last token, where the caller looked it up
        already (False: looked up here).
        Returns the receipt with decision "admitted", or "wait" when requests in flight, or
        writes to the coldstore in flight (their staging, and the entries they make durable,
        hence releasable), hold the missing memory (the request stays first in line); raises
        Refused otherwise."""
        bank = self.bank
        free = lambda: budget - held_bytes(pricing, bank) + taken_over  # noqa: E731
        r = AdmissionReceipt(need_bytes=need, free_before=free(), taken_over_bytes=taken_over)
        if free() >= need:
            r.free_after = free()
            return r
        target = lambda: max(0, bank.total_nbytes - (need - free()))  # noqa: E731
        if hit is False:
            hit = bank.lookup(tokens, tenant, limit=len(tokens) - 1)
        source = (hit.entry.key,) if hit else ()
        # 3. idle LRU entries; active sessions and the prompt's own restore source stay
        r.lru_evicted = self.shrink_to_bytes(target(), reason=TrimReason.ADMISSION_LRU,
                                             protect_active=True, protect_unwritten=True,
                                             protect_keys=source).evicted_entries
        # 4. admission shed: non-terminal entries first, then any idle session's (not
        #    unwritten ones: step 5 writes those out before they go)
        if free() < need:
            shed_target = target()
            if chain_shed:  # the admission-chain policy: shed what the chain will need too
                shed_target = max(0, shed_target - pricing.cache_bytes(len(tokens)))
            r.shed_target_bytes = shed_target
            shed = self.shrink_for_admission(
                shed_target, protect_tokens=tokens, reason=TrimReason.ADMISSION_SHED,
                tenant=tenant, protect_sessions=[(tenant, session_id)], protect_unwritten=True)
            r.shed_non_terminal, r.shed_terminal = shed.non_terminal_evicted, shed.terminal_evicted
        # 5. release idle conversations, writing their KV to SSD first; never the request's
        #    own conversation. The entry its prompt restores from (another conversation's,
        #    sharing a prefix) goes only if the others were not enough and its conversation
        #    makes the room: the prefix is then read back from SSD, where the release wrote
        #    it, or computed; either beats a refusal.
        for protect in ((source, ()) if source else ((),)):
            if free() >= need or (protect == () and source and self._session_bytes(
                    hit.entry.session) < need - free()):
                break
            rel = self.release_sessions(target(), reason=TrimReason.ADMISSION_RELEASE,
                                        keep_sessions=[(tenant, session_id)], protect_keys=protect,
                                        write_out_before_release=True)
            r.released_sessions += len(rel.rows)
            r.written_out += rel.written_out_entries
            r.write_out_s = round(r.write_out_s + rel.write_out_s, 4)
        r.free_after = free()
        if r.lru_evicted or r.shed_non_terminal or r.shed_terminal or r.released_sessions:
            _let_go()
        if r.free_after >= need:
            return r
        # 6. it does not fit: wait for requests in flight, or refuse with the reason
        ledger = bank.ledger()
        r.holders = {"fixed_bytes": pricing.fixed_bytes, "bank_bytes": ledger["entries_bytes"],
                     "running_bytes": bank.running_bytes(),
                     "staged_bytes": ledger["staged_bytes"],
                     "unaccounted_bytes": pricing.unaccounted_bytes}
        if solo_need > budget - pricing.fixed_bytes:
            r.decision, r.reason, r.verdict = (Decision.REFUSED, RefusalReason.OVER_MEMORY_BUDGET,
                                               Verdict.NEVER)
            raise _refused(r, f"this request needs {_size(solo_need)} but the memory budget "
                             f"leaves {_size(budget - pricing.fixed_bytes)} beyond the model: "
                             f"shorten the prompt, lower max_tokens or raise --memory-budget")
        if running or ledger["staged_bytes"]:  # what they hold comes free as they end
            r.decision, r.reason = Decision.WAIT, RefusalReason.IN_FLIGHT
            r.verdict = Verdict.AFTER_IN_FLIGHT if running else Verdict.AFTER_SSD
            return r
        unwritten = sum(e.nbytes for e in bank.entries.values() if e.awaits_queued_write)
        r.decision, r.reason = Decision.REFUSED, RefusalReason.MEMORY_HELD
        r.verdict = Verdict.AFTER_SSD if unwritten else Verdict.NOT_WITHOUT_SHORTER
        raise _refused(r, f"this request needs {_size(need)} and {_size(r.free_after)} are free "
                         f"after trimming the bank; held: "
                         + ", ".join(f"{k.removesuffix('_bytes')} {_size(v)}"
                                     for k, v in r.holders.items()))

    def _session_bytes(self, session: SessionKey) -> int:
        return sum(e.nbytes for e in self.bank.session_entries(session))

    # -- after a commit ----------------------------------------------------------------------

    def keep_within_cap(self, *, protect_keys=(), keep_sessions=()) -> ReleaseReceipt | None:
        """After a commit, over --bank-bytes: least recently used entries already on SSD
        leave first; if only conversations whose KV is not on SSD yet remain above the cap,
        they are written out and released (the seeds'
        `release_sessions(write_out_before_release=True)`), so the bank never grows past its
        cap on unwritten KV. `protect_keys`: the entry just committed stays; `keep_sessions`:
        its conversation is not released (its turn is still being answered). Returns the
        release's receipt when one was needed."""
        bank = self.bank
        cap = bank.effective_max_bytes
        self.shrink_to_bytes(cap, reason=TrimReason.BANK_BUDGET, protect_unwritten=True,
                             protect_keys=protect_keys)
        if bank.total_nbytes <= cap:
            return None
        return self.release_sessions(cap, reason=TrimReason.BANK_BUDGET,
                                     protect_keys=protect_keys, keep_sessions=keep_sessions,
                                     write_out_before_release=True)

    def write_ahead(self) -> int:
        """Under a cap that binds, the writes the next commit's release would wait for go now.

        A commit may add a whole conversation (one back from SSD) to the bank; room for it is
        then made from entries on SSD, and an unwritten one is written out first while the
        turn's answer waits (`keep_within_cap`). So whatever unwritten KV would not fit beside
        one more conversation the size of the largest entry, least recently used first, has
        its queued write promoted to go now rather than at a quiet window or `--max-dirty-s`:
        the coldstore writes it while the next prompts are read, and by the next commit it is
        on SSD and leaves without a wait. These are writes a quiet window, `--max-dirty-s` or
        the release would make anyway; they only move off the answer's path. One that misses
        its deadline is sent again (RETRY_OUTCOMES). Returns how many writes were promoted."""
        if self.writer is None:
            return 0
        entries = list(self.bank.entries.values())
        room = self.bank.effective_max_bytes - max((e.nbytes for e in entries), default=0)
        kept, promoted = 0, 0
        give_up_at = time.time() + WRITE_AHEAD_MAX_S
        for e in sorted(entries, key=lambda e: e.last_used, reverse=True):
            if not e.awaits_queued_write:
                continue
            if kept + e.nbytes <= room:
                kept += e.nbytes
            elif self.writer.write_ahead(e, give_up_at):
                promoted += 1
        return promoted

    # -- the guard's and the operator's ------------------------------------------------------

    def apply_dynamic_ceiling(self, pricing: Pricing, budget: int) -> None:
        """The bank may hold what the budget leaves after everything else; never an active
        conversation's KV (it may stay above)."""
        bank = self.bank
        ledger = bank.ledger()
        others = pricing.fixed_bytes + bank.running_bytes() + ledger["staged_bytes"]
        bank.set_ceiling(max(0, budget - others))
        if bank.total_nbytes > bank.effective_max_bytes:
            self.shrink_to_bytes(bank.effective_max_bytes, reason=TrimReason.DYNAMIC_CEILING,
                                 protect_active=True, protect_unwritten=True)

    def pressure_trim(self, level: PressureLevel, source: PressureSource,
                      deferred_s: float) -> PressureReceipt:
        """warning: half of the bank, keeping unwritten entries; critical: every idle entry.
        At critical the machine's own shortage (`system`, `psi`, or one an operator injects)
        drops unwritten entries, counted, because there memory comes first. kvbank's own
        ledger at critical is a line it drew itself, with the machine not short: unwritten
        entries are written out and then released (the seeds'
        `release_sessions(write_out_before_release)`), and only one whose write fails is
        dropped. Dropping them there lost agents' turns in n-agents at +200 MB (the ledger
        counts RSS, and RSS swings with prefill buffers). Only a conversation with a request
        in flight is spared: the active pin (`--active-pin-s`) orders the ranking but does not
        veto a pressure trim."""
        bank = self.bank
        mx.clear_cache()  # MLX's kept buffers first: nothing needs them back
        if level == PressureLevel.WARNING:
            r = self.shrink_to_bytes(bank.total_nbytes // 2, reason=TrimReason.PRESSURE_WARNING,
                                     protect_unwritten=True)
            evicted, kept, dropped = r.evicted_entries, r.unwritten_kept, r.unwritten_dropped
        elif source == PressureSource.LEDGER:
            r = self.shrink_to_bytes(0, reason=TrimReason.PRESSURE_CRITICAL,
                                     protect_unwritten=True)
            rel = self.release_sessions(0, reason=TrimReason.PRESSURE_CRITICAL,
                                        write_out_before_release=True)
            evicted = r.evicted_entries + rel.released_entries
            kept, dropped = 0, rel.unwritten_dropped
        else:
            r = self.shrink_to_bytes(0, reason=TrimReason.PRESSURE_CRITICAL)
            evicted, kept, dropped = r.evicted_entries, r.unwritten_kept, r.unwritten_dropped
        receipt = PressureReceipt(level=level, source=source, reason=r.reason,
                                  bank_entries_evicted=evicted, bank_unwritten_kept=kept,
                                  bank_unwritten_dropped=dropped,
                                  bytes_after=bank.total_nbytes, deferred_s=round(deferred_s, 3))
        bank.record(receipt)
        return receipt

    def trim(self, tenant: str | None = None) -> ShrinkReceipt:
        """Admin: every idle conversation already on SSD leaves RAM; a tenant's call, its own
        only (None: the operator's, every tenant's)."""
        others = {e.session for e in self.bank.entries.values()
                  if tenant is not None and e.session[0] != tenant}
        return self.shrink_to_bytes(0, reason=TrimReason.ADMIN_TRIM, protect_active=False,
                                    protect_unwritten=True, protect_sessions=others)

    # -- room for a prefetch hint -------------------------------------------------------------

    def displace(self, key: SessionKey, hinted_at: float, short: int,
                 give_up_at: float) -> bool:
        """Free `short` bytes for the conversation `key`, hinted at `hinted_at`, from those
        that will be back later than it: hinted after it (its tool call started later, so it
        ends later) or idle with no hint at all, the farthest first. Nothing leaves unless
        enough can, and nothing leaves that is not on SSD (a conversation's unwritten tail is
        written first, within `give_up_at`): nothing is lost, only a read later."""
        bank = self.bank
        now = bank.clock()

        def back_at(s: SessionKey) -> float | None:  # None: not later than `key`
            other = self.hint_came_at(s)
            if other is not None:
                return other if other > hinted_at else None
            return None if bank.is_active(s, now) else float("inf")  # no hint: idle

        later = [(at, s) for s in bank.sessions()
                 if s != key and not bank.is_busy(s) and (at := back_at(s)) is not None]
        if sum(bank.session_nbytes(s) for _, s in later) < short:
            return False
        chosen, freed = [], 0
        for _, s in sorted(later, key=lambda p: -p[0]):
            if freed >= short:
                break
            if self._written_out(s, give_up_at):
                chosen.append(s)
                freed += bank.session_nbytes(s)
        if freed < short:
            return False
        self.release_sessions(bank.total_nbytes - short, only_sessions=chosen,
                              reason=TrimReason.PREFETCH)
        return True

    def _written_out(self, s: SessionKey, give_up_at: float) -> bool:
        """All of the conversation's entries on SSD, writing the unwritten ones now."""
        for e in self.bank.session_entries(s):
            if not e.durable and (self.writer is None or not e.awaits_queued_write
                                  or self.writer.write_out(e, give_up_at) != Outcome.WRITTEN):
                return False
        return True


def _refused(r: AdmissionReceipt, message: str) -> Refused:
    retry = None if r.verdict == Verdict.NEVER else 5
    return Refused(r.reason, r.verdict, message, retry_after_s=retry, receipt=r)


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if abs(n) >= 1e6 else f"{n / 1e3:.0f} KB"


def _let_go() -> None:
    """What an admission evicted leaves the process before the request allocates its own:
    MLX's kept buffers and the heap's freed pages (the engine gives them back after a turn,
    too late here). Kept, a release-then-restore held both conversations at once: a worker
    admitted at 1,691 MiB of its 1,973 went to 2,019 MiB as it restored 566 MiB of KV
    (`bench compare --arch llama --size wide-kv --memory-limit 2.4GB`, Dec 2026)."""
    mx.clear_cache()
    give_back_freed_memory()
