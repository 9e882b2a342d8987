"""What the engine reports: the Status command's memory and scheduler figures, the recent policy
receipts and evictions as one tenant may see them, and each admission and restore in the
metrics and the event log (engine thread)."""

from __future__ import annotations

import dataclasses
import logging

import mlx.core as mx

from kvbank import events, metrics
from kvbank.contracts.vocabulary import Decision
from kvbank.v1 import api_pb2
from kvbank.worker.memory.pricing import held_bytes, resident_bytes
from kvbank.worker.tiers.bank import SessionBank

logger = logging.getLogger(__name__)


def status(engine) -> dict:
    """The engine's ledger, pressure, scheduler and pricing, for StatusResponse."""
    e = engine
    ledger = e.bank.ledger()
    return {
        "pressure_level": e.guard.level, "pressure_source": e.guard.source,
        "memory_budget_bytes": e.memory_budget,
        "held_bytes": held_bytes(e.pricing, e.bank),
        "unaccounted_bytes": e.pricing.unaccounted_bytes,
        "rss_bytes": resident_bytes(), "mlx_cache_bytes": mx.get_cache_memory(),
        "fixed_bytes": e.pricing.fixed_bytes, "bank_bytes": ledger["entries_bytes"],
        "running_bytes": ledger["active_bytes"], "staged_bytes": ledger["staged_bytes"],
        "bank_max_bytes": e.bank.max_bytes,
        "bank_ceiling_bytes": e.bank.ceiling_bytes or 0,
        "bank_entries": len(e.bank.entries), "scheduler": e.scheduler.mode,
        "running_requests": e._running(), "waiting_requests": len(e._pending),
        "kv_bytes_per_token": e.kv_bytes_per_token, "kv_bits": e.kinds.kv_bits or 0,
        "prefill_chunk_tokens": e.pricing.chunk_tokens,
        "transient_base_bytes": e.pricing.transient_base,
        "transient_per_context_token": e.pricing.transient_per_context_token,
    }


def recent_receipts(admissions, bank: SessionBank, tenant: str,
                    n: int = 20) -> tuple[list[dict], list[dict]]:
    """The last receipts of every policy and the eviction log, as `tenant` may see them:
    admission receipts and eviction rows of its own conversations, release rows of its own,
    the other policies' counts."""
    out = [dataclasses.asdict(r) for r in list(admissions)[-4 * n:] if r.tenant == tenant][-n:]
    for r in list(bank.receipts)[-4 * n:]:
        d = dataclasses.asdict(r)
        if "rows" in d:
            d["rows"] = [row for row in d["rows"] if row["tenant"] == tenant]
            if not d["rows"] and not d["skipped_busy_sessions"]:
                continue
        out.append(d)
    out = sorted(out, key=lambda d: d["at"])[-3 * n:]
    evictions = [dataclasses.asdict(e) for e in bank.eviction_log
                 if e.tenant == tenant][-5 * n:]
    return out, evictions


def count_restore(req, session, n_tokens: int, cached: int, source: int) -> None:
    """A request's prompt and what it found cached, in the metrics and the event log."""
    tier = {api_pb2.CACHE_SOURCE_RAM: "ram", api_pb2.CACHE_SOURCE_SSD: "ssd"}.get(source,
                                                                                 "none")
    metrics.PROMPT_TOKENS.inc(n_tokens)
    if req.no_cache:
        return
    metrics.PREFIX_QUERIES.inc()
    metrics.PREFIX_HITS.labels(tier).inc()
    if cached:
        metrics.CACHED_TOKENS.labels(tier).inc(cached)
        events.emit("kv_restored", tenant=req.tenant, session_id=session[1], tier=tier,
                    tokens=cached, prompt_tokens=n_tokens)


def log_admission(admissions, req, session, receipt) -> None:
    """Every decision but a wait is a receipt (the Status RPC, the event log)."""
    receipt.tenant, receipt.session_id = session
    metrics.ADMISSIONS.labels(receipt.decision).inc()
    if receipt.decision != Decision.WAIT:
        admissions.append(receipt)
        events.emit(prompt_tokens=len(req.token_ids), max_tokens=req.max_tokens,
                    **dataclasses.asdict(receipt))
    if receipt.decision != Decision.ADMITTED or receipt.lru_evicted or receipt.released_sessions:
        logger.info("admission %s for %s: need %.0f MB, free %.0f -> %.0f MB, lru %d, "
                    "shed %d+%d, released %d (%d written out) %s %s", receipt.decision,
                    session[1], receipt.need_bytes / 1e6,
                    receipt.free_before / 1e6, receipt.free_after / 1e6,
                    receipt.lru_evicted, receipt.shed_non_terminal, receipt.shed_terminal,
                    receipt.released_sessions, receipt.written_out, receipt.reason,
                    receipt.verdict)
