"""The worker's admission: make room for a priced request by the bank's policies, or refuse.

Steps 3-6 of the admission path (the router did 1-2: ceilings and the queue). Each step
re-measures and stops as soon as the request fits:
3. `shrink_to_bytes` of idle LRU entries (protect_active, and the prompt's restore source);
4. `shrink_for_admission` of prefill-shed candidates (the chain-derived target with
   `--admission-chain-shed`);
5. `release_sessions(write_out_before_release=True)` of idle conversations;
6. refuse before any prefill work, naming the holders of memory and a retry verdict.
"""

from __future__ import annotations

from kvbank.contracts.failures import Refused
from kvbank.contracts.pricing import Pricing
from kvbank.contracts.receipts import AdmissionReceipt
from kvbank.contracts.vocabulary import Decision, RefusalReason, TrimReason, Verdict
from kvbank.worker.memory.pricing import held_bytes


def make_room(*, bank, pricing: Pricing, budget: int, need: int, solo_need: int, tokens,
              tenant: str, session_id: str, running: int,
              chain_shed: bool = False) -> AdmissionReceipt:
    """Steps 3-6 for one request; each step re-measures and stops when it fits.

    `need` prices the request in the batch as it is (mlx-lm pads batched caches); `solo_need`
    alone. Returns the receipt with decision "admitted", or "wait" when requests in flight
    hold the missing memory (the request stays first in line); raises Refused otherwise.
    """
    free = lambda: budget - held_bytes(pricing, bank)  # noqa: E731
    r = AdmissionReceipt(need_bytes=need, free_before=free())
    if free() >= need:
        r.free_after = free()
        return r
    target = lambda: max(0, bank.total_nbytes - (need - free()))  # noqa: E731
    hit = bank.lookup(tokens, tenant, limit=len(tokens) - 1)
    source = (hit.entry.key,) if hit else ()
    # 3. idle LRU entries; active sessions and the prompt's own restore source stay
    r.lru_evicted = bank.shrink_to_bytes(target(), reason=TrimReason.ADMISSION_LRU,
                                         protect_active=True, protect_unwritten=True,
                                         protect_keys=source).evicted_entries
    # 4. admission shed: non-terminal entries first, then any idle session's (not unwritten
    #    ones: step 5 writes those out before they go)
    if free() < need:
        shed_target = target()
        if chain_shed:  # the admission-chain policy: shed what the chain will need too
            shed_target = max(0, shed_target - pricing.cache_bytes(len(tokens)))
        r.shed_target_bytes = shed_target
        shed = bank.shrink_for_admission(
            shed_target, protect_tokens=tokens, reason=TrimReason.ADMISSION_SHED, tenant=tenant,
            protect_sessions=[(tenant, session_id)], protect_unwritten=True)
        r.shed_non_terminal, r.shed_terminal = shed.non_terminal_evicted, shed.terminal_evicted
    # 5. release idle conversations, writing their KV to SSD first; never the request's own
    #    conversation, nor the entry its prompt restores from (whoever's it is)
    if free() < need:
        rel = bank.release_sessions(target(), reason=TrimReason.ADMISSION_RELEASE,
                                    keep_sessions=[(tenant, session_id)], protect_keys=source,
                                    write_out_before_release=True)
        r.released_sessions, r.written_out = len(rel.rows), rel.written_out_entries
        r.write_out_s = rel.write_out_s
    r.free_after = free()
    if r.free_after >= need:
        return r
    # 6. it does not fit: wait for requests in flight, or refuse with the reason
    ledger = bank.ledger()
    r.holders = {"fixed_bytes": pricing.fixed_bytes, "bank_bytes": ledger["entries_bytes"],
                 "running_bytes": ledger["active_bytes"], "staged_bytes": ledger["staged_bytes"],
                 "unaccounted_bytes": pricing.unaccounted_bytes}
    if solo_need > budget - pricing.fixed_bytes:
        r.decision, r.reason, r.verdict = (Decision.REFUSED, RefusalReason.OVER_MEMORY_BUDGET,
                                           Verdict.NEVER)
        raise _refused(r, f"this request needs {_size(solo_need)} but the memory budget leaves "
                         f"{_size(budget - pricing.fixed_bytes)} beyond the model: "
                         f"shorten the prompt, lower max_tokens or raise --memory-budget")
    if running:
        r.decision, r.reason = Decision.WAIT, RefusalReason.IN_FLIGHT
        r.verdict = Verdict.AFTER_IN_FLIGHT
        return r
    unwritten = sum(e.nbytes for e in bank.entries.values() if e.awaits_queued_write)
    r.decision, r.reason = Decision.REFUSED, RefusalReason.MEMORY_HELD
    r.verdict = Verdict.AFTER_SSD if unwritten else Verdict.NOT_WITHOUT_SHORTER
    raise _refused(r, f"this request needs {_size(need)} and {_size(r.free_after)} are free "
                     f"after trimming the bank; held: "
                     + ", ".join(f"{k.removesuffix('_bytes')} {_size(v)}"
                                 for k, v in r.holders.items()))


def _refused(r: AdmissionReceipt, message: str) -> Refused:
    retry = None if r.verdict == Verdict.NEVER else 5
    return Refused(r.reason, r.verdict, message, retry_after_s=retry, receipt=r)


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if abs(n) >= 1e6 else f"{n / 1e3:.0f} KB"
