"""`kvbank bench prerender`: the time to first token of a new user query after a tool loop, on a
template that drops earlier reasoning at a new query, with the idle pre-render and without.

    kvbank bench prerender [--family qwen3_5] [--rounds 3] [--steps 3] [--listing 300]
                           [--json [FILE]]

Two stacks on the family's scripted model (kvbank/testing/family_models.py), one with
`--prerender on` (the default) and one with `--prerender off`, otherwise alike, started once and
used by turns (round r runs `on` first when r is even, `off` first when odd), so the machine's
load falls on both alike. A round, on each stack, is a new conversation: a tool loop of
`--steps` requests (every answer a call of `run`, each answered by a listing of `--listing`
lines), an answer with no call (`tool_choice: none`), the user's pause (on the `on` stack, until
the worker logs `prerender_done`), then the new query, and the same request again (a RAM hit:
its whole prompt in the bank, only the generation prompt computed). Each of the last two is
sent with max_tokens 1, its time is that of its first token (shim, router and worker
included: both stacks pay them alike).

    ratio_to_ram_hit = median new-query TTFT / median RAM-hit TTFT      (goal: <= 1.15 with on)
    ratio_to_ram_hit_paired = median over rounds of new-query TTFT / that round's RAM hit

and what the pre-render costs: the seconds of compute it took in idle time, the tokens it
computed, the bytes its entry holds in RAM (the first to leave), and how long after the answer
it was ready.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

GOAL = 1.15
FAMILIES = ("qwen3_5", "glm4_5", "glm4_6")  # templates that drop reasoning at a new query


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", choices=FAMILIES, default="qwen3_5",
                   help="the template and scripted model (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per stack (default: 3)")
    p.add_argument("--steps", type=int, default=3,
                   help="tool-loop requests before the answer (default: 3)")
    p.add_argument("--listing", type=int, default=300,
                   help="lines of each tool result (~10 tokens a line) (default: 300)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="print the result as JSON (to FILE if given)")


def run_cli(args: argparse.Namespace) -> int:
    from kvbank.apps.bench.report import print_result, write_json

    result = run(args.family, rounds=args.rounds, steps=args.steps, listing=args.listing)
    if args.json:
        write_json(result, args.json)
        if args.json != "-":
            print_result("prerender", result, False)
    else:
        print_result("prerender", result, False)
    return 0


ENDS = ("prerender_done", "prerender_skipped", "prerender_dropped")  # a pre-render's last word


def _events(stack) -> list[dict]:
    path = stack.layout.events_path
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _timed(client, messages: list[dict], tools: list[dict]) -> tuple[float, int, int]:
    """(seconds to the first token, prompt tokens, cached tokens) of one max_tokens-1 request."""
    t0 = time.perf_counter()
    r = client.chat.completions.create(model="kvbank", messages=messages, tools=tools,
                                       max_tokens=1, temperature=0)
    return (time.perf_counter() - t0, r.usage.prompt_tokens,
            r.usage.prompt_tokens_details.cached_tokens)


def _round(stack, prerender: bool, steps: int, listing: str, tools: list[dict]) -> dict:
    import openai

    c = openai.OpenAI(base_url=stack.shim_url + "/v1", api_key="none", max_retries=0,
                      timeout=600)
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": f"[{uuid.uuid4().hex[:8]}] List the files here."}]
    ask = dict(model="kvbank", tools=tools, max_tokens=120, temperature=0)
    for _ in range(steps):
        m = c.chat.completions.create(messages=messages, **ask).choices[0].message
        messages.append(m.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": t.id, "content": listing}
                     for t in m.tool_calls or ()]
    seen = len(_events(stack))
    answered_at = time.perf_counter()
    m = c.chat.completions.create(messages=messages, tool_choice="none", **ask).choices[0].message
    messages.append(m.model_dump(exclude_none=True))
    done = None
    if prerender:  # the user reads until the worker says it is ready, or why it is not
        deadline = time.monotonic() + 600
        while done is None and time.monotonic() < deadline:
            done = next((e for e in _events(stack)[seen:] if e["kind"] in ENDS), None)
            time.sleep(0.02)
        if done is None:
            raise RuntimeError("no pre-render ended in 600 s: see the stack's log")
    ready_s = time.perf_counter() - answered_at
    messages.append({"role": "user", "content": "Now the tests folder."})
    ttft, prompt, cached = _timed(c, messages, tools)
    hit, _, hit_cached = _timed(c, messages, tools)
    out = {"new_query_ttft_s": round(ttft, 4), "ram_hit_ttft_s": round(hit, 4),
           "prompt_tokens": prompt, "cached_tokens": cached, "ram_hit_cached_tokens": hit_cached}
    if done is not None and done["kind"] != "prerender_done":
        out |= {"prerender_status": done.get("status", "dropped"),  # it came to nothing
                "prerender_tokens": done["tokens"]}
    elif done is not None:
        out |= {"prerender_compute_s": done["seconds"], "prerender_tokens": done["tokens"],
                "prerender_computed_tokens": done["computed"],
                "prerender_bytes": done["bytes"], "ready_after_answer_s": round(ready_s, 3)}
    return out


def run(family: str = "qwen3_5", *, rounds: int = 3, steps: int = 3,
        listing: int = 300) -> dict:
    from kvbank.deploy.local import LocalStack
    from kvbank.testing.family_models import TOOLS, scripted_model

    model = scripted_model(family)
    text = "\n".join(f"src/module_{i}.py" for i in range(listing))
    rows: dict[str, list[dict]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory(prefix="kvbank-bench-prerender-") as tmp:
        stacks = {mode: LocalStack.start(model, Path(tmp) / mode, timeout_s=600,
                                         extra=["--prerender", mode])
                  for mode in ("on", "off")}
        try:
            for r in range(rounds):
                for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
                    rows[mode].append(_round(stacks[mode], mode == "on", steps, text, TOOLS))
        finally:
            for s in stacks.values():
                s.stop()

    def med(mode: str, key: str) -> float:
        return round(statistics.median(row[key] for row in rows[mode]), 4)

    done = [row for row in rows["on"] if "prerender_compute_s" in row]
    out = {"family": family, "rounds": rounds, "steps": steps, "listing_lines": listing,
           "prompt_tokens": rows["on"][-1]["prompt_tokens"]}
    for mode in ("on", "off"):
        ttft, hit = med(mode, "new_query_ttft_s"), med(mode, "ram_hit_ttft_s")
        out[f"{mode}_new_query_ttft_s"] = ttft
        out[f"{mode}_ram_hit_ttft_s"] = hit
        out[f"{mode}_cached_tokens"] = rows[mode][-1]["cached_tokens"]
        out[f"{mode}_ratio_to_ram_hit"] = round(ttft / hit, 3)
        # each round's new query against its own RAM hit, sent right after it: the load the
        # two met is alike, where medians over rounds may pair a busy moment with a quiet one
        out[f"{mode}_ratio_to_ram_hit_paired"] = round(statistics.median(
            row["new_query_ttft_s"] / row["ram_hit_ttft_s"] for row in rows[mode]), 3)
    out["speedup"] = round(out["off_new_query_ttft_s"] / out["on_new_query_ttft_s"], 2)
    out["goal_ratio_to_ram_hit"] = GOAL
    out["goal_met"] = (out["on_ratio_to_ram_hit"] <= GOAL
                       and out["on_ratio_to_ram_hit_paired"] <= GOAL) if done else None
    out["prerendered_rounds"] = len(done)  # the rest say why not (`prerender_status`)
    for key in ("prerender_compute_s", "prerender_computed_tokens", "prerender_bytes",
                "ready_after_answer_s"):
        out[key] = round(statistics.median(row[key] for row in done), 4) if done else None
    out["rows"] = rows
    return out
