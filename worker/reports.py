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
from worker.admission import held_bytes, resident_bytes
from worker.bank import SessionBank

logger = logging.getLogger(__name__)


def status(engine, tenant: str | None = None) -> dict:
    """The engine's ledger, pressure, scheduler and pricing, for StatusResponse: the whole
    server's (`tenant` None: the operator), or one tenant's (`tenant_status`)."""
    e = engine
    ledger = e.bank.ledger()
    settings = {
        "pressure_level": e.guard.level, "pressure_source": e.guard.source,
        "memory_budget_bytes": e.memory_budget, "fixed_bytes": e.pricing.fixed_bytes,
        "bank_max_bytes": e.bank.max_bytes, "scheduler": e.scheduler.mode,
        "kv_bytes_per_token": e.kv_bytes_per_token, "kv_bits": e.kinds.kv_bits or 0,
        "prefill_chunk_tokens": e.pricing.chunk_tokens,
        "transient_base_bytes": e.pricing.transient_base,
        "transient_per_context_token": e.pricing.transient_per_context_token,
    }
    if tenant is not None:
        return settings | tenant_status(e, tenant)
    return settings | {
        "scope": "server",
        "held_bytes": held_bytes(e.pricing, e.bank),
        "unaccounted_bytes": e.pricing.unaccounted_bytes,
        "rss_bytes": resident_bytes(), "mlx_cache_bytes": mx.get_cache_memory(),
        "bank_bytes": ledger["entries_bytes"],
        "running_bytes": ledger["active_bytes"], "staged_bytes": ledger["staged_bytes"],
        "bank_ceiling_bytes": e.bank.ceiling_bytes or 0,
        "bank_entries": len(e.bank.entries),
        "running_requests": e._running(), "waiting_requests": len(e._pending),
    }


def tenant_status(engine, tenant: str) -> dict:
    """A tenant's own figures: its conversations' bank entries and bytes, its requests
    running and waiting. Nothing of the whole server's memory or load: from those one tenant
    could read the size of another's prompts and answers."""
    e = engine
    mine = [x for x in e.bank.entries.values() if x.session[0] == tenant]
    running = sum(r.job.request.tenant == tenant for r in e.batch.running.values())
    running += sum(r.job.request.tenant == tenant for r in e.restores)
    return {"scope": "tenant", "bank_bytes": sum(x.nbytes for x in mine),
            "bank_entries": len(mine), "running_requests": running,
            "waiting_requests": sum(j.request.tenant == tenant for j in e._pending)}


# An admission receipt's figures of the whole bank: what the request found free, and what was
# taken from other conversations to make room. A tenant sees its decision and need only.
SERVER_WIDE = ("free_before", "free_after", "lru_evicted", "shed_non_terminal",
               "shed_terminal", "released_sessions", "shed_target_bytes", "written_out",
               "write_out_s", "holders")


def recent_receipts(admissions, bank: SessionBank, tenant: str | None,
                    n: int = 20) -> tuple[list[dict], list[dict]]:
    """The last receipts of every policy and the eviction log, as `tenant` may see them: all
    of them for the operator (None); for a tenant, its own admissions (without the bank's
    figures), the rows of releases of its own conversations and their evictions."""
    if tenant is None:
        out = [dataclasses.asdict(r) for r in list(admissions)[-n:]]
        out += [dataclasses.asdict(r) for r in list(bank.receipts)[-2 * n:]]
        evictions = [dataclasses.asdict(e) for e in bank.eviction_log][-5 * n:]
        return sorted(out, key=lambda d: d["at"])[-3 * n:], evictions
    out = [{k: v for k, v in dataclasses.asdict(r).items() if k not in SERVER_WIDE}
           for r in list(admissions)[-4 * n:] if r.tenant == tenant][-n:]
    for r in list(bank.receipts)[-4 * n:]:
        d = dataclasses.asdict(r)
        if "rows" not in d:
            continue  # the trims' and the guard's receipts count the whole bank
        d["rows"] = [row for row in d["rows"] if row["tenant"] == tenant]
        if not d["rows"]:
            continue
        d = {k: d[k] for k in ("kind", "reason", "at", "rows")}
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
