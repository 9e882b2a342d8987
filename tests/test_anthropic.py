"""Anthropic's Messages API on the shim (`/v1/messages`), driven by the official `anthropic`
SDK (and raw HTTP where the bytes matter) against the real stack; and the OpenAI routes'
`--default-max-tokens`. The tiny model is random, so the tests check structure, token counts
and cached tokens, never the text itself. Its context is 2,048 tokens."""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import openai
import pytest

from kvbank.contracts.failures import Refused
from kvbank.v1 import worker_pb2
from kvbank.router.admission import Ceilings, check_ceilings
from tests.conftest import start_stack

KEY = "k-anthropic"
DEFAULT_MAX_TOKENS = 300  # the stack's --default-max-tokens: more than the old fixed 256
CONTEXT = 2048  # the tiny model's max_position_embeddings
MAX_TOKENS = 8
# The SDK no longer takes sampling parameters as arguments; the API (and kvbank) still does.
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def keyed(tiny_model, tmp_path_factory, cache_dir):
    """One stack for the module, with an API key (every test passes through auth) and a
    default max_tokens for OpenAI requests that send none."""
    s = start_stack(tiny_model, tmp_path_factory.mktemp("anthropic") / "data", cache_dir=cache_dir,
                    extra=["--api-key", KEY, "--default-max-tokens", str(DEFAULT_MAX_TOKENS)])
    yield s
    s.stop()


def _client(stack, key: str = KEY) -> anthropic.Anthropic:
    # An explicit timeout: the SDK's own refuses a non-streamed max_tokens of 32000 (or none).
    return anthropic.Anthropic(base_url=stack.shim_url, api_key=key, max_retries=0,
                               timeout=120.0)


def _user(text: str) -> list[dict]:
    # A unique first message, so no earlier test's KV serves as this test's prefix.
    return [{"role": "user", "content": f"[{uuid.uuid4().hex}] {text}"}]


def _prompt(usage) -> int:
    """The whole prompt, as Anthropic counts it."""
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_text_turn(keyed):
    c = _client(keyed)
    messages = _user("Hello")
    r = c.messages.create(model="kvbank", max_tokens=MAX_TOKENS, messages=messages,
                          system=[{"type": "text", "text": "Be terse.",
                                   "cache_control": {"type": "ephemeral"}}],
                          stop_sequences=["\n\n\n"], cache_control={"type": "ephemeral"},
                          extra_body={"temperature": 0, "top_p": 0.9},
                          extra_headers={"anthropic-beta": "prompt-caching-2024-07-31"})
    assert r.type == "message" and r.id.startswith("msg_") and r.role == "assistant"
    assert r.model == "kvbank"
    [block] = r.content
    assert block.type == "text" and isinstance(block.text, str)
    assert (r.stop_reason, r.stop_sequence) in (("end_turn", None), ("max_tokens", None),
                                                ("stop_sequence", "\n\n\n"))
    u = r.usage
    assert 0 < u.output_tokens <= MAX_TOKENS and u.cache_creation_input_tokens == 0
    assert u.input_tokens > 0 and u.cache_read_input_tokens >= 0
    assert u.model_extra["kvbank"]["cache_source"] in ("none", "ram", "ssd")
    # input_tokens + cache_read_input_tokens is the whole prompt: what count_tokens renders,
    # and what the chat endpoint counts for the same conversation.
    counted = c.messages.count_tokens(model="kvbank", messages=messages, system="Be terse.")
    assert _prompt(u) == counted.input_tokens
    chat = openai.OpenAI(base_url=keyed.shim_url + "/v1", api_key=KEY, max_retries=0)
    same = chat.chat.completions.create(
        model="kvbank", max_tokens=MAX_TOKENS, temperature=0, top_p=0.9, stop=["\n\n\n"],
        messages=[{"role": "system", "content": "Be terse."}, *messages])
    assert same.usage.prompt_tokens == _prompt(u)
    assert same.choices[0].message.content == block.text  # the same request to the router
    # ... whose prompt was the Anthropic turn's, now restored from the bank
    assert same.usage.prompt_tokens_details.cached_tokens >= _prompt(u) - 1


@pytest.mark.parametrize("identity", ["metadata", "anonymous"])
def test_second_turn_is_served_from_cache(keyed, identity):
    """Anthropic's clients resend the whole conversation; the first turn's KV (its prompt and
    its answer) serves the second's prefix, named by metadata.user_id or found by tokens."""
    c = _client(keyed)
    same = ({"metadata": {"user_id": f"agent-{uuid.uuid4().hex[:8]}"}}
            if identity == "metadata" else {})
    messages = _user("List three prime numbers.")
    t1 = c.messages.create(model="kvbank", max_tokens=MAX_TOKENS, messages=messages,
                           **GREEDY, **same)
    messages += [{"role": "assistant", "content": [{"type": "text", "text": t1.content[0].text}]},
                 {"role": "user", "content": "Now three even ones."}]
    t2 = c.messages.create(model="kvbank", max_tokens=MAX_TOKENS, messages=messages,
                           **GREEDY, **same)
    first = _prompt(t1.usage) + t1.usage.output_tokens
    assert t2.usage.cache_read_input_tokens >= first - 1  # the first turn, prompt and answer
    assert t2.usage.input_tokens == _prompt(t2.usage) - t2.usage.cache_read_input_tokens > 0
    assert t2.usage.model_extra["kvbank"]["cache_source"] == "ram"
    if identity == "metadata":
        assert t2.usage.model_extra["kvbank"]["session_id"] == same["metadata"]["user_id"]
    else:
        assert t2.usage.model_extra["kvbank"]["session_id"].startswith("~")


def test_stream_through_the_sdk_is_the_non_streamed_answer(keyed):
    c = _client(keyed)
    messages = _user("Tell me a story.")
    whole = c.messages.create(model="kvbank", max_tokens=16, messages=messages, **GREEDY)
    with c.messages.stream(model="kvbank", max_tokens=16, messages=messages,
                           **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.id.startswith("msg_") and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert _prompt(final.usage) == _prompt(whole.usage)
    # The second request saw the same prompt: its KV came back from the bank.
    assert final.usage.cache_read_input_tokens > 0


def test_stream_events_in_anthropics_order(keyed):
    body = {"model": "kvbank", "max_tokens": MAX_TOKENS, "messages": _user("Count."),
            "temperature": 0, "stream": True}
    with httpx.stream("POST", keyed.shim_url + "/v1/messages", json=body,
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = []
    for block in raw.split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue  # a keep-alive comment (a slow machine)
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        data = json.loads(lines[1].removeprefix("data: "))
        assert data["type"] == lines[0].removeprefix("event: ")
        events.append(data)
    kinds = [e["type"] for e in events]
    deltas = kinds.count("content_block_delta")
    assert kinds == ["message_start", "content_block_start", "ping",
                     *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"]
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert "input_tokens" in start["usage"]
    assert events[1] == {"type": "content_block_start", "index": 0,
                         "content_block": {"type": "text", "text": ""}}
    assert all(e["delta"]["type"] == "text_delta" for e in events[3:3 + deltas])
    end = events[-2]
    assert end["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert 0 < end["usage"]["output_tokens"] <= MAX_TOKENS
    assert end["usage"]["input_tokens"] > 0


BAD = [  # (what replaces a good body's fields, what the 400's message must name)
    ({"max_tokens": anthropic.omit}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"extra_body": {"temperature": 1.5}}, "temperature"),
    ({"extra_body": {"top_k": -1}}, "top_k"),
    # output_config is Claude Code's and accepted (the Claude Code test below); a thinking
    # switch kvbank cannot map is refused
    ({"extra_body": {"thinking": {"type": "sometimes"}}}, "thinking.type"),
    # this stack's model has no tools in its chat template (tests/test_agent_api.py's has)
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "no tool calling"),
    ({"extra_body": {"frobnicate": True}}, "frobnicate"),
    ({"extra_body": {"metadata": {"user_id": "a", "x": 1}}}, "metadata.x"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                 "content": "42"}]}]}, "no tool calling"),
    ({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": [{"type": "tool_use", "id": "t1",
                                                      "name": "f", "input": {}}]},
                   {"role": "user", "content": "go on"}]}, "no tool calling"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
    ({"tool_choice": {"type": "any"}}, "tool_choice needs tools"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, "image"),
    ({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "The answer is"}]}, "prefill"),
    ({"messages": [{"role": "system", "content": "Hi"}]}, "messages[0].role"),
    ({"stop_sequences": [""]}, "stop_sequences"),
]


@pytest.mark.parametrize("fields,named", BAD, ids=[n for _, n in BAD])
def test_bad_request_is_a_400_in_anthropics_shape_naming_it(keyed, fields, named):
    body = {"model": "kvbank", "max_tokens": MAX_TOKENS, "messages": _user("hi"), **fields}
    with pytest.raises(anthropic.BadRequestError) as info:
        _client(keyed).messages.create(**body)
    error = info.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"]


def test_raw_errors_keep_anthropics_shape(keyed):
    url = keyed.shim_url + "/v1/messages"
    headers = {"x-api-key": KEY}
    r = httpx.post(url, json={"model": "kvbank", "messages": _user("hi")}, headers=headers)
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": r.json()["error"]["message"]}}
    assert "max_tokens is required" in r.json()["error"]["message"]
    r = httpx.post(url, content=b"{not json", headers=headers)
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.get(url, headers=headers)  # no such method: still Anthropic's shape
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    # Well-formed but a prompt beyond the model's context: the router's sentence comes through.
    long = [{"role": "user", "content": "hi " * (CONTEXT + 100)}]
    r = httpx.post(url, json={"max_tokens": 4, "messages": long}, headers=headers)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]


def test_api_key_is_checked(keyed):
    with pytest.raises(anthropic.AuthenticationError) as info:
        _client(keyed, key="wrong").messages.create(model="kvbank", max_tokens=2,
                                                     messages=_user("hi"))
    assert info.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(keyed.shim_url + "/v1/messages",
                   json={"max_tokens": 2, "messages": _user("hi")})
    assert r.status_code == 401 and "x-api-key" in r.json()["error"]["message"]
    # An auth token (Anthropic's clients send it as a bearer) is the same key.
    c = anthropic.Anthropic(base_url=keyed.shim_url, auth_token=KEY, max_retries=0)
    assert c.messages.create(model="kvbank", max_tokens=2, messages=_user("hi")).content


def test_max_tokens_beyond_the_context_is_lowered_to_the_room_left(keyed):
    """Anthropic's clients send max_tokens as a bound (32000, whatever the model): the answer
    may fill the context, and says so when it does."""
    c = _client(keyed)
    messages = [{"role": "user", "content": " ".join(["word"] * 1900)}]
    with c.messages.stream(model="kvbank", max_tokens=32000, messages=messages,
                           **GREEDY) as stream:
        r = stream.get_final_message()
    room = CONTEXT - _prompt(r.usage)
    assert 0 < room < DEFAULT_MAX_TOKENS
    if r.stop_reason != "end_turn":
        assert r.stop_reason == "model_context_window_exceeded"
        assert r.usage.output_tokens == room
    assert r.usage.output_tokens <= room


# -- the OpenAI routes' --default-max-tokens -------------------------------------------------


def _openai(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.shim_url + "/v1", api_key=KEY, max_retries=0)


def test_no_max_tokens_gets_the_flags_default(keyed):
    """256 was the old fixed default; the flag's 300 reaches the shim through `kvbank up`.
    The random model at temperature 0 runs to the end of this prompt's default."""
    r = _openai(keyed).completions.create(model="kvbank", prompt=list(range(1000, 1032)),
                                          temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == DEFAULT_MAX_TOKENS


def test_no_max_tokens_with_a_long_prompt_fills_the_context(keyed):
    """A prompt that leaves less room than the default is not refused: max_tokens is lowered
    to the room it leaves, for completions and chat alike."""
    c = _openai(keyed)
    prompt = [1000 + i % 977 for i in range(CONTEXT - 100)]
    r = c.completions.create(model="kvbank", prompt=prompt, temperature=0)
    assert r.usage.prompt_tokens == CONTEXT - 100
    assert r.usage.completion_tokens <= 100
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 100
    streamed = list(c.chat.completions.create(
        model="kvbank", messages=[{"role": "user", "content": " ".join(["word"] * 1900)}],
        temperature=0, stream=True, stream_options={"include_usage": True}))
    usage = streamed[-1].usage
    assert 0 < usage.completion_tokens <= CONTEXT - usage.prompt_tokens < DEFAULT_MAX_TOKENS
    # A max_tokens the client chose is its own: too long for the context is still a 400.
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model="kvbank", prompt=prompt, max_tokens=DEFAULT_MAX_TOKENS)
    assert "context" in info.value.body["message"]


# -- without a stack: the room the router's refusals leave -----------------------------------


def test_the_router_fits_max_tokens_to_the_room_the_prompt_leaves():
    """fit_max_tokens: the router lowers max_tokens to what the context, --max-request-tokens
    and the memory budget leave for this prompt (router/server.py Backend.fit), and the
    result then passes the ceilings; with no room left it stays, and the ceilings refuse."""
    from types import SimpleNamespace

    from kvbank.router.server import Backend
    from kvbank.router.validation import ValidRequest

    def v(max_tokens: int, fit: bool = True) -> ValidRequest:
        return ValidRequest("", "tokens", (), "", (), False, max_tokens, (), False,
                            fit_max_tokens=fit)

    def fit(ceilings: Ceilings, info, prompt: int, max_tokens: int, fit: bool = True) -> int:
        return Backend.fit(SimpleNamespace(ceilings=ceilings), v(max_tokens, fit),
                           [7] * prompt, info).max_tokens

    context = worker_pb2.InfoResponse(max_context_tokens=2048)
    assert fit(Ceilings(), context, 1900, 4096) == 148
    assert fit(Ceilings(), context, 1900, 100) == 100  # it fits already
    assert fit(Ceilings(), context, 1900, 4096, fit=False) == 4096  # the client's own number
    assert fit(Ceilings(), context, 2048, 4096) == 4096  # no room: refused as before
    assert fit(Ceilings(max_request_tokens=1000), context, 900, 4096) == 100
    budget = worker_pb2.InfoResponse(max_context_tokens=100_000, memory_budget_bytes=150_000_000,
                                     fixed_bytes=100_000_000, kv_bytes_per_token=10_000,
                                     prefill_chunk_tokens=512, transient_base_bytes=1_000_000,
                                     transient_per_context_token=100.0)
    room = fit(Ceilings(), budget, 1000, 4096)
    assert 0 < room < 4096
    check_ceilings(Ceilings(), prompt_tokens=1000, max_tokens=room, info=budget)  # it fits
    with pytest.raises(Refused):
        check_ceilings(Ceilings(), prompt_tokens=1000, max_tokens=room + 50, info=budget)

def test_claude_codes_requests_are_taken_as_sent_and_its_turns_read_the_whole_history(keyed):
    """Claude Code's fields (thinking, context_management, output_config) and its
    mid-conversation system message are accepted, and the attribution line it puts first in
    the system prompt, different on every request, is kept out of the prompt: the second
    request, after a side request of its own (a title), reads all of the first from cache."""
    import random

    c = _client(keyed)

    def system():  # a new nonce each request, as Claude Code sends it
        nonce = "".join(random.choices("0123456789abcdef", k=5))
        return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.328; "
                                         f"cc_entrypoint=cli; cch={nonce};"},
                {"type": "text", "text": "You are Claude Code. " * 20,
                 "cache_control": {"type": "ephemeral"}}]

    fields = {"thinking": {"type": "enabled", "budget_tokens": 1024},
              "context_management": {"edits": [{"type": "clear_thinking_20251015",
                                                "keep": "all"}]},
              "output_config": {"effort": "high"}, "temperature": 0}
    # its environment block, a system message after the first user message (newer models)
    messages = _user("List the files here.") + [
        {"role": "system", "content": [{"type": "text", "text": "# Environment\n - cwd: /w"}]}]
    first = c.messages.create(model="claude-opus-5-5", max_tokens=MAX_TOKENS,
                              system=system(), messages=messages, extra_body=fields)
    assert first.model == "kvbank"  # any model name a client sends maps to the served model
    messages += [{"role": "assistant", "content": first.content[0].text or "."},
                 {"role": "user", "content": "Now read README.md."}]
    # a side request between turns, as Claude Code sends for a title: its own small prompt
    c.messages.create(model="claude-haiku-4-5", max_tokens=MAX_TOKENS, extra_body=fields,
                      system="Write a 3-word title for this conversation.",
                      messages=_user("List the files here."))
    second = c.messages.create(model="claude-opus-5-5", max_tokens=MAX_TOKENS,
                               system=system(), messages=messages, extra_body=fields)
    assert second.usage.cache_read_input_tokens >= _prompt(first.usage), second.usage


def test_a_prompt_longer_than_the_context_gets_the_error_clients_compact_on(keyed):
    """Anthropic's `prompt is too long: N tokens > M maximum`; OpenAI's
    `context_length_exceeded` code."""
    import re

    long = _user("word " * (CONTEXT + 100))
    with pytest.raises(anthropic.BadRequestError) as info:
        _client(keyed).messages.create(model="kvbank", max_tokens=MAX_TOKENS, messages=long)
    err = info.value.body["error"]
    assert err["type"] == "invalid_request_error"
    assert re.match(r"prompt is too long: \d+ tokens > \d+ maximum", err["message"]), err
    oa = openai.OpenAI(base_url=f"{keyed.shim_url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        oa.chat.completions.create(model="kvbank", messages=long, max_tokens=MAX_TOKENS)
    assert info.value.code == "context_length_exceeded", info.value.body


def test_any_model_name_maps_to_the_served_model_unless_strict(keyed, tmp_path):
    """Agents send their own model names (claude-..., gpt-...): each is served. A shim run
    with --strict-model-name refuses them with a 404 that names the served model."""
    import subprocess
    import sys

    from kvbank.deploy.local import free_port
    from tests.waiting import wait_until

    said = _client(keyed).messages.create(model="claude-sonnet-4-5", max_tokens=MAX_TOKENS,
                                          messages=_user("hello"), **GREEDY)
    assert said.usage.output_tokens > 0
    port = free_port()
    with open(tmp_path / "shim.log", "w") as log:
        strict = subprocess.Popen([sys.executable, "-m", "kvbank.apps.cli", "shim", "--router",
                                   keyed.address, "--shim-port", str(port), "--api-key", KEY,
                                   "--strict-model-name"], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert strict.poll() is None, (tmp_path / "shim.log").read_text()
            try:
                return httpx.get(url + "/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, "the strict shim to answer /health", 60)
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.NotFoundError) as info:
            c.chat.completions.create(model="gpt-4o", messages=_user("hi"), max_tokens=4)
        assert (info.value.body["code"], info.value.body["param"]) == ("model_not_found", "model")
        assert "'kvbank'" in info.value.body["message"]
        a = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
        with pytest.raises(anthropic.NotFoundError):
            a.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=_user("hi"))
        ok = c.chat.completions.create(model="kvbank", messages=_user("hi"), max_tokens=4)
        assert ok.usage.completion_tokens > 0
    finally:
        strict.terminate()
        strict.wait(timeout=30)


def test_a_websocket_to_responses_is_refused_and_http_still_answers(keyed):
    """Codex tries the Responses API over a WebSocket first: the handshake is refused at
    once, so it falls back to HTTP, which answers."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    ws_url = keyed.shim_url.replace("http://", "ws://") + "/v1/responses"
    with pytest.raises(InvalidStatus) as info:
        connect(ws_url, additional_headers={"Authorization": f"Bearer {KEY}"},
                open_timeout=30).close()
    assert 400 <= info.value.response.status_code < 500
    c = openai.OpenAI(base_url=keyed.shim_url + "/v1", api_key=KEY, max_retries=0)
    r = c.responses.create(model="gpt-5-codex", input="hi", max_output_tokens=4)
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens > 0
