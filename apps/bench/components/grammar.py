"""`kvbank bench grammar`: what constrained decoding (JSON schema) costs per token.

Structured output masks every token the grammar does not allow (worker/compute/grammar.py's
GrammarProcessor); the goal is that this adds at most 10 % to a decode step. This bench decodes
the same prompt constrained (C) and unconstrained (U) through mlx-lm's BatchGenerator the way
the worker drives it (worker/compute/scheduler.py: a fresh prompt cache, a sampler and a list of logits
processors per request, `all_tokens`), so what it measures is what a request pays.

Every run makes exactly `tokens` tokens: greedy, EOS is not a stop token, and the schema asks
for more than fits, so a constrained run never leaves the grammar. A run's per-token time is
the median interval between consecutive steps from the first token to the last (prefill is
not decode; the median shrugs off another process's burst on a shared machine). C and U runs
alternate in pairs, the order flipping each pair, so a change in the machine's load hits both
alike; `c_over_u` is the median of the pairs' ratios. The grammar's own work per step is
timed apart, replaying the run's tokens through a fresh processor on ready logits: inside the
decode loop the processor's call also waits for the previous step's token, which is not its
cost.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

OVERHEAD_GOAL = 0.10
# Twelve people need ~250 tokens: the default run (64) cannot finish the JSON and stop early.
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "minItems": 12, "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                     "city": {"type": "string"}},
    "required": ["name", "age", "city"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False}
PROMPT = [{"role": "user", "content": "List twelve people with name, age and city as JSON."}]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvbank.apps.flags import model_flag

    model_flag(p)
    p.add_argument("--tokens", type=int, default=64, help="tokens per run (default: %(default)s)")
    p.add_argument("--pairs", type=int, default=6,
                   help="C/U pairs per batch size, order alternating (default: %(default)s)")
    p.add_argument("--batch", default="1,4",
                   help="batch sizes, comma-separated: that many identical requests decode "
                        "together (default: %(default)s)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="print the result as JSON (to FILE if given)")


def _decode(model, prompt: list[int], tokens: int, batch: int, grammar) -> tuple[float, list]:
    """One run: (median seconds per decode step, the requests' (tokens, processor or None))."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import make_prompt_cache

    from kvbank.worker.compute.decoding import make_request_sampler
    from kvbank.worker.compute.scheduler import PREFILL_STEP_TOKENS

    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=batch,
                         prefill_batch_size=batch, prefill_step_size=PREFILL_STEP_TOKENS)
    procs = [grammar.processor() if grammar else None for _ in range(batch)]
    uids = gen.insert([prompt] * batch, max_tokens=[tokens] * batch,
                      caches=[make_prompt_cache(model) for _ in range(batch)],
                      samplers=[make_request_sampler(0.0, 0.0, None) for _ in range(batch)],
                      logits_processors=[[p] if p else [] for p in procs],
                      all_tokens=[[] for _ in range(batch)])
    out: dict[int, list[int]] = {uid: [] for uid in uids}
    stamps, done = [], 0
    try:
        while done < batch:
            _, responses = gen.next()
            if responses:
                stamps.append(time.perf_counter())
            for r in responses:
                out[r.uid].append(r.token)
                done += r.finish_reason is not None
    finally:
        gen.close()
    step_s = statistics.median(b - a for a, b in zip(stamps, stamps[1:]))
    return step_s, [(out[uid], p) for uid, p in zip(uids, procs)]


def _grammar_call_s(grammar, prompt: list[int], generated: list[int], logits) -> float:
    """Median seconds of one processor call (take the last token, fill the mask, mask the
    logits, evaluated) over `generated`, on logits that are already computed."""
    import mlx.core as mx

    p = grammar.processor()
    p(mx.array(prompt), logits)  # the first call only learns the prompt's length
    times = []
    for i in range(1, len(generated)):
        context = mx.array(prompt + generated[:i])
        t0 = time.perf_counter()
        mx.eval(p(context, logits))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _check(runs: list, batch: int) -> None:
    """A constrained run must have stayed inside the grammar; else its time means nothing."""
    for generated, p in runs:
        p.completed(generated)  # mlx-lm never shows a processor the last token
        if p.error:
            raise RuntimeError(f"batch {batch}: the grammar rejected a token: {p.error}")


def run(*, model: str | None, tokens: int, pairs: int, batches: list[int]) -> dict:
    from kvbank.config import preload_openblas
    from kvbank.models import prepare_model

    model_dir = prepare_model(model)
    preload_openblas()  # before the first `import mlx` in this process
    import mlx.core as mx
    from mlx_lm import load

    from kvbank.worker.compute.grammar import Grammars

    mlx_model, tokenizer = load(str(model_dir))
    prompt = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)
    grammar = Grammars(tokenizer).for_response_format(
        {"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA}})
    logits = mlx_model(mx.array(prompt)[None])[:, -1, :]
    mx.eval(logits)
    result: dict = {"model": str(model_dir), "tokens": tokens, "pairs": pairs,
                    "schema": "people (minItems 12)", "batches": {}}
    for batch in batches:
        for g in (None, grammar):  # warm-up: both paths once
            _decode(mlx_model, prompt, 8, batch, g)
        u_s, c_s, ratios = [], [], []
        for i in range(pairs):
            got = {}
            for kind in ("U", "C") if i % 2 == 0 else ("C", "U"):
                got[kind] = _decode(mlx_model, prompt, tokens, batch,
                                    grammar if kind == "C" else None)
            _check(got["C"][1], batch)
            u_s.append(got["U"][0])
            c_s.append(got["C"][0])
            ratios.append(got["C"][0] / got["U"][0])
        c_text, u_text = (tokenizer.decode(got[k][1][0][0]) for k in ("C", "U"))
        call_s = _grammar_call_s(grammar, prompt, got["C"][1][0][0], logits)
        u_ms = statistics.median(u_s) * 1e3
        result["batches"][str(batch)] = {
            "u_ms_per_token": round(u_ms, 3),
            "c_ms_per_token": round(statistics.median(c_s) * 1e3, 3),
            "c_over_u": round(statistics.median(ratios), 4),
            "ratios": [round(r, 4) for r in ratios],
            # one call per request per step
            "grammar_ms_per_step": round(call_s * batch * 1e3, 4),
            "grammar_share_of_step": round(call_s * batch * 1e3 / u_ms, 4),
            "sample_constrained": c_text,
            "sample_unconstrained": u_text,
        }
    result["overhead_goal"] = OVERHEAD_GOAL
    result["within_goal"] = all(b["c_over_u"] - 1 <= OVERHEAD_GOAL
                                for b in result["batches"].values())
    return result


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"kvbank bench grammar: {result['tokens']} tokens, {result['pairs']} pairs, "
                    f"{Path(result['model']).name}", title_justify="left")
    for col in ("batch", "U ms/token", "C ms/token", "C/U (median)", "pairs' C/U",
                "grammar ms/step"):
        t.add_column(col, justify="right")
    for batch, b in result["batches"].items():
        t.add_row(batch, f"{b['u_ms_per_token']:.2f}", f"{b['c_ms_per_token']:.2f}",
                  f"{b['c_over_u']:.3f}", f"{min(b['ratios']):.2f}-{max(b['ratios']):.2f}",
                  f"{b['grammar_ms_per_step']:.3f}")
    t.caption = (f"goal: C/U - 1 <= {result['overhead_goal']:.2f}; "
                 f"within goal: {result['within_goal']}")
    Console(stderr=True).print(t)


def run_cli(args: argparse.Namespace) -> int:
    from kvbank.apps.bench.report import write_json

    try:
        batches = [int(x) for x in args.batch.split(",") if x.strip()]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1 or args.tokens < 2 or args.pairs < 1:
        sys.stderr.write("kvbank bench grammar: --batch takes sizes >= 1 (e.g. 1,4), "
                         "--tokens >= 2, --pairs >= 1\n")
        return 2
    result = run(model=args.model, tokens=args.tokens, pairs=args.pairs, batches=batches)
    print_table(result)
    write_json(result, args.json)
    return 0
