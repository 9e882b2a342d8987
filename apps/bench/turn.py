"""`kvbank bench turn`: what a returning conversation costs, by where its KV comes from.

Builds an N-token conversation on a fresh stack, then times a returning turn's TTFT four ways
in one run: restored from the RAM bank, restored from SSD through a warm page cache (the bank
released it; its blocks were just written), restored from SSD cold (the page cache dropped
first: the blocks come from the disk), and recomputed (cache off). The floor is mlx-lm itself, in this process, prefilling the same number
of new tokens on a cache of the same length: what no server can beat. Each returning turn is
paired with a floor timed just after it, on a cache grown just before it, so that each side's
timed forward follows the other's work: a returning turn meets a worker that idled while
others computed, and so does the floor. This machine's speed moves by a third from one minute
to the next: `ram_vs_floor` / `ssd_vs_floor` are the medians of the pairs' ratios, what kvbank
adds (`*_vs_warm_floor`: against the floor timed again at once, after its own forward). Ratios,
not absolute seconds, are what carry across machines. Each turn's TTFT is split by the worker's
`kvbank_worker_stage_seconds` (`stages_*_s`): waiting, restore, the first token
(`ram_forward_vs_floor` compares it with the floor), and what lies outside the worker (router,
gRPC, client).

The cold turn's floor is the compute floor plus reading its KV from the disk: the same blocks
of the same store file read cold by a no-copy `get` loop (apps/bench/disk.py `raw_get`), in
alternating order with the turn, each after a page-cache drop (`cold_ssd_vs_floor`: the
median of each turn over its floor and read; `cold_restore_vs_read`: the worker's restore
stage over the raw read, the restore's cost beyond the disk's). `page_cache` says how the
cache was dropped (root: drop_caches; else the file's pages, which the kernel may keep).

A model with window or recurrent caches also reports its checkpoints (`checkpoints`): one's
bytes, what the conversation holds in the bank and what its first returning turn added, read
from the bank's own ledger, and the same counts at Qwen3.6-27B's size.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

import numpy as np

from kvbank.deploy.local import LocalStack

logger = logging.getLogger(__name__)

SESSION = "bench-turn"
TURN_TOKENS = 16
TURNS_PER_REPEAT = 3  # from RAM, from SSD warm, from SSD cold
SETTLE_S = 0.5  # between one side's forward and the other's: idle BLAS threads spin a while
# Qwen3.6-27B in bf16: one checkpoint of its 48 Gated DeltaNet layers (llama.cpp logs 149.626
# MiB for it), and the KV per token of its 16 full-attention layers (4 KV heads of 256).
QWEN36_27B_CHECKPOINT_BYTES = int(149.626 * 2**20)
QWEN36_27B_KV_BYTES_PER_TOKEN = 16 * 2 * 4 * 256 * 2


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    # Ordinary vocabulary, clear of the special tokens at the start of most vocabularies.
    return rng.integers(1000, 20000, size=n).tolist()


class Floor:
    """mlx-lm in this process on a cache of a conversation's length, prefilled in chunks as the
    worker does: `grow` brings it to the conversation (untimed), `sample` times prefilling
    `new_tokens` more and picking the next token, then trims the cache back."""

    def __init__(self, model_dir: Path, context_tokens: int, new_tokens: int, *, seed: int = 0,
                 chunk_tokens: int = 512):
        """A model with window or recurrent caches cannot trim them: its floor restores the
        cache from a checkpoint of it (worker/kv/cache_kinds.py) before each timed forward."""
        from kvbank.config import preload_openblas

        preload_openblas()
        import mlx.core as mx
        from mlx_lm import load
        from mlx_lm.models.cache import make_prompt_cache

        from kvbank.worker.kv.cache_kinds import CacheKinds

        self.mx, self.new_tokens = mx, new_tokens
        self.model, _ = load(str(model_dir))
        self.kinds = CacheKinds.of(self.model)
        self.frozen = None  # (layers, checkpoint, tokens) for a checkpointed model
        self.rng = np.random.default_rng(seed + 1)
        self.chunk_tokens = chunk_tokens
        self.cache = make_prompt_cache(self.model)
        self.grow(context_tokens)

    def grow(self, context_tokens: int) -> None:
        """The cache at `context_tokens`, with room for the new tokens (a forward that grows
        a cache copies all of it: not what a floor measures)."""
        from mlx_lm.models.cache import trim_prompt_cache

        mx, have = self.mx, self.kinds.position(self.cache)
        if have is None:  # recurrent caches alone: the floor counts what it read
            have = self.frozen[2] if self.frozen else 0
        context = mx.array(_tokens(self.rng, context_tokens - have))
        for s in range(0, context_tokens - have, self.chunk_tokens):
            self.model(context[s:s + self.chunk_tokens][None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
        if self.kinds.checkpointed:
            self.frozen = (*self.kinds.freeze(self.cache, context_tokens), context_tokens)
            return
        if self.cache[0].keys.shape[2] < context_tokens + self.new_tokens:
            self.model(mx.array(_tokens(self.rng, self.new_tokens))[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
            trim_prompt_cache(self.cache, self.new_tokens)

    def sample(self) -> float:
        """Seconds to prefill `new_tokens` on the cache as it is and pick the next token."""
        from mlx_lm.models.cache import trim_prompt_cache

        mx = self.mx
        new = mx.array(_tokens(self.rng, self.new_tokens))[None]
        cache = self.cache
        if self.frozen is not None:  # restored, with room, before the clock starts
            layers, checkpoint, n = self.frozen
            cache = self.kinds.restore(layers, checkpoint, n)
            self.kinds.with_room(cache, n + self.new_tokens)
            mx.eval([c.state for c in cache])
        t0 = time.perf_counter()
        logits = self.model(new, cache=cache)
        mx.eval(mx.argmax(logits[:, -1, :], axis=-1))
        elapsed = time.perf_counter() - t0
        if self.frozen is None:
            trim_prompt_cache(self.cache, self.new_tokens)
        return elapsed


def _worker_stages(stack) -> dict[str, float]:
    """The worker's seconds so far by stage (`kvbank_worker_stage_seconds`' sums)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(stack.metrics_url("worker"), timeout=10).text
    return {s.labels["stage"]: s.value for fam in text_string_to_metric_families(text)
            if fam.name == "kvbank_worker_stage_seconds" for s in fam.samples
            if s.name.endswith("_sum")}


def _timed_turn(stack, stages: list[dict], turn) -> dict:
    """`turn()`'s usage; its time by worker stage appended to `stages`, and what the worker
    did not see (the router, gRPC both ways, the client) as `outside`."""
    before = _worker_stages(stack)
    usage = turn()
    after = _worker_stages(stack)
    split = {k: after[k] - before.get(k, 0.0) for k in after}
    split["outside"] = usage["ttft_s"] - sum(split.values())
    stages.append({k: round(v, 4) for k, v in split.items()})
    return usage


def _median_stages(stages: list[dict]) -> dict:
    return {k: round(float(np.median([s[k] for s in stages])), 4) for k in stages[0]}


def _paired_ratio(seconds: list[float], floors: list[float]) -> float:
    """The median over pairs of a turn's seconds over the floor measured just before it."""
    return float(np.median([t / f for t, f in zip(seconds, floors)]))


def _checkpoints(kinds, held: list) -> dict:
    """Checkpoint bytes from the bank's ledger (`Session.checkpoint_bytes`) after the build
    (`held[0]`) and after the first returning turn (`held[1]`)."""
    per_token, one, _ = kinds.measure()
    conversation, before = held[1].checkpoint_bytes, held[0].checkpoint_bytes
    count, added = conversation / one, (conversation - before) / one
    return {
        "checkpoint_bytes": one, "kv_bytes_per_token": per_token,
        "per_conversation_bytes": conversation, "per_conversation": round(count, 2),
        "first_turn_added_bytes": conversation - before, "first_turn_added": round(added, 2),
        "tokens": held[1].token_count,
        "qwen36_27b": {  # the same counts at Qwen3.6-27B's size (bf16)
            "checkpoint_bytes": QWEN36_27B_CHECKPOINT_BYTES,
            "per_conversation_bytes": round(count * QWEN36_27B_CHECKPOINT_BYTES),
            "first_turn_added_bytes": round(added * QWEN36_27B_CHECKPOINT_BYTES),
            "kv_bytes_at_tokens": held[1].token_count * QWEN36_27B_KV_BYTES_PER_TOKEN},
    }


def longest_fit(model_dir: Path, repeats: int) -> int:
    """The longest `--tokens` the model's context holds: the conversation grows by a turn of
    TURN_TOKENS and a one-token answer three times per repeat (RAM, SSD, cold SSD), after its
    own one-token answer."""
    import json

    context = json.loads((Path(model_dir) / "config.json").read_text()).get(
        "max_position_embeddings", 8192)
    return context - 1 - TURNS_PER_REPEAT * repeats * (TURN_TOKENS + 1)


def run(*, model: str | None, tokens: int, block_tokens: int, seed: int = 0,
        repeats: int = 3, arch: str | None = None, cold_turns: bool = True) -> dict:
    """Raises ValueError, before any stack starts, when the conversation would outgrow the
    model's context. `arch`: a random-weight model of the default model's size with that
    architecture (kvbank/testing/tiny.py) instead of `model`. `cold_turns=False`: no cold-SSD turns
    (their keys are then absent)."""
    from kvbank.models import prepare_model
    from kvbank.testing.tiny import bench_model

    model_dir = bench_model(arch) if arch else prepare_model(model)
    if tokens > (fit := longest_fit(model_dir, repeats)):
        raise ValueError(f"--tokens {tokens}: with {repeats} returning turns from RAM, SSD and "
                         f"cold SSD each (--repeats) the conversation would outgrow the "
                         f"model's context; use --tokens {fit} or less")
    rng = np.random.default_rng(seed)
    from kvbank.apps.bench.disk import delta, drop_caches, io_counters, raw_get, session_blocks

    ram, ssd, floor_ram, floor_ssd, floor_warm = [], [], [], [], []
    stages_ram, stages_ssd = [], []
    cold, floor_cold, raw_cold, stages_cold, cold_io = [], [], [], [], []
    page_cache = None
    with tempfile.TemporaryDirectory(prefix="kvbank-bench-") as tmp:
        # No tail delay: the run waits for each turn to reach SSD, and measures restores.
        stack = LocalStack.start(model_dir, Path(tmp) / "data",
                                 extra=["--block-tokens", str(block_tokens),
                                        "--tail-delay-s", "0"])
        try:
            with stack.client() as c:
                t0 = time.monotonic()
                c.generate(session_id=SESSION, token_ids=_tokens(rng, tokens), append=True,
                           max_tokens=1)
                build_s = time.monotonic() - t0
                floor = Floor(model_dir, tokens, TURN_TOKENS, seed=seed)  # the stack idles
                # Turns alternate: one from RAM, then (released) one from SSD, `repeats` times;
                # each adds TURN_TOKENS + 1 to the conversation. The floor is grown to the
                # turn's context before it and timed after it, so that each side's timed
                # forward follows the other's: a returning turn reaches a worker that was idle
                # while others computed, and so does the floor (`floor_warm`: timed again at
                # once, after its own forward, for comparison).
                def paired(context: int, turns: list, floors: list, stages: list, turn):
                    """`turn`'s usage into `turns`, then the floor on `context` timed into
                    `floors` and, at once again, into `floor_warm`."""
                    floor.grow(context)
                    time.sleep(SETTLE_S)
                    turns.append(_timed_turn(stack, stages, turn))
                    stack.wait_durable(SESSION, timeout_s=600)
                    time.sleep(SETTLE_S)
                    floors.append(floor.sample())
                    floor_warm.append(floor.sample())

                stack.wait_durable(SESSION, timeout_s=600)
                held = [c.get_session(SESSION)]  # the bank's bytes for it: before, after a turn
                for _ in range(repeats):
                    new = _tokens(rng, TURN_TOKENS)
                    paired(c.get_session(SESSION).token_count, ram, floor_ram, stages_ram,
                           lambda: c.generate(session_id=SESSION, token_ids=new, append=True,
                                              max_tokens=1).usage)
                    if len(held) == 1:
                        held.append(c.get_session(SESSION))
                    c.release(SESSION)
                    prompt = list(c.get_session(SESSION).token_ids) + _tokens(rng, TURN_TOKENS)
                    paired(len(prompt) - TURN_TOKENS, ssd, floor_ssd, stages_ssd,
                           lambda: c.generate(session_id=SESSION, token_ids=prompt,
                                              max_tokens=1).usage)
                    if not cold_turns:
                        continue
                    # Cold: released, every block on SSD, the page cache dropped; the same
                    # blocks read raw before the turn or after it, in turn.
                    c.release(SESSION)
                    stack.wait_durable(SESSION, timeout_s=600)
                    store = stack.layout.store_dir
                    ids = session_blocks(store, "", SESSION)
                    prompt = list(c.get_session(SESSION).token_ids) + _tokens(rng, TURN_TOKENS)
                    floor.grow(len(prompt) - TURN_TOKENS)
                    raw = None
                    if len(cold) % 2:
                        drop_caches(store / "data.mdb")
                        raw = raw_get(store, ids)
                    page_cache = drop_caches(store / "data.mdb")
                    time.sleep(SETTLE_S)
                    io0 = io_counters(stack.pid("worker"))
                    cold.append(_timed_turn(stack, stages_cold, lambda: c.generate(
                        session_id=SESSION, token_ids=prompt, max_tokens=1).usage))
                    cold_io.append(delta(io_counters(stack.pid("worker")), io0))
                    stack.wait_durable(SESSION, timeout_s=600)
                    if raw is None:
                        drop_caches(store / "data.mdb")
                        raw = raw_get(store, ids)
                    raw_cold.append(raw)
                    time.sleep(SETTLE_S)
                    floor_cold.append(floor.sample())
                checkpoints = _checkpoints(floor.kinds, held) if floor.kinds.checkpointed else {}
                del floor
                recompute = c.generate(token_ids=prompt, max_tokens=1, no_cache=True).usage
        finally:
            stack.stop()
    ram_s = float(np.median([u["ttft_s"] for u in ram]))
    ssd_s = float(np.median([u["ttft_s"] for u in ssd]))
    cold_floors = [f + r["s"] for f, r in zip(floor_cold, raw_cold)]
    floor_s = float(np.median(floor_ram + floor_ssd))
    out = {
        "model": str(model_dir),
        "arch": arch or "",
        "tokens": tokens,
        "block_tokens": block_tokens,
        "repeats": repeats,
        "build_s": round(build_s, 3),
        "ttft_ram_s": round(ram_s, 4),
        "ttft_ssd_s": round(ssd_s, 4),
        "ttft_ram_all_s": [u["ttft_s"] for u in ram],
        "ttft_ssd_all_s": [u["ttft_s"] for u in ssd],
        "ttft_recompute_s": recompute["ttft_s"],
        "cached_tokens_ram": min(u["cached_tokens"] for u in ram),
        "cached_tokens_ssd": min(u["cached_tokens"] for u in ssd),
        "cache_source_ssd": ",".join(sorted({u["cache_source"] for u in ssd})),
        "ssd_speedup": round(recompute["ttft_s"] / ssd_s, 2),
        "ram_speedup": round(recompute["ttft_s"] / ram_s, 2),
        "ttft_floor_s": round(floor_s, 4),
        "ttft_floor_all_s": [round(f, 4) for f in floor_ram + floor_ssd],
        "ttft_floor_warm_s": round(float(np.median(floor_warm)), 4),
        "ttft_floor_warm_all_s": [round(f, 4) for f in floor_warm],
        "ram_vs_floor": round(_paired_ratio([u["ttft_s"] for u in ram], floor_ram), 2),
        "ssd_vs_floor": round(_paired_ratio([u["ttft_s"] for u in ssd], floor_ssd), 2),
        # against the floor timed right after its own forward: a server that was just busy
        "ram_vs_warm_floor": round(_paired_ratio([u["ttft_s"] for u in ram], floor_warm[::2]), 2),
        "ssd_vs_warm_floor": round(_paired_ratio([u["ttft_s"] for u in ssd], floor_warm[1::2]), 2),
        # where a turn's TTFT went, medians by stage: the worker's own (waiting, restore,
        # first_token: its forward and sampling) and the rest
        "stages_ram_s": _median_stages(stages_ram),
        "stages_ssd_s": _median_stages(stages_ssd),
        "stages_ram_all_s": stages_ram,
        "stages_ssd_all_s": stages_ssd,
        "ram_forward_vs_floor": round(_paired_ratio(
            [s["first_token"] for s in stages_ram], floor_ram), 2),
        "checkpoints": checkpoints,
    }
    if not cold_turns:
        return out
    out.update({
        # from SSD cold: against the compute floor plus reading the same blocks from the disk
        "page_cache": page_cache,
        "ttft_cold_ssd_s": round(float(np.median([u["ttft_s"] for u in cold])), 4),
        "ttft_cold_ssd_all_s": [u["ttft_s"] for u in cold],
        "cached_tokens_cold_ssd": min(u["cached_tokens"] for u in cold),
        "cache_source_cold_ssd": ",".join(sorted({u["cache_source"] for u in cold})),
        "cold_read_s_all": [round(r["s"], 4) for r in raw_cold],
        "cold_read_bytes": [r["bytes"] for r in raw_cold],
        "cold_read_mb_s": round(float(np.median([r["bytes"] / r["s"] / 1e6
                                                 for r in raw_cold])), 1),
        "cold_read_io": [r["io"] for r in raw_cold],
        "cold_turn_worker_io": cold_io,
        "ttft_floor_cold_all_s": [round(f, 4) for f in cold_floors],
        "ttft_floor_cold_compute_all_s": [round(f, 4) for f in floor_cold],
        "cold_ssd_vs_floor": round(_paired_ratio([u["ttft_s"] for u in cold], cold_floors), 2),
        "stages_cold_ssd_s": _median_stages(stages_cold),
        "stages_cold_ssd_all_s": stages_cold,
        "cold_restore_vs_read": round(float(np.median(
            [s["restore"] / r["s"] for s, r in zip(stages_cold, raw_cold)])), 2),
    })
    # A cold turn is one whose blocks came from the disk: the cache dropped as root, and the
    # worker's read counters moved; else its ratios are not reported (`cold_withheld`).
    cold_ok = "drop_caches" in page_cache and all(io["read_bytes"] > 0 for io in cold_io)
    out["cold_withheld"] = [] if cold_ok else ["cold_ssd_vs_floor", "cold_restore_vs_read"]
    for key in out["cold_withheld"]:
        out[key] = None
    return out


def add_arguments(p) -> None:
    """`kvbank bench turn`'s flags."""
    from kvbank.apps.flags import model_flag
    from kvbank.config import DEFAULT_BLOCK_TOKENS
    from kvbank.testing.tiny import ARCHS

    model_flag(p)
    p.add_argument("--tokens", type=int, default=2048, help="conversation length")
    p.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS)
    p.add_argument("--repeats", type=int, default=3,
                   help="returning turns from RAM, from SSD and from SSD cold, each; the "
                        "medians count")
    p.add_argument("--arch", choices=ARCHS, default=None,
                   help="a random-weight model of the default model's size with this "
                        "architecture, instead of --model")
    p.add_argument("--json", action="store_true")


def run_cli(args) -> int:
    import sys

    from kvbank.apps.bench.report import print_result

    if args.repeats < 1:
        print("kvbank bench turn: --repeats must be at least 1", file=sys.stderr)
        return 2
    try:
        result = run(model=args.model, tokens=args.tokens, block_tokens=args.block_tokens,
                     repeats=args.repeats, arch=args.arch)
    except ValueError as e:
        print(f"kvbank bench turn: {e}", file=sys.stderr)
        return 2
    print_result(args.bench, result, args.json)
    return 0
