"""OpenAI bodies in, a kvbank `GenerateRequest` out; the router's messages in, OpenAI bodies out.

A body is validated here, once, before anything reaches the router: whatever the OpenAI API
would refuse becomes an `ApiError` (HTTP 400) whose message and `param` name the field.
Sampling controls (logit_bias, the penalties, seed), logprobs, tools and response_format are
passed on; fields that would change the answer's shape in ways kvbank does not serve (n > 1,
echo, best_of, suffix) are refused, so a client never gets less than it asked for without
being told. Fields about billing and storage on OpenAI's side (metadata, store, ...) are
ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from kvbank.contracts.vocabulary import MAX_TOP_LOGPROBS
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
MAX_STOP = 4          # OpenAI's bound
MAX_COMPLETION_LOGPROBS = 5

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
    gateways send), else the body's `user`, else `prompt_cache_key` (chat), else none: most
    clients send none, and the worker then finds the conversation by its tokens. The input is
    always the whole conversation (append=False), as OpenAI clients send it.
    """
    if not isinstance(body, dict):
        raise invalid(None, f"the body must be a JSON object; given {type(body).__name__}")
    _optional(body, "model", str, "a string")
    user = _optional(body, "user", str, "a string")
    _refuse_unsupported(kind, body)
    cache_key = _optional(body, "prompt_cache_key", str, "a string") if kind == "chat" else None
    req = api_pb2.GenerateRequest(session_id=session_header or user or cache_key or "",
                                  append=False)
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
    _sampling_controls(kind, body, req.sampling)
    if kind == "chat":
        _tools(body, req.chat)
        thinking = _thinking_switch(body)
        if thinking is not None:
            req.enable_thinking = thinking
    _response_format(body, req)
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


EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def reasoning_switch(effort: object, param: str) -> bool | None:
    """A reasoning effort as the chat template's reasoning switch (`enable_thinking`): off
    for "none", on for any other; None (the template's default) when absent. A template
    without a switch ignores it, and no effort bounds the reasoning's length (max_tokens
    does)."""
    if effort is not None and effort not in EFFORTS:
        raise invalid(param, f"{param} must be one of {', '.join(EFFORTS)}; given {effort!r}")
    return None if effort is None else effort != "none"


def _thinking_switch(body: dict) -> bool | None:
    """`chat_template_kwargs.enable_thinking` (vLLM's and SGLang's spelling), else
    `reasoning_effort`. No other template keyword is taken: the template is the model's."""
    kwargs = _optional(body, "chat_template_kwargs", dict, "an object") or {}
    other = sorted(k for k in kwargs if k != "enable_thinking")
    if other:
        raise invalid(f"chat_template_kwargs.{other[0]}",
                      f"chat_template_kwargs.{other[0]} is not supported: chat_template_kwargs "
                      f"takes enable_thinking only")
    switch = _optional(kwargs, "enable_thinking", bool, "true or false",
                       param="chat_template_kwargs.enable_thinking")
    effort = reasoning_switch(body.get("reasoning_effort"), "reasoning_effort")
    return switch if switch is not None else effort


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


# Fields of OpenAI's API that would change the answer in ways kvbank cannot: each a 400 naming
# it. Fields about OpenAI's own service (metadata, store, service_tier, prompt_cache_key, ...)
# and other servers' extensions are ignored, so gateways that add their defaults still pass.
REFUSED = {
    "audio": "audio output is not supported (kvbank serves a text model)",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
}


def _refuse_unsupported(kind: str, body: dict) -> None:
    for name, why in REFUSED.items():
        if body.get(name) is not None:
            raise invalid(name, f"{name}: {why}")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise invalid("modalities", f'modalities must be ["text"]; given {modalities!r}')
    n = _int(body, "n", lo=1)
    if n not in (None, 1):
        raise invalid("n", f"n must be 1: kvbank returns one choice per request; given {n}")
    if body.get("functions") or body.get("function_call"):
        name = "functions" if body.get("functions") else "function_call"
        raise invalid(name, f"{name} is OpenAI's deprecated form: send tools and tool_choice")
    if kind == "completion" and body.get("tools"):
        raise invalid("tools", "tools are a chat field: send them to /v1/chat/completions")
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
        msg = api_pb2.ChatMessage(role=ROLES[role], content=_content(m.get("content"), where))
        if role == "assistant":
            msg.tool_calls.extend(_tool_calls(m.get("tool_calls"), where))
            # what this server (or another) answered as reasoning, sent back with the turn
            msg.reasoning = next((r for key in ("reasoning_content", "reasoning")
                                  if isinstance(r := m.get(key), str)), "")
        if role == "tool":
            msg.tool_call_id = _optional(m, "tool_call_id", str, "a string",
                                         param=f"{where}.tool_call_id") or ""
            msg.name = _optional(m, "name", str, "a string", param=f"{where}.name") or ""
        out.append(msg)
    return out


def _tool_calls(calls: object, where: str) -> list[api_pb2.ToolCall]:
    """An assistant message's tool_calls, as the client got them (arguments as JSON text)."""
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise invalid(f"{where}.tool_calls", f"{where}.tool_calls must be an array")
    out = []
    for j, c in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(at, f'{at} must be {{"id", "type": "function", "function": '
                              f'{{"name", "arguments"}}}}')
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            raise invalid(f"{at}.function.arguments", f"{at}.function.arguments must be a "
                                                      f"string of JSON")
        out.append(api_pb2.ToolCall(id=str(c.get("id") or ""), name=fn["name"], arguments=args))
    return out


def _tools(body: dict, chat: api_pb2.ChatMessages) -> None:
    """tools as JSON for the router (which validates each), tool_choice in kvbank's words."""
    tools = _optional(body, "tools", list, "an array of function tools")
    choice = body.get("tool_choice")
    _optional(body, "parallel_tool_calls", bool, "true or false")
    if tools:
        chat.tools_json = json.dumps(tools)
    if choice is None:
        return
    if isinstance(choice, str) and choice in ("none", "auto", "required"):
        chat.tool_choice = choice
    elif (isinstance(choice, dict) and choice.get("type") == "function"
          and isinstance((choice.get("function") or {}).get("name"), str)):
        chat.tool_choice = "function:" + choice["function"]["name"]
    else:
        raise invalid("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                                     '{"type": "function", "function": {"name": ...}}; given '
                                     f"{choice!r}")
    if not tools and chat.tool_choice != "none":
        raise invalid("tool_choice", "tool_choice needs tools: send the tools it chooses from")


def _sampling_controls(kind: str, body: dict, s: api_pb2.SamplingParams) -> None:
    """logit_bias, the penalties and logprobs, with OpenAI's bounds (the token ids are checked
    against the vocabulary by the router)."""
    bias = _optional(body, "logit_bias", dict, "an object of token id -> bias") or {}
    for token, value in bias.items():
        if not (isinstance(token, str) and token.isdigit()) or int(token) > MAX_UINT32:
            raise invalid("logit_bias", f"logit_bias keys must be token ids; given {token!r}")
        if (not isinstance(value, (int, float)) or isinstance(value, bool)
                or not -100 <= value <= 100):
            raise invalid("logit_bias", f"logit_bias values must be numbers in [-100, 100]; "
                                        f"given {value!r} for token {token}")
        s.logit_bias[int(token)] = float(value)
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name, -2.0, 2.0)
        if value is not None:
            setattr(s, name, value)
    value = _number(body, "repetition_penalty", 0.0, 10.0)  # mlx-lm's and vLLM's extensions
    if value is not None:
        s.repetition_penalty = value
    s.top_k = _int(body, "top_k", lo=0, hi=MAX_UINT32) or 0
    s.min_p = _number(body, "min_p", 0.0, 1.0) or 0.0
    if kind == "chat":
        s.logprobs = bool(_optional(body, "logprobs", bool, "true or false"))
        top = _int(body, "top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
        if top is not None and not s.logprobs:
            raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
        s.top_logprobs = top or 0
    else:  # completions: logprobs is how many alternatives, 0 for the chosen token's alone
        top = None if body.get("logprobs") is False else _int(body, "logprobs", lo=0,
                                                               hi=MAX_COMPLETION_LOGPROBS)
        s.logprobs, s.top_logprobs = top is not None, top or 0


def _response_format(body: dict, req: api_pb2.GenerateRequest) -> None:
    fmt = body.get("response_format")
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise invalid("response_format", 'response_format.type must be "text", "json_object" '
                                         f"or \"json_schema\"; given {kind!r}")
    req.response_format.type = kind
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise invalid("response_format.json_schema.schema",
                          "response_format.json_schema.schema must be a JSON schema object")
        req.response_format.json_schema = json.dumps(schema)


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
    if len(stops) > MAX_STOP:
        raise invalid("stop", f"stop takes at most {MAX_STOP} strings; given {len(stops)}")
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
