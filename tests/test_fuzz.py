"""Bad input, at random: hypothesis drives the router's gRPC API and the OpenAI shim of one
real stack (router, worker, coldstore, shim) with malformed, empty, huge and hostile requests.

What must hold for every request: it ends in OK, or in a clear status (gRPC INVALID_ARGUMENT,
RESOURCE_EXHAUSTED, NOT_FOUND, UNAUTHENTICATED; HTTP 400/401/404/413/422/429 in OpenAI's error
shape) with a sentence saying why. What must hold after all of them: no process died or was
restarted, a session made before the fuzzing has exactly its token history, and a normal
request still works. The tiny model is random, so only statuses and shapes are checked.

The runs are derandomized (one fixed set of examples per test, no example database), so CI
sees the same requests every time.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections import Counter

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvbank.v1 import api_pb2, api_pb2_grpc
from kvbank.router.validation import MAX_SESSION_ID_BYTES, MAX_STOP_STRINGS, ROLES
from tests.conftest import rpc_error, start_stack

KEY = "fuzz-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
CALL_TIMEOUT_S = 60  # a call that takes longer has hung: DEADLINE_EXCEEDED fails the test
PROCESSES = ("router", "worker", "coldstore", "shim")
VOCAB = 49152  # the default model's tokenizer, which the tiny model shares
OK = grpc.StatusCode.OK
CLEAR = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
         grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED}
HTTP_CLEAR = {400, 401, 404, 413, 422, 429}
FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example])


class FuzzStack:
    """The module's stack, its process ids at start, and one session nobody fuzzes."""

    def __init__(self, stack, keeper: str):
        self.stack = stack
        self.pids = {name: stack.pid(name) for name in PROCESSES}
        self.channel = grpc.insecure_channel(
            stack.address, options=[("grpc.max_send_message_length", 16 << 20)])
        self.generation = api_pb2_grpc.GenerationStub(self.channel)
        self.sessions = api_pb2_grpc.SessionsStub(self.channel)
        self.keeper = keeper
        for text in ("Remember the number 42.", "And the colour blue."):
            self.turn(keeper, text)
        self.keeper_tokens = list(self.get(keeper).token_ids)

    def turn(self, session_id: str, text: str, max_tokens: int = 6) -> api_pb2.Usage:
        req = api_pb2.GenerateRequest(session_id=session_id, append=True, max_tokens=max_tokens)
        req.chat.messages.add(role="user", content=text)
        [*_, last] = self.generation.Generate(req, metadata=AUTH, timeout=CALL_TIMEOUT_S)
        return last.usage

    def get(self, session_id: str) -> api_pb2.Session:
        return self.sessions.Get(api_pb2.GetSessionRequest(session_id=session_id),
                                 metadata=AUTH, timeout=CALL_TIMEOUT_S)

    def delete(self, session_id: str) -> bool:
        return self.sessions.Delete(api_pb2.DeleteSessionRequest(session_id=session_id),
                                    metadata=AUTH, timeout=CALL_TIMEOUT_S).deleted

    def assert_unharmed(self) -> None:
        """No process died or was restarted, the keeper's history is intact, and it serves."""
        assert self.stack.proc.poll() is None, self.stack.log_tail()
        for name, pid in self.pids.items():
            assert self.stack.pid(name) == pid, f"{name} was restarted:\n{self.stack.log_tail()}"
            os.kill(pid, 0)  # raises ProcessLookupError if it is gone
        assert list(self.get(self.keeper).token_ids) == self.keeper_tokens
        usage = self.turn(f"after-{uuid.uuid4().hex[:8]}", "Still there?", max_tokens=2)
        assert usage.durable and 0 < usage.completion_tokens <= 2
        errors = _unexpected_errors(self.stack.log.read_text(errors="replace"))
        assert not errors, "\n".join(errors[:20])


# gRPC logs these itself, with a traceback, when a request does not parse (see
# test_undecodable_request_is_invalid_argument); any other ERROR or traceback is a failure.
DECODE_ERROR = "google.protobuf.message.DecodeError: Error parsing message with type"


def _unexpected_errors(log: str) -> list[str]:
    """The stack log's ERROR lines and tracebacks, but for requests that did not parse."""
    lines = log.splitlines()
    errors = [line for line in lines if (" ERROR " in line or " CRITICAL " in line)
              and "Unexpected [DecodeError] raised by servicer method" not in line]
    tracebacks = sum(line.startswith("Traceback (most recent call last)") for line in lines)
    decode_errors = sum(line.startswith(DECODE_ERROR) for line in lines)
    if tracebacks != decode_errors:
        errors.append(f"{tracebacks - decode_errors} tracebacks not of a DecodeError")
    return errors


@pytest.fixture(scope="module")
def fuzz(tiny_model, tmp_path_factory, cache_dir):
    """One stack for the module, with an API key, so that auth is part of every request."""
    s = start_stack(tiny_model, tmp_path_factory.mktemp("fuzz") / "data",
                    extra=["--api-key", KEY], cache_dir=cache_dir)
    try:
        stack = FuzzStack(s, keeper=f"keeper-{uuid.uuid4().hex}")
        yield stack
        stack.channel.close()
    finally:
        s.stop()


# -- strategies ------------------------------------------------------------------------------
# A request is mostly well formed with one part broken (so each check of the validation is
# reached with everything else right), or broken everywhere at once.

NAMES = st.text(st.characters(categories=["L", "N"], include_characters="-_.:/"),
                min_size=1, max_size=16)
CONTROL = st.characters(max_codepoint=0x1F) | st.sampled_from("\x7f\u200b\u202e\ufeff\uffff")
session_ids = st.one_of(
    st.sampled_from(["fuzz-a", "fuzz-b"]),  # reused: appends grow them, deletes find them
    st.text(max_size=12),
    st.text(CONTROL, min_size=1, max_size=8),
    st.builds(lambda c, n: c * n, st.sampled_from("aé😀"),
              st.sampled_from([64, 65, 128, 256, 257, 1000])),  # around the limit, in bytes
)
bad_metadata = st.sampled_from([(), (("authorization", "Bearer nope"),),
                                (("authorization", "bearer"),), (("authorization", KEY),),
                                (("authorization", f"Basic {KEY}"),)])
messages = st.lists(
    st.builds(lambda role, content: api_pb2.ChatMessage(role=role, content=content),
              st.sampled_from(ROLES) | st.text(max_size=8),
              st.text(max_size=40) | st.sampled_from(["", " \n\t", "word " * 3000])),
    max_size=4)
prompts = st.text(max_size=60) | st.sampled_from(["", "word " * 300, "word " * 2100,
                                                  "word " * 1_000_000])  # 5 MB: over the limit
token_ids = st.one_of(st.lists(st.integers(0, 2**32 - 1), max_size=8),
                      st.lists(st.integers(0, VOCAB + 100), min_size=1, max_size=40),
                      st.sampled_from([[5] * 3000, [VOCAB - 1], [VOCAB]]))
GOOD = {
    "session_id": st.just("") | st.sampled_from(["fuzz-a", "fuzz-b", "fuzz-c"]) | NAMES,
    "input": st.one_of(
        st.lists(st.builds(lambda r, c: api_pb2.ChatMessage(role=r, content=c),
                           st.sampled_from(ROLES), NAMES), min_size=1, max_size=3),
        NAMES, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40).map(tuple)),
    "max_tokens": st.integers(1, 6),
    "temperature": st.floats(0, 2, width=32),
    "top_p": st.floats(0, 1, width=32),
    "seed": st.none() | st.integers(0, 2**64 - 1),
    "stop": st.lists(NAMES, max_size=3),
}
BAD = {
    "session_id": session_ids,
    "input": st.one_of(st.none(), messages, prompts, token_ids.map(tuple)),
    "max_tokens": st.one_of(st.integers(-(2**31), 0), st.integers(2049, 2**31 - 1)),
    "temperature": st.floats(width=32),
    "top_p": st.floats(width=32),
    "seed": st.integers(0, 2**64 - 1),
    "stop": st.lists(st.text(max_size=6), max_size=MAX_STOP_STRINGS + 2)
    | st.sampled_from([["s" * 200_000], ["\n"] * 1000]),
}


@st.composite
def generate_requests(draw) -> tuple[api_pb2.GenerateRequest, tuple]:
    """(request, metadata): well formed but for one part (or none, or all)."""
    broken = draw(st.sampled_from([None, None, "auth", "all", *GOOD]))

    def part(name: str):
        return draw((BAD if broken in (name, "all") else GOOD)[name])

    req = api_pb2.GenerateRequest(session_id=part("session_id"), max_tokens=part("max_tokens"),
                                  append=draw(st.booleans()), no_cache=draw(st.booleans()))
    given = part("input")
    if isinstance(given, list):  # chat messages; an empty list is still a chat
        req.chat.SetInParent()
        req.chat.messages.extend(given)
    elif isinstance(given, str):
        req.prompt = given
    elif isinstance(given, tuple):
        req.tokens.SetInParent()
        req.tokens.ids.extend(given)
    req.sampling.temperature = part("temperature")
    req.sampling.top_p = part("top_p")
    if (seed := part("seed")) is not None:
        req.sampling.seed = seed
    req.stop.extend(part("stop"))
    md = draw(bad_metadata) if broken in ("auth", "all") else AUTH
    return req, md


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    """One protobuf field on the wire: varint (0), 64-bit (1), length-delimited (2), 32-bit (5)."""
    body = {0: lambda: _varint(int.from_bytes(payload[:8] or b"\0", "little")),
            1: lambda: payload[:8].ljust(8, b"\0"), 2: lambda: _varint(len(payload)) + payload,
            5: lambda: payload[:4].ljust(4, b"\0")}[wire_type]()
    return _varint(number << 3 | wire_type) + body


GOOD_REQUEST = api_pb2.GenerateRequest(prompt="Hello", max_tokens=2).SerializeToString()
# Field numbers GenerateRequest does not use (a newer client's fields, say).
FIRST_UNKNOWN = 1 + max(f.number for f in api_pb2.GenerateRequest.DESCRIPTOR.fields)
unknown_fields = st.lists(
    st.builds(_field, st.integers(FIRST_UNKNOWN, 2**29 - 1).filter(
        lambda n: not 19000 <= n <= 19999),
              st.sampled_from([0, 1, 2, 5]), st.binary(max_size=12)),
    min_size=1, max_size=4).map(b"".join)
not_utf8 = st.binary(min_size=1, max_size=12).filter(lambda b: not _is_utf8(b))


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode()
        return True
    except UnicodeDecodeError:
        return False


# -- gRPC ------------------------------------------------------------------------------------


def _generate(stack: FuzzStack, req: api_pb2.GenerateRequest, md) -> grpc.StatusCode:
    """One call, checked: OK with a well-formed stream, or a clear status with a sentence."""
    try:
        out = list(stack.generation.Generate(req, metadata=md, timeout=CALL_TIMEOUT_S))
    except grpc.RpcError as e:
        assert e.code() in CLEAR, f"{e.code()}: {e.details()!r}"
        assert e.details(), e.code()
        return e.code()
    *body, last = out
    assert last.HasField("usage") and not any(m.HasField("usage") for m in body)
    assert last.finish_reason in (api_pb2.FINISH_REASON_STOP, api_pb2.FINISH_REASON_LENGTH)
    u = last.usage
    assert sum(len(m.token_ids) for m in out) == u.completion_tokens <= req.max_tokens
    assert u.cached_tokens < u.prompt_tokens
    if req.session_id:  # an acknowledged turn of a named session is in its record on disk
        assert u.durable, f"turn of session {req.session_id!r} acknowledged but not durable"
    return OK


def test_random_generate_requests_get_ok_or_a_clear_status(fuzz):
    """Also three fixed cases: a 1 KiB (256 emoji) session id, past LMDB's key size once the
    store prefixes the tenant (it was acknowledged, never durable); the longest session id
    allowed; and a 5 MB prompt, over gRPC's message size."""
    seen: Counter = Counter()

    @settings(FUZZ, max_examples=60)
    @given(call=generate_requests())
    @example(call=(api_pb2.GenerateRequest(session_id="😀" * 256, prompt="hi", max_tokens=2),
                   AUTH))
    @example(call=(api_pb2.GenerateRequest(session_id="é" * (MAX_SESSION_ID_BYTES // 2),
                                           prompt="hi", max_tokens=2, append=True), AUTH))
    @example(call=(api_pb2.GenerateRequest(prompt="word " * 1_000_000, max_tokens=2), AUTH))
    def run(call):
        seen[_generate(fuzz, *call)] += 1

    run()
    assert seen[OK] and seen[grpc.StatusCode.INVALID_ARGUMENT], seen  # both sides were reached
    fuzz.assert_unharmed()


def test_random_session_calls_get_ok_or_a_clear_status(fuzz):
    seen: Counter = Counter()

    @settings(FUZZ, max_examples=40)
    @given(op=st.sampled_from(["list", "get", "delete"]), sid=st.just("") | session_ids,
           md=st.sampled_from([AUTH] * 4) | bad_metadata)
    def run(op, sid, md):
        try:
            if op == "list":
                r = fuzz.sessions.List(api_pb2.ListSessionsRequest(), metadata=md,
                                       timeout=CALL_TIMEOUT_S)
                assert fuzz.keeper in [s.session_id for s in r.sessions]
            elif op == "get":
                s = fuzz.sessions.Get(api_pb2.GetSessionRequest(session_id=sid), metadata=md,
                                      timeout=CALL_TIMEOUT_S)
                assert s.session_id == sid and len(s.token_ids) == s.token_count
            else:
                fuzz.sessions.Delete(api_pb2.DeleteSessionRequest(session_id=sid), metadata=md,
                                     timeout=CALL_TIMEOUT_S)
            seen[OK] += 1
        except grpc.RpcError as e:
            assert e.code() in CLEAR, f"{op} {sid!r}: {e.code()}: {e.details()!r}"
            assert e.details(), e.code()
            seen[e.code()] += 1

    run()
    assert seen[OK] and seen[grpc.StatusCode.NOT_FOUND], seen
    fuzz.assert_unharmed()


def _raw_generate(stack: FuzzStack, raw: bytes):
    """Generate with bytes that skip the client's serializer: the server must parse them."""
    call = stack.channel.unary_stream("/kvbank.v1.Generation/Generate",
                                      request_serializer=lambda b: b,
                                      response_deserializer=api_pb2.GenerateResponse.FromString)
    return list(call(raw, metadata=AUTH, timeout=CALL_TIMEOUT_S))


def test_random_bytes_get_a_status_and_a_sentence(fuzz):
    """Bytes that do not parse, or parse into nonsense, or carry a string field that is not
    UTF-8: each call ends with a status and a sentence, and nothing else is disturbed."""

    @settings(FUZZ, max_examples=40)
    @given(raw=st.one_of(st.binary(max_size=64),
                         st.builds(bytes.__add__, st.just(GOOD_REQUEST), st.binary(max_size=16)),
                         st.builds(lambda n, b: _field(n, 2, b), st.sampled_from([1, 3]),
                                   not_utf8)))
    def run(raw):
        try:
            _raw_generate(fuzz, raw)
        except grpc.RpcError as e:
            assert e.code() in CLEAR, \
                f"{e.code()}: {e.details()!r}"
            assert e.details(), e.code()

    run()
    fuzz.assert_unharmed()


def test_unknown_fields_are_ignored(fuzz):
    @settings(FUZZ, max_examples=25)
    @given(extra=unknown_fields, before=st.booleans())
    def run(extra, before):
        *_, last = _raw_generate(fuzz, extra + GOOD_REQUEST if before else GOOD_REQUEST + extra)
        assert last.HasField("usage") and last.usage.completion_tokens <= 2

    run()


@pytest.mark.parametrize("raw", [b"\xff\xff\xff", _field(1, 2, b"\xff\xfe"),
                                 _field(3, 2, b"\xc3(")],
                         ids=["corrupt", "session-id-not-utf8", "prompt-not-utf8"])
def test_undecodable_request_is_invalid_argument(fuzz, raw):
    err = rpc_error(lambda: _raw_generate(fuzz, raw))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    assert "GenerateRequest" in err.details()


def test_deleting_a_session_while_it_generates(fuzz):
    """One thread streams a long turn of session s while this one deletes s over and over:
    both end with clear answers, the worker stays up, and the next turn on s works."""
    sid = f"busy-{uuid.uuid4().hex[:8]}"
    req = api_pb2.GenerateRequest(session_id=sid, append=True, max_tokens=300)
    req.chat.messages.add(role="user", content="Go on and on.")
    streaming, outcome = threading.Event(), {}

    def stream():
        try:
            out = []
            for msg in fuzz.generation.Generate(req, metadata=AUTH, timeout=120):
                out.append(msg)
                streaming.set()
            outcome["last"] = out[-1]
        except grpc.RpcError as e:
            outcome["error"] = e
        finally:
            streaming.set()

    thread = threading.Thread(target=stream)
    thread.start()
    deletes, during = [], 0
    while thread.is_alive():
        deletes.append(fuzz.delete(sid))  # raises on anything but an answer
        during += streaming.is_set() and thread.is_alive()
        time.sleep(0.005)
    thread.join()

    if "error" in outcome:
        e = outcome["error"]
        assert e.code() in CLEAR and e.details(), (e.code(), e.details())
    else:
        last = outcome["last"]
        assert last.HasField("usage")
        assert last.finish_reason in (api_pb2.FINISH_REASON_STOP, api_pb2.FINISH_REASON_LENGTH)
    assert during > 0, "no delete ran while the turn streamed"
    assert all(isinstance(d, bool) for d in deletes)

    usage = fuzz.turn(sid, "Are you still there?", max_tokens=4)
    assert usage.durable
    assert fuzz.get(sid).token_count == usage.prompt_tokens + usage.completion_tokens
    fuzz.assert_unharmed()


def test_a_session_deleted_mid_turn_does_not_come_back(fuzz):
    sid = f"undead-{uuid.uuid4().hex[:8]}"
    fuzz.turn(sid, "A secret to forget.", max_tokens=4)
    secret = list(fuzz.get(sid).token_ids)
    req = api_pb2.GenerateRequest(session_id=sid, append=True, max_tokens=800)
    req.chat.messages.add(role="user", content="Go on and on.")
    stream = fuzz.generation.Generate(req, metadata=AUTH, timeout=120)
    next(stream)  # the turn is running
    assert fuzz.delete(sid) is True
    assert rpc_error(lambda: fuzz.get(sid)).code() == grpc.StatusCode.NOT_FOUND
    try:
        for _ in stream:
            pass
    except grpc.RpcError as e:
        assert e.details(), e.code()  # the turn may be refused or cancelled; with a sentence
    try:
        after = list(fuzz.get(sid).token_ids)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.NOT_FOUND
        return
    assert after[: len(secret)] != secret, "the deleted history came back"


# -- the OpenAI shim -------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=10)
numbers = st.one_of(st.integers(), st.floats(), st.sampled_from(
    [0, 1, -1, 2**31, 2**63, 2**64, 10**30, -(10**30), 1e308, float("nan"), float("inf")]))
openai_messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant",
                                                    "tool", "wizard"]) | json_values},
                          optional={"content": st.text(max_size=30) | json_values | st.lists(
                              st.fixed_dictionaries({"type": st.just("text") | json_values,
                                                     "text": st.text(max_size=10) | json_values}),
                              max_size=3)}),
    max_size=3) | json_values
GOOD_BODY = {  # optional fields, each well formed
    "temperature": st.floats(0, 2), "top_p": st.floats(0, 1), "seed": st.integers(0, 2**64 - 1),
    "stop": NAMES | st.lists(NAMES, min_size=1, max_size=3), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": NAMES, "n": st.just(1), "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, 100).map(str), st.integers(-100, 100)),
}
BAD_BODY = {  # any field, with anything in it
    "model": json_values, "messages": openai_messages,
    "prompt": st.lists(st.integers(-5, 2**33), max_size=5) | json_values,
    "max_tokens": numbers | json_values, "max_completion_tokens": numbers,
    "temperature": numbers, "top_p": numbers, "seed": numbers, "n": numbers, "best_of": numbers,
    "stop": json_values, "stream": json_values, "stream_options": json_values,
    "user": st.just("u" * 300) | json_values, "tools": json_values, "logprobs": json_values,
    "response_format": json_values, "echo": json_values, "suffix": json_values,
    "not_an_openai_field": json_values,
}


@st.composite
def shim_requests(draw) -> tuple[str, bytes]:
    """(path, body): mostly an OpenAI body with a few fields broken, else any bytes at all."""
    chat = draw(st.booleans())
    path = "/v1/chat/completions" if chat else "/v1/completions"
    shape = draw(st.sampled_from(["openai"] * 4 + ["json", "bytes", "not-utf8", "fixed"]))
    if shape == "json":
        return path, json.dumps(draw(json_values)).encode()
    if shape == "bytes":
        return path, draw(st.binary(max_size=40))
    if shape == "not-utf8":
        return path, b'{"prompt": "' + draw(not_utf8) + b'", "max_tokens": 2}'
    if shape == "fixed":
        return path, draw(st.sampled_from([b"", b"{", b"\xef\xbb\xbf{}", b"[]", b"null",
                                           b'{"prompt": "hi"}' * 2, b'{"max_tokens": NaN}']))
    # max_tokens is always set: the shim's default (256) would make the run slow.
    body = {"model": "kvbank", "max_tokens": draw(st.integers(1, 4))}
    if chat:
        body["messages"] = [{"role": "user", "content": draw(NAMES)}]
    else:
        body["prompt"] = draw(NAMES | st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8))
    for name in draw(st.lists(st.sampled_from(sorted(GOOD_BODY)), max_size=3, unique=True)):
        body[name] = draw(GOOD_BODY[name])
    for name in draw(st.lists(st.sampled_from(sorted(BAD_BODY)), max_size=2, unique=True)):
        body[name] = draw(BAD_BODY[name])
    return path, json.dumps(body).encode()  # NaN and Infinity too: Python's JSON reads them


http_headers = st.fixed_dictionaries(
    {"authorization": st.sampled_from([f"Bearer {KEY}"] * 8 + ["", "Bearer nope", KEY])},
    optional={"content-type": st.sampled_from(["text/plain", "application/x-www-form-urlencoded",
                                               "application/json; charset=latin-1"]),
              # (HTTP header values carry no leading or trailing whitespace: clients refuse it)
              "x-session-id": st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E),
                                      max_size=300).filter(lambda v: v == v.strip())
              | st.binary(min_size=1, max_size=8).map(lambda b: bytes(x | 0x80 for x in b))})


def _check_http(r: httpx.Response, path: str) -> int:
    """An OpenAI error with a clear status, or a 200 whose body (or stream) is well formed."""
    assert r.status_code in HTTP_CLEAR | {200}, (r.status_code, r.text[:500])
    assert "Traceback" not in r.text
    if r.status_code != 200:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "code", "param"} and error["message"], error
        return r.status_code
    chat = path.endswith("/chat/completions")
    if r.headers["content-type"].startswith("text/event-stream"):
        data = [line.removeprefix("data: ") for line in r.text.splitlines()
                if line.startswith("data: ")]
        assert data[-1] == "[DONE]", data[-3:]
        chunks = [json.loads(d) for d in data[:-1]]
        assert chunks and all("error" not in c for c in chunks), chunks[-1]
        kind = "chat.completion.chunk" if chat else "text_completion"
        assert all(c["object"] == kind for c in chunks)
        return 200
    body = r.json()
    assert body["object"] == ("chat.completion" if chat else "text_completion")
    [choice] = body["choices"]
    assert choice["finish_reason"] in ("stop", "length")
    assert isinstance(choice["message"]["content"] if chat else choice["text"], str)
    assert body["usage"]["total_tokens"] == (body["usage"]["prompt_tokens"]
                                            + body["usage"]["completion_tokens"])
    return 200


def test_random_shim_requests_get_a_200_or_an_openai_error(fuzz):
    seen: Counter = Counter()
    with httpx.Client(base_url=fuzz.stack.shim_url, timeout=CALL_TIMEOUT_S) as http:

        @settings(FUZZ, max_examples=100)  # cheap: most are refused before the router
        @given(request=shim_requests(), headers=http_headers)
        @example(request=("/v1/completions", b'{"prompt": "hi", "max_tokens": 2}'),
                 headers={"authorization": f"Bearer {KEY}", "content-type": "text/plain"})
        @example(request=("/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": "x" * 5_000_000}], "max_tokens": 2}
        ).encode()), headers={"authorization": f"Bearer {KEY}"})
        def run(request, headers):
            path, body = request
            seen[_check_http(http.post(path, content=body, headers=headers), path)] += 1

        run()
    assert seen[200] and seen[400] and seen[401] and seen[413], seen
    fuzz.assert_unharmed()


def test_a_request_over_the_routers_message_limit_is_a_413_not_a_429(fuzz):
    """gRPC itself refuses a message over 4 MiB with RESOURCE_EXHAUSTED; passed on, that was a
    429 with Retry-After, and the openai clients retried a request that can never succeed."""
    for path, body in [("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "x" * (5 << 20)}]}),
                       ("/v1/completions", {"prompt": "x" * (5 << 20)})]:
        r = httpx.post(fuzz.stack.shim_url + path, json=body | {"max_tokens": 2},
                       headers={"authorization": f"Bearer {KEY}"}, timeout=CALL_TIMEOUT_S)
        assert r.status_code == 413, r.text[:300]
        assert r.headers["x-should-retry"] == "false" and "retry-after" not in r.headers
        assert r.json()["error"]["code"] == "request_too_large"


# -- every string field of the three HTTP APIs: lone surrogates and deep nesting --------------
# Python's JSON reader takes "\ud800" (a lone surrogate) as a string that protobuf then cannot
# encode, and ~1,000 levels of nesting as a RecursionError: both were a 500. Each string of a
# body rich in fields (tools, tool calls and results, system, metadata) is broken in turn.

SCHEMA = {"type": "object", "properties": {"path": {"type": "string", "description": "P"}}}
API_BODIES = {
    "/v1/chat/completions": {
        "model": "kvbank", "max_tokens": 2, "user": "u1", "stop": ["zz"],
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": [{"type": "text", "text": "U"}]},
            {"role": "assistant", "content": "A", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "read", "arguments": "{\"path\": \"a\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "R"}],
        "tools": [{"type": "function", "function": {"name": "read", "description": "D",
                                                    "parameters": SCHEMA}}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "n", "schema": SCHEMA}}},
    "/v1/responses": {
        "model": "kvbank", "max_output_tokens": 2, "instructions": "I",
        "prompt_cache_key": "pk", "metadata": {"k": "v"},
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "U"}]},
            {"type": "function_call", "call_id": "c1", "name": "read",
             "arguments": "{\"path\": \"a\"}"},
            {"type": "function_call_output", "call_id": "c1", "output": "R"}],
        "tools": [{"type": "function", "name": "read", "description": "D",
                   "parameters": SCHEMA}],
        "text": {"format": {"type": "json_schema", "name": "n", "schema": SCHEMA}}},
    "/v1/messages": {
        "model": "kvbank", "max_tokens": 2, "stop_sequences": ["zz"],
        "metadata": {"user_id": "u"}, "system": [{"type": "text", "text": "S"}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "U"}]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "t1", "name": "read", "input": {"path": "a"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "R"}]}],
        "tools": [{"name": "read", "description": "D", "input_schema": SCHEMA}]},
}
MARK = "@@kvbank-fuzz@@"


def _string_fields(value, path: str = "") -> list[str]:
    """Every string's path in a body, as kvbank/json_input.py names it."""
    if isinstance(value, str):
        return [path]
    if isinstance(value, dict):
        return [p for k, v in value.items()
                for p in _string_fields(v, f"{path}.{k}" if path else k)]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _string_fields(v, f"{path}[{i}]")]
    return []


def _steps(path: str) -> list:
    return [int(p) if p.isdigit() else p
            for p in path.replace("[", ".").replace("]", "").split(".")]


def _at(body: dict, path: str) -> str:
    node = body
    for p in _steps(path):
        node = node[p]
    return node


def _with(body: dict, path: str, fragment: str) -> bytes:
    """The body's JSON with the string at `path` replaced by the raw JSON `fragment`."""
    value = json.loads(json.dumps(body))
    *parents, last = _steps(path)
    node = value
    for p in parents:
        node = node[p]
    node[last] = MARK
    return json.dumps(value).replace(json.dumps(MARK), fragment, 1).encode()


def _escaped(text: str) -> str:
    return json.dumps(text)[1:-1]  # \uXXXX for what JSON must escape


lone_surrogates = st.integers(0xD800, 0xDFFF).map(lambda c: f"\\u{c:04x}")


@st.composite
def broken_strings(draw, path: str, original: str) -> tuple[str, str]:
    """(fragment, what the refusal must name): a lone surrogate somewhere in the string (a
    high half never followed by a low one), or the string replaced by nesting past the
    limit (to ~3,000 deep, beyond Python's own reader)."""
    if draw(st.booleans()):
        text = draw(st.text(st.characters(codec="utf-8"), max_size=12)) + original
        at = draw(st.integers(0, len(text)))
        half = draw(lone_surrogates)
        after = _escaped(text[at:])
        if half < "\\udc00" and after.startswith("\\udc"):  # it would pair with its neighbour
            after = "x" + after
        return f'"{_escaped(text[:at])}{half}{after}"', path
    depth = draw(st.integers(129, 3000))
    return "[" * depth + '"x"' + "]" * depth, path.split(".", 1)[0].split("[", 1)[0]


def _names(r: httpx.Response, api: str, field: str) -> bool:
    """The refusal names the field: OpenAI's `param`, Anthropic's message."""
    if api == "/v1/messages":
        body = r.json()
        return body["type"] == "error" and field in body["error"]["message"]
    return r.json()["error"]["param"] == field


@pytest.mark.parametrize("api", sorted(API_BODIES))
def test_a_lone_surrogate_or_deep_nesting_in_any_string_field_is_a_400_naming_it(fuzz, api):
    body = API_BODIES[api]
    fields = _string_fields(body)
    assert len(fields) >= 14, fields
    headers = {"authorization": f"Bearer {KEY}", "x-api-key": KEY,
               "content-type": "application/json"}
    with httpx.Client(base_url=fuzz.stack.shim_url, timeout=CALL_TIMEOUT_S) as http:
        def refused(raw: bytes, field: str) -> None:
            r = http.post(api, content=raw, headers=headers)
            assert r.status_code == 400, (field, r.status_code, r.text[:300])
            assert "Traceback" not in r.text and "panic" not in r.text
            assert _names(r, api, field), (field, r.text[:300])

        for path in fields:  # every field, each way, once
            top = path.split(".", 1)[0].split("[", 1)[0]
            refused(_with(body, path, '"a\\ud800b"'), path)
            refused(_with(body, path, "[" * 200 + "1" + "]" * 200), top)
            refused(_with(body, path, "[" * 2000 + "1" + "]" * 2000), top)

        @settings(FUZZ, max_examples=60)
        @given(data=st.data())
        def run(data):
            path = data.draw(st.sampled_from(fields))
            fragment, field = data.draw(broken_strings(path, _at(body, path)))
            refused(_with(body, path, fragment), field)

        run()
        # A surrogate pair (an emoji escaped as two halves) is Unicode, and is served.
        ok = http.post(api, headers=headers, content=json.dumps(
            {"model": "kvbank", "max_output_tokens": 2, "input": "Hi \ud83d\ude00"}
            if api == "/v1/responses" else
            {"model": "kvbank", "max_tokens": 2,
             "messages": [{"role": "user", "content": "Hi \ud83d\ude00"}]}).encode())
        assert ok.status_code == 200, ok.text[:300]
    fuzz.assert_unharmed()


def test_a_stored_response_the_shim_did_not_write_is_a_400_naming_it(fuzz):
    """The Responses gRPC service stores whatever bytes a client puts under an id; read back
    as a response (GET, previous_response_id) such a value was a 500."""
    stub = api_pb2_grpc.ResponsesStub(fuzz.channel)
    headers = {"authorization": f"Bearer {KEY}"}
    values = [b"not json", b"\xff\xfe", b"[]", b'{"items": 5}', b'{"items": [], "response": 1}',
              b'{"items": [], "response": {"output": {}}}', b'{"items": [], "response": '
              b'{"output": []}}', b'{"a": ' + b"[" * 3000 + b"]" * 3000 + b"}"]
    with httpx.Client(base_url=fuzz.stack.shim_url, timeout=CALL_TIMEOUT_S) as http:
        for i, value in enumerate(values):
            rid = f"resp_fuzz_{uuid.uuid4().hex[:8]}_{i}"
            stub.Put(api_pb2.StoredResponse(id=rid, created_at=time.time(), body=value),
                     metadata=AUTH, timeout=CALL_TIMEOUT_S)
            got = http.get(f"/v1/responses/{rid}", headers=headers)
            go_on = http.post("/v1/responses", headers=headers, json={
                "model": "kvbank", "previous_response_id": rid, "input": "Go on.",
                "max_output_tokens": 2})
            for r, param in ((got, None), (go_on, "previous_response_id")):
                assert r.status_code == 400, (value, r.status_code, r.text[:300])
                error = r.json()["error"]
                assert rid in error["message"] or param == error["param"], error
                if param:
                    assert error["param"] == param, error
        # Stored as this API stores one, but its items are not input items: continuing it
        # is refused like any input that is not.
        rid = f"resp_fuzz_{uuid.uuid4().hex[:8]}"
        value = {"items": [5, {"type": "wizard"}], "response": {"id": rid, "output": [None]}}
        stub.Put(api_pb2.StoredResponse(id=rid, created_at=time.time(),
                                        body=json.dumps(value).encode()),
                 metadata=AUTH, timeout=CALL_TIMEOUT_S)
        r = http.post("/v1/responses", headers=headers, json={
            "model": "kvbank", "previous_response_id": rid, "input": "Go on.",
            "max_output_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["message"], r.text[:300]
    fuzz.assert_unharmed()


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "max_output_tokens"])
def test_max_tokens_beyond_the_context_names_it_and_says_how_many_fit(fuzz, field):
    """`max_tokens: 2147483647` was a 400 naming `messages` (`prompt is too long: 31 tokens >
    0 maximum`), which agents take as "compact the conversation"."""
    path = "/v1/responses" if field == "max_output_tokens" else "/v1/chat/completions"
    body = ({"input": "Hi"} if field == "max_output_tokens"
            else {"messages": [{"role": "user", "content": "Hi"}]})
    r = httpx.post(fuzz.stack.shim_url + path, timeout=CALL_TIMEOUT_S,
                   headers={"authorization": f"Bearer {KEY}"},
                   json={"model": "kvbank", field: 2**31 - 1, **body})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == field and error["code"] == "max_tokens_too_large", error
    assert "prompt is too long" not in error["message"], error
    fits = int(error["message"].split("at most ")[1].split()[0])
    assert 2000 < fits < 2048, error  # the tiny model's context is 2,048 tokens


@pytest.mark.parametrize("depth", [200, 3000])
def test_deep_json_in_a_grpc_field_is_invalid_argument_naming_it(fuzz, depth):
    """The gRPC API's JSON fields (tools, a schema, a tool call's arguments): nesting past
    the limit was a RecursionError, INTERNAL."""
    deep = "[" * depth + "1" + "]" * depth
    cases = {"tools": lambda r: setattr(r.chat, "tools_json", deep),
             "response_format.json_schema": lambda r: (
                 setattr(r.response_format, "type", "json_schema"),
                 setattr(r.response_format, "json_schema", '{"a": ' + deep + "}")),
             "chat.messages[0].tool_calls[0].arguments": lambda r: r.chat.messages[0].tool_calls
             .add(id="c", name="f", arguments='{"a": ' + deep + "}")}
    for param, breaks in cases.items():
        req = api_pb2.GenerateRequest(max_tokens=2)
        req.chat.messages.add(role="assistant", content="A")
        req.chat.messages.add(role="user", content="U")
        breaks(req)
        err = rpc_error(lambda: list(fuzz.generation.Generate(req, metadata=AUTH,
                                                             timeout=CALL_TIMEOUT_S)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (param, err.details())
        assert dict(err.trailing_metadata())["x-kvbank-param"] == param, err.details()
        assert "deeper than 128" in err.details()


def test_the_router_refuses_a_schema_over_the_workers_limit_from_its_length_alone():
    """A schema over the worker's --max-grammar-bytes (in its Info) is refused by the router
    before it is parsed: a client resending a 1.1 MB schema made the router parse it each time
    (~40 ms of its loop, which every stream's tokens pass through) and the worker read it
    again only to refuse it. Under the limit the same text is read, and refused as JSON."""
    from kvbank.contracts.failures import GrammarTooLarge, InvalidRequest
    from kvbank.router.validation import validate

    req = api_pb2.GenerateRequest(max_tokens=2)
    req.chat.messages.add(role="user", content="Fill it in.")
    req.response_format.type = "json_schema"
    req.response_format.json_schema = "not JSON " * 40_000  # 360 KB
    with pytest.raises(GrammarTooLarge) as big:
        validate(req, vocab_size=1000, max_grammar_bytes=256 << 10)
    assert big.value.param == "response_format" and "360,000 bytes" in str(big.value)
    with pytest.raises(InvalidRequest, match="is not valid JSON"):
        validate(req, vocab_size=1000, max_grammar_bytes=1 << 20)


def test_a_schema_over_the_grammar_size_limit_is_refused_at_once_naming_it(fuzz):
    """A 1.1 MB schema was compiled on the worker's engine thread (every stream stalled 3.4 s)
    and refused with llguidance's panic and backtrace. Compiles run beside the engine now, and
    one over --max-grammar-bytes (256 KiB) is not compiled at all."""
    schema = {"type": "object", "properties": {
        f"field_{i}": {"type": "string", "enum": [f"v{i}_{j}" for j in range(3)]}
        for i in range(4000)}}
    r = httpx.post(fuzz.stack.shim_url + "/v1/chat/completions", timeout=CALL_TIMEOUT_S,
                   headers={"authorization": f"Bearer {KEY}"}, json={
                       "model": "kvbank", "max_tokens": 2,
                       "messages": [{"role": "user", "content": "Fill it in."}],
                       "response_format": {"type": "json_schema",
                                           "json_schema": {"name": "big", "schema": schema}}})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "response_format" and "--max-grammar-bytes" in error["message"]
    assert "panic" not in r.text and "backtrace" not in r.text
