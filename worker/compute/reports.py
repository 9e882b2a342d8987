"""What the engine reports: the Status command's memory and scheduler figures, and each
restore in the metrics and the event log (engine thread). The tiers' own receipts and
admissions: worker/tiers/manager.py."""

from __future__ import annotations

import logging

import mlx.core as mx

from kvbank import events, metrics
from kvbank.v1 import api_pb2
from kvbank.worker.memory.pricing import held_bytes, resident_bytes

logger = logging.getLogger(__name__)


def status(engine) -> dict:
    """The engine's ledger, pressure, scheduler and pricing, for StatusResponse."""
    e = engine
    return {
        "pressure_level": e.guard.level, "pressure_source": e.guard.source,
        "memory_budget_bytes": e.memory_budget,
        "held_bytes": held_bytes(e.pricing, e.kv),
        "unaccounted_bytes": e.pricing.unaccounted_bytes,
        "rss_bytes": resident_bytes(), "mlx_cache_bytes": mx.get_cache_memory(),
        "fixed_bytes": e.pricing.fixed_bytes, **e.kv.stats(),
        "scheduler": e.scheduler.mode,
        "running_requests": e.running(), "waiting_requests": e.waiting(),
        "kv_bytes_per_token": e.kv_bytes_per_token, "kv_bits": e.kinds.kv_bits or 0,
        "prefill_chunk_tokens": e.pricing.chunk_tokens,
        "transient_base_bytes": e.pricing.transient_base,
        "transient_per_context_token": e.pricing.transient_per_context_token,
    }


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
