"""OpenAI bodies in, a kvbank `GenerateRequest` out; the router's messages in, OpenAI bodies out.

A body is validated here, once, before anything reaches the router: whatever the OpenAI API
would refuse becomes an `ApiError` (HTTP 400) whose message and `param` name the field.
Fields that only tune sampling in ways kvbank does not (penalties, logit_bias, metadata, ...)
are ignored; fields that would change the answer's shape (n > 1, tools, logprobs, a JSON
response format, echo, best_of) are refused, so a client never gets less than it asked for
without being told.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field

from kvbank.client import CACHE_SOURCES, FINISH_REASONS
from kvbank.v1 import api_pb2

# What a request without max_tokens / max_completion_tokens gets (`--default-max-tokens`),
# lowered by the router to the room its prompt leaves in the context and under its ceilings
# (`fit_max_tokens`), so a long prompt is never refused for it. The OpenAI API's own default
# is "as many as fit"; kvbank prices a request's memory by prompt + max_tokens before it runs,
# so the default is a bound a coding agent's longest answer fits in, not the whole context.
DEFAULT_MAX_TOKENS = 4096
# OpenAI's default, honoured as given: clients that want greedy answers send 0.
DEFAULT_TEMPERATURE = 1.0
MAX_TEMPERATURE = 2.0  # OpenAI's bound (the router would take up to 10)
MAX_INT32, MAX_UINT32 = 2**31 - 1, 2**32 - 1  # the proto's field types
# gRPC's default receive limit, which the router keeps. A larger request would come back from
# gRPC itself as RESOURCE_EXHAUSTED, which the shim would pass on as a 429: no rate limit, since
# the same request can never succeed. It is refused here with 413 instead.
MAX_REQUEST_BYTES = 4 << 20
# "developer" is OpenAI's newer name for the system role.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}

# What vllm-router adds to a client's body before it asks a render endpoint for the prompt's
# tokens (it re-serializes the body with its own defaults). None of them changes the prompt:
# the render endpoints drop a key that holds exactly this value, and validate the rest of the
# body as the generation endpoint does.
ROUTER_RENDER_DEFAULTS = {
    "logprobs": False, "echo": False, "no_stop_trim": False, "ignore_eos": False,
    "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
    "stream_reasoning": True, "return_hidden_states": False, "include_reasoning": True,
}


class ApiError(Exception):
    """An answer in OpenAI's error shape: `{"error": {message, type, code, param}}`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 retry_after_s: float | None = None, retry: bool | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.code, self.param, self.retry_after_s = code, param, retry_after_s
        self.retry = retry  # False: the same request can never succeed (x-should-retry)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code,
                          "param": self.param}}

    def headers(self) -> dict[str, str]:
        """Retry-After in whole seconds (HTTP's unit), and to the millisecond for the openai
        clients, which read `retry-after-ms` first; `x-should-retry`, which they obey."""
        out = {} if self.retry is None else {"x-should-retry": str(self.retry).lower()}
        if self.retry_after_s is not None:
            out["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
            out["retry-after-ms"] = str(max(1, round(self.retry_after_s * 1000)))
        return out


def invalid(param: str | None, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value" if param else None)


@dataclass(frozen=True)
class OpenAIRequest:
    kind: str  # "chat" | "completion"
    generate: api_pb2.GenerateRequest
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk that carries the usage
    # max_tokens is the server's default, not the client's: the shim may lower it to the room
    # the prompt leaves (a client's own max_tokens is never lowered: too long is a 400).
    fit_max_tokens: bool = False


def parse(kind: str, body: object, *, session_header: str | None,
          default_max_tokens: int = DEFAULT_MAX_TOKENS) -> OpenAIRequest:
    """A decoded JSON body of /v1/chat/completions (kind "chat") or /v1/completions.

    The session name is the `x-session-id` header, else `x-smg-routing-key` (what SMG-style
    gateways send), else the body's `user`, else none: most clients send none, and the worker
    then finds the conversation by its tokens. The input is always the whole conversation
    (append=False), as OpenAI clients send it.
    """
    if not isinstance(body, dict):
        raise invalid(None, f"the body must be a JSON object; given {type(body).__name__}")
    _optional(body, "model", str, "a string")
    user = _optional(body, "user", str, "a string")
    _refuse_unsupported(kind, body)
    req = api_pb2.GenerateRequest(session_id=session_header or user or "", append=False)
    if kind == "chat":
        req.chat.messages.extend(_messages(body))
    else:
        _prompt(body, req)
    max_tokens = _int(body, "max_completion_tokens", lo=1, hi=MAX_INT32)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", lo=1, hi=MAX_INT32)
    req.max_tokens = default_max_tokens if max_tokens is None else max_tokens
    temperature = _number(body, "temperature", 0.0, MAX_TEMPERATURE)
    req.sampling.temperature = DEFAULT_TEMPERATURE if temperature is None else temperature
    top_p = _number(body, "top_p", 0.0, 1.0)
    req.sampling.top_p = 1.0 if top_p is None else top_p
    seed = _int(body, "seed", lo=0, hi=2**64 - 1)
    if seed is not None:
        req.sampling.seed = seed
    req.stop.extend(_stop(body))
    stream = bool(_optional(body, "stream", bool, "true or false"))
    options = _optional(body, "stream_options", dict, "an object") or {}
    include_usage = _optional(options, "include_usage", bool, "true or false",
                              param="stream_options.include_usage")
    if (size := req.ByteSize()) > MAX_REQUEST_BYTES:
        raise ApiError(413, f"the request is {size} bytes as a kvbank request; the router takes "
                            f"at most {MAX_REQUEST_BYTES}: shorten the prompt",
                       code="request_too_large", retry=False)
    return OpenAIRequest(kind, req, stream, bool(include_usage),
                         fit_max_tokens=max_tokens is None)


def parse_render(kind: str, body: object, *, session_header: str | None) -> OpenAIRequest:
    """A body of /v1/chat/completions/render or /v1/completions/render: the generation
    endpoint's body, less the keys vllm-router adds with its defaults (ROUTER_RENDER_DEFAULTS);
    everything else is validated by `parse`, so a body it refuses is refused here alike. A body
    without max_tokens renders with 1: its generation would lower the default to whatever room
    the prompt leaves, so only a prompt that fills the context is refused, as it would be."""
    if isinstance(body, dict):
        body = {k: v for k, v in body.items()
                if not (k in ROUTER_RENDER_DEFAULTS and v is ROUTER_RENDER_DEFAULTS[k])}
    return parse(kind, body, session_header=session_header, default_max_tokens=1)


def _refuse_unsupported(kind: str, body: dict) -> None:
    n = _int(body, "n", lo=1)
    if n not in (None, 1):
        raise invalid("n", f"n must be 1: kvbank returns one choice per request; given {n}")
    if body.get("tools") or body.get("functions"):
        name = "tools" if body.get("tools") else "functions"
        raise invalid(name, f"{name} are not supported: kvbank returns text only")
    if body.get("logprobs") is not None and body.get("logprobs") is not False:
        raise invalid("logprobs", "logprobs are not supported")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise invalid("response_format", 'response_format must be {"type": "text"}: kvbank '
                                         "does not constrain output to JSON")
    if kind == "completion":
        if body.get("echo"):
            raise invalid("echo", "echo is not supported")
        if body.get("best_of") not in (None, 1):
            raise invalid("best_of", "best_of must be 1")
        if body.get("suffix"):
            raise invalid("suffix", "suffix is not supported")


def each_message(body: dict):
    """(where, message) for each object of body["messages"], a non-empty array; else a 400
    naming what is wrong (the OpenAI and Anthropic routes share it)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        given = ("it is missing" if messages is None else "it is empty" if messages == []
                 else f"given {type(messages).__name__}")
        raise invalid("messages", f"messages must be a non-empty array of messages; {given}")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(where, f"{where} must be an object with role and content")
        yield where, m


def _messages(body: dict) -> list[api_pb2.ChatMessage]:
    out = []
    for where, m in each_message(body):
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"{where}.role", f"{where}.role must be one of "
                                           f"{', '.join(ROLES)}; given {role!r}")
        out.append(api_pb2.ChatMessage(role=ROLES[role], content=_content(m.get("content"), where)))
    return out


def _content(content: object, where: str) -> str:
    """A string, null (an assistant turn that only called tools), or text parts, joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise invalid(f"{where}.content", f"{where}.content must be a string or an array of "
                                          f"text parts; given {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise invalid(f"{at}.type", f'{at}.type must be "text" (kvbank serves a text-only '
                                        f"model); given {kind!r}")
        if not isinstance(part.get("text"), str):
            raise invalid(f"{at}.text", f"{at}.text must be a string")
        texts.append(part["text"])
    return "".join(texts)


def _prompt(body: dict, req: api_pb2.GenerateRequest) -> None:
    """One prompt: a string, an array of one string, or an array of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        req.prompt = prompt
    elif (isinstance(prompt, list) and prompt
          and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_UINT32
                  for t in prompt)):
        req.tokens.ids.extend(prompt)
    else:
        raise invalid("prompt", "prompt must be a string or an array of token ids (one prompt "
                                "per request); " + ("it is missing" if prompt is None else
                                                   f"given {type(prompt).__name__}"))


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop", "stop must be a non-empty string or an array of them")
    return stops


def _optional(body: dict, name: str, typ: type, what: str, *, param: str | None = None):
    value = body.get(name)
    if value is not None and not isinstance(value, typ):
        raise invalid(param or name, f"{param or name} must be {what}; given {value!r}")
    return value


def _int(body: dict, name: str, *, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if (not isinstance(value, int) or isinstance(value, bool) or value < lo
            or (hi is not None and value > hi)):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise invalid(name, f"{name} must be an integer {bound}; given {value!r}")
    return value


def _number(body: dict, name: str, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or not math.isfinite(value) or not lo <= value <= hi):
        raise invalid(name, f"{name} must be a number in [{lo:g}, {hi:g}]; given {value!r}")
    return float(value)


# -- answers --------------------------------------------------------------------------------


def usage_body(u: api_pb2.Usage) -> dict:
    """OpenAI's usage, plus kvbank's own facts under `kvbank` (clients ignore unknown keys)."""
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "kvbank": {"cache_source": CACHE_SOURCES[u.cache_source],
                   "recomputed_tokens": u.recomputed_tokens, "ttft_s": round(u.ttft_s, 4),
                   "queue_s": round(u.queue_s, 4), "durable": u.durable,
                   "session_id": u.session_id},
    }


@dataclass
class Answer:
    """One request's answer as the router streams it, shaped for its endpoint."""

    kind: str
    model: str
    include_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None

    def add(self, msg: api_pb2.GenerateResponse) -> None:
        if msg.text:
            self.text.append(msg.text)
        if msg.HasField("usage"):
            self.usage = usage_body(msg.usage)
            self.finish_reason = FINISH_REASONS.get(msg.finish_reason, "stop")

    def body(self) -> dict:
        text = "".join(self.text)
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text,
                                              "refusal": None}}
        else:
            choice = {"index": 0, "text": text}
        choice |= {"logprobs": None, "finish_reason": self.finish_reason}
        return self._envelope([choice], "chat.completion" if self.kind == "chat"
                              else "text_completion") | {"usage": self.usage}

    def first_chunk(self) -> dict | None:
        """OpenAI's chat streams open with the role and empty content."""
        if self.kind != "chat":
            return None
        return self._chunk({"role": "assistant", "content": "", "refusal": None}, None)

    def chunks(self, msg: api_pb2.GenerateResponse) -> list[dict]:
        """The chunks one router message becomes (a text delta; the finish; the usage)."""
        self.add(msg)
        out = []
        if msg.text:
            out.append(self._chunk({"content": msg.text} if self.kind == "chat" else msg.text,
                                   None))
        if msg.HasField("usage"):
            out.append(self._chunk({} if self.kind == "chat" else "", self.finish_reason))
            if self.include_usage:
                out.append(self._envelope([], self._chunk_object()) | {"usage": self.usage})
        return out

    def _chunk(self, delta: dict | str, finish_reason: str | None) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": delta}
        choice |= {"logprobs": None, "finish_reason": finish_reason}
        body = self._envelope([choice], self._chunk_object())
        return body | {"usage": None} if self.include_usage else body

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def _envelope(self, choices: list, obj: str) -> dict:
        prefix = "chatcmpl-" if self.kind == "chat" else "cmpl-"
        return {"id": prefix + self.id, "object": obj, "created": self.created,
                "model": self.model, "system_fingerprint": None, "choices": choices}
