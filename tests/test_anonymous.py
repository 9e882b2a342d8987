"""Conversations that come with no name (no `x-session-id`, no `user`), as most OpenAI clients
send them: found by their tokens, they get every tier and guarantee a named one gets.

Real processes, the official `openai` client with its defaults, the tiny test model (random:
the tests check token counts and cache sources, never text).
"""

from __future__ import annotations

import json
import uuid

import openai

from kvbank.coldstore.store import ColdStore
from tests.conftest import start_stack
from tests.waiting import wait_until

BLOCK_TOKENS = 16  # start_stack's --block-tokens
KV_BYTES_PER_TOKEN = 512  # the tiny model: 2 layers x 2 KV heads x 16 dims x float32 x (K, V)
SYSTEM = "You are a coding agent. " + " ".join(f"Rule {i}: read before you write." for i in range(25))


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.shim_url + "/v1", api_key="unused", max_retries=0)


class Agent:
    """One agent's conversation, sent whole every turn, as an OpenAI client does."""

    def __init__(self, client: openai.OpenAI, name: str, system: str = SYSTEM):
        self.client, self.name = client, name
        self.messages = [{"role": "system", "content": system}]
        self.turns: list = []  # each turn's usage

    def turn(self, text: str, max_tokens: int = 12):
        self.messages.append({"role": "user", "content": text})
        r = self.client.chat.completions.create(model="kvbank", messages=self.messages,
                                                max_tokens=max_tokens, temperature=0)
        self.messages.append({"role": "assistant", "content": r.choices[0].message.content})
        self.turns.append(r.usage)
        return r.usage

    @property
    def session_id(self) -> str:
        return self.turns[-1].model_extra["kvbank"]["session_id"]


def _tool_result(agent: str, turn: int) -> str:
    return f"[{agent} turn {turn}] tool output: " + " ".join(f"line {i} ok" for i in range(8))


def _events(stack) -> list[dict]:
    path = stack.layout.events_path
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_two_anonymous_agents_return_to_their_whole_conversation_from_ram_or_ssd(
        tiny_model, tmp_path, cache_dir):
    """At a bank that holds about one conversation, each agent's returning turn restores its
    previous prompt and answer (from SSD once RAM let it go), never only the system prompt."""
    one_conversation = 420 * KV_BYTES_PER_TOKEN  # what one agent's context grows to
    s = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir,
                    extra=["--bank-bytes", str(one_conversation)])
    try:
        c = _client(s)
        agents = [Agent(c, "a"), Agent(c, "b")]
        for t in range(5):
            for a in agents:
                a.turn(_tool_result(a.name, t))
                s.wait_durable(a.session_id)  # the agent runs its tool meanwhile
        for a in agents:
            assert len({u.model_extra["kvbank"]["session_id"] for u in a.turns}) == 1
            for prev, now in zip(a.turns, a.turns[1:]):
                k = now.model_extra["kvbank"]
                assert now.prompt_tokens_details.cached_tokens >= (
                    prev.prompt_tokens + prev.completion_tokens - 2), (a.name, k)
                assert k["recomputed_tokens"] == 0 and k["durable"]
        assert agents[0].session_id != agents[1].session_id
        sources = [u.model_extra["kvbank"]["cache_source"] for a in agents for u in a.turns[1:]]
        assert "ssd" in sources, sources  # RAM let the other agent's conversation go
        with s.client() as g:
            listed = {x.session_id: x for x in g.list_sessions()}
        for a in agents:  # RAM holds each conversation once: the turns superseded each other
            assert listed[a.session_id].ram_bytes <= (
                listed[a.session_id].token_count * KV_BYTES_PER_TOKEN)
    finally:
        s.stop()


def test_an_anonymous_conversation_survives_kill_9_of_the_worker(tiny_model, tmp_path,
                                                                 cache_dir):
    s = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir)
    try:
        a = Agent(_client(s), "survivor")
        a.turn("Remember the number 42. " * 6, max_tokens=16)
        before = s.wait_durable(a.session_id)
        assert before.durable_tokens > BLOCK_TOKENS

        s.wait_restarted("worker", s.kill9("worker"))

        u = a.turn("What was the number?")
        k = u.model_extra["kvbank"]
        assert k["session_id"] == a.session_id  # found again by its tokens alone
        assert k["cache_source"] == "ssd"
        assert u.prompt_tokens_details.cached_tokens >= before.token_count - 2
        assert k["recomputed_tokens"] == 0
    finally:
        s.stop()


def test_two_anonymous_conversations_store_their_shared_system_prompt_once(
        tiny_model, tmp_path, cache_dir):
    s = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir, shim=True)
    try:
        c = _client(s)
        a, b = Agent(c, "a"), Agent(c, "b")
        a.turn("First agent's task: fix the parser.")
        b.turn("Second agent's task: write the docs.")
        assert b.turns[0].prompt_tokens_details.cached_tokens >= 4 * BLOCK_TOKENS
        for x in (a, b):
            s.wait_durable(x.session_id)
    finally:
        s.stop()
    store = ColdStore(s.layout.store_dir, readonly=True)
    try:
        blocks = {sid: set(store.get_session("", sid)[0].block_ids())
                  for sid in (a.session_id, b.session_id)}
        shared = blocks[a.session_id] & blocks[b.session_id]
        assert len(shared) >= 4  # the system prompt's full blocks
        assert store.stats()["blocks"] == len(blocks[a.session_id] | blocks[b.session_id])
    finally:
        store.close()


def test_an_anonymous_conversation_that_never_returns_is_retired_with_an_event(
        tiny_model, tmp_path, cache_dir):
    s = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir,
                    extra=["--anonymous-ttl-s", "2"])
    try:
        a = Agent(_client(s), "gone")
        a.turn(f"[{uuid.uuid4().hex}] A one-off question.")
        with s.client() as g:
            g.generate(session_id="named", prompt="A named conversation stays.", max_tokens=4)
            retired = wait_until(lambda: [e for e in _events(s)
                                          if e["kind"] == "conversation_retired"
                                          and e["session_id"] == a.session_id],
                                 "the retirement event", every_s=0.1)
            assert retired[0]["reason"] == "anonymous_ttl" and retired[0]["removed"] == "record"
            wait_until(lambda: a.session_id not in {x.session_id for x in g.list_sessions()},
                       "the worker forgetting it", timeout_s=10, every_s=0.1)
            assert g.get_session("named").token_count > 0
        assert not [e for e in _events(s) if e["kind"] == "conversation_retired"
                    and e["session_id"] == "named"]
    finally:
        s.stop()


def test_under_the_store_cap_an_anonymous_conversation_is_retired_whole_with_an_event(
        tiny_model, tmp_path, cache_dir):
    """--store-max-bytes: the least recently used conversation's KV leaves the store; an
    unnamed one leaves whole (nothing could name it again), and says so."""
    one = 300 * (KV_BYTES_PER_TOKEN + 64)  # ~300 tokens of KV with block headers
    s = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir,
                    extra=["--store-max-bytes", str(int(one * 1.5))])
    try:
        c = _client(s)
        old, new = Agent(c, "old", system="x"), Agent(c, "new", system="y")
        old.turn(f"[{uuid.uuid4().hex}] " + "older work " * 90)
        s.wait_durable(old.session_id)
        new.turn(f"[{uuid.uuid4().hex}] " + "newer work " * 180)  # both do not fit
        s.wait_durable(new.session_id)
        (ev,) = wait_until(lambda: [e for e in _events(s) if e["kind"] == "conversation_retired"],
                           "the retirement event", every_s=0.1)
        assert ev["session_id"] == old.session_id and ev["reason"] == "store_cap"
        assert ev["removed"] == "record"
        with s.client() as g:
            wait_until(lambda: old.session_id not in {x.session_id for x in g.list_sessions()},
                       "the worker forgetting it", timeout_s=10, every_s=0.1)
    finally:
        s.stop()


def test_names_from_gateways_are_names_and_completions_are_found_by_tokens(
        tiny_model, tmp_path, cache_dir):
    s = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir)
    try:
        for header in ("x-session-id", "x-smg-routing-key"):
            c = openai.OpenAI(base_url=s.shim_url + "/v1", api_key="unused", max_retries=0,
                              default_headers={header: f"agent-{header}"})
            r = c.chat.completions.create(model="kvbank", max_tokens=4,
                                          messages=[{"role": "user", "content": "Hi"}])
            assert r.usage.model_extra["kvbank"]["session_id"] == f"agent-{header}"
            with s.client() as g:
                assert g.get_session(f"agent-{header}").token_count == (
                    r.usage.prompt_tokens + r.usage.completion_tokens)

        c = _client(s)
        prompt = f"[{uuid.uuid4().hex}] def parse(text):\n    " + "tokens = text.split()\n    " * 6
        first = c.completions.create(model="kvbank", prompt=prompt, max_tokens=8, temperature=0)
        again = c.completions.create(model="kvbank", prompt=prompt + first.choices[0].text
                                     + "\n# and now the tests\n", max_tokens=8, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 2
        assert (again.usage.model_extra["kvbank"]["session_id"]
                == first.usage.model_extra["kvbank"]["session_id"])
    finally:
        s.stop()
