"""Prefetch: an agent in a tool call will come back; a hint brings its KV from SSD into RAM
first, so the returning turn reads RAM (the real stack, the tiny model, the openai SDK and
plain HTTP for the hint, which no SDK knows)."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest

from kvbank.v1 import api_pb2
from tests.conftest import start_stack
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def hinted(tiny_model, tmp_path_factory, cache_dir):
    s = start_stack(tiny_model, tmp_path_factory.mktemp("prefetch") / "data",
                    cache_dir=cache_dir)
    yield s
    s.stop()


def _chat(stack, messages, **kw):
    c = openai.OpenAI(base_url=stack.shim_url + "/v1", api_key="none", max_retries=0)
    return c.chat.completions.create(model="kvbank", messages=messages, max_tokens=6,
                                     temperature=0, **kw)


def _hint(stack, body: dict, headers: dict | None = None) -> dict:
    r = httpx.post(stack.shim_url + "/v1/kvbank/prefetch", json=body, headers=headers or {},
                   timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _cold(stack, session_id: str) -> None:
    """The conversation on SSD only, as after its agent's long tool call."""
    with stack.client() as c:
        c.flush()
        c.release(session_id, write_out=True)
        assert c.get_session(session_id).state == "cold"


@pytest.mark.parametrize("named", [True, False], ids=["named", "anonymous"])
def test_a_hinted_conversation_comes_back_from_ram(hinted, named):
    messages = [{"role": "user", "content": f"[{uuid.uuid4().hex}] Run the tests."}]
    headers = {"x-session-id": f"agent-{uuid.uuid4().hex[:8]}"} if named else {}
    t1 = _chat(hinted, messages, extra_headers=headers)
    session = t1.usage.model_extra["kvbank"]["session_id"]
    messages.append({"role": "assistant", "content": t1.choices[0].message.content})
    _cold(hinted, session)
    # The agent starts its tool call and says it will be back: by name, or by what it sends.
    report = _hint(hinted, {} if named else {"messages": messages}, headers)
    assert report["status"] == "restored" and report["restored_tokens"] > 0, report
    with hinted.client() as c:
        assert c.get_session(session).state == "resident-clean"
    assert _hint(hinted, {} if named else {"messages": messages}, headers)["status"] == "in_ram"
    messages.append({"role": "user", "content": "All 12 passed."})
    t2 = _chat(hinted, messages, extra_headers=headers)
    usage = t2.usage.model_extra["kvbank"]
    assert usage["cache_source"] == "ram" and usage["recomputed_tokens"] == 0
    assert t2.usage.prompt_tokens_details.cached_tokens >= t1.usage.prompt_tokens


def test_a_hint_stays_live_while_the_agent_is_away(hinted):
    """Hinted while its KV was still in RAM, then pushed out (here by a release): the worker
    reads it back by itself once there is room, before the agent returns."""
    name = f"agent-{uuid.uuid4().hex[:8]}"
    headers = {"x-session-id": name}
    messages = [{"role": "user", "content": f"[{uuid.uuid4().hex}] Build it."}]
    t1 = _chat(hinted, messages, extra_headers=headers)
    with hinted.client() as c:
        c.flush()
    assert _hint(hinted, {}, headers)["status"] == "in_ram"
    with hinted.client() as c:
        c.release(name, write_out=True)
        wait_until(lambda: c.get_session(name).state == "resident-clean", timeout_s=30,
                   what="the hinted conversation back in RAM")
    messages += [{"role": "assistant", "content": t1.choices[0].message.content},
                 {"role": "user", "content": "Built."}]
    assert _chat(hinted, messages, extra_headers=headers).usage.model_extra[
        "kvbank"]["cache_source"] == "ram"


def test_a_deleted_conversation_is_not_brought_back(hinted):
    name = f"agent-{uuid.uuid4().hex[:8]}"
    headers = {"x-session-id": name}
    _chat(hinted, [{"role": "user", "content": f"[{uuid.uuid4().hex}] x"}],
          extra_headers=headers)
    _cold(hinted, name)
    assert _hint(hinted, {}, headers)["status"] == "restored"
    with hinted.client() as c:
        c.release(name, write_out=True)
        c.sessions.Delete(api_pb2.DeleteSessionRequest(session_id=name), timeout=10)
        c.trim()  # a later turn of the engine's loop: still no entry for it
        assert all(s.session_id != name for s in c.list_sessions())
        assert c.status().bank_entries == sum(1 for s in c.list_sessions()
                                              if s.state.startswith("resident"))


def test_without_a_hint_the_same_return_reads_ssd(hinted):
    messages = [{"role": "user", "content": f"[{uuid.uuid4().hex}] Run the tests."}]
    t1 = _chat(hinted, messages)
    _cold(hinted, t1.usage.model_extra["kvbank"]["session_id"])
    messages += [{"role": "assistant", "content": t1.choices[0].message.content},
                 {"role": "user", "content": "All 12 passed."}]
    assert _chat(hinted, messages).usage.model_extra["kvbank"]["cache_source"] == "ssd"


def test_a_hint_for_what_kvbank_does_not_hold_changes_nothing(hinted):
    assert _hint(hinted, {"session_id": f"never-{uuid.uuid4().hex}"})["status"] == "unknown"
    fresh = [{"role": "user", "content": f"[{uuid.uuid4().hex}] hello"}]
    assert _hint(hinted, {"messages": fresh})["status"] == "unknown"
    r = httpx.post(hinted.shim_url + "/v1/kvbank/prefetch", json={}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id"


def test_a_hint_that_cannot_fit_leaves_ram_alone(tiny_model, tmp_path, cache_dir):
    """With a bank too small for the conversation, the hint says so and leaves RAM alone."""
    s = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir,
                    extra=["--bank-bytes", "20000"])
    try:
        name = f"big-{uuid.uuid4().hex[:8]}"
        messages = [{"role": "user", "content": f"[{uuid.uuid4().hex}] " + "word " * 80}]
        _chat(s, messages, extra_headers={"x-session-id": name})
        _cold(s, name)
        report = _hint(s, {"session_id": name})
        assert report["status"] == "no_room" and report["ssd_tokens"] > 0, report
        with s.client() as c:
            assert c.get_session(name).state == "cold"
    finally:
        s.stop()


def test_the_agent_whose_tool_call_started_first_gets_ram_first(tiny_model, tmp_path,
                                                                  cache_dir):
    """RAM for one conversation, two agents in tool calls. Agent A hints first (its call
    started first, so it ends first): at the hint B holds RAM, just used and with no hint, so A
    waits. Once B hints too, B will be back later than A, and B is on SSD already: A takes its
    place. Both return with nothing recomputed, A from RAM."""
    one_conversation = 180 * 512  # the tiny model's 512 bytes a token; each context ~120
    s = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir,
                    extra=["--bank-bytes", str(one_conversation)])
    try:
        agents = {n: (f"{n}-{uuid.uuid4().hex[:8]}",
                      [{"role": "user", "content": f"[{uuid.uuid4().hex}] " + "step " * 80}])
                  for n in "ab"}
        for name, messages in agents.values():
            t = _chat(s, messages, extra_headers={"x-session-id": name})
            messages.append({"role": "assistant", "content": t.choices[0].message.content})
            s.wait_durable(name)
        (a, a_messages), (b, b_messages) = agents["a"], agents["b"]
        _cold(s, a)
        with s.client() as c:
            assert c.get_session(b).state == "resident-clean"

        assert _hint(s, {"session_id": a})["status"] == "no_room"  # B was just used
        assert _hint(s, {"session_id": b})["status"] == "in_ram"
        with s.client() as c:
            wait_until(lambda: c.get_session(a).state == "resident-clean", timeout_s=30,
                       what="A read back in B's place")
            assert c.get_session(b).state == "cold"
            evictions = [json.loads(e) for e in c.status().recent_evictions_json]
            assert any(e["reason"] == "prefetch" and e["session_id"] == b and e["durable"]
                       for e in evictions), evictions

        for name, messages, source in ((a, a_messages, "ram"), (b, b_messages, "ssd")):
            messages.append({"role": "user", "content": "Done."})
            usage = _chat(s, messages, extra_headers={"x-session-id": name}).usage
            k = usage.model_extra["kvbank"]
            assert k["cache_source"] == source and k["recomputed_tokens"] == 0, (name, k)
    finally:
        s.stop()
