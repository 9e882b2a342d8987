"""Several stacks behind the real vllm-router (`--policy kv_aware`), on loopback, tiny model:
conversations sent with no session name go back to the stack that holds their KV.

Which stack served a turn is read from the stacks' own event logs: each committed turn is a
`kv_resident` event naming its conversation and its length.
"""

from __future__ import annotations

import re
import signal
import threading
import time

import httpx
import openai
import pytest

from kvbank.deploy import cluster
from tests.served import served_by
from tests.waiting import wait_until

SYSTEM = ("You are a coding agent. Read the task, plan the change, edit the files, run the "
          "tests, and report what you did. ") * 8
THINK_S = 0.3  # an agent's tool call between turns
STACK_FLAGS = ["--block-tokens", "16", "--quiet-grace-s", "0.1", "--tail-delay-s", "0"]


@pytest.fixture(scope="module")
def three_stacks(tiny_model, cache_dir, tmp_path_factory):
    """One cluster for the module: each test's agents have tasks of their own (a test that
    kills a worker waits for it to be back)."""
    cluster.find_router_bin()  # the test extra installs it; missing, this fails and says so
    c = cluster.ClusterStack.start(tiny_model, tmp_path_factory.mktemp("cluster"), stacks=3,
                                   extra=STACK_FLAGS, timeout_s=240,
                                   router_extra=["--log-level", "debug"],  # its decisions
                                   env={"KVBANK_CACHE_DIR": str(cache_dir)})
    yield c
    c.stop()


def task(i: int) -> str:
    """An agent's own task: a few hundred tokens, as a coding agent's first prompt is."""
    return " ".join(f"In module_{i}/file_{k}.py the function handle_{i}_{k} returns "
                    f"{i * 31 + k} instead of {i * 37 + k}; fix it." for k in range(12))


def tool_result(i: int, t: int) -> str:
    """What a tool returned: a file's lines, about a hundred tokens."""
    return "\n".join(f"{n:4d}  value_{i}_{t}_{n} = compute({i}, {t}, {n})" for n in range(12))


def agent(base_url: str, i: int, turns: int, out: list, errors: list) -> None:
    """One agent: a shared system prompt, its own task, its history sent back each turn."""
    client = openai.OpenAI(base_url=base_url, api_key="none")
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": task(i)}]
    try:
        for t in range(turns):
            r = client.chat.completions.create(model="kvbank", messages=messages, max_tokens=8,
                                               temperature=0)
            usage = r.model_dump()["usage"]
            out.append((i, t, usage["kvbank"]["session_id"],
                        usage["prompt_tokens"] + usage["completion_tokens"],
                        usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": tool_result(i, t)}]
            time.sleep(THINK_S)  # the tool runs
    except Exception as e:  # reported by the test, not lost in a thread
        errors.append(repr(e))


def router_idle(c: cluster.ClusterStack) -> bool:
    """vllm-router has no request in flight on any stack (its own gauge): the next choice
    weighs only what each stack holds."""
    text = httpx.get(f"http://127.0.0.1:{c.plan.prometheus_port}/metrics", timeout=10).text
    return all(float(line.rsplit(" ", 1)[1]) == 0 for line in text.splitlines()
               if line.startswith("vllm_router_running_requests"))


def router_log(c: cluster.ClusterStack) -> list[str]:
    """vllm-router's log lines, its colour codes taken out."""
    return [re.sub(r"\x1b\[[0-9;]*m", "", line)
            for line in c.router_log.read_text(errors="replace").splitlines()]


def batches_taken(c: cluster.ClusterStack, url: str) -> int:
    """How many batches of a stack's KV events vllm-router has applied (its debug log)."""
    return sum("sequence advanced" in line and f"source={url} " in line
               for line in router_log(c))


def test_anonymous_agents_return_to_the_stack_that_holds_their_kv(three_stacks):
    """Six agents with one system prompt, each begun on a stack of its own (its first turn
    sent to that stack's shim), then three turns each through vllm-router with no session
    name: every turn lands on the stack that holds its conversation and finds all of it
    cached there, though all three stacks hold the shared system prompt.

    The turns go one at a time, each once the router has none in flight: vllm-router 0.1.17's
    kv_aware weighs a busy holder's load against its cached prefix and moves some turns of
    agents sent together (its trade, not ours; `kvbank bench cluster` measures it, in
    docs/benchmarks.md). With no load to weigh, where a turn goes says only what the stacks
    announced."""
    c = three_stacks
    agents = range(6)
    messages = {i: [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task(i)}]
                for i in agents}
    holder: dict[int, int] = {}
    last_prompt: dict[int, int] = {}
    turns = []

    def send(base_url: str, i: int, t: int) -> int:
        """One turn of agent `i`; the stack that served it, once vllm-router has taken in a
        batch of that stack's KV events sent since the turn began."""
        before = [batches_taken(c, stack.shim_url) for stack in c.plan.stacks]
        r = openai.OpenAI(base_url=base_url, api_key="none").chat.completions.create(
            model="kvbank", messages=messages[i], max_tokens=8, temperature=0)
        usage = r.model_dump()["usage"]
        sid, n = usage["kvbank"]["session_id"], usage["prompt_tokens"] + usage["completion_tokens"]
        messages[i] += [{"role": "assistant", "content": r.choices[0].message.content},
                        {"role": "user", "content": tool_result(i, t)}]
        wait_until(lambda: (sid, n) in served_by(c.stacks), "the turn in a stack's event log")
        stack = stack_of(c, sid, n)
        url = c.plan.stacks[stack].shim_url
        wait_until(lambda: batches_taken(c, url) > before[stack],
                   "vllm-router to take the turn's KV events")
        if t:
            turns.append((i, t, holder[i], stack, last_prompt[i],
                          usage["prompt_tokens_details"]["cached_tokens"]))
        last_prompt[i] = usage["prompt_tokens"]
        return stack

    for i in agents:  # where each conversation begins: stack 0, 1, 2, 0, 1, 2
        holder[i] = send(f"{c.plan.stacks[i % 3].shim_url}/v1", i, 0)
        assert holder[i] == i % 3
    for t in range(1, 4):
        for i in agents:
            wait_until(lambda: router_idle(c), "vllm-router to finish the last turn")
            send(c.base_url, i, t)
    assert len(turns) == 18
    moved = [turn for turn in turns if turn[2] != turn[3]]
    assert moved == [], ("turns that left the stack holding them (agent, turn, holder, stack, "
                         f"last prompt, cached): {moved}")
    uncached = [turn for turn in turns if turn[5] < turn[4]]
    assert uncached == [], f"turns that did not find their history cached: {uncached}"
    assert c.dead() == []


def stack_of(c: cluster.ClusterStack, sid: str, n_tokens: int) -> int:
    (stack,) = served_by(c.stacks)[(sid, n_tokens)]
    return stack


def router_log_lines(c: cluster.ClusterStack) -> int:
    return len(router_log(c))


def router_sees_healthy(c: cluster.ClusterStack, url: str) -> bool:
    workers = httpx.get(f"{c.url}/workers", timeout=10).json()["workers"]
    return any(w["url"] == url and w["is_healthy"] for w in workers)


def router_took_restart(c: cluster.ClusterStack, url: str, after_line: int) -> bool:
    """vllm-router's debug log, past `after_line`: it saw the source's sequence start again (a
    new incarnation) and applied a batch of it. Each batch kvbank sends a new subscriber holds
    the whole state, so one applied is enough."""
    lines = router_log(c)[after_line:]
    restart = next((i for i, line in enumerate(lines)
                    if "restart seq" in line and url in line), None)
    return restart is not None and any("sequence advanced" in line and url in line
                                       for line in lines[restart + 1:])


def test_a_killed_worker_fails_no_request_and_its_conversations_go_on(three_stacks):
    """kill -9 of one stack's worker while agents run: the router retries what that stack
    could not answer on another, and every agent finishes."""
    c = three_stacks
    turns: list = []
    errors: list = []
    threads = [threading.Thread(target=agent, args=(c.base_url, i, 6, turns, errors))
               for i in (6, 8, 9)]  # agents of this test alone (7 is the next test's)
    for t in threads:
        t.start()
    wait_until(lambda: len(turns) >= 5, "a few turns before the kill")
    victim = c.stacks[stack_of(c, turns[-1][2], turns[-1][3])]

    def retries() -> float:
        text = httpx.get(f"http://127.0.0.1:{c.plan.prometheus_port}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm_router_retries_total"))

    # The path is taken: a request to the dead worker is retried on another stack. A test
    # seam: the victim's supervisor is paused, so its worker stays dead until one has (it
    # restarts a worker that had served within 0.1 s), then goes on and restarts it.
    victim.proc.send_signal(signal.SIGSTOP)
    try:
        old = victim.kill9("worker")
        wait_until(lambda: retries() > 0, "a request to meet the dead worker")
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    for t in threads:
        t.join(600)
    assert errors == [], errors
    assert len(turns) == 18
    victim.wait_restarted("worker", old, timeout_s=120)


def test_a_restarted_stack_gets_its_conversation_back_from_ssd(three_stacks):
    """A conversation only on one stack's SSD (its worker restarted, its RAM gone) is routed
    back to that stack, which announced its SSD blocks when it came back."""
    c = three_stacks
    client = openai.OpenAI(base_url=c.base_url, api_key="none")
    messages = [{"role": "user", "content": task(7)}]
    served = []
    for t in range(3):
        r = client.chat.completions.create(model="kvbank", messages=messages, max_tokens=8,
                                           temperature=0)
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": tool_result(7, t)}]
        usage = r.model_dump()["usage"]
        sid, n = usage["kvbank"]["session_id"], usage["prompt_tokens"] + usage["completion_tokens"]
        wait_until(lambda: (sid, n) in served_by(c.stacks), "the turn in a stack's event log")
        served.append(stack_of(c, sid, n))
    assert len(set(served)) == 1, f"one agent alone moved between stacks: {served}"
    holder = c.stacks[served[-1]]
    with holder.client() as g:
        wait_until(lambda: g.get_session(sid).durable_tokens == n, "the conversation on SSD",
                   timeout_s=60)
    url = c.plan.stacks[served[-1]].shim_url
    seen = router_log_lines(c)
    old = holder.kill9("worker")
    holder.wait_restarted("worker", old, timeout_s=120)
    # The router must know the stack is back before it can send the turn there: healthy by
    # its own checks, and the new worker's announcement (its SSD blocks) taken in.
    wait_until(lambda: router_sees_healthy(c, url), "vllm-router to mark the stack healthy",
               timeout_s=120)
    wait_until(lambda: router_took_restart(c, url, seen), "vllm-router to take the restarted "
               "worker's KV events", timeout_s=60)
    r = client.chat.completions.create(model="kvbank", messages=messages, max_tokens=8,
                                       temperature=0)
    after = r.model_dump()["usage"]
    assert after["kvbank"]["cache_source"] == "ssd", after
    assert after["prompt_tokens_details"]["cached_tokens"] >= n - 16, after
    assert c.stacks[stack_of(c, after["kvbank"]["session_id"],
                             after["prompt_tokens"] + after["completion_tokens"])] is holder
