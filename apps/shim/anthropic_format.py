"""Anthropic's Messages API (`POST /v1/messages`) in, the kvbank `GenerateRequest` the chat
endpoint builds out; the router's messages in, Anthropic's message and stream events out.

The conversation reaches the router as chat messages with roles, rendered by the model's chat
template, exactly as `/v1/chat/completions` sends it, so whatever finds KV for one (the
prefix, RAM or SSD, a conversation found by its tokens, a name from `x-session-id` or
`metadata.user_id`) finds it for the other.

Tools: `tools` become the chat template's tools (OpenAI's function shape, `input_schema` as
the parameters), `tool_use` blocks an assistant turn's tool calls and `tool_result` blocks
tool messages, so a tool loop finds its KV as a chat completions loop does. `tool_choice`
`any` and `tool` are the worker's grammar-constrained call.

A body is validated here, once, before anything reaches the router. A field kvbank does not
support, a content block it cannot render (images, documents, server tools ...) and an
assistant prefill are each a 400, in Anthropic's error shape, that names them, so a client
never gets less than it asked for without being told. `cache_control` (top-level or on a
block) is accepted and ignored: kvbank keeps the KV of every prompt without being asked; so
are the fields about where and how fast Anthropic would serve a request (NO_EFFECT).

Usage follows Anthropic's arithmetic: the prompt is `input_tokens + cache_read_input_tokens +
cache_creation_input_tokens`, where `cache_read_input_tokens` is what kvbank restored (RAM or
SSD) and `input_tokens` what it computed; `cache_creation_input_tokens` is always 0 (there is
no separate, billed cache write).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from kvbank.apps.shim.openai_answer import usage_body as openai_usage
from kvbank.apps.shim.openai_format import (MAX_INT32, MAX_REQUEST_BYTES, ApiError, _int, _number,
                                            _optional, each_message, invalid)
from kvbank.v1 import api_pb2

DEFAULT_TEMPERATURE = 1.0  # Anthropic's default
SUPPORTED = ("model", "max_tokens", "messages", "system", "stop_sequences", "temperature",
             "top_p", "top_k", "stream", "metadata", "tools", "tool_choice", "thinking")
# Accepted, and without effect on one local machine that caches every prompt and keeps every
# conversation whole: prompt caching is always on; `context_management` (server-side clearing
# of old tool results) and `output_config` (effort, output format hints) ask for nothing the
# answer's tokens depend on here.
NO_EFFECT = ("cache_control", "service_tier", "speed", "inference_geo", "context_management",
             "output_config")
# Why a known field is refused; any other unknown field is refused as unknown.
NOT_SUPPORTED: dict[str, str] = {}
# Claude Code's first system block: a per-request nonce (`cch=`), never part of a prefix.
ATTRIBUTION = "x-anthropic-billing-header:"
# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}
ZERO_USAGE = {"input_tokens": 0, "output_tokens": 0, "cache_creation_input_tokens": 0,
              "cache_read_input_tokens": 0}


def error_body(e: ApiError) -> dict:
    """`{"type": "error", "error": {"type", "message"}}` for an error the OpenAI routes would
    answer with `e` (same HTTP status, same headers)."""
    kind = ERROR_TYPES.get(e.status) or ("api_error" if e.status >= 500
                                         else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


@dataclass(frozen=True)
class MessagesRequest:
    generate: api_pb2.GenerateRequest
    stream: bool


def parse(body: object, *, session_header: str | None,
          count_only: bool = False, keep_attribution: bool = False) -> MessagesRequest:
    """A decoded JSON body of /v1/messages (or, `count_only`, /v1/messages/count_tokens, which
    needs no max_tokens). The session name is the `x-session-id` (or `x-smg-routing-key`)
    header, else `metadata.user_id`, else none (the worker finds the conversation by its
    tokens). The input is always the whole conversation (append=False)."""
    if not isinstance(body, dict):
        raise invalid(None, f"the body must be a JSON object; given {type(body).__name__}")
    _refuse_unsupported(body)
    _optional(body, "model", str, "a string")
    metadata = _optional(body, "metadata", dict, "an object") or {}
    extra = sorted(k for k, v in metadata.items() if k != "user_id" and v is not None)
    if extra:
        raise invalid(f"metadata.{extra[0]}", "metadata takes only user_id; given "
                                              + ", ".join(f"metadata.{k}" for k in extra))
    user = _optional(metadata, "user_id", str, "a string", param="metadata.user_id")
    req = api_pb2.GenerateRequest(session_id=session_header or user or "", append=False)
    system = _system(body.get("system"), keep_attribution)
    if system:
        req.chat.messages.append(api_pb2.ChatMessage(role="system", content=system))
    req.chat.messages.extend(_messages(body))
    _tools(body, req.chat)
    thinking = _thinking(body.get("thinking"))
    if thinking is not None:
        req.enable_thinking = thinking
    max_tokens = _int(body, "max_tokens", lo=1, hi=MAX_INT32)
    if max_tokens is None and not count_only:
        raise invalid("max_tokens", "max_tokens is required (the most tokens the answer may "
                                    "have; kvbank lowers it to the room the prompt leaves in "
                                    "the model's context)")
    req.max_tokens = max_tokens or 1
    temperature = _number(body, "temperature", 0.0, 1.0)
    req.sampling.temperature = DEFAULT_TEMPERATURE if temperature is None else temperature
    top_p = _number(body, "top_p", 0.0, 1.0)
    req.sampling.top_p = 1.0 if top_p is None else top_p
    req.sampling.top_k = _int(body, "top_k", lo=0, hi=MAX_INT32) or 0
    req.stop.extend(_stop_sequences(body))
    stream = bool(_optional(body, "stream", bool, "true or false"))
    if (size := req.ByteSize()) > MAX_REQUEST_BYTES:
        raise ApiError(413, f"the request is {size} bytes as a kvbank request; the router takes "
                            f"at most {MAX_REQUEST_BYTES}: shorten the prompt",
                       code="request_too_large", retry=False)
    return MessagesRequest(req, stream)


def _absent(name: str, value: object) -> bool:
    """null, and the values that ask for nothing (no tools), are absent."""
    return value is None or (name == "tools" and value == [])


def _thinking(value: object) -> bool | None:
    """`thinking` as the chat template's reasoning switch (`enable_thinking`): on for
    `enabled` and `adaptive`, off for `disabled`; a template without one ignores it, and
    `budget_tokens` is not enforced (the answer's max_tokens bounds it)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise invalid("thinking.type", f'thinking.type must be "enabled", "adaptive" or '
                                       f'"disabled"; given {kind!r}')
    return kind != "disabled"


def _refuse_unsupported(body: dict) -> None:
    named = [k for k, v in body.items()
             if k not in SUPPORTED and k not in NO_EFFECT and not _absent(k, v)]
    if not named:
        return
    why = "; ".join(f"{k}: {NOT_SUPPORTED.get(k, 'not a field kvbank knows')}" for k in named)
    raise invalid(named[0], f"unsupported field{'s' if len(named) > 1 else ''} "
                            f"{', '.join(named)} ({why}); kvbank's Messages API takes "
                            f"{', '.join(SUPPORTED)}")


def _system(system: object, keep_attribution: bool = False) -> str:
    """The system prompt's text. Claude Code's attribution block (`ATTRIBUTION`) differs on
    every request; it is left out unless the shim runs with --keep-attribution-line."""
    if system is None or isinstance(system, str):
        return system or ""
    if (not keep_attribution and isinstance(system, list) and system
            and isinstance(system[0], dict)
            and str(system[0].get("text", "")).startswith(ATTRIBUTION)):
        system = system[1:]
    return _text(system, "system")


def _messages(body: dict) -> list[api_pb2.ChatMessage]:
    out = []
    for where, m in each_message(body):
        role = m.get("role")
        if role not in ("user", "assistant", "system") or (role == "system" and not out):
            raise invalid(f"{where}.role", f'{where}.role must be "user" or "assistant" (the '
                                           f"system prompt is the top-level system; a system "
                                           f"message may follow the first turn); given {role!r}")
        extra = sorted(k for k, v in m.items() if k not in ("role", "content") and v is not None)
        if extra:
            raise invalid(f"{where}.{extra[0]}", f"{where} takes role and content only; given "
                                                 f"{', '.join(extra)}")
        if "content" not in m:
            raise invalid(f"{where}.content", f"{where}.content is missing")
        if role == "system":  # Claude Code's environment block: rendered where it stands
            out.append(api_pb2.ChatMessage(role="system",
                                           content=_text(m["content"], f"{where}.content")))
            continue
        out += _turn(role, m["content"], f"{where}.content")
    if out[-1].role == "assistant":
        raise invalid(f"messages[{len(out) - 1}].role",
                      "the last message is the assistant's: continuing a prefilled answer is "
                      "not supported yet (the chat template renders the turn as finished); end "
                      "with a user message")
    return out


def _turn(role: str, content: object, where: str) -> list[api_pb2.ChatMessage]:
    """One Anthropic message as chat messages: an assistant's text and tool calls in one; a
    user's tool results as tool messages, then the user's text (if any) after them."""
    if isinstance(content, str):
        return [api_pb2.ChatMessage(role=role, content=content)]
    if not isinstance(content, list):
        raise invalid(where, f"{where} must be a string or an array of content blocks; given "
                             f"{type(content).__name__}")
    texts, calls, results, thinking = [], [], [], []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, at))
        elif kind == "thinking" and role == "assistant":
            thinking.append(_str(block, "thinking", at))
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # another server's encrypted reasoning: nothing a template can render
        elif kind == "tool_result" and role == "user":
            results.append(api_pb2.ChatMessage(
                role="tool", tool_call_id=_str(block, "tool_use_id", at),
                content=_result_text(block.get("content"), f"{at}.content")))
        elif kind in ("tool_use", "tool_result"):
            raise invalid(f"{at}.type", f"{at} is a {kind} block in a {role} message: "
                                        f"tool_use belongs to assistant turns, tool_result to "
                                        f"user turns")
        else:
            texts.append(_text([block], at.rsplit("[", 1)[0], first=j))
    out = results
    if texts or not results:
        msg = api_pb2.ChatMessage(role=role, content="\n".join(texts),
                                  reasoning="\n".join(thinking))
        msg.tool_calls.extend(calls)
        out = out + [msg]
    return out


def _tool_use(block: dict, at: str) -> api_pb2.ToolCall:
    if not isinstance(block.get("input"), dict):
        raise invalid(f"{at}.input", f"{at}.input must be an object (the tool's arguments)")
    return api_pb2.ToolCall(id=_str(block, "id", at), name=_str(block, "name", at),
                            arguments=json.dumps(block["input"]))


def _str(block: dict, key: str, at: str) -> str:
    value = block.get(key)
    if not isinstance(value, str) or not value:
        raise invalid(f"{at}.{key}", f"{at}.{key} must be a non-empty string")
    return value


def _result_text(content: object, where: str) -> str:
    """A tool_result's content: a string, or text blocks (absent: empty)."""
    return "" if content is None else _text(content, where)


def _tools(body: dict, chat: api_pb2.ChatMessages) -> None:
    """Anthropic's tools as the template's (OpenAI's function shape); tool_choice in kvbank's
    words: auto, none, any (required) or one tool by name."""
    tools = _optional(body, "tools", list, "an array of tools") or []
    functions = []
    for i, t in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") not in (None, "custom"):
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise invalid(f"{at}.type", f"{at} is a {kind!r} tool: kvbank runs no server tools; "
                                        f"send custom tools (name, description, input_schema)")
        name = _str(t, "name", at)
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise invalid(f"{at}.input_schema", f"{at}.input_schema must be a JSON schema object")
        functions.append({"type": "function", "function": {
            "name": name, "description": t.get("description") or "", "parameters": schema}})
    if functions:
        chat.tools_json = json.dumps(functions)
    choice = _optional(body, "tool_choice", dict, "an object with a type")
    if choice is None:
        return
    kind = choice.get("type")
    words = {"auto": "auto", "none": "none", "any": "required"}
    if kind in words:
        chat.tool_choice = words[kind]
    elif kind == "tool" and isinstance(choice.get("name"), str):
        chat.tool_choice = "function:" + choice["name"]
    else:
        raise invalid("tool_choice", 'tool_choice.type must be "auto", "any", "none" or "tool" '
                                     f'(with a name); given {choice!r}')
    if not functions and chat.tool_choice != "none":
        raise invalid("tool_choice", "tool_choice needs tools: send the tools it chooses from")


def _text(content: object, where: str, first: int = 0) -> str:
    """A string, or text blocks (joined by newlines); any other block is refused by name."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, f"{where} must be a string or an array of content blocks; given "
                             f"{type(content).__name__}")
    texts = []
    for j, block in enumerate(content, start=first):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise invalid(f"{at}.type", f'{at}.type must be "text", "tool_use" or '
                                        f'"tool_result" (kvbank serves a text-only model); '
                                        f"given {kind!r}")
        if not isinstance(block.get("text"), str):
            raise invalid(f"{at}.text", f"{at}.text must be a string")
        extra = sorted(k for k, v in block.items()
                       if k not in ("type", "text", "cache_control") and v not in (None, []))
        if extra:
            raise invalid(f"{at}.{extra[0]}", f"{at}: {', '.join(extra)} not supported on text "
                                              f"blocks")
        texts.append(block["text"])
    return "\n".join(texts)


def _stop_sequences(body: dict) -> list[str]:
    stops = body.get("stop_sequences")
    if stops is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop_sequences", "stop_sequences must be an array of non-empty strings")
    return stops


# -- answers --------------------------------------------------------------------------------


def usage_body(u: api_pb2.Usage) -> dict:
    """Anthropic's usage (input_tokens: the prompt tokens not read from cache), plus kvbank's
    own facts under `kvbank` (clients ignore unknown keys)."""
    return {"input_tokens": u.prompt_tokens - u.cached_tokens,
            "output_tokens": u.completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": u.cached_tokens,
            "kvbank": openai_usage(u)["kvbank"]}


@dataclass
class Message:
    """One request's answer as the router streams it: a message, or its stream events.

    Content blocks in the order the answer made them: the model's reasoning as a `thinking`
    block (its signature empty: kvbank signs nothing, and takes the block back unchecked),
    the text, then one `tool_use` block per call, each sent whole: start, its input as one
    `input_json_delta`, stop. The first block opens with the first delta."""

    model: str
    # What the client asked for; when the router lowered it to the room the prompt left in
    # the model's context, an answer that fills that room stops for it
    # ("model_context_window_exceeded"), not for max_tokens.
    asked_max_tokens: int = 0
    id: str = field(default_factory=lambda: "msg_" + uuid.uuid4().hex)
    text: list[str] = field(default_factory=list)
    thinking: list[str] = field(default_factory=list)
    tool_calls: list[api_pb2.ToolCall] = field(default_factory=list)
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: dict | None = None
    _open: tuple[int, str] | None = None  # the streamed block still open: (index, type)
    _blocks: int = 0                      # blocks streamed so far

    def add(self, msg: api_pb2.GenerateResponse) -> None:
        if msg.text:
            self.text.append(msg.text)
        if msg.reasoning:
            self.thinking.append(msg.reasoning)
        self.tool_calls.extend(msg.tool_calls)
        if msg.HasField("usage"):
            self.usage = usage_body(msg.usage)
            if msg.finish_reason == api_pb2.FINISH_REASON_TOOL_CALLS:
                self.stop_reason = "tool_use"
            elif msg.stop_sequence:
                self.stop_reason, self.stop_sequence = "stop_sequence", msg.stop_sequence
            elif msg.finish_reason != api_pb2.FINISH_REASON_LENGTH:
                self.stop_reason = "end_turn"
            elif msg.usage.max_tokens and msg.usage.max_tokens < self.asked_max_tokens:
                self.stop_reason = "model_context_window_exceeded"
            else:
                self.stop_reason = "max_tokens"

    def body(self) -> dict:
        text = "".join(self.text)
        content = ([{"type": "thinking", "thinking": "".join(self.thinking), "signature": ""}]
                   if self.thinking else [])
        content += ([{"type": "text", "text": text}]
                    if text or not (self.tool_calls or self.thinking) else [])
        content += [_tool_use_block(c) for c in self.tool_calls]
        return self._message(content, self.usage)

    def opening(self) -> list[dict]:
        """The stream's start, sent once the worker admits the request: the usage is not
        known yet (kvbank counts the prompt and what it restored as it runs); message_delta
        carries all of it. The first block opens with the first delta, when its kind is
        known, and a `ping` follows it; while the prompt is read, the stream's keep-alive
        comments hold the connection."""
        return [_event("message_start", message=self._message([], dict(ZERO_USAGE)))]

    def events(self, msg: api_pb2.GenerateResponse) -> list[dict]:
        """The events one router message becomes (thinking and text deltas; tool_use blocks;
        the end)."""
        self.add(msg)
        out = []
        if msg.reasoning:
            out += self._switch("thinking")
            out.append(_event("content_block_delta", index=self._open[0],
                              delta={"type": "thinking_delta", "thinking": msg.reasoning}))
        if msg.text:
            out += self._switch("text")
            out.append(_event("content_block_delta", index=self._open[0],
                              delta={"type": "text_delta", "text": msg.text}))
        for call in msg.tool_calls:
            out += self._switch(None)
            block = _tool_use_block(call)
            i, self._blocks = self._blocks, self._blocks + 1
            out += [_event("content_block_start", index=i, content_block={**block, "input": {}}),
                    _event("content_block_delta", index=i,
                           delta={"type": "input_json_delta",
                                  "partial_json": json.dumps(block["input"])}),
                    _event("content_block_stop", index=i)]
        if msg.HasField("usage"):
            out += self._switch(None)
            out += [_event("message_delta",
                           delta={"stop_reason": self.stop_reason,
                                  "stop_sequence": self.stop_sequence},
                           usage=self.usage),
                    _event("message_stop")]
        return out

    def _switch(self, kind: str | None) -> list[dict]:
        """Close the open block unless it is of `kind`; open one of `kind` (None: none). An
        answer's content opens with a block, text if nothing else came first."""
        if self._open is not None and self._open[1] == kind:
            return []
        out = []
        if not self._blocks and kind is None:
            out += self._switch("text")
        if self._open is not None:
            i, was = self._open
            if was == "thinking":
                out.append(_event("content_block_delta", index=i,
                                  delta={"type": "signature_delta", "signature": ""}))
            out.append(_event("content_block_stop", index=i))
            self._open = None
        if kind is not None:
            self._open, self._blocks = (self._blocks, kind), self._blocks + 1
            block = ({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                     else {"type": "text", "text": ""})
            out.append(_event("content_block_start", index=self._open[0], content_block=block))
            if self._blocks == 1:
                out.append(_event("ping"))
        return out

    def _message(self, content: list, usage: dict | None) -> dict:
        done = usage is not None and self.stop_reason is not None
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": self.stop_reason if done else None,
                "stop_sequence": self.stop_sequence if done else None, "usage": usage}


def _tool_use_block(call: api_pb2.ToolCall) -> dict:
    try:
        args = json.loads(call.arguments or "{}")
    except ValueError:  # a parser that returned text: Anthropic's input is always an object
        args = {"arguments": call.arguments}
    return {"type": "tool_use", "id": call.id, "name": call.name,
            "input": args if isinstance(args, dict) else {"arguments": args}}


def _event(kind: str, **fields) -> dict:
    return {"type": kind, **fields}
