"""What the Status command answers: the engine's memory and scheduler figures, and the recent
policy receipts and evictions as one tenant may see them (engine thread)."""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from worker.admission import held_bytes, resident_bytes
from worker.bank import SessionBank


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
        "running_requests": len(e.batch), "waiting_requests": len(e._pending),
        "kv_bytes_per_token": e.kv_bytes_per_token,
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
