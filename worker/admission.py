"""The worker's admission: price a request, make room by the bank's policies, or refuse.

Steps 3-6 of the admission path (the router did 1-2: ceilings and the queue). Each step
re-measures and stops as soon as the request fits:
3. `shrink_to_bytes` of idle LRU entries (protect_active, and the prompt's restore source);
4. `shrink_for_admission` of prefill-shed candidates (the chain-derived target with
   `--admission-chain-shed`);
5. `release_sessions(write_out_before_release=True)` of idle conversations;
6. refuse before any prefill work, naming the holders of memory and a retry verdict.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvbank import heap
from kvbank.config import DEFAULT_DECODE_WAIT_S
from kvbank.contracts.failures import Refused
from kvbank.contracts.pricing import Pricing
from kvbank.contracts.receipts import AdmissionReceipt
from kvbank.contracts.vocabulary import Decision, RefusalReason, TrimReason, Verdict

logger = logging.getLogger(__name__)

SCHEDULERS = ("batch", "serial", "hyper")
DEFAULT_BATCH_ACTIVE = 4


@dataclass(frozen=True)
class SchedulerConfig:
    mode: str = "batch"
    max_active: int = DEFAULT_BATCH_ACTIVE
    decode_wait_s: float = DEFAULT_DECODE_WAIT_S  # see worker/scheduler.py

    @classmethod
    def from_flags(cls, mode: str, max_active: int | None,
                   decode_wait_s: float = DEFAULT_DECODE_WAIT_S) -> "SchedulerConfig":
        """Checked at start: a flag that contradicts the mode stops the process, naming it."""
        if mode not in SCHEDULERS:
            raise SystemExit(f"--scheduler-mode {mode}: choose one of {', '.join(SCHEDULERS)}")
        if max_active is not None and max_active < 1:
            raise SystemExit(f"--max-active-requests {max_active}: must be at least 1")
        if not decode_wait_s >= 0:
            raise SystemExit(f"--decode-wait-s {decode_wait_s}: must be 0 (answers take a token "
                             f"every step) or more")
        mode = "hyper" if mode == "serial" else mode  # its alias (docs/decisions.md)
        if mode == "hyper" and max_active not in (None, 1):
            raise SystemExit(f"--scheduler-mode hyper runs exactly one request at a time; "
                             f"--max-active-requests {max_active} would allow more: drop it "
                             f"or use --scheduler-mode batch")
        if max_active is None:
            max_active = DEFAULT_BATCH_ACTIVE if mode == "batch" else 1
        return cls(mode, max_active, decode_wait_s)


# -- pricing (the list itself: kvbank/contracts/pricing.py) ---------------------------------------


CALIBRATION_CHUNKS = 5


def calibrate(model, pricing: Pricing, on_chunk=lambda i: None) -> Pricing:
    """Measure a prefill chunk's transient bytes at contexts 0 and 4 chunks (MLX tracks CPU
    allocations too), so pricing reflects this model and this chunk size. `on_chunk(i)`
    after each chunk (the start's progress; worker/starting.py keeps the result)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    C = pricing.chunk_tokens
    cache = make_prompt_cache(model)
    peaks = {}
    for i in range(CALIBRATION_CHUNKS):  # at context 0 and 4C: the slope over a wide span
        tokens = mx.array([[(1000 + 7 * j + i) % 5000 for j in range(C)]], dtype=mx.uint32)
        mx.eval(tokens)
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        model(tokens, cache=cache)
        mx.eval([c.state for c in cache])
        kv_growth = mx.get_active_memory() - before
        if i in (0, 4):
            peaks[i] = max(0, mx.get_peak_memory() - before - kv_growth)
        on_chunk(i + 1)
    del cache
    mx.clear_cache()
    peaks = [peaks[0], peaks[4]]
    pricing.transient_base = peaks[0]
    pricing.transient_per_context_token = max(0.0, (peaks[1] - peaks[0]) / (4 * C))
    return pricing


# -- the ledger ---------------------------------------------------------------------------------


def resident_bytes(pid: int | str = "self") -> int:
    """Memory a process holds itself: anonymous + shared resident pages (Linux RssAnon +
    RssShmem). File-backed pages (libraries, the LMDB map a restore reads) are the kernel's
    page cache and can be dropped any time, so they do not count. Elsewhere: RSS."""
    try:
        fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
        return sum(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssShmem"))
    except (OSError, KeyError, ValueError):
        import psutil

        return psutil.Process(None if pid == "self" else int(pid)).memory_info().rss


def default_memory_budget() -> int:
    """60 % of RAM: the rest is for the OS, the coldstore's page cache and other programs."""
    import psutil

    return int(psutil.virtual_memory().total * 0.6)


def memory_budget_bytes(spec: str | int | None, pricing: Pricing) -> int:
    """--memory-budget: bytes, or "+N" (N bytes for KV beyond the model and one prefill
    chunk's working memory), or None (default_memory_budget)."""
    if spec is None:
        budget = default_memory_budget()
    elif isinstance(spec, str) and spec.startswith("+"):
        budget = pricing.fixed_bytes + pricing.transient_base + int(spec[1:])
    else:
        budget = int(spec)
    logger.info("memory budget %.0f MB: model and runtime %.0f MB, a %d-token prefill chunk "
                "%.0f MB + %.0f KB per context token; one request fits up to %d tokens",
                budget / 1e6, pricing.fixed_bytes / 1e6, pricing.chunk_tokens,
                pricing.transient_base / 1e6, pricing.transient_per_context_token / 1e3,
                pricing.max_fit_tokens(budget))
    if pricing.fixed_bytes + pricing.transient_base >= budget:
        raise SystemExit(f"--memory-budget {spec}: {budget} bytes is less than the model "
                         f"and one prefill chunk take ({pricing.fixed_bytes} + "
                         f"{pricing.transient_base} bytes): raise it")
    return budget


MLX_CACHE_MAX_BYTES = 512 << 20


def mlx_cache_limit(budget: int, fixed_bytes: int) -> int:
    """How much freed memory MLX may keep for reuse: 4 % of what the budget leaves beyond the
    model, at most 512 MB; reserved in the budget's fixed part. A prefill chunk's transients
    (attention scores, activations) are freed every layer and allocated again by the next;
    kept, they are reused warm instead of faulted in afresh (measured: `bench compare`'s
    kvbank wall 106.5 s with 8 MB, 98.7 s with 512 MB)."""
    return max(0, min(MLX_CACHE_MAX_BYTES, (budget - fixed_bytes) // 25))


def drop_stale_buffers() -> None:
    """Empty MLX's buffer cache before a prompt forward.

    MLX's CPU cache takes a freed buffer only while it has room, never evicting, and hands one
    back only for a request of nearly its size. A prompt forward's transients are sized by its
    context, which grows with every chunk: kept, they fill the cache with sizes no later
    forward asks for, and then every layer of every forward faults its transients in afresh.
    Emptied first, a forward faults in its first layer's and the other layers reuse them
    (prefilling 4,096 tokens: 0.44 M page faults against 1.8-2.5 M, and 8-15 % faster;
    docs/decisions.md)."""
    import mlx.core as mx

    mx.clear_cache()


MMAP_THRESHOLD_BYTES = 32 << 20  # the largest glibc takes


def serve_buffers_from_the_heap() -> None:
    """Buffers up to 32 MB from glibc's heap, at a threshold that never moves.

    A forward's transients (attention scores, activations) go back to glibc when MLX's cache
    is emptied before the next prompt forward (`drop_stale_buffers`). From the heap the next
    forward reuses those pages at once; mapped one by one, as at glibc's 128 KB, every buffer
    is unmapped and faulted in afresh: a returning turn's 16-token forward on a 2K cache took
    1.10x mlx-lm's beside it at 128 KB and 1.01-1.05x at 32 MB (`kvbank bench turn`). Fixed,
    the threshold does not drift with what was freed last. The heap keeps freed pages until
    `give_back_freed_memory`, which the engine calls after every turn and whenever the ledger
    shrinks, so RSS still follows the ledger."""
    if heap.glibc() and not heap.mallopt(heap.M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES):
        logger.warning("glibc refused an mmap threshold of %d bytes", MMAP_THRESHOLD_BYTES)


def give_back_freed_memory() -> None:
    """Return the heap's free pages to the OS, so resident memory follows the ledger (glibc
    keeps them otherwise)."""
    heap.give_back_freed_pages()


def held_bytes(pricing: Pricing, bank) -> int:
    """Every byte the worker answers for: fixed, bank entries, running requests, staged, and
    what RSS shows beyond them."""
    return pricing.fixed_bytes + pricing.unaccounted_bytes + bank.ledger()["held_bytes"]


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
