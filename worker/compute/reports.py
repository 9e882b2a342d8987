"""What the engine reports: the Status command's memory and scheduler figures, and each
restore in the metrics and the event log (engine thread). The tiers' own receipts and
admissions: worker/tiers/manager.py."""

from __future__ import annotations

import logging

import mlx.core as mx

from kvbank import events, metrics
from kvbank.v1 import api_pb2
from kvbank.heap import resident_bytes
from kvbank.worker.memory.pricing import held_bytes

logger = logging.getLogger(__name__)


def status(engine, tenant: str | None = None) -> dict:
    """The engine's ledger, pressure, scheduler and pricing, for StatusResponse: the whole
    server's (`tenant` None: the operator), or one tenant's (`tenant_status`)."""
    e = engine
    settings = {
        "pressure_level": e.guard.level, "pressure_source": e.guard.source,
        "memory_budget_bytes": e.memory_budget, "fixed_bytes": e.pricing.fixed_bytes,
        "bank_max_bytes": e.kv.bank.max_bytes, "scheduler": e.scheduler.mode,
        "kv_bytes_per_token": e.kv_bytes_per_token, "kv_bits": e.kinds.kv_bits or 0,
        "mtp": _mtp(e),
        "prefill_chunk_tokens": e.pricing.chunk_tokens,
        "transient_base_bytes": e.pricing.transient_base,
        "transient_per_context_token": e.pricing.transient_per_context_token,
    }
    if tenant is not None:
        return settings | tenant_status(e, tenant)
    return settings | e.kv.stats() | {
        "scope": "server",
        "held_bytes": held_bytes(e.pricing, e.kv),
        "unaccounted_bytes": e.pricing.unaccounted_bytes,
        "rss_bytes": resident_bytes(), "mlx_cache_bytes": mx.get_cache_memory(),
        "running_requests": e.running(), "waiting_requests": e.waiting(),
    }


def tenant_status(engine, tenant: str) -> dict:
    """A tenant's own figures: its conversations' bank entries and bytes, its requests
    running and waiting. Nothing of the whole server's memory or load: from those one tenant
    could read the size of another's prompts and answers."""
    e = engine
    mine = e.kv.tenant_stats(tenant)
    running = sum(r.job.request.tenant == tenant for r in e.batch.running.values())
    return {"scope": "tenant", "bank_bytes": mine["bank_bytes"],
            "bank_entries": mine["bank_entries"],
            "running_requests": running + mine["reading_requests"],
            "waiting_requests": e.waiting(tenant)}


def _mtp(e) -> str:
    """MTP on, its depth and what its drafts kept so far; or off, and why."""
    if e.mtp is None:
        return "off: " + e.mtp_message.removeprefix("MTP off").lstrip(": ")
    s = e.mtp.decoder.stats
    return f"on, depth {e.mtp.depth}: {s.accepted} of {s.drafted} drafts kept"


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
