"""`kvbank bench overhead`: what the serving path costs per decoded token.

Streams one greedy answer through shim -> router -> worker (an OpenAI client's path) and
generates the same answer in this process with mlx-lm's `stream_generate`, on the same model
and prompt. Both rates run from the first token to the last, so time to first token (prefill,
queueing) is left out, and `decode_ratio` (kvbank's rate over the in-process one; goal >= 0.95)
shows what HTTP, SSE, gRPC and the worker's bookkeeping cost a decoding agent. The two alternate for `rounds` rounds after a warm-up each, so a change in
the machine's load hits both alike; the medians are reported.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from kvbank.deploy.local import LocalStack

SESSION = "bench-overhead"


def add_arguments(p) -> None:
    """`kvbank bench overhead`'s flags."""
    from kvbank.apps.flags import model_flag

    model_flag(p)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", action="store_true")


def _prompt(prompt_tokens: int, seed: int) -> list[int]:
    # Ordinary vocabulary, clear of the special tokens at the start of most vocabularies.
    return np.random.default_rng(seed).integers(1000, 20000, size=prompt_tokens).tolist()


def _decode_rate(token_count: int, first_s: float, last_s: float) -> float:
    """Tokens after the first, per second between the first token and the last."""
    return (token_count - 1) / (last_s - first_s) if token_count > 1 and last_s > first_s else 0.0


def _through_kvbank(shim_url: str, prompt: list[int], max_tokens: int) -> tuple[float, int, str]:
    """Decode rate (tokens/s), token count and text of one streamed completion."""
    body = {"model": "kvbank", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "user": SESSION}
    arrivals, text, tokens = [], [], 0
    with httpx.stream("POST", shim_url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
                text.append(chunk["choices"][0]["text"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return _decode_rate(tokens, arrivals[0], arrivals[-1]), tokens, "".join(text)


def _in_process(model, tokenizer, prompt: list[int], max_tokens: int) -> tuple[float, int, str]:
    from mlx_lm.generate import stream_generate

    arrivals, text = [], []
    for response in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        arrivals.append(time.perf_counter())  # one response per token
        text.append(response.text)
    return _decode_rate(len(arrivals), arrivals[0], arrivals[-1]), len(arrivals), "".join(text)


def run(*, model: str | None, prompt_tokens: int, max_tokens: int, rounds: int = 5,
        seed: int = 0) -> dict:
    from kvbank.models import prepare_model
    from kvbank.config import preload_openblas

    model_dir = prepare_model(model)
    prompt = _prompt(prompt_tokens, seed)
    preload_openblas()  # before the first `import mlx` in this process
    from mlx_lm import load

    mlx_model, tokenizer = load(str(model_dir))
    served, local = [], []
    with tempfile.TemporaryDirectory(prefix="kvbank-bench-") as tmp:
        # No tail delay: each round waits for its turn to reach SSD (below), not 30 s more.
        stack = LocalStack.start(model_dir, Path(tmp) / "data", extra=["--tail-delay-s", "0"])
        try:
            _through_kvbank(stack.shim_url, prompt, max_tokens)  # warm-up: both paths once
            _in_process(mlx_model, tokenizer, prompt, max_tokens)
            for _ in range(rounds):
                served.append(_through_kvbank(stack.shim_url, prompt, max_tokens))
                # The coldstore writes the turn out while the worker is idle: let it finish,
                # so that it does not slow the in-process run down instead.
                stack.wait_durable(SESSION, timeout_s=600)
                local.append(_in_process(mlx_model, tokenizer, prompt, max_tokens))
        finally:
            stack.stop()
    kvbank_tps = statistics.median(rate for rate, _, _ in served)
    local_tps = statistics.median(rate for rate, _, _ in local)
    return {
        "model": str(model_dir),
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "completion_tokens": served[-1][1],
        "completion_tokens_in_process": local[-1][1],
        "same_text": served[-1][2] == local[-1][2],
        "kvbank_decode_tps": round(kvbank_tps, 2),
        "in_process_decode_tps": round(local_tps, 2),
        "kvbank_decode_tps_rounds": [round(rate, 2) for rate, _, _ in served],
        "in_process_decode_tps_rounds": [round(rate, 2) for rate, _, _ in local],
        "decode_ratio": round(kvbank_tps / local_tps, 3) if local_tps else None,
    }


def run_cli(args) -> int:
    from kvbank.apps.bench.report import print_result

    print_result(args.bench, run(model=args.model, prompt_tokens=args.prompt_tokens,
                     max_tokens=args.max_tokens), args.json)
    return 0
