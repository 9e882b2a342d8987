"""`kvbank bench tenants`: one tenant floods, another's short request keeps its pace.

A real stack (default model) with two API keys: `flood` and `probe`. While `flood` does one
thing at a time, `probe` sends short streamed chat requests through the OpenAI API and the
bench measures, as its client receives them, the time to its first token and the gaps
between its tokens. The floods, each from issue #48's table:
- `long`: 20 requests at once, each a long prompt of its own and a long answer, sent again as
  each ends;
- `full_queue`: as many as fill `flood`'s share of the router's queue, and more;
- `big_prompts`: eight 4 MB prompts at once, sent again as each is answered;
- `big_schema`: a 1.1 MB JSON schema (response_format), sent again as it is answered;
- `slow_schema`: JSON schemas under the size limit that take seconds to compile, a new one
  each time (no compile is cached), two at once.
`idle` is the probe alone. Goals (issue #48): the probe's TTFT within 3x of idle and never more
than 2 s above it, its longest gap under 1.5 s and within 3x of its median step.
Scenarios alternate with the idle case for `--rounds` rounds; the JSON records argv, versions,
commit and date.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

FLOOD_KEY, PROBE_KEY, OPERATOR_KEY = "bench-flood-key", "bench-probe-key", "bench-operator-key"
SCENARIOS = ("long", "full_queue", "big_prompts", "big_schema", "slow_schema")
WORDS = ("lighthouse harbour keeper storm ledger copper signal tide beacon rope lantern gull "
         "anchor chart compass reef channel buoy mast sail").split()


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvbank.apps.flags import model_flag

    model_flag(p)
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help="which floods, comma-separated (default: all)")
    p.add_argument("--probes", type=int, default=3,
                   help="probe requests per scenario and round (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds of idle and every scenario, alternated (default: %(default)s)")
    p.add_argument("--probe-tokens", type=int, default=40,
                   help="the probe's max_tokens (default: %(default)s)")
    p.add_argument("--long-prompt-tokens", type=int, default=1000,
                   help="about how long each long request's prompt is (default: %(default)s)")
    p.add_argument("--stack-dir", type=Path, default=None,
                   help="run the stack from this other checkout of kvbank, with its own .venv "
                        "(a before/after)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="write the result as JSON to FILE (- or nothing: one line to stdout)")


def run_cli(args: argparse.Namespace) -> int:
    import sys

    from kvbank.apps.bench.provenance import stamp
    from kvbank.apps.bench.report import write_json

    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        print(f"kvbank bench tenants: unknown scenarios {sorted(unknown)}; "
              f"choose from {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    result = run(model=args.model, scenarios=scenarios, probes=args.probes, rounds=args.rounds,
                 probe_tokens=args.probe_tokens, long_prompt_tokens=args.long_prompt_tokens,
                 stack_dir=args.stack_dir)
    if args.json:
        write_json(result, args.json)
        print_table(result, stderr=args.json == "-")  # stdout is the JSON's then
    else:
        stamp(result)
        print_table(result)
    return 0


def print_table(result: dict, *, stderr: bool = False) -> None:
    """A row per scenario: what the flood got, the probe's TTFT and longest gap, the goals."""
    from rich.console import Console
    from rich.table import Table

    from kvbank.apps.bench.report import footer

    def s(x, unit: str = " s") -> str:
        return "-" if x is None else f"{x}{unit}"

    def met(x) -> str:
        return "" if x is None else "met" if x else "NOT met"

    t = Table(title="bench tenants: the probe's short request while another key floods",
              title_justify="left")
    for col in ("scenario", "flood's answers", "TTFT p50", "max", "queued p50", "longest gap",
                "step", "before token", "TTFT goal", "gap goal"):
        t.add_column(col, justify="left" if col in ("scenario", "flood's answers") else "right")
    for name in ("idle", *SCENARIOS):
        r = result.get(name)
        if r is None:
            continue
        flood = ", ".join(f"{n} x {code}" for code, n in sorted(r.get("flood_answers", {}).items()))
        t.add_row(name, flood or "-", s(r["ttft_p50_s"]), s(r["ttft_max_s"]),
                  s(r["kvbank_queue_p50_s"]), s(r["gap_max_s"]), s(r["step_median_s"]),
                  s(r["gap_max_before_token"], ""), met(r.get("ttft_met")), met(r.get("gap_met")))
    console = Console(stderr=stderr)
    if not console.is_terminal:  # a log file or a pipe: do not squeeze to 80 columns
        console = Console(stderr=stderr, width=150)
    console.print(t)
    console.print("goals: TTFT (the slowest probe) within 3x idle and idle + 2 s; the longest "
                  "gap under 1.5 s and within 3x the median step", markup=False)
    for e in result.get("errors", []):
        console.print(f"error: {e}", markup=False)
    console.print(footer(result), markup=False)


def run(*, model: str | None, scenarios: list[str], probes: int, rounds: int,
        probe_tokens: int, long_prompt_tokens: int, stack_dir: Path | None = None) -> dict:
    from kvbank.apps.bench.report import provenance
    from kvbank.deploy.local import LocalStack
    from kvbank.models import prepare_model

    t0 = time.monotonic()
    model_dir = prepare_model(model)
    with tempfile.TemporaryDirectory(prefix="kvbank-bench-tenants-") as tmp:
        keys = Path(tmp) / "keys"
        keys.write_text(f"flood {FLOOD_KEY}\nprobe {PROBE_KEY}\n")
        stack = LocalStack.start(model_dir, Path(tmp) / "data", extra=[
            "--api-keys-file", str(keys), "--admin-key", OPERATOR_KEY],
            checkout=stack_dir)
        try:
            bench = Bench(stack, probe_tokens, long_prompt_tokens)
            bench.probe(1)  # warm: the first request's kernels and allocations
            samples: dict[str, list[Probe]] = {"idle": []}
            floods: dict[str, Counter] = {}
            errors: list[str] = []
            for _ in range(rounds):
                for scenario in scenarios:
                    samples["idle"] += bench.probe(probes)
                    try:
                        got, seen = bench.during(scenario, probes)
                    except Exception as e:  # one scenario's failure is a finding, not the end
                        errors.append(f"{scenario}: {type(e).__name__}: {e}"[:300])
                        continue
                    samples.setdefault(scenario, []).extend(got)
                    floods.setdefault(scenario, Counter()).update(seen)
        finally:
            stack.stop()
    return {"model": model_dir.name, **report(samples, floods), "errors": errors,
            "rounds": rounds,
            "probes_per_round": probes, "probe_tokens": probe_tokens,
            "long_prompt_tokens": long_prompt_tokens, "stack_dir": str(stack_dir or "."),
            "load_average": [round(x, 1) for x in os.getloadavg()],
            "cpu_pressure_some_avg300": _cpu_pressure(),
            "wall_s": round(time.monotonic() - t0),
            **provenance()}


class Probe:
    """One probe request as its client saw it: when it was sent, its token events' times."""

    def __init__(self, sent: float, times: list[float], status: int, refusals: int = 0,
                 usage: dict | None = None):
        self.sent, self.times, self.status, self.refusals = sent, times, status, refusals
        self.usage = usage or {}  # kvbank's own: queue_s (router and worker), ttft_s

    @property
    def ttft(self) -> float:
        return self.times[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]


class Bench:
    def __init__(self, stack, probe_tokens: int, long_prompt_tokens: int):
        self.stack, self.url = stack, stack.shim_url
        self.probe_tokens, self.long_prompt_tokens = probe_tokens, long_prompt_tokens
        self.n = 0

    # -- the probe -------------------------------------------------------------------------

    def probe(self, n: int) -> list[Probe]:
        """`n` probe requests, one after another. A refusal (429, 503) is retried after its
        Retry-After, as the OpenAI SDKs do: the probe's TTFT counts from its first try."""
        out = []
        with httpx.Client(timeout=600, headers={"authorization": f"Bearer {PROBE_KEY}"}) as c:
            for _ in range(n):
                self.n += 1
                body = {"model": "kvbank", "stream": True, "max_tokens": self.probe_tokens,
                        "temperature": 0, "stream_options": {"include_usage": True},
                        "messages": [{"role": "user", "content":
                                      f"Note {self.n}: say hello to the team in one sentence."}]}
                sent, times, refusals, usage = time.monotonic(), [], 0, {}
                while True:
                    with c.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
                        for line in r.iter_lines():
                            if line.startswith("data: {") and _content(line[6:]):
                                times.append(time.monotonic())
                            elif line.startswith("data: {") and '"usage":{' in line:
                                usage = json.loads(line[6:])["usage"].get("kvbank", {})
                    if r.status_code not in (429, 503) or refusals >= 20:
                        break
                    refusals += 1
                    time.sleep(min(10.0, float(r.headers.get("retry-after", 1))))
                if r.status_code == 200 and times:
                    out.append(Probe(sent, times, r.status_code, refusals, usage))
        return out

    # -- the floods ------------------------------------------------------------------------

    def during(self, scenario: str, probes: int) -> tuple[list[Probe], Counter]:
        """The probes, sent while `scenario`'s flood runs; and the flood's answers by status.
        The flood is a process of its own (`flood`): in this one its threads' JSON and HTTP
        work would hold the probe's client back and be measured as the server's."""
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        stop, started, counts = ctx.Event(), ctx.Event(), ctx.Queue()
        proc = ctx.Process(target=flood, args=(self.url, scenario, self.long_prompt_tokens,
                                               stop, started, counts), daemon=True)
        proc.start()
        seen = Counter()
        try:
            self._in_effect(scenario, started)
            return self.probe(probes), seen
        finally:
            stop.set()
            try:  # its counts so far, then it goes: its connections close, and the shim
                while True:  # cancels what they waited for
                    last = counts.get(timeout=2)
                    seen.clear()
                    seen.update(last)
            except queue.Empty:
                pass
            proc.kill()
            proc.join(timeout=60)
            self._idle()

    def _load(self) -> dict:
        """The stack's load (/v1/loads), asked again while the router is too busy to say."""
        while True:
            got = httpx.get(self.url + "/v1/loads", timeout=30).json()
            if "loads" in got:
                return got["loads"][0]
            time.sleep(0.2)

    def _in_effect(self, scenario: str, started: threading.Event) -> None:
        """Until the flood holds what it takes: its share of the slots (and a queue) for the
        long ones; its first answer for the others."""
        deadline = time.monotonic() + 600
        if scenario in ("long", "full_queue"):
            want_waiting = 30 if scenario == "full_queue" else 10
            while time.monotonic() < deadline:
                load = self._load()
                if load["num_running_reqs"] >= 3 and load["num_waiting_reqs"] >= want_waiting:
                    return
                time.sleep(0.1)
            raise RuntimeError(f"{scenario}: the flood never filled its share")
        if scenario == "slow_schema":
            time.sleep(1.0)  # the first compile is under way: its request is on a thread
            return
        if not started.wait(600):
            raise RuntimeError(f"{scenario}: the flood got no answer")

    def _idle(self) -> None:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            load = self._load()
            if load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0:
                return
            time.sleep(0.2)

def flood(url: str, scenario: str, long_prompt_tokens: int, stop, started, counts) -> None:
    """The flooding tenant (a process of its own): its senders, each sending again as soon as
    it is answered, until `stop`; then its answers by status on `counts`. Bodies are made
    once, so the flood spends its time sending, not serializing."""
    import concurrent.futures

    bodies = Bodies(long_prompt_tokens)
    senders, make = {"long": (20, bodies.long), "full_queue": (48, bodies.long_answer),
                     "big_prompts": (8, bodies.big_prompt), "big_schema": (1, bodies.big_schema),
                     "slow_schema": (2, bodies.slow_schema)}[scenario]
    seen, lock = Counter(), threading.Lock()
    clients = [httpx.Client(timeout=900, headers={"authorization": f"Bearer {FLOOD_KEY}",
                                                  "content-type": "application/json"})
               for _ in range(senders)]

    def send(c: httpx.Client) -> None:
        while not stop.is_set():
            try:
                status = c.post(url + "/v1/chat/completions", content=make()).status_code
            except Exception as e:  # httpx's
                status = type(e).__name__
            with lock:
                seen[str(status)] += 1
            started.set()
            if status == 429:  # its share is full: again soon, not in a spin
                stop.wait(0.2)

    pool = concurrent.futures.ThreadPoolExecutor(senders)
    for c in clients:
        pool.submit(send, c)
    while not stop.wait(1.0):  # its counts every second; the bench kills it when done
        with lock:
            counts.put(dict(seen))
    with lock:
        counts.put(dict(seen))


class Bodies:
    """The flood's request bodies, as JSON bytes."""

    def __init__(self, long_prompt_tokens: int):
        self.long_prompt_tokens = long_prompt_tokens
        self.rng = random.Random(os.getpid())
        self._big_prompt = _body({"max_tokens": 16, "messages": [
            {"role": "user", "content": "word " * 800_000}]})  # 4 MB
        self._big_schema = _body({"max_tokens": 16, "messages": [
            {"role": "user", "content": "Fill it in."}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "big", "schema": {
                "type": "object", "properties": {
                    f"field_{i}": {"type": "string", "enum": [f"v{i}_{j}" for j in range(3)]}
                    for i in range(15000)}}}}})  # 1.1 MB

    def _text(self, tokens: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(tokens))

    def long(self) -> bytes:  # a prompt of its own: nothing cached
        return _body({"max_tokens": 256, "temperature": 0, "messages": [
            {"role": "user", "content": self._text(self.long_prompt_tokens)}]})

    def long_answer(self) -> bytes:
        return _body({"max_tokens": 1024, "temperature": 0, "messages": [
            {"role": "user", "content": self._text(64) + " Tell a very long story."}]})

    def big_prompt(self) -> bytes:
        return self._big_prompt

    def big_schema(self) -> bytes:
        return self._big_schema

    def slow_schema(self) -> bytes:
        salt = self.rng.randrange(1 << 30)  # a new schema each time: no compile is kept
        return _body({"max_tokens": 16, "messages": [
            {"role": "user", "content": "Fill it in."}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "slow", "schema": {
                "type": "object", "properties": {
                    f"f{salt}_{i}": {"type": "string"} for i in range(5000)}}}}})  # 170 KB


def _body(body: dict) -> bytes:
    return json.dumps({"model": "kvbank", **body}).encode()


def _cpu_pressure() -> float | None:
    """The share of the last 5 minutes some task waited for a CPU (Linux PSI): what else on
    the machine took the cores from the stack while it was measured."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return float(dict(kv.split("=") for kv in line.split()[1:])["avg300"])
    except (OSError, ValueError, KeyError, IndexError):
        return None


def _content(data: str) -> bool:
    """A chunk that carries answer text (not the role's opening, not the usage)."""
    try:
        choices = json.loads(data).get("choices") or [{}]
    except ValueError:
        return False
    return bool((choices[0].get("delta") or {}).get("content"))


def report(samples: dict[str, list[Probe]], floods: dict[str, Counter]) -> dict:
    """Per scenario: the probe's TTFT (p50, max) and its gaps (median step, longest), against
    the idle case; each goal met or not."""
    def stats(probes: list[Probe]) -> dict:
        ttfts = sorted(p.ttft for p in probes)
        gaps = [g for p in probes for g in p.gaps]
        queued = sorted(p.usage.get("queue_s", 0.0) for p in probes)
        served = sorted(p.usage.get("ttft_s", 0.0) for p in probes)
        return {"probes": len(probes), "refused_first": sum(p.refusals for p in probes),
                "kvbank_queue_p50_s": round(statistics.median(queued), 3) if queued else None,
                "kvbank_ttft_p50_s": round(statistics.median(served), 3) if served else None,
                "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
                "ttft_max_s": round(ttfts[-1], 3) if ttfts else None,
                "step_median_s": round(statistics.median(gaps), 4) if gaps else None,
                "gap_max_s": round(max(gaps), 3) if gaps else None,
                # which token the longest gap came before (2: the gap after the first token)
                "gap_max_before_token": max(((g, i + 2) for p in probes
                                             for i, g in enumerate(p.gaps)),
                                            default=(0, None))[1]}

    idle = stats(samples["idle"])
    out = {"idle": idle}
    for scenario, probes in samples.items():
        if scenario == "idle":
            continue
        s = stats(probes)
        if s["ttft_max_s"] is not None and idle["ttft_p50_s"]:
            bound = min(3 * idle["ttft_p50_s"], idle["ttft_p50_s"] + 2.0)
            s["ttft_goal_s"] = round(bound, 3)
            s["ttft_vs_idle"] = round(s["ttft_p50_s"] / idle["ttft_p50_s"], 2)
            s["ttft_met"] = s["ttft_max_s"] <= bound
            s["gap_met"] = (s["gap_max_s"] < 1.5
                            and s["gap_max_s"] <= 3 * max(s["step_median_s"], 1e-9))
        s["flood_answers"] = dict(floods.get(scenario, {}))
        out[scenario] = s
    return out
