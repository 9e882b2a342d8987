"""What the engine thread does besides requests: operator tools, the guard's actions, the
dynamic ceiling, and sending writes again. A mixin of `Engine` (worker/engine.py), kept apart
so that file reads as one request's path; every method here runs on the engine thread (via
`Engine.call`) unless its docstring says otherwise.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import mlx.core as mx

from kvbank import metrics
from worker.admission import held_bytes, resident_bytes
from worker.bank import SessionKey
from worker.guard import PressureTrim
from worker.persist import ColdstoreUnavailable

if TYPE_CHECKING:
    from worker.engine import SessionInfo

logger = logging.getLogger(__name__)

RETRY_WRITES_EVERY_S = 5.0
RSS_SLACK = 0.05  # of the budget: resident memory beyond the ledger that is not yet "held"


class Upkeep:
    # -- session operations (engine thread, via call) ---------------------------------------

    def delete_session(self, session: SessionKey) -> bool:
        existed = session in self.sessions or bool(self.bank.session_entries(session))
        if self.bank.is_busy(session):  # its running turn must not bring it back
            self._deleted_at[session] = time.monotonic()
        self.bank.drop_session(session, reason="session_deleted")
        self.coldstore.request({"op": "delete_session", "tenant": session[0],
                                "session_id": session[1]})
        self.lineages.drop(session)
        self._set_session(session, None)
        self._refresh_ram_bytes()
        return existed

    def forget_retired(self, msg: dict) -> None:
        """The coldstore retired a conversation's KV (an anonymous one's whole record): what
        RAM holds of it is no longer on SSD. A turn committed since then keeps it."""
        session = (msg["tenant"], msg["session_id"])
        info = self.sessions.get(session)
        if info is None or info.updated_at > msg["at"]:
            return
        self.bank.mark_durable(session, 0, lowered=True)
        if msg["removed"] == "record":
            self.lineages.drop(session)
            self._set_session(session, None)
        else:
            self._set_session(session, replace(info, durable_tokens=0))
        logger.info("the coldstore retired %s (%s)", session[1], msg["reason"])

    def release(self, session: SessionKey, write_out: bool):
        """Move one session's KV out of RAM (Admin.Release); returns the receipt."""
        receipt = self.bank.release_sessions(None, only_sessions=[session], reason="admin_release",
                                             write_out_before_release=write_out)
        self._refresh_ram_bytes()
        return receipt

    # -- memory and pressure (engine thread, via call, unless noted) ------------------------

    def held_bytes(self) -> int:
        """Any thread: the ledger's total (a moment's reading)."""
        while True:
            try:
                return held_bytes(self.pricing, self.bank)
            except RuntimeError:  # a dict changed under us: read again
                continue

    def update_gauges(self) -> None:
        """Any thread (the guard's tick): the gauges that are cheap to read from snapshots."""
        rss = resident_bytes()
        ledger = self.held_bytes() - self.pricing.unaccounted_bytes
        # Reconcile with what the OS sees: RSS may drift past the ledger by a little (threads,
        # interpreter, allocator); beyond RSS_SLACK of the budget the excess counts as held.
        slack = int(self.memory_budget * RSS_SLACK)
        self.pricing.unaccounted_bytes = max(0, rss - ledger - slack)
        metrics.MEMORY_HELD.set(self.held_bytes())
        metrics.MEMORY_BUDGET.set(self.memory_budget)
        metrics.WORKER_RSS.set(rss)

    def idle(self) -> bool:
        """Any thread: no request running or waiting."""
        return not self.batch and not self._pending

    def apply_dynamic_ceiling(self) -> None:
        """The bank may hold what the budget leaves after everything else; never an active
        conversation's KV (it may stay above)."""
        ledger = self.bank.ledger()
        others = self.pricing.fixed_bytes + ledger["active_bytes"] + ledger["staged_bytes"]
        self.bank.ceiling_bytes = max(0, self.memory_budget - others)
        if self.bank.total_nbytes > self.bank.effective_max_bytes:
            self.bank.shrink_to_bytes(self.bank.effective_max_bytes, reason="dynamic_ceiling",
                                      protect_active=True, protect_unwritten=True)
            self._refresh_ram_bytes()

    def pressure_trim(self, level: str, source: str, deferred_s: float) -> PressureTrim:
        """warning: half of the bank, keeping unwritten entries; critical: every idle entry,
        unwritten ones counted, because there memory comes first. Only a conversation with a
        request in flight is spared either way: the active pin (`--active-pin-s`) orders the
        LRU but does not veto a pressure trim."""
        mx.clear_cache()  # MLX's kept buffers first: nothing needs them back
        out: dict = {}
        if level == "warning":
            self.bank.shrink_to_bytes(self.bank.total_nbytes // 2, reason="pressure_warning",
                                      protect_unwritten=True, receipt_out=out)
        else:
            self.bank.shrink_to_bytes(0, reason="pressure_critical", receipt_out=out)
        self._refresh_ram_bytes()
        return PressureTrim(level=level, source=source,
                            bank_entries_evicted=out.get("evicted_entries", 0),
                            bank_unwritten_kept=out.get("unwritten_kept", 0),
                            bank_unwritten_dropped=out.get("unwritten_dropped", 0),
                            bytes_after=self.bank.total_nbytes, deferred_s=round(deferred_s, 3))

    def trim(self) -> dict:
        """Admin: every idle conversation already on SSD leaves RAM."""
        out: dict = {}
        self.bank.shrink_to_bytes(0, reason="admin_trim", protect_active=False,
                                  protect_unwritten=True, receipt_out=out)
        self._refresh_ram_bytes()
        return out

    def flush(self) -> tuple[int, int, float]:
        """Admin: write every conversation not on SSD yet, now; they stay in RAM."""
        from worker.persist import RELEASE_WRITE_OUT_MAX_S

        t0 = time.monotonic()
        deadline_s = self.bank.write_out_deadline_s
        give_up_at = time.time() + (RELEASE_WRITE_OUT_MAX_S if deadline_s is None else deadline_s)
        written = failed = 0
        for e in [e for e in self.bank.entries.values() if e.awaits_queued_write]:
            if self.writer.write_out(e, give_up_at) == "written":
                written += 1
            else:
                failed += 1
        self._refresh_ram_bytes()
        return written, failed, time.monotonic() - t0

    def status(self) -> dict:
        ledger = self.bank.ledger()
        return {
            "pressure_level": self.guard.level, "pressure_source": self.guard.source,
            "memory_budget_bytes": self.memory_budget,
            "held_bytes": held_bytes(self.pricing, self.bank),
            "unaccounted_bytes": self.pricing.unaccounted_bytes,
            "rss_bytes": resident_bytes(), "mlx_cache_bytes": mx.get_cache_memory(),
            "fixed_bytes": self.pricing.fixed_bytes, "bank_bytes": ledger["entries_bytes"],
            "running_bytes": ledger["active_bytes"], "staged_bytes": ledger["staged_bytes"],
            "bank_max_bytes": self.bank.max_bytes,
            "bank_ceiling_bytes": self.bank.ceiling_bytes or 0,
            "bank_entries": len(self.bank.entries), "scheduler": self.scheduler.mode,
            "running_requests": len(self.batch), "waiting_requests": len(self._pending),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "prefill_chunk_tokens": self.pricing.chunk_tokens,
            "transient_base_bytes": self.pricing.transient_base,
            "transient_per_context_token": self.pricing.transient_per_context_token,
        }

    def recent_receipts(self, tenant: str, n: int = 20) -> tuple[list[dict], list[dict]]:
        """The last receipts of every policy and the eviction log, as `tenant` may see them:
        admission receipts and eviction rows of its own conversations, release rows of its
        own, the bank's and the guard's counts."""
        out = [{"at": at, "kind": "admission", "session_id": sid, **dataclasses.asdict(r)}
               for at, t, sid, r in list(self.admission_log)[-4 * n:] if t == tenant][-n:]
        for r in list(self.bank.receipts)[-4 * n:]:
            d = dataclasses.asdict(r)
            if "rows" in d:
                d["rows"] = [row for row in d["rows"] if row["tenant"] == tenant]
                if not d["rows"] and not d["skipped_busy_sessions"]:
                    continue
            out.append(d)
        out += [dataclasses.asdict(r) for r in self.guard.receipts[-n:]]
        out = sorted(out, key=lambda d: d["at"])[-3 * n:]
        evictions = [dataclasses.asdict(e) for e in self.bank.eviction_log
                     if e.tenant == tenant][-5 * n:]
        return out, evictions

    def retry_writes(self) -> int:
        """Send again what the coldstore refused, lost (it restarted) or never got (it was
        down): the record first if it missed turns, then the KV. Returns entries sent."""
        now = time.monotonic()
        if now - getattr(self, "_retried_at", 0.0) < RETRY_WRITES_EVERY_S:
            return 0
        self._retried_at = now
        pending = [e for e in self.bank.entries.values()
                   if e.session in self.sessions and e.awaits_queued_write]
        if not pending:
            return 0
        try:
            live = set(self.coldstore.request({"op": "ping"}, timeout_s=2.0)["jobs"])
        except ColdstoreUnavailable:
            return 0
        self.writer.forget_lost_jobs(live)
        sent = 0
        for e in pending:
            if e.write_job in live or self.writer.unsent(e.write_job):
                continue
            info = self.sessions.get(e.session)
            if info is None or not self._ensure_record(e.session, info):
                continue
            if self.writer.write_behind(e) is not None:
                sent += 1
        if sent:
            logger.info("sent %d conversations' KV to the coldstore again", sent)
        return sent

    def _ensure_record(self, session: SessionKey, info: "SessionInfo") -> bool:
        if info.recorded:
            return True
        try:
            reply = self.coldstore.request(
                {"op": "put_session", "tenant": session[0], "session_id": session[1],
                 "block_tokens": self.block_tokens}, [info.tokens.tobytes()], timeout_s=2.0)
        except ColdstoreUnavailable:
            return False
        current = self.sessions.get(session)
        if current is info:
            self._set_session(session, replace(info, recorded=True,
                                               durable_tokens=reply["durable_tokens"]))
        return True
