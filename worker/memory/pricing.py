"""What the worker's memory costs: a prefill chunk's transients measured on the model
(`calibrate`, the list itself: kvbank/contracts/pricing.py), the process's resident bytes, the
memory budget, and every byte the worker answers for (`held_bytes`).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from kvbank.contracts.pricing import Pricing

logger = logging.getLogger(__name__)

# Of the budget, held from the start (`rss_slack`): resident memory the ledger does not itemize
# (threads, the interpreter, the allocators' drift during a forward), so that the process's
# resident set, not only its ledger, stays within --memory-budget. Left out, a worker held
# 4 % past its budget near a full request (1,654 MiB RSS on 1,592: `bench compare --arch llama
# --size wide-kv`, Dec 2026) and a memory limit sized from that budget killed it.
RSS_SLACK = 0.05


CALIBRATION_CHUNKS = 5
LAST_FORWARD_SAMPLES = 3  # one forward's peak varies by ~100 KB between runs (`_upper_line`)
# Transients are priced this much above what was measured: a forward's peak moves with where
# MLX's threads free their buffers, more so on a loaded machine (test_scheduler's price test,
# run in the suite beside two others, found a 1,500-token request 67 KB past a price from
# three samples and a fitted line; 5 % of that forward's transient is ~650 KB).
TRANSIENT_MARGIN = 1.05


CALIBRATION_METHOD = ("chunks at contexts 0..4C, a line over them raised to the highest; the "
                      "highest of three last forwards with their logits; 5 % above")


def calibrate(model, pricing: Pricing, on_chunk=lambda i: None, *,
              last_forward_tokens: int, chunks: int = CALIBRATION_CHUNKS) -> Pricing:
    """Measure a prefill chunk's transient bytes at contexts 0 to `chunks` - 1 chunks (MLX
    tracks CPU allocations too), so pricing reflects this model and this chunk size; and a
    prompt's last forward (`last_forward_tokens`), which computes logits over the whole
    vocabulary for each of its tokens (the chunks before it compute none): 12 MB on a 49K
    vocabulary in float32 at 64 tokens. A forward's transient is the larger of the two, and
    grows with the context by the chunks' slope (`_upper_line`). `on_chunk(i)` after each
    chunk (the start's progress; worker/memory/calibration.py keeps the result)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    def forward(cache, n: int, salt: int, logits: bool) -> int:
        """One forward of n tokens: its peak beyond the KV it adds."""
        tokens = mx.array([[(1000 + 7 * j + salt) % 5000 for j in range(n)]], dtype=mx.uint32)
        mx.eval(tokens)
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        out = model(tokens, cache=cache)
        mx.eval([c.state for c in cache], *([out] if logits else []))
        kv_growth = mx.get_active_memory() - before - (out.nbytes if logits else 0)
        del out
        return max(0, mx.get_peak_memory() - before - kv_growth)

    C = pricing.chunk_tokens
    last = max(forward(make_prompt_cache(model), min(last_forward_tokens, C), s, logits=True)
               for s in range(LAST_FORWARD_SAMPLES))  # its peak varies: the highest
    cache = make_prompt_cache(model)
    peaks = []
    for i in range(chunks):  # at contexts 0, C, ... (chunks - 1) C
        peaks.append(forward(cache, C, i, logits=False))
        on_chunk(i + 1)
    del cache
    mx.clear_cache()
    slope, base = _upper_line([i * C for i in range(len(peaks))], peaks)
    pricing.transient_base = int(max(base, last) * TRANSIENT_MARGIN)
    pricing.transient_per_context_token = slope * TRANSIENT_MARGIN
    return pricing


def _upper_line(contexts: list[int], peaks: list[int]) -> tuple[float, int]:
    """The slope fitted over every chunk's peak (least squares), and the line raised to the
    highest of them. One forward's peak varies between runs by up to ~100 KB here (where MLX's
    threads free their buffers); a slope from two peaks, extrapolated six times past a span of
    four 64-token chunks, priced a 1,500-token request 117 KB short one run in ten."""
    n = len(contexts)
    mean_x, mean_p = sum(contexts) / n, sum(peaks) / n
    var = sum((x - mean_x) ** 2 for x in contexts)
    slope = max(0.0, sum((x - mean_x) * (p - mean_p) for x, p in zip(contexts, peaks)) / var)
    return slope, int(max(p - slope * x for x, p in zip(contexts, peaks)))


def default_memory_budget() -> int:
    """60 % of the memory this process may use: RAM, or its cgroup's limit where that is lower
    (a container: psutil reports the host's RAM there). The rest is for the OS, kvbank's other
    processes, the coldstore's page cache and other programs."""
    import psutil

    ram = psutil.virtual_memory().total
    return int(min(ram, cgroup_memory_limit() or ram) * 0.6)


UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1


def cgroup_memory_limit(proc_cgroup: Path = Path("/proc/self/cgroup"),
                        root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The lowest memory limit of this process's cgroup and its ancestors (cgroup v1's
    `memory.limit_in_bytes`, v2's `memory.max`; a cgroup's limit bounds every cgroup below
    it), or None where none is set or none can be read (macOS, no cgroup mounted)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    v1 = root / "memory"
    for line in lines:
        _, names, path = line.split(":", 2)
        if "memory" in names.split(",") and v1.is_dir():
            return _lowest(v1, path, "memory.limit_in_bytes")
    for line in lines:
        _, names, path = line.split(":", 2)
        if names == "" and (root / "cgroup.controllers").exists():
            return _lowest(root, path, "memory.max")
    return None


def _lowest(mount: Path, path: str, name: str) -> int | None:
    limits = []
    here = mount / path.lstrip("/")
    while True:
        try:
            text = (here / name).read_text().strip()
        except OSError:
            text = "max"
        if text.isdigit() and int(text) < UNLIMITED:
            limits.append(int(text))
        if here == mount or mount not in here.parents:
            break
        here = here.parent
    return min(limits, default=None)


def memory_budget_bytes(spec: str | int | None, pricing: Pricing) -> int:
    """--memory-budget: bytes, or "+N" (N bytes for KV beyond the model and one prefill
    chunk's working memory), or None (default_memory_budget)."""
    if spec is None:
        budget = default_memory_budget()
    elif isinstance(spec, str) and spec.startswith("+"):
        budget = math.ceil((pricing.fixed_bytes + pricing.transient_base + int(spec[1:]))
                           / (1 - RSS_SLACK))  # N for KV, beside the slack
    else:
        budget = int(spec)
    logger.info("memory budget %.0f MB: model and runtime %.0f MB, a %d-token prefill chunk "
                "%.0f MB + %.0f KB per context token; one request fits up to %d tokens",
                budget / 1e6, pricing.fixed_bytes / 1e6, pricing.chunk_tokens,
                pricing.transient_base / 1e6, pricing.transient_per_context_token / 1e3,
                pricing.max_fit_tokens(budget - rss_slack(budget)))
    if pricing.fixed_bytes + pricing.transient_base + rss_slack(budget) >= budget:
        raise SystemExit(f"--memory-budget {spec}: {budget} bytes is less than the model, "
                         f"one prefill chunk and the allocators' slack take "
                         f"({pricing.fixed_bytes} + {pricing.transient_base} + "
                         f"{rss_slack(budget)} bytes): raise it")
    return budget


def rss_slack(budget: int) -> int:
    """What the budget holds back for resident memory no ledger line itemizes (RSS_SLACK)."""
    return int(budget * RSS_SLACK)


def held_bytes(pricing: Pricing, tiers) -> int:
    """Every byte the worker answers for: fixed, bank entries, running requests, staged (the
    `tiers`' ledger: the KV manager's, or a bank's), and what RSS shows beyond them."""
    return pricing.fixed_bytes + pricing.unaccounted_bytes + tiers.ledger()["held_bytes"]


def reconcile_rss(pricing: Pricing, tiers_held: int, rss: int) -> None:
    """RSS beyond the ledger (the model and the slack it holds for what no line itemizes,
    `rss_slack`, and `tiers_held`: every byte the KV tiers answer for) counts as held, so the
    budget is the resident set's."""
    ledger = pricing.fixed_bytes + tiers_held
    pricing.unaccounted_bytes = max(0, rss - ledger)
