"""The OpenAI-compatible shim, driven by the official `openai` client (and raw HTTP where the
bytes matter) against the real stack. The tiny model is random, so the tests check structure,
token counts and cached tokens, never the text itself."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import uuid

import grpc
import httpx
import openai
import pytest
import uvicorn

from kvbank.deploy.local import free_ports
from kvbank.apps.shim.server import create_app, error_for
from kvbank.v1 import api_pb2, api_pb2_grpc
from tests.conftest import start_stack
from tests.waiting import wait_until

KEY = "k1"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def shim(tiny_model, tmp_path_factory, cache_dir):
    """One stack for the module, with an API key, so every test also passes through auth."""
    s = start_stack(tiny_model, tmp_path_factory.mktemp("shim") / "data",
                    extra=["--api-key", KEY], cache_dir=cache_dir)
    yield s
    s.stop()


def _client(stack, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.shim_url + "/v1", api_key=key, max_retries=0)


def _user(text: str) -> list[dict]:
    # A unique first message, so no earlier test's KV serves as this test's prefix.
    return [{"role": "user", "content": f"[{uuid.uuid4().hex}] {text}"}]


def _check_usage(usage, max_tokens: int = MAX_TOKENS) -> None:
    assert usage.prompt_tokens > 0
    assert 0 < usage.completion_tokens <= max_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


def test_chat_completion(shim):
    r = _client(shim).chat.completions.create(
        model="kvbank", messages=_user("Hello"), max_tokens=MAX_TOKENS, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == "kvbank"
    [choice] = r.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    _check_usage(r.usage)
    assert r.usage.model_extra["kvbank"]["cache_source"] in ("none", "ram", "ssd")


def test_async_chat_completion(shim):
    async def ask():
        async with openai.AsyncOpenAI(base_url=shim.shim_url + "/v1", api_key=KEY,
                                      max_retries=0) as c:
            # A list of text parts is joined into one message, as OpenAI does.
            content = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "async."}]
            return await c.chat.completions.create(
                model="kvbank", messages=[{"role": "user", "content": content}],
                max_completion_tokens=4, temperature=0.7, top_p=0.9, seed=3)

    r = asyncio.run(ask())
    assert r.choices[0].message.role == "assistant"
    _check_usage(r.usage, max_tokens=4)


def test_streamed_chat_is_the_non_streamed_answer(shim):
    c = _client(shim)
    messages = _user("Tell me a story.")
    whole = c.chat.completions.create(model="kvbank", messages=messages, max_tokens=16,
                                      temperature=0)
    chunks = list(c.chat.completions.create(
        model="kvbank", messages=messages, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))

    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) \
        == whole.choices[0].message.content
    *body, finish, last = chunks
    assert all(ch.usage is None and ch.choices[0].finish_reason is None for ch in body)
    assert finish.choices[0].finish_reason == whole.choices[0].finish_reason
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    # The second request saw the same prompt: its KV came back from the bank.
    assert last.usage.prompt_tokens_details.cached_tokens > 0


def test_completions_take_text_or_token_ids(shim):
    c = _client(shim)
    r = c.completions.create(model="kvbank", prompt="Once upon a time", max_tokens=MAX_TOKENS,
                             temperature=0, stop=["\n\n", "END"])
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert isinstance(r.choices[0].text, str) and r.choices[0].finish_reason in ("stop", "length")
    _check_usage(r.usage)

    tokens = c.completions.create(model="kvbank", prompt=[1000, 2000, 3000, 4000],
                                  max_tokens=MAX_TOKENS, temperature=0)
    assert tokens.usage.prompt_tokens == 4

    streamed = list(c.completions.create(model="kvbank", prompt=[1000, 2000, 3000, 4000],
                                         max_tokens=MAX_TOKENS, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == tokens.choices[0].text
    assert streamed[-1].choices[0].finish_reason == tokens.choices[0].finish_reason


def test_models_lists_the_one_model(shim):
    c = _client(shim)
    [model] = c.models.list().data
    assert model.id == "kvbank" and model.object == "model"
    assert c.models.retrieve("kvbank").id == "kvbank"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")


@pytest.mark.parametrize("identity", ["user", "header"])
def test_second_turn_reuses_the_first_turns_kv(shim, identity):
    """The OpenAI API resends the whole conversation; the session's KV serves its prefix."""
    c = _client(shim)
    session = f"agent-{identity}-{uuid.uuid4().hex[:8]}"
    same = ({"user": session} if identity == "user"
            else {"extra_headers": {"x-session-id": session}})
    messages = _user("List three prime numbers.")
    t1 = c.chat.completions.create(model="kvbank", messages=messages, max_tokens=MAX_TOKENS,
                                   temperature=0, **same)
    messages += [{"role": "assistant", "content": t1.choices[0].message.content},
                 {"role": "user", "content": "Now three even ones."}]
    t2 = c.chat.completions.create(model="kvbank", messages=messages, max_tokens=MAX_TOKENS,
                                   temperature=0, **same)
    cached = t2.usage.prompt_tokens_details.cached_tokens
    assert cached >= t1.usage.prompt_tokens - 1  # at least the whole first prompt
    assert t2.usage.model_extra["kvbank"]["cache_source"] == "ram"
    with shim.client() as router:  # the router knows the conversation by that session id
        s = router.sessions.Get(api_pb2.GetSessionRequest(session_id=session), timeout=10,
                                metadata=(("authorization", f"Bearer {KEY}"),))
    assert s.token_count == t2.usage.prompt_tokens + t2.usage.completion_tokens


def test_an_answer_cut_at_max_tokens_comes_back_from_cache_whole(shim, tiny_model):
    """An answer cut at the token limit (sampled text, or in the middle of a character: its
    text then ends in U+FFFD where its last token holds half a character), sent back as the
    client got it, is read from cache as the tokens the model generated: the next turn
    recomputes none of it. On the chat API and on the Responses API, as Codex sends it."""
    from kvbank.router.tokenizer import PromptTokenizer

    c = _client(shim)
    half = PromptTokenizer(tiny_model).tok.convert_tokens_to_ids("ä")  # the byte 0xE4 alone
    messages = _user(f"[{uuid.uuid4().hex[:8]}] Spell something.")
    t1 = c.chat.completions.create(model="kvbank", messages=messages, max_tokens=12,
                                   temperature=0, logit_bias={str(half): 100})
    text = t1.choices[0].message.content
    assert t1.choices[0].finish_reason == "length" and text.endswith("\ufffd"), text
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "More."}]
    t2 = c.chat.completions.create(model="kvbank", messages=messages, max_tokens=1)
    assert t2.usage.prompt_tokens_details.cached_tokens >= \
        t1.usage.prompt_tokens + t1.usage.completion_tokens, (t1.usage, t2.usage)

    for n in (9, 23, 40):
        given = [{"role": "developer", "content": "You are a coding agent."},
                 {"role": "user", "content": f"[{uuid.uuid4().hex[:8]}] Fix the bug."}]
        r1 = c.responses.create(model="kvbank", input=given, max_output_tokens=n,
                                temperature=1.0, store=False)
        assert r1.status == "incomplete"
        given += [o.model_dump(exclude_none=True) for o in r1.output]
        given.append({"role": "user", "content": "Go on."})
        r2 = c.responses.create(model="kvbank", input=given, max_output_tokens=1, store=False)
        assert r2.usage.input_tokens_details.cached_tokens >= \
            r1.usage.input_tokens + r1.usage.output_tokens, (n, r1.usage, r2.usage)


BAD_CHAT = [  # (what replaces a good body's fields, the field the 400 must name)
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 10**30}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": -0.1}, "top_p"),
    ({"seed": -1}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"n": 2}, "n"),
    ({"user": 12}, "user"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),  # no tool template
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"logit_bias": {"hello": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),  # past the vocabulary: the router says so
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function"}}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    # an effort is the template's reasoning switch (tests/test_reasoning.py); not this one
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"extra_body": {"chat_template_kwargs": {"add_generation_prompt": False}}},
     "chat_template_kwargs.add_generation_prompt"),
    ({"extra_body": {"min_p": 1.5}}, "min_p"),
]


@pytest.mark.parametrize("fields,param", BAD_CHAT, ids=[p for _, p in BAD_CHAT])
def test_bad_chat_request_is_a_400_naming_the_field(shim, fields, param):
    body = {"model": "kvbank", "messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(openai.BadRequestError) as info:
        _client(shim).chat.completions.create(**body)
    error = info.value.body
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param in error["message"]


def test_malformed_bodies_and_router_refusals_are_400s(shim):
    headers = {"authorization": f"Bearer {KEY}"}
    url = shim.shim_url + "/v1"
    for path, content in [("/chat/completions", b"{not json"), ("/chat/completions", b"[1, 2]"),
                          ("/completions", b"")]:
        r = httpx.post(url + path, content=content, headers=headers)
        assert r.status_code == 400, r.text
        assert set(r.json()["error"]) == {"message", "type", "code", "param"}
    for path, body, param in [("/chat/completions", {"model": "kvbank"}, "messages"),
                              ("/completions", {"model": "kvbank"}, "prompt"),
                              ("/completions", {"prompt": ["a", "b"]}, "prompt"),
                              ("/completions", {"prompt": [2**40]}, "prompt")]:
        r = httpx.post(url + path, json=body, headers=headers)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param, r.text
        assert "missing" in error["message"] or "one prompt" in error["message"]
    # Well-formed but too long for the model: the router refuses; the sentence comes through.
    with pytest.raises(openai.BadRequestError) as info:
        _client(shim).completions.create(model="kvbank", prompt="hi", max_tokens=100_000)
    assert "context" in info.value.body["message"]
    # An unknown path is an OpenAI-shaped 404, not an HTML page.
    r = httpx.get(url + "/engines", headers=headers)
    assert r.status_code == 404 and "error" in r.json()


def test_api_key_is_checked(shim):
    with pytest.raises(openai.AuthenticationError) as info:
        _client(shim, key="wrong").chat.completions.create(
            model="kvbank", messages=_user("hi"), max_tokens=2)
    assert info.value.body["code"] == "invalid_api_key"
    r = httpx.post(shim.shim_url + "/v1/chat/completions",
                   json={"messages": _user("hi"), "max_tokens": 2})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert httpx.get(shim.shim_url + "/v1/models").status_code == 401
    assert httpx.get(shim.shim_url + "/health").status_code == 200  # health needs no key


def test_sse_framing_byte_for_byte(shim):
    body = {"model": "kvbank", "messages": _user("Count."), "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", shim.shim_url + "/v1/chat/completions", json=body,
                      headers={"authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read()
    raw = re.sub(rb"(?m)^: ping[^\n]*\n\n", b"", raw)  # keep-alive comments (a slow machine)
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.split(b"\n\n")[:-1]
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    # Re-encoding each chunk compactly gives back exactly the bytes sent.
    assert raw == b"".join(b"data: " + json.dumps(c, ensure_ascii=False, separators=(",", ":"))
                           .encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.matrix  # make test-all: end to end; the shim's 429 is checked against a fake
def test_queue_full_is_a_429_with_retry_after(tiny_model, tmp_path, cache_dir):  # router below
    stack = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir,
                        extra=["--max-active-requests", "1", "--max-queue", "0"])
    try:
        c = _client(stack, key="x")
        # One long request holds the only slot while it streams; the others find no room.
        holder = c.chat.completions.create(model="kvbank", messages=_user("Go on and on."),
                                           max_tokens=1500, temperature=0, stream=True)
        first = next(holder)
        refusals = []
        for _ in range(3):
            try:
                c.chat.completions.create(model="kvbank", messages=_user("Me too."),
                                          max_tokens=2)
            except openai.RateLimitError as e:
                refusals.append(e)
        rest = list(holder)
    finally:
        stack.stop()
    assert first.choices[0].delta.role == "assistant"
    assert rest[-1].choices[0].finish_reason == "length"  # it ran its whole length meanwhile
    assert refusals, "no request was refused while the only slot was taken"
    for e in refusals:
        assert e.status_code == 429
        assert int(e.response.headers["retry-after"]) >= 1
        assert e.body["message"] and e.body["type"] == "requests"


# -- against a fake router: failures on cue, and hang-ups --------------------------------


class FakeRouter(api_pb2_grpc.GenerationServicer):
    """Answers by the prompt: "forever" streams until cancelled, "fail" dies after one
    message, "full" is refused as a full queue would be."""

    def __init__(self):
        self.streaming = threading.Semaphore(0)  # released once per call that streams forever
        self.cancelled = threading.Semaphore(0)  # released once per cancelled call

    async def Generate(self, request, context):
        if request.prompt == "full":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "1 running, 0 waiting",
                                trailing_metadata=(("retry-after", "7"),
                                                   ("x-kvbank-reason", "queue_full")))
        yield api_pb2.GenerateResponse(text="Hel", token_ids=[1])
        if request.prompt == "fail":  # as the router says it: its reason, a retry-after
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is not reachable",
                                trailing_metadata=(("retry-after", "1"),
                                                   ("x-kvbank-reason", "worker_unavailable")))
        self.streaming.release()
        try:
            while True:
                yield api_pb2.GenerateResponse(text="lo", token_ids=[2])
                await asyncio.sleep(0.01)
        finally:  # only a cancel ends it: in the sleep (CancelledError) or while grpc sends
            self.cancelled.release()  # the last message (the generator is closed at its yield)


@pytest.fixture(scope="module")
def fake():
    """A shim in this process (uvicorn in a thread) in front of a FakeRouter."""
    router, loop = FakeRouter(), asyncio.new_event_loop()

    async def serve(port: int) -> grpc.aio.Server:
        server = grpc.aio.server()  # made in the loop that runs it
        api_pb2_grpc.add_GenerationServicer_to_server(router, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        return server

    router_port, shim_port = free_ports(2)
    threading.Thread(target=loop.run_forever, daemon=True).start()
    server = asyncio.run_coroutine_threadsafe(serve(router_port), loop).result(10)
    http = uvicorn.Server(uvicorn.Config(create_app(f"127.0.0.1:{router_port}"), port=shim_port,
                                         loop="asyncio", log_config=None))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    wait_until(lambda: http.started or not thread.is_alive(), "the shim (uvicorn) to start")
    assert http.started, "the shim's uvicorn thread ended before it started serving"
    router.port, router.url = shim_port, f"http://127.0.0.1:{shim_port}/v1"
    yield router
    http.should_exit = True
    thread.join(10)
    asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)


def test_refusal_before_the_first_token_keeps_its_http_status(fake):
    c = openai.OpenAI(base_url=fake.url, api_key="x", max_retries=0)
    for stream in (False, True):
        with pytest.raises(openai.RateLimitError) as info:
            c.completions.create(model="kvbank", prompt="full", stream=stream)
        assert info.value.response.headers["retry-after"] == "7"
        assert info.value.body["code"] == "queue_full"
        assert info.value.body["message"] == "1 running, 0 waiting"


def test_failure_mid_stream_is_an_error_event_that_ends_it(fake):
    with httpx.stream("POST", fake.url + "/completions",
                      json={"prompt": "fail", "stream": True}) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line]
    assert json.loads(events[0].removeprefix("data: "))["choices"][0]["text"] == "Hel"
    error = json.loads(events[-1].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and "not reachable" in error["message"]
    assert len(events) == 2  # no [DONE]: the stream ended on the error
    # The openai client turns that event into an exception.
    stream = openai.OpenAI(base_url=fake.url, api_key="x").completions.create(
        model="kvbank", prompt="fail", stream=True)
    with pytest.raises(openai.APIError, match="not reachable"):
        list(stream)


def test_a_client_that_hangs_up_cancels_its_router_call(fake):
    with httpx.stream("POST", fake.url + "/chat/completions",
                      json={"messages": [{"role": "user", "content": "forever"}],
                            "stream": True}) as r:
        next(r.iter_lines())
    assert fake.streaming.acquire(timeout=30)
    assert fake.cancelled.acquire(timeout=30), "the streamed call was not cancelled"

    # A non-streamed answer that never ends: the client hangs up once the router has begun.
    body = json.dumps({"prompt": "forever"}).encode()
    with socket.create_connection(("127.0.0.1", fake.port)) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: shim\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        assert fake.streaming.acquire(timeout=30)
    assert fake.cancelled.acquire(timeout=30), "the non-streamed call was not cancelled"


# -- without a stack: the mapping of router failures -----------------------------------------


def _rpc_error(code: grpc.StatusCode, details: str, **trailing: str) -> grpc.aio.AioRpcError:
    md = grpc.aio.Metadata(*((k.replace("_", "-"), v) for k, v in trailing.items()))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), md, details=details)


def test_router_statuses_map_to_http():
    full = error_for(_rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "2 running, 0 waiting",
                                retry_after="3", x_kvbank_reason="queue_full",
                                x_kvbank_verdict="after_in_flight_requests_finish"))
    assert (full.status, full.code, full.message) == (429, "queue_full", "2 running, 0 waiting")
    assert full.headers()["Retry-After"] == "3"
    assert error_for(_rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")) \
        .headers()["Retry-After"] == "1"
    never = error_for(_rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "too long",
                                 x_kvbank_verdict="not_without_a_shorter_prompt"))
    assert never.headers() == {"x-should-retry": "false"}
    assert error_for(_rpc_error(grpc.StatusCode.UNAVAILABLE, "restarting",
                                x_kvbank_reason="worker_unavailable")).status == 503
    # No router answered (gRPC's own text): a 503 in kvbank's words, with Retry-After.
    away = error_for(_rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect to all "
                                "addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: refused"))
    assert away.status == 503 and away.headers()["Retry-After"] == "1"
    assert "connect" not in away.message and "retry in 1 s" in away.message
    assert error_for(_rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens")).status == 400
    assert error_for(_rpc_error(grpc.StatusCode.UNAUTHENTICATED, "key")).status == 401
    assert error_for(_rpc_error(grpc.StatusCode.NOT_FOUND, "no session")).status == 404
    internal = error_for(_rpc_error(grpc.StatusCode.INTERNAL, "Traceback: secret"))
    assert internal.status == 500 and "secret" not in internal.message


def test_bench_overhead_compares_the_same_answer(tiny_model):
    from kvbank.apps.bench.overhead import run

    result = run(model=str(tiny_model), prompt_tokens=32, max_tokens=16, rounds=1)
    assert result["same_text"] and result["completion_tokens"] == 16
    assert result["kvbank_decode_tps"] > 0 and result["in_process_decode_tps"] > 0
    assert result["decode_ratio"] > 0

