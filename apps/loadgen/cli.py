"""`kvbank loadgen`: argument parsing and the entry point (`kvbank bench compare` wires its
own in apps/bench/compare.py, which uses this module's scenario flags and `execute`).

Exit codes of `kvbank loadgen`: 0 the run happened (refusals and errors are in the report),
1 it happened but no turn succeeded, 2 bad arguments or a target that cannot be reached (one
line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path

from kvbank.apps.loadgen.scenarios import SCENARIOS


def add_scenario_arguments(p: argparse.ArgumentParser, *, default: str | None) -> None:
    """The flags that pick and size a scenario (`kvbank loadgen` and `kvbank bench compare`)."""
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default=default,
                   help="what the agents do (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds every message: the same seed sends the same prompts, given "
                        "the same answers (default: %(default)s)")
    p.add_argument("--turns", type=int, default=None, help="turns per agent")
    p.add_argument("--turn-tokens", type=int, default=None,
                   help="about this many tokens per user/tool message")
    p.add_argument("--max-tokens", type=int, default=None, help="answer length asked per turn")
    p.add_argument("--system-tokens", type=int, default=None,
                   help="about this many tokens of shared system prompt")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="grpc://HOST:PORT (kvbank's router) or openai://HOST:PORT "
                                  "(any OpenAI-compatible server; also openai://http(s)://...)")
    add_scenario_arguments(p, default="two-agents")
    p.add_argument("--agents", type=int, default=None,
                   help="agents (n-agents) or sessions (shared-prefix)")
    p.add_argument("--think-s", type=float, default=None,
                   help="n-agents: mean pause between an agent's turns, seconds")
    p.add_argument("--prefetch", action="store_true",
                   help="n-agents: each agent hints kvbank (POST /v1/kvbank/prefetch) at the "
                        "start of its think time that it will be back, as a harness would when "
                        "a tool call starts")
    p.add_argument("--compact-every", type=int, default=None,
                   help="compaction: turns between summaries")
    p.add_argument("--summary-tokens", type=int, default=None,
                   help="compaction: about this many tokens per summary")
    p.add_argument("--max-wall-s", type=float, default=1800.0,
                   help="start no turn after this many seconds (default: %(default)s)")
    p.add_argument("--request-timeout-s", type=float, default=600.0,
                   help="per turn (default: %(default)s)")
    p.add_argument("--connect-timeout-s", type=float, default=10.0,
                   help="how long the target may take to answer at all (default: %(default)s)")
    p.add_argument("--model-name", default=None,
                   help="openai targets: the `model` field (default: the one /v1/models "
                        "lists, else default_model)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="the served model's folder, to count new tokens exactly (default: "
                        "count them from the usage)")
    p.add_argument("--run-id", default=None,
                   help="prefix of the session ids (default: random), e.g. to reuse sessions")
    p.add_argument("--json", type=Path, default=None, metavar="FILE",
                   help="write the summary and one row per turn here")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                   help="draw TTFT per turn, coloured by cache source")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def execute(scenario, target, *, run_id: str, max_wall_s: float, request_timeout_s: float,
            counter=None, progress: bool = True, label: str = "", prefetch: bool = False):
    """Run a scenario with a progress bar on stderr; returns the `RunResult`."""
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn)

    from kvbank.apps.loadgen.run import Runner

    total = scenario.params.agents * scenario.params.turns
    if not progress:
        return Runner(scenario, target, run_id=run_id, max_wall_s=max_wall_s,
                      request_timeout_s=request_timeout_s, counter=counter,
                      prefetch=prefetch).run()
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[last]}"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task(label or scenario.params.scenario, total=total, last="")

        def on_row(row) -> None:
            last = (f"{row.agent} t{row.turn} {row.status} ttft "
                    f"{row.ttft_s if row.ttft_s is not None else '-'} s")
            bar.update(task, advance=1, last=last)

        return Runner(scenario, target, run_id=run_id, max_wall_s=max_wall_s,
                      request_timeout_s=request_timeout_s, counter=counter,
                      on_row=on_row, prefetch=prefetch).run()


def _fail(msg: str) -> int:
    sys.stderr.write(f"kvbank loadgen: {' '.join(msg.split())}\n")
    return 2


def run_cli(args: argparse.Namespace) -> int:
    from kvbank.apps.loadgen import report
    from kvbank.apps.loadgen.scenarios import build, params
    from kvbank.apps.loadgen.targets import TargetUnreachable, parse_target

    try:
        p = params(args.scenario, seed=args.seed, agents=args.agents, turns=args.turns,
                   turn_tokens=args.turn_tokens, system_tokens=args.system_tokens,
                   max_tokens=args.max_tokens, think_s=args.think_s,
                   compact_every=args.compact_every, summary_tokens=args.summary_tokens)
        target = parse_target(args.target, model_name=args.model_name)
    except ValueError as e:
        return _fail(str(e))
    try:
        target.check(args.connect_timeout_s)
    except TargetUnreachable as e:
        target.close()
        return _fail(f"cannot reach {args.target}: {e}")
    counter = None
    if args.tokenizer is not None:
        from kvbank.apps.loadgen.run import TokenCounter

        try:
            counter = TokenCounter(args.tokenizer)
        except (OSError, ValueError) as e:
            target.close()
            return _fail(f"cannot load a tokenizer from {args.tokenizer}: {e}")
    try:
        result = execute(build(p), target, run_id=args.run_id or f"lg-{secrets.token_hex(4)}",
                         max_wall_s=args.max_wall_s, request_timeout_s=args.request_timeout_s,
                         counter=counter, progress=not args.no_progress,
                         prefetch=args.prefetch)
    finally:
        target.close()
    summary = report.summarize(result)
    report.print_tables(result, summary)
    if args.json:
        report.write_json(args.json, report.document(result, summary))
    if args.plot:
        report.plot_ttft(args.plot, {result.target: result.rows},
                         f"TTFT per turn: {p.scenario}, seed {p.seed}")
    return 0 if summary["turns_ok"] > 0 else 1
