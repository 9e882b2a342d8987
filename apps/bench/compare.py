"""`kvbank bench compare`: one loadgen scenario through the OpenAI API of kvbank and of
mlx-lm's server, at the same memory and the same settings.

Sides (apps/bench/compare_servers.py), each freshly started in a memory cgroup of its own:
- **kvbank** and **mlx-lm** under the same limit (`--memory-limit`, bytes: cgroup v1
  `memory.limit_in_bytes` or v2 `memory.max`, which count the page cache), each side's whole
  process tree in it: what kvbank keeps on SSD reads back from the disk, not from a page cache
  no one counts. The memory flags each server gets are set from the limit by one rule
  (`compare_servers.size`): kvbank's `--memory-budget`, mlx-lm's `--prompt-cache-bytes`;
- **kvbank unbounded** (the ideal: the same engine, nothing evicted) and **mlx-lm unlimited**
  beside it, in cgroups with no limit (their peaks are read all the same);
- with `--prefetch`, kvbank under the limit again, its agents hinting at the start of each
  think time that they will be back (`POST /v1/kvbank/prefetch`).

What both servers have a knob for is set the same (`Settings`: prefill chunk, requests at once,
greedy sampling, max tokens). Every side gets one warm-up request before its run, so loading
is not timed. New tokens are counted with the model's tokenizer for every side
(`TokenCounter`), so `recomputed_tokens = prompt - cached - new` means the same on each;
kvbank's own count (`server_recomputed_tokens`) is reported beside it.

Ratios, per round and then their median with the spread (min, max) over `--rounds` rounds, the
order reversed each round so that no side always runs first:
- `wall_speedup` = mlx-lm (limit) wall / kvbank (limit) wall (goal: >= 2 for two agents);
- `vs_ideal` = kvbank (limit) wall / kvbank unbounded wall (goal: <= 1.15). Below 1 is a
  finding to explain (the same engine with less memory cannot be faster but by noise);
- `recomputed_fraction` = kvbank's recomputed / prompt tokens (goal: <= 0.01);
- `mlx_lm_vs_unlimited`, `unbounded_kvbank_vs_mlx_lm`: the other two pairs, for reading.

A side that did not serve every turn (refused or failed some) did other work than the rest:
every ratio of it is left out of that round (null where no round has it), and
`fairness.incomplete` names it.

The JSON records each side's argv, settings, limit, peak (the cgroup's `max_usage`, page cache
included, and the sampled peak of its own memory), whether the limit was hit (the kernel
reclaimed or throttled) and whether anything was OOM-killed, with the versions, the commit, the
date, the machine and the load (`provenance`), and `fairness`: whether the pairs compared ran
under the same limit and settings. By default the clients send no session name (`anonymous`:
true), as the official SDKs and most agents do; `--session-ids` sends `user` and
`x-session-id` to every server.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import tempfile
from pathlib import Path

from kvbank.apps.bench.compare_servers import BY_NAME, SIDES, Settings, serve, size, versions

logger = logging.getLogger(__name__)

DEFAULT_LIMIT = "1.3GB"  # the smallest (in 0.1 GB) at which kvbank serves every default turn
DEFAULT_SIDES = ("kvbank", "mlx_lm", "kvbank_unbounded", "mlx_lm_unlimited")
# The pairs each ratio compares: (numerator, denominator); a limited pair must share its limit.
PAIRS = {"wall_speedup": ("mlx_lm", "kvbank"), "vs_ideal": ("kvbank", "kvbank_unbounded"),
         "mlx_lm_vs_unlimited": ("mlx_lm", "mlx_lm_unlimited"),
         "unbounded_kvbank_vs_mlx_lm": ("kvbank_unbounded", "mlx_lm_unlimited")}
GOALS = {"wall_speedup": (">=", 2.0), "vs_ideal": ("<=", 1.15),
         "recomputed_fraction": ("<=", 0.01)}


def _run_side(name: str, label: str, url: str, scenario, counter, model_name: str | None,
              max_wall_s: float, progress: bool, names: bool, prefetch: bool = False):
    from kvbank.apps.bench.compare_servers import warm_up
    from kvbank.apps.loadgen.cli import execute
    from kvbank.apps.loadgen.targets import parse_target

    warm_up(url, model_name)
    target = parse_target("openai://" + url, model_name=model_name, names=names)
    try:
        target.check(30)
        return execute(scenario, target, run_id=f"compare-{name}", max_wall_s=max_wall_s,
                       request_timeout_s=max_wall_s, counter=counter, progress=progress,
                       label=label, prefetch=prefetch)
    finally:
        target.close()


def _ratio(a: float | None, b: float | None, nd: int = 3) -> float | None:
    return round(a / b, nd) if a is not None and b else None


def side_order(sides: tuple[str, ...], round_index: int) -> list[str]:
    """The sides of one round: SIDES' order in even rounds, reversed in odd ones, so no side is
    always the first (fresh page cache) or the last (a machine that has warmed up)."""
    order = [s.name for s in SIDES if s.name in sides]
    return order if round_index % 2 == 0 else order[::-1]


def round_ratios(sums: dict) -> dict:
    """One round's ratios from its sides' summaries; a side not run gives null ratios."""
    none = {"wall_s": None, "ttft_p50_s": None, "recomputed_tokens": None,
            "prompt_tokens": None}
    get = lambda n: sums.get(n, none)  # noqa: E731
    out = {key: _ratio(get(a)["wall_s"], get(b)["wall_s"]) for key, (a, b) in PAIRS.items()}
    kv, mb = get("kvbank"), get("mlx_lm")
    out.update(recomputed_fraction=_ratio(kv["recomputed_tokens"], kv["prompt_tokens"], 4),
               mlx_lm_recomputed_fraction=_ratio(mb["recomputed_tokens"], mb["prompt_tokens"],
                                                 4),
               ttft_p50_speedup=_ratio(mb["ttft_p50_s"], kv["ttft_p50_s"]))
    return out


def median_ratios(rounds: list[dict]) -> dict:
    """Each ratio's median over the rounds that have it (null where none has)."""
    out = {}
    for key in rounds[0]:
        vals = [r[key] for r in rounds if r.get(key) is not None]
        out[key] = round(statistics.median(vals), 4) if vals else None
    return out


def spread(rounds: list[dict]) -> dict:
    """Each ratio's [min, max] over the rounds (null where none has it)."""
    out = {}
    for key in rounds[0]:
        vals = [r[key] for r in rounds if r.get(key) is not None]
        out[key] = [min(vals), max(vals)] if vals else None
    return out


def goals(ratios: dict) -> dict:
    """Each goal's figure and whether it is met (None: not measured)."""
    out = {}
    for key, (op, bound) in GOALS.items():
        v = ratios.get(key)
        out[key] = {"goal": f"{op} {bound}", "value": v,
                    "met": None if v is None else (v >= bound if op == ">=" else v <= bound)}
    return out


def fairness(sides: dict) -> dict:
    """Whether each pair a ratio compares ran fairly: both limited sides under the same limit
    in every round (both unbounded ones under none), every side with the same settings.
    `sides`: {name: {"limit_bytes": [per round], "settings": {...}}}. `ok` is False, with
    the reasons in `problems`, where any pair did not."""
    problems = []
    for key, (a, b) in PAIRS.items():
        if a not in sides or b not in sides:
            continue
        la, lb = sides[a]["limit_bytes"], sides[b]["limit_bytes"]
        if BY_NAME[a].limited == BY_NAME[b].limited and la != lb:
            problems.append(f"{key}: {a} ran under limits {la}, {b} under {lb}")
        if BY_NAME[a].limited != BY_NAME[b].limited and BY_NAME[a].limited and None in la:
            problems.append(f"{key}: {a} ran without its limit")
    names = sorted(sides)
    for n in names[1:]:
        if sides[n]["settings"] != sides[names[0]]["settings"]:
            problems.append(f"settings: {n} ran with {sides[n]['settings']}, {names[0]} with "
                            f"{sides[names[0]]['settings']}")
    limited = {n for n in sides if BY_NAME[n].limited}
    return {"ok": not problems, "problems": problems,
            "same_limit": len({tuple(sides[n]["limit_bytes"]) for n in limited}) <= 1,
            "same_settings": not any(p.startswith("settings") for p in problems)}


def served_all(sums: dict, expected: int) -> dict:
    """The sides of one round (`{name: summary}`) that served all `expected` turns: one that
    refused or failed some did less work, so no ratio of it compares like with like."""
    return {n: x for n, x in sums.items() if x["turns_ok"] == expected}


def withhold(ratios: dict, fair: dict) -> tuple[dict, list[str]]:
    """`ratios` (one round's, or the medians, or the spread) with every ratio of a pair that
    did not run fairly set to None (all of them where the settings differed): an unfair
    comparison is not reported, only why (`fair["problems"]`). Returns them and the keys
    withheld."""
    problems = fair["problems"]
    unfair = set(PAIRS) if any(p.startswith("settings") for p in problems) else {
        p.split(":", 1)[0] for p in problems}
    if "wall_speedup" in unfair:  # mlx-lm's side of it
        unfair |= {"mlx_lm_recomputed_fraction", "ttft_p50_speedup"}
    keys = sorted(k for k in unfair if k in ratios)
    return {k: (None if k in keys else v) for k, v in ratios.items()}, keys


def findings(ratios: dict, spread_: dict) -> list[str]:
    """What a reader must not take as a result: `vs_ideal` below 1 (the same engine with
    less memory cannot be faster, but by noise: its rounds' spread says whether it is)."""
    out = []
    v, sp = ratios.get("vs_ideal"), spread_.get("vs_ideal")
    if v is not None and v < 1:
        out.append(f"vs_ideal {v} < 1: kvbank under the limit ran faster than the same engine "
                   f"unbounded (rounds {sp[0]} to {sp[1]}); "
                   + ("noise: the rounds straddle 1" if sp[1] >= 1 else
                      "every round below 1: a measurement to look into, not a result"))
    return out


def prefetch_summary(without, hinted) -> dict:
    """The kvbank run without hints (`without`, may be None) and the one with, both under the
    limit: how many returning turns (an agent's second and later) came from SSD, and the TTFT
    p50 of the hinted run's returning turns against the RAM hits of the run without hints (a
    ratio that fails when hints land late: the hinted turns then wait for their reads)."""
    from kvbank.apps.loadgen.report import percentile

    def returning(result, source: str | None = None) -> list:
        return [r for r in (result.rows if result else []) if r.status == "ok" and r.turn > 1
                and r.ttft_s is not None and (source is None or r.cache_source == source)]

    def p50(rows) -> float | None:
        return round(percentile([r.ttft_s for r in rows], 50), 3) if rows else None

    hinted_turns = [r for r in returning(hinted) if r.hint]
    ram_hits = returning(without, "ram")
    return {
        "returning_turns": len(returning(hinted)),
        "ssd_turns_without_hints": len(returning(without, "ssd")) if without else None,
        "ssd_turns_with_hints": len(returning(hinted, "ssd")),
        "hints": {h: sum(r.hint == h for r in hinted_turns)
                  for h in sorted({r.hint for r in hinted_turns})},
        "hinted_ttft_p50_s": p50(hinted_turns),
        "ram_hit_ttft_p50_s": p50(ram_hits),
        "hinted_vs_ram_hits": _ratio(p50(hinted_turns), p50(ram_hits)),
        "without_hints_ttft_p50_by_source_s": {
            src: p50(returning(without, src)) for src in ("ram", "ssd")} if without else None,
    }


def run(*, model: str | None, scenario, limit_bytes: int, max_wall_s: float,
        progress: bool = True, names: bool = False, prefetch: bool = False,
        sides: tuple[str, ...] = DEFAULT_SIDES, rounds: int = 3, arch: str | None = None,
        model_size: str = "default", settings: Settings | None = None,
        mlx_lm_cache_bytes: int | None = None) -> tuple[dict, list[dict]]:
    """Returns (the result document, one {side: RunResult} per round). `arch`: a random-weight
    model of the default model's size with that architecture (kvbank/testing/tiny.py), its
    tokenizer with think tokens and its template Qwen3.5's, which drops earlier answers'
    reasoning. Raises CgroupUnavailable where no memory cgroup can be made, ValueError for a
    limit that leaves a side no room."""
    from kvbank.apps.loadgen.report import summarize
    from kvbank.apps.loadgen.run import TokenCounter
    from kvbank.models import prepare_model
    from kvbank.testing.tiny import bench_model

    if rounds < 1:
        raise ValueError(f"--rounds must be 1 or more, not {rounds}")
    limit_bytes -= limit_bytes % os.sysconf("SC_PAGE_SIZE")  # the kernel's limit is in pages
    if unknown := set(sides) - set(BY_NAME):
        raise ValueError(f"--sides: unknown {', '.join(sorted(unknown))}")
    settings = settings or Settings(max_tokens=scenario.params.max_tokens)
    model_dir = bench_model(arch, size=model_size) if arch else prepare_model(model)
    counter = TokenCounter(model_dir)
    if prefetch and "kvbank_prefetch" not in sides:
        sides = (*sides, "kvbank_prefetch")
    results: list[dict] = []
    records: list[dict] = []  # per round: {side: its argv, memory, kvbank's sessions}
    with tempfile.TemporaryDirectory(prefix="kvbank-compare-") as tmpdir:
        sizing = size(model_dir, Path(tmpdir), settings, limit_bytes, mlx_lm_cache_bytes)
        for i in range(rounds):
            tmp = Path(tmpdir) / f"round-{i + 1}"
            tmp.mkdir()
            this, recs = {}, {}
            for name in side_order(sides, i):
                side = BY_NAME[name]
                label = side.label + (f" #{i + 1}" if rounds > 1 else "")
                logger.info("compare: starting %s", label)
                recs[name] = {}
                with serve(side, model_dir, tmp, settings, sizing, limit_bytes,
                           recs[name]) as url:
                    this[name] = _run_side(
                        name, label, url, scenario, counter,
                        None if side.engine == "kvbank" else "default_model", max_wall_s,
                        progress, names, prefetch=side.hints)
            results.append(this)
            records.append(recs)
    sums = [{name: summarize(r) for name, r in this.items()} for this in results]
    expected = scenario.params.agents * scenario.params.turns
    # a side that did not serve every turn did other work: no ratio of it is a comparison
    per_round = [round_ratios(served_all(s, expected)) for s in sums]
    incomplete = [f"{BY_NAME[n].label} round {i + 1}: {x['turns_ok']} of {expected} turns "
                  f"({x['refused']} refused, {x['errored']} errors)"
                  for i, s in enumerate(sums) for n, x in s.items() if x["turns_ok"] != expected]
    ratios = median_ratios(per_round)
    side_docs = {}
    for side in SIDES:
        if side.name not in sums[0]:
            continue
        recs = [r[side.name] for r in records]
        side_docs[side.name] = {
            "label": side.label, "engine": side.engine,
            "limit_bytes": [r["memory"]["limit_bytes"] for r in recs],
            "settings": settings.as_dict(),
            "argv": recs[0].get("argv"),
            "summary": sums[0][side.name],
            "wall_s_by_round": [this[side.name]["wall_s"] for this in sums],
            "memory_by_round": [r["memory"] for r in recs],
            "peak_bytes": max(r["memory"]["peak_bytes"] for r in recs),
            "throttled": any(r["memory"]["throttled"] for r in recs),
            "killed": any(r["memory"]["killed"] for r in recs),
            **({"kvbank_by_round": [r.get("kvbank") for r in recs]}
               if side.engine == "kvbank" else {}),
        }
    fair = fairness(side_docs)
    ratios, withheld = withhold(ratios, fair)
    per_round = [withhold(r, fair)[0] for r in per_round]
    doc = {
        "model": str(model_dir),
        "arch": arch or "",
        "model_size": model_size if arch else "",
        "scenario": dataclasses.asdict(scenario.params),
        "memory_limit_bytes": limit_bytes,
        "anonymous": not names,
        "rounds": rounds,
        "versions": versions(),
        "sizing": sizing,
        **ratios,
        "spread": spread(per_round),
        "goals": goals(ratios),
        "round_ratios": [{"order": side_order(sides, i), **r} for i, r in enumerate(per_round)],
        "complete": all(s["turns_ok"] == s["turns"] == scenario.params.agents
                        * scenario.params.turns for this in sums for s in this.values()),
        "fairness": {**fair, "withheld": withheld, "incomplete": incomplete},
        "findings": findings(ratios, spread(per_round)),
        "sides": side_docs,
        "prefetch": (prefetch_summary(results[0].get("kvbank"), results[0]["kvbank_prefetch"])
                     if "kvbank_prefetch" in results[0] else None),
    }
    return doc, results


def print_table(doc: dict, *, stderr: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table

    def f(x, nd: int = 2) -> str:
        return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))

    def mb(x) -> str:
        return "-" if x is None else f"{x / 1e6:.0f}"

    p = doc["scenario"]
    t = Table(title=f"bench compare: {p.get('scenario')} x{p.get('turns')} turns, memory limit "
                    f"{doc['memory_limit_bytes'] / 1e6:.0f} MB per side (cgroup), "
                    f"{'no session names' if doc['anonymous'] else 'named sessions'}")
    for col in ("server", "limit MB", "peak MB", "own MB", "hit limit", "killed", "wall s",
                "ttft p50", "p95", "prompt", "cached", "recomp", "refused", "errors"):
        t.add_column(col, justify="left" if col == "server" else "right")
    for side in doc["sides"].values():
        s, m = side["summary"], side["memory_by_round"][0]
        t.add_row(side["label"], mb(m["limit_bytes"]), mb(side["peak_bytes"]),
                  mb(max(x["peak_anon_bytes"] for x in side["memory_by_round"])),
                  "yes" if side["throttled"] else "no", "YES" if side["killed"] else "no",
                  f(s["wall_s"], 1), f(s["ttft_p50_s"]), f(s["ttft_p95_s"]),
                  f(s["prompt_tokens"]), f(s["cached_tokens"]), f(s["recomputed_tokens"]),
                  f(s["refused"]), f(s["errored"]))
    console = Console(stderr=stderr)
    if not console.is_terminal:  # a log file or a pipe: do not squeeze to 80 columns
        console = Console(stderr=stderr, width=150)
    console.print(t)
    sp = doc["spread"]
    console.print("; ".join(
        f"{key} {f(doc[key])} ({f((sp[key] or [None])[0])} to {f((sp[key] or [None, None])[1])})"
        for key in ("wall_speedup", "vs_ideal", "recomputed_fraction", "mlx_lm_vs_unlimited",
                    "unbounded_kvbank_vs_mlx_lm")) + f": medians over {doc['rounds']} rounds "
                  "(the lowest to the highest)", markup=False)
    console.print("goals: " + ", ".join(
        f"{k} {g['goal']}: {f(g['value'])} {'met' if g['met'] else '-' if g['met'] is None else 'NOT met'}"
        for k, g in doc["goals"].items()))
    fair = doc["fairness"]
    console.print("fair: same limit and settings" if fair["ok"] else
                  "NOT FAIR, so not reported (" + ", ".join(fair.get("withheld", []))
                  + "): " + "; ".join(fair["problems"]), markup=False)
    for line in fair.get("incomplete", []):
        console.print("INCOMPLETE, its ratios not reported: " + line, markup=False)
    for finding in doc.get("findings", []):
        console.print("finding: " + finding, markup=False)
    sz = doc["sizing"]
    console.print(f"flags from the limit: kvbank --memory-budget "
                  f"{mb(sz['kvbank']['memory_budget_bytes'])} MB, mlx-lm --prompt-cache-bytes "
                  f"{mb(sz['mlx_lm']['prompt_cache_bytes'])} MB"
                  + (f" (given; the rule's: {mb(sz['mlx_lm']['by_rule_bytes'])} MB)"
                     if sz["mlx_lm"].get("given") else "")
                  + f" (idle: kvbank's processes "
                  f"{mb(sz['idle']['kvbank']['tree_anon_bytes'])} MB, mlx-lm's "
                  f"{mb(sz['idle']['mlx_lm']['tree_anon_bytes'])} MB)")
    kv = doc["sides"].get("kvbank", {}).get("summary", {})
    if kv.get("ttft_p50_by_source_s"):
        console.print("kvbank TTFT p50 by cache source: " + ", ".join(
            f"{src} {f(v)} s" for src, v in kv["ttft_p50_by_source_s"].items()))
    pf = doc.get("prefetch")
    if pf:
        console.print(f"kvbank prefetch: returning turns from SSD "
                      f"{f(pf['ssd_turns_without_hints'])} of {pf['returning_turns']} without "
                      f"hints, {pf['ssd_turns_with_hints']} "
                      f"with ({', '.join(f'{h} {n}' for h, n in pf['hints'].items())}); hinted "
                      f"turns' TTFT p50 {f(pf['hinted_ttft_p50_s'])} s, RAM hits' (no hints) "
                      f"{f(pf['ram_hit_ttft_p50_s'])} s: hinted_vs_ram_hits "
                      f"{f(pf['hinted_vs_ram_hits'], 3)}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`kvbank bench compare`'s flags."""
    from kvbank.apps.loadgen.cli import add_scenario_arguments
    from kvbank.testing.tiny import ARCHS

    p.add_argument("--model", default=None,
                   help="an mlx-lm model folder or a .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--arch", choices=ARCHS, default=None,
                   help="a random-weight model of the default model's size with this "
                        "architecture, instead of --model (its answers reason, and its "
                        "template drops earlier reasoning, as Qwen3.5's does)")
    p.add_argument("--size", choices=("default", "wide-kv"), default="default",
                   help="with --arch: the model's shape. wide-kv: the default's width and "
                        "depth with full multi-head attention of 128-wide heads (a token's KV "
                        "6x the default's, Llama-3-8B's in bfloat16) and the default model's "
                        "own template (default: %(default)s)")
    add_scenario_arguments(p, default="two-agents")
    p.add_argument("--agents", type=int, default=None, help="n-agents: how many at once")
    p.add_argument("--think-s", type=float, default=None,
                   help="n-agents: mean pause between an agent's turns (its tool calls)")
    p.add_argument("--memory-limit", default=DEFAULT_LIMIT,
                   help="the memory cgroup limit of each limited side's whole process tree, "
                        "page cache included (e.g. 1.2GB); each server's memory flags are "
                        "set from it (default: %(default)s)")
    p.add_argument("--mlx-lm-prompt-cache-bytes", default=None, metavar="SIZE",
                   help="mlx-lm's --prompt-cache-bytes under the limit, instead of the "
                        "rule's (limit - its idle memory - a prefill transient), where that "
                        "size is killed; recorded in the JSON (sizing.mlx_lm.given)")
    p.add_argument("--prefill-chunk", type=int, default=Settings.prefill_chunk_tokens,
                   help="prompt tokens a prefill step reads, both servers (default: "
                        "%(default)s)")
    p.add_argument("--concurrency", type=int, default=Settings.concurrency,
                   help="requests each server runs at once (default: %(default)s)")
    p.add_argument("--prefetch", action="store_true",
                   help="run kvbank under the limit once more, its agents hinting at the "
                        "start of each think time that they will be back")
    p.add_argument("--sides", default=",".join(DEFAULT_SIDES),
                   help=f"which servers to run, comma-separated, of "
                        f"{', '.join(s.name for s in SIDES)} (default: %(default)s)")
    p.add_argument("--max-wall-s", type=float, default=900.0,
                   help="per server: start no turn after this many seconds "
                        "(default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3,
                   help="run every side this many times, the order reversed each round; each "
                        "ratio is then the median of the rounds' (default: %(default)s)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="print the result as JSON (to FILE if given)")
    p.add_argument("--plot-dir", type=Path, default=None,
                   help="write TTFT plots (PNG) here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--session-ids", action="store_true",
                   help="name each conversation (`user` and `x-session-id`); by default none "
                        "is sent, as most OpenAI clients send none")


def run_cli(args: argparse.Namespace) -> int:
    from kvbank.apps.bench.cgroup import CgroupUnavailable, parse_bytes
    from kvbank.apps.bench.provenance import stamp
    from kvbank.apps.loadgen import report
    from kvbank.apps.loadgen.scenarios import build, params

    try:
        p = params(args.scenario, seed=args.seed, turns=args.turns,
                   turn_tokens=args.turn_tokens, max_tokens=args.max_tokens,
                   system_tokens=args.system_tokens, agents=args.agents,
                   think_s=args.think_s)
        limit = parse_bytes(args.memory_limit)
    except ValueError as e:
        sys.stderr.write(f"kvbank bench compare: {e}\n")
        return 2
    mlx_cache = None
    if args.mlx_lm_prompt_cache_bytes is not None:
        try:
            mlx_cache = parse_bytes(args.mlx_lm_prompt_cache_bytes)
        except ValueError:
            mlx_cache = 0
        if mlx_cache <= 0:
            sys.stderr.write(f"kvbank bench compare: --mlx-lm-prompt-cache-bytes "
                             f"{args.mlx_lm_prompt_cache_bytes!r}: not a size in bytes (e.g. "
                             f"600MB)\n")
            return 2
    if args.size != "default" and not args.arch:
        sys.stderr.write("kvbank bench compare: --size shapes a random-weight model: it needs "
                         "--arch\n")
        return 2
    scenario = build(p)
    settings = Settings(prefill_chunk_tokens=args.prefill_chunk, concurrency=args.concurrency,
                        max_tokens=p.max_tokens)
    try:
        doc, results = run(model=args.model, scenario=scenario, limit_bytes=limit,
                           max_wall_s=args.max_wall_s, progress=not args.no_progress,
                           names=args.session_ids, prefetch=args.prefetch,
                           sides=tuple(args.sides.split(",")), rounds=args.rounds,
                           arch=args.arch, model_size=args.size, settings=settings,
                           mlx_lm_cache_bytes=mlx_cache)
    except CgroupUnavailable as e:
        sys.stderr.write(f"kvbank bench compare: cannot hold both servers to the same memory "
                         f"here, so it does not compare them: {e}\n")
        return 2
    except (RuntimeError, ValueError) as e:  # a bad --rounds, or a server that would not
        # start (its log tail is in the message)
        sys.stderr.write(f"kvbank bench compare: {e}\n")
        return 2
    stamp(doc)
    if args.plot_dir:
        report.plot_ttft(Path(args.plot_dir) / f"compare-{p.scenario}.png",
                         {BY_NAME[n].label: r.rows for n, r in results[0].items()},
                         f"TTFT per turn, {p.scenario}, limit {limit / 1e6:.0f} MB")
    print_table(doc, stderr=args.json == "-")  # stdout is the JSON's then
    if args.json == "-":
        sys.stdout.write(json.dumps(doc) + "\n")
    elif args.json:
        full = {**doc, "rows": {n + (f"#{i + 1}" if i else ""): report.document(r)["rows"]
                                for i, this in enumerate(results) for n, r in this.items()}}
        report.write_json(Path(args.json), full)
    return 0 if doc["complete"] and doc["fairness"]["ok"] else 1
