"""Several stacks behind the real SGLang Model Gateway (SMG, PyPI `smg`), on loopback, tiny model.

SMG takes KV events only from gRPC workers; in front of kvbank's OpenAI shims (HTTP workers)
it routes by its own approximate prefix tree of the request text (`--policy cache_aware`, its
default), or sticky by the `X-SMG-Routing-Key` header (`--policy consistent_hashing` or
`manual`), which it forwards and kvbank takes as the session name. It does not forward
`x-session-id`. It retries a 5xx answer (kvbank's 503 while a stack's worker restarts) on
another worker (`--retry-max-retries`, 5).

Which stack served a turn is read from the stacks' own event logs (each committed turn is a
`kv_resident` event naming its conversation and its length), and checked against the
`x-smg-routed-worker-id` header SMG adds to each answer.

The three stacks are started once for the module; each test starts its own SMG in front of
them (about a second). The test extra installs SMG; missing, the tests fail and say so.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import matrix

from kvbank.deploy import cluster
from kvbank.deploy.local import LocalStack
from tests.served import served_by
from tests.waiting import wait_until

SMG_REQUIREMENT = "smg==1.13.0"  # the version these tests were written and measured against
SYSTEM = ("You are a coding agent. Read the task, plan the change, edit the files, run the "
          "tests, and report what you did. ") * 8
THINK_S = 0.3  # an agent's tool call between turns
STACK_FLAGS = ["--block-tokens", "16", "--quiet-grace-s", "0.1", "--tail-delay-s", "0"]
N_STACKS = 3
SMG_STOP_S = 20.0  # started with no shutdown grace, it exits at once
ROUTED_HEADER = "x-smg-routed-worker-id"


# -- SMG ---------------------------------------------------------------------------------


def find_smg() -> str:
    """The `smg` program next to this Python (a venv's bin/), else on PATH; fails the test
    naming the install command when there is none (never a skip)."""
    beside = Path(sys.executable).parent / "smg"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("smg")
    if found is None:
        pytest.fail(f"SMG (the SGLang Model Gateway) is not installed: pip install "
                    f"'{SMG_REQUIREMENT}' (the test extra installs it)", pytrace=False)
    return found


@dataclass
class Gateway:
    proc: subprocess.Popen
    url: str
    metrics_url: str
    log: Path
    argv: list[str]

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return "(no log)"

    def series(self, name: str) -> dict[str, float]:
        """Every series of one of SMG's metrics: its labels -> its value."""
        text = httpx.get(self.metrics_url, timeout=10).text
        return {line.rsplit(" ", 1)[0][len(name):]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith(name + "{") or line.startswith(name + " ")}

    def metric(self, name: str) -> float:
        """The sum of every series of one of SMG's counters."""
        return sum(self.series(name).values())

    def ready_workers(self) -> list[str]:
        try:
            r = httpx.get(f"{self.url}/workers", timeout=2)
            workers = r.json()["workers"] if r.status_code == 200 else []
        except (httpx.HTTPError, ValueError, KeyError):
            return []
        return [w["url"] for w in workers if w.get("is_healthy") and w.get("status") == "ready"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=SMG_STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_smg(stacks: list[LocalStack], log_dir: Path, policy: str,
              extra: list[str] = ()) -> Gateway:
    """`smg launch` in front of the stacks' shims, on loopback; returns once SMG lists every
    stack as a healthy, ready worker. Fails the test with SMG's log if it does not."""
    smg = find_smg()
    port, metrics_port = cluster.free_ports(2)
    argv = [smg, "launch", "--host", cluster.LOOPBACK, "--port", str(port),
            "--worker-urls", *[s.shim_url for s in stacks], "--policy", policy,
            "--prometheus-host", cluster.LOOPBACK, "--prometheus-port", str(metrics_port),
            "--shutdown-grace-period-secs", "0",  # a test stops it with nothing in flight
            *extra]
    log = log_dir / f"smg-{policy}-{port}.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "NO_COLOR": "1"}, **cluster.popen_kwargs())
    gw = Gateway(proc, f"http://{cluster.LOOPBACK}:{port}",
                 f"http://{cluster.LOOPBACK}:{metrics_port}/metrics", log, argv)
    deadline = time.monotonic() + 60
    while len(gw.ready_workers()) < len(stacks):
        if proc.poll() is not None or time.monotonic() > deadline:
            gw.stop()
            pytest.fail(f"SMG did not start with {len(stacks)} ready workers: {argv}; the end of "
                        f"{log}:\n{gw.log_tail()}", pytrace=False)
        time.sleep(0.2)
    return gw


@pytest.fixture
def gateway(stacks, tmp_path):
    """Starts SMG (`gateway(policy, *flags)`); every one started is stopped at the end."""
    started: list[Gateway] = []

    def start(policy: str, *extra: str) -> Gateway:
        started.append(start_smg(stacks, tmp_path, policy, list(extra)))
        return started[-1]

    yield start
    for gw in started:
        gw.stop()


# -- the stacks ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stacks(tiny_model, cache_dir, tmp_path_factory):
    """Three `kvbank up` stacks on the tiny model, started together, each its own data dir;
    stopped together at the end of the module."""
    find_smg()  # before a minute of start-up
    base = tmp_path_factory.mktemp("smg-stacks")
    env = {"KVBANK_CACHE_DIR": str(cache_dir)}
    started: list[LocalStack] = []
    try:
        for i in range(N_STACKS):
            started.append(LocalStack.start(tiny_model, base / f"stack-{i}", extra=STACK_FLAGS,
                                            env=env, wait=False, popen=cluster.popen_kwargs()))
        deadline = time.monotonic() + 240
        for i, s in enumerate(started):
            s.wait_started(max(1.0, deadline - time.monotonic()))
            while not cluster.http_ok(f"{s.shim_url}/health"):
                assert s.proc.poll() is None and time.monotonic() < deadline, \
                    f"stack {i}'s OpenAI API is not healthy; the end of {s.log}:\n{s.log_tail()}"
                time.sleep(0.2)
        yield started
    finally:
        for s in started:
            if s.proc.poll() is None:
                s.proc.send_signal(signal.SIGTERM)
        for s in started:
            s.stop()


# -- agents ----------------------------------------------------------------------------------


def task(i: int) -> str:
    """Agent i's own task: a few hundred tokens, as a coding agent's first prompt is. Its
    first prompt names an anonymous conversation, so each test uses agents of its own: 0-9,
    10-19, ... (the same length each: six turns stay in the tiny model's context)."""
    tag, j = "abcdefghij"[i // 10], i % 10
    return f"Task {tag}{j}. " + " ".join(
        f"In module_{j}/file_{k}.py the function handle_{j}_{k} returns "
        f"{j * 31 + k} instead of {j * 37 + k}; fix it." for k in range(12))


def tool_result(i: int, t: int) -> str:
    """What a tool returned: a file's lines, about a hundred tokens."""
    j = i % 10
    return "\n".join(f"{n:4d}  value_{j}_{t}_{n} = compute({j}, {t}, {n})" for n in range(12))


@dataclass
class Turn:
    agent: int
    turn: int
    session_id: str
    tokens: int  # the conversation's length after the turn
    prompt: int
    cached: int
    routed_to: str  # SMG's x-smg-routed-worker-id: the worker's URL


def first_messages(i: int, system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": task(i)}]


def one_turn(client: openai.OpenAI, i: int, t: int, messages: list[dict]) -> Turn:
    """Agent i's turn t: sends its history, adds the answer and the next tool result to it."""
    raw = client.chat.completions.with_raw_response.create(
        model="kvbank", messages=messages, max_tokens=8, temperature=0)
    r = raw.parse()
    usage = r.model_dump()["usage"]
    messages += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": tool_result(i, t)}]
    return Turn(i, t, usage["kvbank"]["session_id"],
                usage["prompt_tokens"] + usage["completion_tokens"], usage["prompt_tokens"],
                usage["prompt_tokens_details"]["cached_tokens"], raw.headers.get(ROUTED_HEADER, ""))


def agent(client: openai.OpenAI, i: int, turns: int, out: list, errors: list) -> None:
    """One agent: a shared system prompt, its own task, its history sent back each turn."""
    messages = first_messages(i)
    try:
        for t in range(turns):
            out.append(one_turn(client, i, t, messages))
            time.sleep(THINK_S)  # the tool runs
    except Exception as e:  # reported by the test, not lost in a thread
        errors.append(f"agent {i}: {e!r}")


def by_agent(stacks: list[LocalStack], turns: list[Turn]) -> dict[int, list[tuple[int, Turn]]]:
    """Each agent's turns in order, each with the stack (index) whose event log has it; checks
    that SMG's header names the same stack."""
    wait_until(lambda: all(served_by(stacks).get((t.session_id, t.tokens)) for t in turns),
               "every turn in some stack's event log", timeout_s=30)
    where = served_by(stacks)
    urls = [s.shim_url for s in stacks]
    out: dict[int, list[tuple[int, Turn]]] = {}
    for t in sorted(turns, key=lambda t: (t.agent, t.turn)):
        (stack,) = where[(t.session_id, t.tokens)]
        assert t.routed_to == urls[stack], (t, urls)
        out.setdefault(t.agent, []).append((stack, t))
    return out


# -- the tests ---------------------------------------------------------------------------------


# SMG's spill gate, lowered: a stack that holds a prompt's prefix is passed over for the least
# loaded one when it runs more than one request above the mean (SMG's defaults, 64 and 1.5x,
# never spill at a few agents per stack).
SPILL = ["--balance-abs-threshold", "1", "--balance-rel-threshold", "1.0"]


def test_anonymous_agents_behind_cache_aware(stacks, gateway):
    """Six agents with no session name (the openai SDK's defaults) behind SMG's cache_aware
    policy with its defaults, one turn at a time: every returning turn reaches the stack that
    served the agent's previous turn and finds its whole history cached there.

    Each agent has a system prompt of its own here. Agents that share one (half of a first
    prompt) all land on ONE stack: SMG's tree matches the shared part above --cache-threshold
    (0.3) and pins each new agent to the stack that served the first (smg 1.13.0: 9 of 9
    runs). Sent together, its spill gate lowered to one request above the mean, it spread them
    over two or three stacks and moved a few returning turns to the least loaded one: a load
    trade that depends on timing, so not asserted here. One turn at a time there is no load to
    weigh, and where a turn goes says only what SMG's tree holds."""
    gw = gateway("cache_aware")
    client = openai.OpenAI(base_url=gw.base_url, api_key="none")
    agents = range(6)
    messages = {i: first_messages(i, f"You are agent {i}. {SYSTEM}") for i in agents}
    turns = [one_turn(client, i, t, messages[i]) for t in range(6) for i in agents]
    seqs = by_agent(stacks, turns)
    summary = {i: [s for s, _ in seq] for i, seq in seqs.items()}
    assert len({s for seq in summary.values() for s in seq}) >= 2, \
        f"every conversation on one stack: nothing was routed: {summary}"
    moved = {i: seq for i, seq in summary.items() if len(set(seq)) > 1}
    assert moved == {}, f"agents whose returning turns left their stack: {moved}"
    for i, seq in seqs.items():
        for (_, before), (_, t) in zip(seq, seq[1:]):
            assert t.cached >= before.prompt, (i, before, t)
    assert all(s.proc.poll() is None for s in stacks)


@pytest.mark.parametrize("policy", matrix(["consistent_hashing", "manual"], keep=("consistent_hashing",)))
def test_routing_key_is_sticky_and_names_the_session(stacks, gateway, policy):
    """`X-SMG-Routing-Key`: every turn with one key reaches one stack, which keeps the
    conversation under that name (its session list has it) and finds its history cached;
    `x-session-id`, which SMG does not forward, names nothing behind it."""
    gw = gateway(policy)
    client = openai.OpenAI(base_url=gw.base_url, api_key="none")
    keys = [f"{policy}-{uuid.uuid4().hex[:8]}-{k}" for k in range(12)]
    where: dict[str, set[int]] = {}
    urls = [s.shim_url for s in stacks]
    for k, key in enumerate(keys):
        messages = [{"role": "user", "content": task(30 + k % 10)}]
        prev_prompt = 0
        for t in range(3):
            raw = client.chat.completions.with_raw_response.create(
                model="kvbank", messages=messages, max_tokens=4, temperature=0,
                extra_headers={"X-SMG-Routing-Key": key})
            r = raw.parse()
            usage = r.model_dump()["usage"]
            assert usage["kvbank"]["session_id"] == key, usage
            assert usage["prompt_tokens_details"]["cached_tokens"] >= prev_prompt, (key, t, usage)
            prev_prompt = usage["prompt_tokens"]
            where.setdefault(key, set()).add(urls.index(raw.headers[ROUTED_HEADER]))
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": tool_result(k, t)}]
    assert all(len(s) == 1 for s in where.values()), f"a key moved between stacks: {where}"
    # 12 keys on one stack of three by chance: 3 * (1/3)**12, under one in 100,000
    assert len({s for v in where.values() for s in v}) >= 2, f"every key on one stack: {where}"
    for i, stack in enumerate(stacks):
        with stack.client() as c:
            names = {s.session_id for s in c.list_sessions()}
        assert {key for key, (s,) in where.items() if s == i} <= names, (i, where, names)
        assert not {key for key, (s,) in where.items() if s != i} & names, (i, where, names)
    # SMG forwards X-SMG-Routing-Key, not x-session-id: behind it, x-session-id names nothing
    name = f"not-forwarded-{uuid.uuid4().hex[:8]}"
    r = client.chat.completions.create(model="kvbank", max_tokens=4, temperature=0,
                                       messages=[{"role": "user", "content": task(40)}],
                                       extra_headers={"x-session-id": name})
    assert r.model_dump()["usage"]["kvbank"]["session_id"].startswith("~"), r.usage


def test_a_killed_worker_fails_no_request(stacks, gateway):
    """kill -9 of one stack's worker while three agents run: SMG retries what that stack
    refuses (503 while its worker restarts) on another, and no client request fails (the
    client makes no retries of its own)."""
    gw = gateway("cache_aware", *SPILL)
    client = openai.OpenAI(base_url=gw.base_url, api_key="none", max_retries=0)
    turns: list[Turn] = []
    errors: list[str] = []
    threads = [threading.Thread(target=agent, args=(client, i, 6, turns, errors))
               for i in (20, 21, 22)]  # agents of its own (task)
    for t in threads:
        t.start()
    wait_until(lambda: len(turns) >= 5, "a few turns before the kill")
    victim = stacks[[s.shim_url for s in stacks].index(turns[-1].routed_to)]
    # A test seam: the victim's supervisor is paused, so its worker stays dead until a request
    # has met it (the supervisor restarts a worker that had served within 0.1 s, which a
    # request may or may not fall into), then goes on and restarts it.
    victim.proc.send_signal(signal.SIGSTOP)
    try:
        old = victim.kill9("worker")
        wait_until(lambda: gw.metric("smg_worker_retries_total") > 0,
                   "a request to meet the dead worker")
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    for t in threads:
        t.join(600)
    assert errors == [], errors
    assert len(turns) == 18
    retries = gw.metric("smg_worker_retries_total")
    upstream = {k: v for k, v in gw.series("smg_router_upstream_responses_total").items() if v}
    print(f"SMG retried {retries:.0f} times; the stacks answered {upstream}")
    victim.wait_restarted("worker", old, timeout_s=120)
