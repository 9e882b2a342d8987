"""`kvbank bench turn`: what a returning conversation costs, by where its KV comes from.

Builds an N-token conversation on a fresh stack, then times the next turn's TTFT three ways
in one run: restored from the RAM bank, restored from SSD (after the bank released it), and
recomputed (cache off). Ratios, not absolute seconds, are what carry across machines.
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


def run(*, model: str | None, tokens: int, block_tokens: int, seed: int = 0) -> dict:
    from kvbank.models import prepare_model

    model_dir = prepare_model(model)
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory(prefix="kvbank-bench-") as tmp:
        stack = LocalStack.start(model_dir, Path(tmp) / "data",
                                 extra=["--block-tokens", str(block_tokens)])
        try:
            with stack.client() as c:
                t0 = time.monotonic()
                c.generate(session_id=SESSION, token_ids=_tokens(rng, tokens), append=True,
                           max_tokens=1)
                build_s = time.monotonic() - t0
                stack.wait_durable(SESSION, timeout_s=600)

                ram = c.generate(session_id=SESSION, token_ids=_tokens(rng, TURN_TOKENS),
                                 append=True, max_tokens=1).usage
                stack.wait_durable(SESSION, timeout_s=600)
                c.release(SESSION)

                ssd_prompt = list(c.get_session(SESSION).token_ids) + _tokens(rng, TURN_TOKENS)
                ssd = c.generate(session_id=SESSION, token_ids=ssd_prompt, max_tokens=1).usage
                cold = c.generate(token_ids=ssd_prompt, max_tokens=1, no_cache=True).usage
        finally:
            stack.stop()
    return {
        "model": str(model_dir),
        "tokens": tokens,
        "block_tokens": block_tokens,
        "build_s": round(build_s, 3),
        "ttft_ram_s": ram["ttft_s"],
        "ttft_ssd_s": ssd["ttft_s"],
        "ttft_recompute_s": cold["ttft_s"],
        "cached_tokens_ram": ram["cached_tokens"],
        "cached_tokens_ssd": ssd["cached_tokens"],
        "cache_source_ssd": ssd["cache_source"],
        "ssd_speedup": round(cold["ttft_s"] / ssd["ttft_s"], 2),
        "ram_speedup": round(cold["ttft_s"] / ram["ttft_s"], 2),
    }
