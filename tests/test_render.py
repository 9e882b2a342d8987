"""The render endpoints vllm-router's kv_aware policy asks before it routes a request
(`/v1/chat/completions/render`, `/v1/completions/render`), and the router's `Render` RPC
behind them: the token ids the worker would prefill, built by Generate's own steps, with
nothing queued, generated or stored.

One stack for the module, with two tenants (the answer-token splice is per tenant) and one
request running at a time (so that a render can be shown to pass a held admission slot)."""

from __future__ import annotations

import re
import uuid

import grpc
import httpx
import pytest

from kvbank.client import Client
from kvbank.router.tokenizer import PromptTokenizer
from tests.conftest import rpc_error, start_stack

KEYS = {"alice": "key-alice-0123", "bob": "key-bob-4567"}
ALICE, BOB = KEYS["alice"], KEYS["bob"]
MAX_TOKENS = 8
# What vllm-router adds to the client's body before it calls a render endpoint.
ROUTER_KEYS = {"logprobs": False, "no_stop_trim": False, "ignore_eos": False,
               "continue_final_message": False, "skip_special_tokens": True,
               "separate_reasoning": True, "stream_reasoning": True,
               "return_hidden_states": False, "include_reasoning": True}
ROUTER_KEYS_COMPLETION = {k: v for k, v in ROUTER_KEYS.items()
                          if "reasoning" not in k} | {"echo": False}


@pytest.fixture(scope="module")
def keyed(tiny_model, tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("render")
    keys_file = root / "keys"
    keys_file.write_text("".join(f"{t} {k}\n" for t, k in KEYS.items()))
    s = start_stack(tiny_model, root / "data", cache_dir=cache_dir,
                    extra=["--api-keys-file", str(keys_file), "--max-active-requests", "1"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tok(tiny_model) -> PromptTokenizer:
    return PromptTokenizer(tiny_model)


def _post(stack, path: str, body, key: str | None = ALICE, *, timeout_s: float = 120,
          headers: dict | None = None) -> httpx.Response:
    auth = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(stack.shim_url + path, json=body, headers=auth | (headers or {}),
                      timeout=timeout_s)


def _render(stack, kind: str, body: dict, key: str = ALICE) -> list[int]:
    path = "/v1/chat/completions/render" if kind == "chat" else "/v1/completions/render"
    extra = ROUTER_KEYS if kind == "chat" else ROUTER_KEYS_COMPLETION
    r = _post(stack, path, {**body, **extra}, key)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    out = r.json()
    assert set(out) == {"model", "token_ids"} and out["model"] == "kvbank"
    assert out["token_ids"] and all(isinstance(t, int) for t in out["token_ids"])
    return out["token_ids"]


def _generate(stack, kind: str, body: dict, key: str = ALICE) -> dict:
    r = _post(stack, "/v1/chat/completions" if kind == "chat" else "/v1/completions", body, key)
    assert r.status_code == 200, r.text
    return r.json()


def _record(stack, session_id: str, key: str = ALICE) -> list[int]:
    """The worker's record of a conversation: every turn's prompt and answer tokens."""
    with Client(stack.address, api_key=key) as c:
        return list(c.get_session(session_id).token_ids)


def _user(text: str) -> list[dict]:
    # A unique first message, so no other test's conversation is this one's prefix.
    return [{"role": "user", "content": f"[{uuid.uuid4().hex}] {text}"}]


def _chat(messages: list[dict]) -> dict:
    return {"model": "kvbank", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}


def _requests_total(stack) -> float:
    text = httpx.get(stack.metrics_url("router"), timeout=10).text
    return sum(float(v) for v in re.findall(r"(?m)^kvbank_requests_total\{[^}]*\} (\S+)$", text))


def test_chat_render_is_the_prompt_the_worker_prefills(keyed, tok):
    messages = _user("List three prime numbers.")
    ids1 = _render(keyed, "chat", _chat(messages))
    assert ids1 == tok.chat(messages)  # the chat template, tokenized as the router does
    t1 = _generate(keyed, "chat", _chat(messages))
    sid = t1["usage"]["kvbank"]["session_id"]
    record1 = _record(keyed, sid)
    assert t1["usage"]["prompt_tokens"] == len(ids1)
    assert record1[:len(ids1)] == ids1  # exactly what the worker prefilled

    # The next turn resends the conversation with the answer as text; the router splices in
    # the tokens the model generated for it (its answer-token memory), and so does the render.
    answer = t1["choices"][0]["message"]["content"]
    messages += [{"role": "assistant", "content": answer},
                 {"role": "user", "content": "Now three even ones."}]
    ids2 = _render(keyed, "chat", _chat(messages))
    answer_ids = record1[len(ids1):]
    remembered = tok.decode(answer_ids) == answer  # kept only when its text is all its tokens
    assert ids2 == tok.chat(messages, answer_tokens=lambda text, prompt: (
        answer_ids if remembered and text == answer and prompt() == ids1 else None))
    if remembered:
        assert ids2[:len(record1)] == record1  # the render continues the record
    t2 = _generate(keyed, "chat", _chat(messages))
    assert t2["usage"]["kvbank"]["session_id"] == sid  # the same conversation, continued
    assert t2["usage"]["prompt_tokens"] == len(ids2)
    assert _record(keyed, sid)[:len(ids2)] == ids2
    shared = next((i for i, (a, b) in enumerate(zip(ids2, record1)) if a != b),
                  min(len(ids2), len(record1)))
    assert t2["usage"]["prompt_tokens_details"]["cached_tokens"] >= shared - 1
    assert t2["usage"]["prompt_tokens_details"]["cached_tokens"] <= shared


def test_completions_render_is_the_prompt_the_worker_prefills(keyed, tok):
    prompt = f"[{uuid.uuid4().hex}] Once upon a time"
    body = {"model": "kvbank", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    ids = _render(keyed, "completion", body)
    assert ids == tok.encode(prompt)
    t = _generate(keyed, "completion", body)
    assert t["usage"]["prompt_tokens"] == len(ids)
    assert _record(keyed, t["usage"]["kvbank"]["session_id"])[:len(ids)] == ids

    token_prompt = {**body, "prompt": [1000, 2000, 3000, 4000, 5000]}  # token ids pass as given
    assert _render(keyed, "completion", token_prompt) == [1000, 2000, 3000, 4000, 5000]
    assert _render(keyed, "completion", {**body, "prompt": [prompt]}) == ids  # one-string array


def test_render_is_json_and_takes_what_vllm_router_adds(keyed, tok):
    messages = _user("Hello")
    plain = _render(keyed, "chat", _chat(messages))
    # stream: true (with its options) still answers one JSON body with the same ids.
    streamed = _post(keyed, "/v1/chat/completions/render",
                     {**_chat(messages), **ROUTER_KEYS, "stream": True,
                      "stream_options": {"include_usage": True}})
    assert streamed.status_code == 200 and streamed.json()["token_ids"] == plain
    assert streamed.headers["content-type"].startswith("application/json")
    # Sampling settings do not change the prompt; a session name does not either.
    assert _render(keyed, "chat", {**_chat(messages), "temperature": 1.3, "top_p": 0.5,
                                   "seed": 4, "stop": ["x"], "user": "agent-7"}) == plain
    # The body as vllm-router sends it to a generation endpoint works there too.
    t = _generate(keyed, "completion", {"prompt": "Hi", "max_tokens": 2,
                                        **ROUTER_KEYS_COMPLETION})
    assert t["usage"]["prompt_tokens"] == len(tok.encode("Hi"))


BAD = [  # (endpoint kind, what replaces a good body's fields): 400 from both endpoints alike
    ("chat", {"messages": []}),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("chat", {"max_tokens": 0}),
    ("chat", {"temperature": "hot"}),
    ("chat", {"stream": "yes"}),
    ("chat", {"n": 2}),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("chat", {"logprobs": "yes"}),  # a value vllm-router does not add is validated as usual
    ("chat", {"max_tokens": 100_000}),  # refused by the router: beyond the model's context
    ("chat", {"messages": [{"role": "user", "content": "   "}]}),  # refused by the router
    ("completion", {"prompt": None}),
    ("completion", {"prompt": ["a", "b"]}),
    ("completion", {"echo": True}),
    ("completion", {"prompt": [2**31]}),  # beyond the vocabulary: refused by the router
]


@pytest.mark.parametrize("kind,fields", BAD, ids=[f"{k}-{next(iter(f))}" for k, f in BAD])
def test_a_bad_body_is_the_generation_endpoints_400(keyed, kind, fields):
    good = _chat(_user("hi")) if kind == "chat" else {"prompt": "hi", "max_tokens": 2}
    body = {k: v for k, v in {**good, **fields}.items() if v is not None}
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    render = _post(keyed, path + "/render", body)
    generate = _post(keyed, path, body)
    assert render.status_code == generate.status_code == 400, (render.text, generate.text)
    assert render.json() == generate.json()


def test_render_checks_the_key_as_generation_does(keyed):
    body = {**_chat(_user("hi")), **ROUTER_KEYS}
    for key in (None, "not-a-key"):
        r = _post(keyed, "/v1/chat/completions/render", body, key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = _post(keyed, "/v1/completions/render", {"prompt": "hi"}, None)
    assert r.status_code == 401
    for path in ("/v1/chat/completions/render", "/v1/completions/render"):
        assert httpx.get(keyed.shim_url + path, timeout=10).status_code == 405
    for raw in (b"{not json", b"[1, 2]"):
        r = httpx.post(keyed.shim_url + "/v1/chat/completions/render", content=raw,
                       headers={"authorization": f"Bearer {ALICE}"}, timeout=30)
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "code",
                                                                  "param"}


def test_render_uses_the_callers_tenant(keyed, tok):
    """Alice's answer is spliced into Alice's render only: Bob gets the plain template."""
    messages = _user("Say something.")
    t = _generate(keyed, "chat", _chat(messages), key=ALICE)
    answer = t["choices"][0]["message"]["content"]
    answer_ids = _record(keyed, t["usage"]["kvbank"]["session_id"])[t["usage"]["prompt_tokens"]:]
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "More."}]
    remembered = tok.decode(answer_ids) == answer
    spliced = tok.chat(messages, answer_tokens=lambda text, prompt: (
        answer_ids if remembered and text == answer else None))
    assert spliced != tok.chat(messages), "this test needs an answer that re-tokenizes otherwise"
    assert _render(keyed, "chat", _chat(messages), key=ALICE) == spliced
    assert _render(keyed, "chat", _chat(messages), key=BOB) == tok.chat(messages)


def test_render_over_grpc_and_in_append_mode(keyed):
    """Client.render: the same ids as the shim's; in append mode, the session's history
    followed by the new turn, as Generate appends it."""
    name = f"agent-{uuid.uuid4().hex[:8]}"
    messages = _user("Count to three.")
    with Client(keyed.address, api_key=ALICE) as c:
        assert c.render(messages=messages) == _render(keyed, "chat", _chat(messages))
        c.generate(session_id=name, messages=messages, max_tokens=MAX_TOKENS)
        history = list(c.get_session(name).token_ids)
        turn = [{"role": "user", "content": "And to five."}]
        ids = c.render(session_id=name, messages=turn, append=True, max_tokens=MAX_TOKENS)
        assert ids[:len(history)] == history and len(ids) > len(history)
        t = c.generate(session_id=name, messages=turn, append=True, max_tokens=MAX_TOKENS)
        assert t.usage["prompt_tokens"] == len(ids)
        assert list(c.get_session(name).token_ids)[:len(ids)] == ids
        # Errors come through the same table as Generate's.
        e = rpc_error(lambda: c.render(messages=turn, append=True))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in e.details()
    with Client(keyed.address) as anonymous:
        e = rpc_error(lambda: anonymous.render(messages=messages))
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED


def test_render_stores_nothing_and_is_not_a_request(keyed):
    with Client(keyed.address, api_key=ALICE) as c:
        before = sorted(s.session_id for s in c.list_sessions())
        requests = _requests_total(keyed)
        name = f"agent-{uuid.uuid4().hex[:8]}"
        _render(keyed, "chat", _chat(_user("Remember nothing.")))
        r = _post(keyed, "/v1/chat/completions/render", _chat(_user("Nor this.")),
                  headers={"x-session-id": name})  # a named conversation is not started
        assert r.status_code == 200
        _render(keyed, "completion", {"prompt": f"[{uuid.uuid4().hex}]", "max_tokens": 2})
        c.render(session_id=name, messages=[{"role": "user", "content": "hi"}], append=True)
        assert sorted(s.session_id for s in c.list_sessions()) == before
        assert rpc_error(lambda: c.get_session(name)).code() == grpc.StatusCode.NOT_FOUND
        assert _requests_total(keyed) == requests


def test_render_does_not_wait_for_an_admission_slot(keyed):
    """The stack runs one request at a time: while a long answer holds the slot, a render
    answers at once (a generation would wait in the queue)."""
    body = {**_chat(_user("Go on and on.")), "max_tokens": 1500, "stream": True}
    with httpx.stream("POST", keyed.shim_url + "/v1/chat/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {ALICE}"}) as holder:
        assert holder.status_code == 200  # sent with the router's first message: admitted
        lines = holder.iter_lines()  # kept: a dropped iterator closes the stream (a hang-up)
        next(lines)
        with Client(keyed.address, api_key=ALICE) as admin:  # loopback: Admin answers
            assert admin.status().running_requests == 1
            r = _post(keyed, "/v1/chat/completions/render", _chat(_user("Me?")), timeout_s=10)
            assert r.status_code == 200 and r.json()["token_ids"]
            assert admin.status().running_requests == 1  # still the holder, alone


def test_a_template_that_takes_a_system_message_only_first_gets_the_later_ones_lifted():
    """Claude Code's environment block is a system message after the first user message; a
    template that refuses one there gets it joined to the leading system message."""
    from kvbank.router.tokenizer import lift_system

    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
            {"role": "system", "content": "# Environment"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Go"}]
    assert lift_system(msgs) == [{"role": "system", "content": "Be terse.\n\n# Environment"},
                                 *msgs[1:2], *msgs[3:]]
    assert lift_system(msgs[1:]) == [{"role": "system", "content": "# Environment"},
                                     *msgs[1:2], *msgs[3:]]
    assert lift_system([m for m in msgs if m["content"] != "# Environment"]) is None
