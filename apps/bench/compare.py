"""`kvbank bench compare`: one loadgen scenario through the OpenAI API of three servers.

One after the other, on the same model folder, each freshly started:

1. **kvbank** (`kvbank up --bank-bytes BUDGET`, through its shim): conversations that leave the
   RAM bank come back from SSD.
2. **mlx-lm, same budget** (`mlx_lm.server --prompt-cache-bytes BUDGET`): what leaves its
   prompt cache is computed again.
3. **mlx-lm, unlimited** (`--prompt-cache-bytes` 1 TiB): nothing is evicted, the ideal.

Both mlx-lm servers get `--prompt-cache-size 100000`, so only the byte budget evicts. Each server
gets one warm-up request (no session, 1 token) before its run, so model loading is not timed.
Wall time is the scenario's alone. New tokens are counted with the model's tokenizer for all
three (`TokenCounter`), so `recomputed_tokens = prompt - cached - new` means the same on each
side; kvbank's own count (`server_recomputed_tokens`) is reported beside it.

Ratios: `wall_speedup` = mlx-lm (same budget) wall / kvbank wall; `vs_ideal` = kvbank wall /
mlx-lm (unlimited) wall; `recomputed_fraction` = kvbank recomputed / kvbank prompt tokens;
`speedup_bound` = mlx-lm (same budget) wall / mlx-lm (unlimited) wall, the most any server can
gain over mlx-lm at the budget (it cannot beat the server that never evicts).

By default the clients send no session name (`anonymous`: true), as the official SDKs and
most agents do; `--session-ids` sends `user` and `x-session-id` to every server.
`--prefetch` adds a side: kvbank again, freshly started, its agents hinting at the start of
each think time (`--think-s`, n-agents) that they will be back (`POST /v1/kvbank/prefetch`).
`prefetch` in the result compares the two kvbank runs (`prefetch_summary`): returning turns
from SSD without and with hints, and `hinted_vs_ram_hits`, the hinted turns' TTFT p50 over
the RAM hits' in the run with hints (the goal: 1, a hinted turn pays nothing for SSD).
`--memory-budget` bounds kvbank's worker as a whole (weights, running requests and bank),
where `--budget-bytes` bounds its bank.

`--rounds N` runs every side N times, the order reversed each round (kvbank first, then last,
...), and each ratio is the median of the rounds' own ratios: on a shared machine the sides of
one round run minutes apart and a wall moves by 10-25 % between minutes, so one pair is noise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

logger = logging.getLogger(__name__)

DEFAULT_BUDGET_BYTES = 150_000_000
UNLIMITED_BYTES = 1 << 40
MLX_CACHE_ENTRIES = 100_000
OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
SIDES = (("kvbank", "kvbank (budget)"), ("kvbank_prefetch", "kvbank (budget), hints"),
         ("mlx_lm_budget", "mlx-lm (budget)"), ("mlx_lm_unlimited", "mlx-lm (unlimited)"))
DEFAULT_SIDES = ("kvbank", "mlx_lm_budget", "mlx_lm_unlimited")  # --prefetch adds the hints


def _wait_health(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    raise RuntimeError(f"{url} did not become healthy in {timeout_s:.0f} s; log:\n{tail}")


def _warm_up(url: str, model_name: str | None) -> None:
    """One anonymous 1-token request, so loading the model is not in the timed run."""
    import httpx

    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
            "temperature": 0.0, "model": model_name or "default_model"}
    httpx.post(url + "/v1/chat/completions", json=body, timeout=300).raise_for_status()


def _sessions(stack) -> dict:
    """Where kvbank's conversations are after the run: RAM bytes against the budget."""
    from kvbank.v1 import api_pb2

    with stack.client() as c:
        sessions = c.sessions.List(api_pb2.ListSessionsRequest(), timeout=30).sessions
    return {"ram_bytes": sum(s.ram_bytes for s in sessions),
            "sessions": {s.session_id: {"state": s.state, "ram_bytes": s.ram_bytes,
                                        "token_count": s.token_count,
                                        "durable_tokens": s.durable_tokens}
                         for s in sessions}}


class _Peaks:
    """The worker's peaks through a run: its RAM bank (the worker's own
    `kvbank_bank_peak_bytes`, read once at the end: polling /metrics would cost the worker
    the CPU the run measures) and its resident memory (anonymous + shared pages, as the
    worker's own ledger counts them), read from /proc every `every_s`."""

    def __init__(self, stack, every_s: float = 0.2):
        self.stack, self.every_s = stack, every_s
        self.bank_bytes = self.worker_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peaks", daemon=True)

    def __enter__(self) -> "_Peaks":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        import httpx

        self._stop.set()
        self._thread.join(timeout=5)
        try:
            text = httpx.get(self.stack.metrics_url("worker"), timeout=10).text
            self.bank_bytes = int(next(float(line.split()[-1]) for line in text.splitlines()
                                       if line.startswith("kvbank_bank_peak_bytes ")))
        except Exception:  # the worker is gone: the run's own error, if any, is the story
            logger.warning("could not read the worker's peak bank bytes")

    def _run(self) -> None:
        from kvbank.worker.memory.pricing import resident_bytes

        pid = self.stack.pid("worker")
        while not self._stop.wait(self.every_s):
            try:
                self.worker_bytes = max(self.worker_bytes, resident_bytes(pid))
            except Exception:  # the worker is gone: the run's own rows say so
                return


@contextmanager
def _kvbank(model_dir: Path, data_dir: Path, budget_bytes: int, after: dict,
            memory_budget: str | None = None) -> Iterator[str]:
    """kvbank with its OpenAI shim; `after` gets the sessions' state once the run is over,
    and the peaks of its bank and its worker's memory through the run."""
    from kvbank.deploy.local import LocalStack

    extra = ["--bank-bytes", str(budget_bytes)]
    if memory_budget:
        extra += ["--memory-budget", memory_budget]
    stack = LocalStack.start(model_dir, data_dir, extra=extra)
    try:
        if not stack.shim_url:
            raise RuntimeError("the kvbank stack was started without its OpenAI shim")
        _wait_health(stack.shim_url, stack.proc, 120, stack.log)
        with _Peaks(stack) as peaks:
            yield stack.shim_url
        after.update(_sessions(stack))
        after.update(peak_bank_bytes=peaks.bank_bytes, peak_worker_bytes=peaks.worker_bytes)
    finally:
        stack.stop()


@contextmanager
def _mlx_lm(model_dir: Path, tmp: Path, cache_bytes: int, name: str) -> Iterator[str]:
    from kvbank.deploy.local import free_port

    port = free_port()
    log = tmp / f"{name}.log"
    argv = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir),
            "--port", str(port), "--prompt-cache-bytes", str(cache_bytes),
            "--prompt-cache-size", str(MLX_CACHE_ENTRIES), "--temp", "0"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if os.path.exists(OPENBLAS):
        env["LD_PRELOAD"] = OPENBLAS
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_health(url, proc, 300, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _run_side(name: str, label: str, url: str, scenario, counter, model_name: str | None,
              max_wall_s: float, progress: bool, names: bool, prefetch: bool = False):
    from kvbank.apps.loadgen.cli import execute
    from kvbank.apps.loadgen.targets import parse_target

    _warm_up(url, model_name)
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
    order = [name for name, _ in SIDES if name in sides]
    return order if round_index % 2 == 0 else order[::-1]


def round_ratios(sums: dict) -> dict:
    """One round's ratios from its sides' summaries; a side not run gives null ratios."""
    none = {"wall_s": None, "ttft_p50_s": None, "recomputed_tokens": None,
            "prompt_tokens": None}
    kv, mb, mu = (sums.get(n, none) for n in ("kvbank", "mlx_lm_budget", "mlx_lm_unlimited"))
    return {
        "wall_speedup": _ratio(mb["wall_s"], kv["wall_s"]),
        "speedup_bound": _ratio(mb["wall_s"], mu["wall_s"]),
        "vs_ideal": _ratio(kv["wall_s"], mu["wall_s"]),
        "recomputed_fraction": _ratio(kv["recomputed_tokens"], kv["prompt_tokens"], 4),
        "mlx_lm_budget_recomputed_fraction": _ratio(mb["recomputed_tokens"],
                                                    mb["prompt_tokens"], 4),
        "ttft_p50_speedup": _ratio(mb["ttft_p50_s"], kv["ttft_p50_s"]),
    }


def median_ratios(rounds: list[dict]) -> dict:
    """Each ratio's median over the rounds that have it (null where none has)."""
    import statistics

    out = {}
    for key in rounds[0]:
        vals = [r[key] for r in rounds if r.get(key) is not None]
        out[key] = round(statistics.median(vals), 4) if vals else None
    return out


def prefetch_summary(without, hinted) -> dict:
    """The two kvbank runs, without hints (`without`, may be None) and with: how many
    returning turns (an agent's second and later) came from SSD, and the TTFT p50 of the
    hinted turns against the RAM hits of the same run."""
    from kvbank.apps.loadgen.report import percentile

    def returning(result, source: str | None = None) -> list:
        return [r for r in (result.rows if result else []) if r.status == "ok" and r.turn > 1
                and r.ttft_s is not None and (source is None or r.cache_source == source)]

    def p50(rows) -> float | None:
        return round(percentile([r.ttft_s for r in rows], 50), 3) if rows else None

    hinted_turns = [r for r in returning(hinted) if r.hint]
    ram_hits = returning(hinted, "ram")
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


def run(*, model: str | None, scenario, budget_bytes: int, max_wall_s: float,
        progress: bool = True, names: bool = False, prefetch: bool = False,
        memory_budget: str | None = None, sides: tuple[str, ...] = DEFAULT_SIDES,
        rounds: int = 1, arch: str | None = None) -> tuple[dict, list[dict]]:
    """Returns (the result document, one {side: RunResult} per round). `arch`: a random-weight
    model of the default model's size with that architecture (kvbank/testing/tiny.py), its tokenizer
    with think tokens and its template Qwen3.5's, which drops earlier answers' reasoning."""
    from kvbank.models import prepare_model
    from kvbank.testing.tiny import bench_model
    from kvbank.apps.loadgen.report import summarize
    from kvbank.apps.loadgen.run import TokenCounter

    if rounds < 1:
        raise ValueError(f"--rounds must be 1 or more, not {rounds}")
    model_dir = bench_model(arch) if arch else prepare_model(model)
    counter = TokenCounter(model_dir)
    if prefetch and "kvbank_prefetch" not in sides:
        sides = (*sides, "kvbank_prefetch")
    labels = dict(SIDES)
    results: list[dict] = []
    afters: list[dict] = []  # kvbank's sessions and peaks after each round
    with tempfile.TemporaryDirectory(prefix="kvbank-compare-") as tmpdir:
        for i in range(rounds):
            tmp = Path(tmpdir) / f"round-{i + 1}"
            tmp.mkdir()
            after: dict = {}
            servers = {
                "kvbank": lambda: _kvbank(model_dir, tmp / "kvbank-data", budget_bytes,
                                          after, memory_budget),
                "kvbank_prefetch": lambda: _kvbank(model_dir, tmp / "kvbank-prefetch-data",
                                                   budget_bytes, {}, memory_budget),
                "mlx_lm_budget": lambda: _mlx_lm(model_dir, tmp, budget_bytes,
                                                 "mlx_lm_budget"),
                "mlx_lm_unlimited": lambda: _mlx_lm(model_dir, tmp, UNLIMITED_BYTES,
                                                    "mlx_lm_unlimited"),
            }
            this: dict = {}
            for name in side_order(sides, i):
                label = labels[name] + (f" #{i + 1}" if rounds > 1 else "")
                logger.info("compare: starting %s", label)
                with servers[name]() as url:
                    this[name] = _run_side(
                        name, label, url, scenario, counter,
                        None if name.startswith("kvbank") else "default_model", max_wall_s,
                        progress, names, prefetch=name == "kvbank_prefetch")
            results.append(this)
            afters.append(after)
    sums = [{name: summarize(r) for name, r in this.items()} for this in results]
    per_round = [round_ratios(s) for s in sums]
    first, kvbank_after = results[0], afters[0]
    peak_bank = max((a.get("peak_bank_bytes") or 0 for a in afters), default=0) or None
    peak_worker = max((a.get("peak_worker_bytes") or 0 for a in afters), default=0) or None
    doc = {
        "model": str(model_dir),
        "arch": arch or "",
        "scenario": dataclasses.asdict(scenario.params),
        "budget_bytes": budget_bytes,
        "anonymous": not names,
        "rounds": rounds,
        "prefetch": (prefetch_summary(first.get("kvbank"), first["kvbank_prefetch"])
                     if "kvbank_prefetch" in first else None),
        "memory_budget": memory_budget,
        **median_ratios(per_round),
        "round_ratios": [{"order": side_order(sides, i), **r} for i, r in enumerate(per_round)],
        "complete": all(s["turns_ok"] == s["turns"] == scenario.params.agents
                        * scenario.params.turns for this in sums for s in this.values()),
        "sides": {name: {"label": label, "summary": sums[0][name],
                         "wall_s_by_round": [this[name]["wall_s"] for this in sums]}
                  for name, label in SIDES if name in sums[0]},
        "kvbank_after": kvbank_after,
        "peak_bank_bytes": peak_bank,
        "peak_worker_bytes": peak_worker,
        "peak_bank_vs_budget": _ratio(peak_bank, budget_bytes),
    }
    return doc, results


def print_table(doc: dict, *, stderr: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table

    def f(x, nd: int = 2) -> str:
        return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))

    p = doc["scenario"]
    t = Table(title=f"bench compare: {p.get('scenario')} x{p.get('turns')} turns, budget "
                    f"{doc['budget_bytes'] / 1e6:.0f} MB, "
                    f"{'no session names' if doc['anonymous'] else 'named sessions'}")
    for col in ("server", "wall s", "ttft p50", "p95", "max", "prompt", "cached", "recomp",
                "kvbank recomp", "refused", "errors"):
        t.add_column(col, justify="left" if col == "server" else "right")
    for side in doc["sides"].values():
        s = side["summary"]
        t.add_row(side["label"], f(s["wall_s"], 1), f(s["ttft_p50_s"]), f(s["ttft_p95_s"]),
                  f(s["ttft_max_s"]), f(s["prompt_tokens"]), f(s["cached_tokens"]),
                  f(s["recomputed_tokens"]), f(s["server_recomputed_tokens"]),
                  f(s["refused"]), f(s["errored"]))
    console = Console(stderr=stderr)
    if not console.is_terminal:  # a log file or a pipe: do not squeeze to 80 columns
        console = Console(stderr=stderr, width=132)
    console.print(t)
    console.print(f"wall_speedup (mlx-lm same budget / kvbank) {f(doc['wall_speedup'])}x "
                  f"of a bound of {f(doc['speedup_bound'])}x (mlx-lm same budget / unlimited), "
                  f"vs_ideal (kvbank / mlx-lm unlimited) {f(doc['vs_ideal'])}, "
                  f"recomputed_fraction {f(doc['recomputed_fraction'], 4)} (mlx-lm same "
                  f"budget: {f(doc['mlx_lm_budget_recomputed_fraction'], 4)})")
    if doc.get("rounds", 1) > 1:
        console.print("the table is round 1; ratios above are medians over the rounds: "
                      + "; ".join(f"round {i + 1} ({' > '.join(r['order'])}) vs_ideal "
                                  f"{f(r['vs_ideal'])}, wall_speedup {f(r['wall_speedup'])} "
                                  f"of {f(r['speedup_bound'])}"
                                  for i, r in enumerate(doc["round_ratios"])))
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
                      f"turns' TTFT p50 {f(pf['hinted_ttft_p50_s'])} s, RAM hits' "
                      f"{f(pf['ram_hit_ttft_p50_s'])} s: hinted_vs_ram_hits "
                      f"{f(pf['hinted_vs_ram_hits'], 3)}")
    ram = doc.get("kvbank_after", {}).get("ram_bytes")
    if ram is not None:
        console.print(f"kvbank RAM bank after the run: {ram / 1e6:.0f} MB of KV (budget "
                      f"{doc['budget_bytes'] / 1e6:.0f} MB)")
    if doc.get("peak_bank_bytes") is not None:
        console.print(f"kvbank peaks through the run: bank {doc['peak_bank_bytes'] / 1e6:.0f} MB "
                      f"({f(doc['peak_bank_vs_budget'])}x the budget), worker "
                      f"{doc['peak_worker_bytes'] / 1e6:.0f} MB resident")


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
    add_scenario_arguments(p, default="two-agents")
    p.add_argument("--agents", type=int, default=None, help="n-agents: how many at once")
    p.add_argument("--think-s", type=float, default=None,
                   help="n-agents: mean pause between an agent's turns (its tool calls)")
    p.add_argument("--prefetch", action="store_true",
                   help="run kvbank a second time, its agents hinting at the start of each "
                        "think time that they will be back (POST /v1/kvbank/prefetch)")
    p.add_argument("--memory-budget", default=None,
                   help="kvbank's worker memory budget (e.g. 1.5GB; default: the worker's)")
    p.add_argument("--sides", default=",".join(DEFAULT_SIDES),
                   help=f"which servers to run, comma-separated, of "
                        f"{', '.join(n for n, _ in SIDES)} (default: %(default)s)")
    p.add_argument("--budget-bytes", type=int, default=DEFAULT_BUDGET_BYTES,
                   help="KV memory budget for kvbank's bank and mlx-lm's prompt cache "
                        "(default: %(default)s)")
    p.add_argument("--max-wall-s", type=float, default=600.0,
                   help="per server: start no turn after this many seconds "
                        "(default: %(default)s)")
    p.add_argument("--rounds", type=int, default=1,
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
    from kvbank.apps.loadgen import report
    from kvbank.apps.loadgen.scenarios import build, params

    try:
        p = params(args.scenario, seed=args.seed, turns=args.turns,
                   turn_tokens=args.turn_tokens, max_tokens=args.max_tokens,
                   system_tokens=args.system_tokens, agents=args.agents,
                   think_s=args.think_s)
    except ValueError as e:
        sys.stderr.write(f"kvbank bench compare: {e}\n")
        return 2
    scenario = build(p)
    try:
        doc, results = run(model=args.model, scenario=scenario,
                           budget_bytes=args.budget_bytes, max_wall_s=args.max_wall_s,
                           progress=not args.no_progress, names=args.session_ids,
                           prefetch=args.prefetch, memory_budget=args.memory_budget,
                           sides=tuple(args.sides.split(",")), rounds=args.rounds,
                           arch=args.arch)
    except (RuntimeError, ValueError) as e:  # a bad --rounds, or a server that would not
        # start (its log tail is in the message)
        sys.stderr.write(f"kvbank bench compare: {e}\n")
        return 2
    if args.plot_dir:
        labels = dict(SIDES)
        report.plot_ttft(Path(args.plot_dir) / f"compare-{p.scenario}.png",
                         {labels[n]: r.rows for n, r in results[0].items()},
                         f"TTFT per turn, {p.scenario}, budget {args.budget_bytes / 1e6:.0f} MB")
    print_table(doc, stderr=args.json == "-")  # stdout is the JSON's then
    if args.json == "-":
        sys.stdout.write(json.dumps(doc) + "\n")
    elif args.json:
        full = {**doc, "rows": {n + (f"#{i + 1}" if i else ""): report.document(r)["rows"]
                                for i, this in enumerate(results) for n, r in this.items()}}
        report.write_json(Path(args.json), full)
    return 0 if doc["complete"] else 1
