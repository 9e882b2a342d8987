"""What the engine does besides requests, one function each: the guard's actions, the dynamic
ceiling, the operator's tools, and sending writes again. Each is a function of the parts it
touches (the bank, the writer, the conversations), called on the engine thread by the
engine's command handlers (worker/compute/engine.py), and each trim returns its receipt.
"""

from __future__ import annotations

import logging
import time

import mlx.core as mx

from kvbank.contracts.failures import ColdstoreUnavailable
from kvbank.contracts.pricing import Pricing
from kvbank.contracts.receipts import (FlushReceipt, PressureReceipt, ReleaseReceipt,
                                       ShrinkReceipt)
from kvbank.contracts.vocabulary import Outcome, PressureLevel, PressureSource, TrimReason
from kvbank.worker.tiers.bank import SessionBank
from kvbank.worker.tiers.conversations import Conversations
from kvbank.worker.link.client import ColdstoreClient
from kvbank.worker.link.writer import RELEASE_WRITE_OUT_MAX_S, KVWriter

logger = logging.getLogger(__name__)

RETRY_WRITES_EVERY_S = 5.0
RSS_SLACK = 0.05  # of the budget: resident memory beyond the ledger that is not yet "held"
RECORD_TIMEOUT_S = 3.0
WRITE_AHEAD_MAX_S = 120.0  # later than a release's write-out (30 s) made soon after: it goes first


def reconcile_rss(pricing: Pricing, bank: SessionBank, budget: int, rss: int) -> None:
    """RSS may drift past the ledger by a little (threads, interpreter, allocator); beyond
    RSS_SLACK of the budget the excess counts as held, so the budget is the real one."""
    ledger = pricing.fixed_bytes + bank.ledger()["held_bytes"]
    pricing.unaccounted_bytes = max(0, rss - ledger - int(budget * RSS_SLACK))


def keep_within_cap(bank: SessionBank, *, protect_keys=(),
                    keep_sessions=()) -> ReleaseReceipt | None:
    """After a commit, over --bank-bytes: least recently used entries already on SSD leave
    first; if only conversations whose KV is not on SSD yet remain above the cap, they are
    written out and released (the seeds' `release_sessions(write_out_before_release=True)`),
    so the bank never grows past its cap on unwritten KV. `protect_keys`: the entry just
    committed stays; `keep_sessions`: its conversation is not released (its turn is still
    being answered). Returns the release's receipt when one was needed."""
    cap = bank.effective_max_bytes
    bank.shrink_to_bytes(cap, reason=TrimReason.BANK_BUDGET, protect_unwritten=True,
                         protect_keys=protect_keys)
    if bank.total_nbytes <= cap:
        return None
    return bank.release_sessions(cap, reason=TrimReason.BANK_BUDGET, protect_keys=protect_keys,
                                 keep_sessions=keep_sessions, write_out_before_release=True)


def write_ahead(bank: SessionBank) -> int:
    """Under a cap that binds, the writes the next commit's release would wait for go now.

    A commit may add a whole conversation (one back from SSD) to the bank; room for it is
    then made from entries on SSD, and an unwritten one is written out first while the turn's
    answer waits (`keep_within_cap`). So whatever unwritten KV would not fit beside one more
    conversation the size of the largest entry, least recently used first, has its queued
    write promoted to go now rather than at a quiet window or `--max-dirty-s`: the coldstore
    writes it while the next prompts are read, and by the next commit it is on SSD and leaves
    without a wait. These are writes a quiet window, `--max-dirty-s` or the release would make
    anyway; they only move off the answer's path. One that misses its deadline is sent again
    (RETRY_OUTCOMES). Returns how many writes were promoted."""
    if bank.writer is None:
        return 0
    entries = list(bank.entries.values())
    room = bank.effective_max_bytes - max((e.nbytes for e in entries), default=0)
    kept, promoted = 0, 0
    give_up_at = time.time() + WRITE_AHEAD_MAX_S
    for e in sorted(entries, key=lambda e: e.last_used, reverse=True):
        if not e.awaits_queued_write:
            continue
        if kept + e.nbytes <= room:
            kept += e.nbytes
        elif bank.writer.write_ahead(e, give_up_at):
            promoted += 1
    return promoted


def apply_dynamic_ceiling(bank: SessionBank, pricing: Pricing, budget: int) -> None:
    """The bank may hold what the budget leaves after everything else; never an active
    conversation's KV (it may stay above)."""
    ledger = bank.ledger()
    others = pricing.fixed_bytes + ledger["active_bytes"] + ledger["staged_bytes"]
    bank.ceiling_bytes = max(0, budget - others)
    if bank.total_nbytes > bank.effective_max_bytes:
        bank.shrink_to_bytes(bank.effective_max_bytes, reason=TrimReason.DYNAMIC_CEILING,
                             protect_active=True, protect_unwritten=True)


def pressure_trim(bank: SessionBank, level: PressureLevel, source: PressureSource,
                  deferred_s: float) -> PressureReceipt:
    """warning: half of the bank, keeping unwritten entries; critical: every idle entry.
    At critical the machine's own shortage (`system`, `psi`, or one an operator injects)
    drops unwritten entries, counted, because there memory comes first. kvbank's own ledger
    at critical is a line it drew itself, with the machine not short: unwritten entries are
    written out and then released (the seeds' `release_sessions(write_out_before_release)`),
    and only one whose write fails is dropped. Dropping them there lost agents' turns in
    n-agents at +200 MB (the ledger counts RSS, and RSS swings with prefill buffers). Only a
    conversation with a request in flight is spared: the active pin (`--active-pin-s`)
    orders the LRU but does not veto a pressure trim."""
    mx.clear_cache()  # MLX's kept buffers first: nothing needs them back
    if level == PressureLevel.WARNING:
        r = bank.shrink_to_bytes(bank.total_nbytes // 2, reason=TrimReason.PRESSURE_WARNING,
                                 protect_unwritten=True)
        evicted, kept, dropped = r.evicted_entries, r.unwritten_kept, r.unwritten_dropped
    elif source == PressureSource.LEDGER:
        r = bank.shrink_to_bytes(0, reason=TrimReason.PRESSURE_CRITICAL, protect_unwritten=True)
        rel = bank.release_sessions(0, reason=TrimReason.PRESSURE_CRITICAL,
                                    write_out_before_release=True)
        evicted = r.evicted_entries + rel.released_entries
        kept, dropped = 0, rel.unwritten_dropped
    else:
        r = bank.shrink_to_bytes(0, reason=TrimReason.PRESSURE_CRITICAL)
        evicted, kept, dropped = r.evicted_entries, r.unwritten_kept, r.unwritten_dropped
    receipt = PressureReceipt(level=level, source=source, reason=r.reason,
                              bank_entries_evicted=evicted, bank_unwritten_kept=kept,
                              bank_unwritten_dropped=dropped,
                              bytes_after=bank.total_nbytes, deferred_s=round(deferred_s, 3))
    bank.record(receipt)
    return receipt


def trim(bank: SessionBank) -> ShrinkReceipt:
    """Admin: every idle conversation already on SSD leaves RAM."""
    return bank.shrink_to_bytes(0, reason=TrimReason.ADMIN_TRIM, protect_active=False,
                                protect_unwritten=True)


def flush(bank: SessionBank, writer: KVWriter) -> FlushReceipt:
    """Admin: write every conversation not on SSD yet, now; they stay in RAM."""
    t0 = time.monotonic()
    deadline_s = bank.write_out_deadline_s
    give_up_at = time.time() + (RELEASE_WRITE_OUT_MAX_S if deadline_s is None else deadline_s)
    written = failed = 0
    for e in [e for e in bank.entries.values() if e.awaits_queued_write]:
        if writer.write_out(e, give_up_at) == Outcome.WRITTEN:
            written += 1
        else:
            failed += 1
    r = FlushReceipt(reason=TrimReason.ADMIN_FLUSH, written_entries=written, failed_entries=failed,
                     seconds=round(time.monotonic() - t0, 4))
    if written or failed:
        bank.record(r)
    return r


def put_record(client: ColdstoreClient, key, tokens, block_tokens: int,
               timeout_s: float = RECORD_TIMEOUT_S) -> int:
    """A conversation's record, committed by the coldstore: its durable extent."""
    return client.put_session(key[0], key[1], block_tokens, tokens.tobytes(),
                              timeout_s=timeout_s)


def retry_writes(bank: SessionBank, writer: KVWriter, client: ColdstoreClient,
                 conversations: Conversations, block_tokens: int) -> int:
    """Send again what the coldstore refused, lost (it restarted) or never got (it was
    down): the record first if it missed turns, then the KV. Returns entries sent."""
    pending = [e for e in bank.entries.values()
               if e.session in conversations and e.awaits_queued_write]
    if not pending:
        return 0
    try:
        live = set(client.ping(timeout_s=2.0).jobs)
    except ColdstoreUnavailable:
        return 0
    writer.forget_lost_jobs(live)
    sent = 0
    for e in pending:
        if e.write_job in live or writer.unsent(e.write_job):
            continue
        info = conversations.get(e.session)
        if info is None:
            continue
        if not info.recorded:  # the record holds its history until the store does
            try:
                durable = put_record(client, e.session, info.held, block_tokens,
                                     timeout_s=2.0)
            except ColdstoreUnavailable:
                continue
            conversations.recorded_again(e.session, info, durable)
        if writer.write_behind(e) is not None:
            sent += 1
    if sent:
        logger.info("sent %d conversations' KV to the coldstore again", sent)
    return sent
