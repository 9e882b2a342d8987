"""`kvbank bench turn`: what a returning conversation costs, by where its KV comes from.

Builds an N-token conversation on a fresh stack, then times a returning turn's TTFT three ways
in one run: restored from the RAM bank, restored from SSD (after the bank released it), and
recomputed (cache off); RAM and SSD turns alternate `repeats` times and their medians count, as
the floor's does (one turn is at the mercy of a shared machine's second). The floor is mlx-lm itself, in this process, prefilling the same new
tokens on a cache of the same length (what no server can beat): `ram_vs_floor` and
`ssd_vs_floor` say what kvbank adds. Ratios, not absolute seconds, are what carry across
machines.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

import numpy as np

from deploy.local import LocalStack

logger = logging.getLogger(__name__)

SESSION = "bench-turn"
TURN_TOKENS = 16


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    # Ordinary vocabulary, clear of the special tokens at the start of most vocabularies.
    return rng.integers(1000, 20000, size=n).tolist()


def ttft_floor_s(model_dir: Path, context_tokens: int, new_tokens: int, *, seed: int = 0,
                 chunk_tokens: int = 512, repeats: int = 5) -> float:
    """mlx-lm in-process: a cache of `context_tokens`, then the time to prefill `new_tokens`
    more and pick the next token (the median of `repeats`; the cache is trimmed back between)."""
    from kvbank.config import preload_openblas

    preload_openblas()
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    model, _ = load(str(model_dir))
    rng = np.random.default_rng(seed)
    cache = make_prompt_cache(model)
    context = mx.array(_tokens(rng, context_tokens))
    for s in range(0, context_tokens, chunk_tokens):  # as the worker prefills: in chunks
        model(context[s:s + chunk_tokens][None], cache=cache)
        mx.eval([c.state for c in cache])
    new = mx.array(_tokens(rng, new_tokens))[None]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        logits = model(new, cache=cache)
        mx.eval(mx.argmax(logits[:, -1, :], axis=-1))
        times.append(time.perf_counter() - t0)
        trim_prompt_cache(cache, new_tokens)
    return float(np.median(times))


def longest_fit(model_dir: Path, repeats: int) -> int:
    """The longest `--tokens` the model's context holds: the conversation grows by a turn of
    TURN_TOKENS and a one-token answer twice per repeat, after its own one-token answer."""
    import json

    context = json.loads((Path(model_dir) / "config.json").read_text()).get(
        "max_position_embeddings", 8192)
    return context - 1 - 2 * repeats * (TURN_TOKENS + 1)


def run(*, model: str | None, tokens: int, block_tokens: int, seed: int = 0,
        repeats: int = 3) -> dict:
    """Raises ValueError, before any stack starts, when the conversation would outgrow the
    model's context."""
    from kvbank.models import prepare_model

    model_dir = prepare_model(model)
    if tokens > (fit := longest_fit(model_dir, repeats)):
        raise ValueError(f"--tokens {tokens}: with {repeats} returning turns from RAM and from "
                         f"SSD each (--repeats) the conversation would outgrow the model's "
                         f"context; use --tokens {fit} or less")
    rng = np.random.default_rng(seed)
    ram, ssd = [], []
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
                # Turns alternate: one from RAM, then (released) one from SSD, `repeats` times;
                # each adds TURN_TOKENS + 1 to the conversation.
                for _ in range(repeats):
                    stack.wait_durable(SESSION, timeout_s=600)
                    ram.append(c.generate(session_id=SESSION, token_ids=_tokens(rng, TURN_TOKENS),
                                          append=True, max_tokens=1).usage)
                    stack.wait_durable(SESSION, timeout_s=600)
                    c.release(SESSION)
                    prompt = list(c.get_session(SESSION).token_ids) + _tokens(rng, TURN_TOKENS)
                    ssd.append(c.generate(session_id=SESSION, token_ids=prompt,
                                          max_tokens=1).usage)
                cold = c.generate(token_ids=prompt, max_tokens=1, no_cache=True).usage
        finally:
            stack.stop()
    floor = ttft_floor_s(model_dir, tokens, TURN_TOKENS, seed=seed)  # the stack is gone
    ram_s = float(np.median([u["ttft_s"] for u in ram]))
    ssd_s = float(np.median([u["ttft_s"] for u in ssd]))
    return {
        "model": str(model_dir),
        "tokens": tokens,
        "block_tokens": block_tokens,
        "repeats": repeats,
        "build_s": round(build_s, 3),
        "ttft_ram_s": round(ram_s, 4),
        "ttft_ssd_s": round(ssd_s, 4),
        "ttft_ram_all_s": [u["ttft_s"] for u in ram],
        "ttft_ssd_all_s": [u["ttft_s"] for u in ssd],
        "ttft_recompute_s": cold["ttft_s"],
        "cached_tokens_ram": min(u["cached_tokens"] for u in ram),
        "cached_tokens_ssd": min(u["cached_tokens"] for u in ssd),
        "cache_source_ssd": ",".join(sorted({u["cache_source"] for u in ssd})),
        "ssd_speedup": round(cold["ttft_s"] / ssd_s, 2),
        "ram_speedup": round(cold["ttft_s"] / ram_s, 2),
        "ttft_floor_s": round(floor, 4),
        "ram_vs_floor": round(ram_s / floor, 2),
        "ssd_vs_floor": round(ssd_s / floor, 2),
    }
