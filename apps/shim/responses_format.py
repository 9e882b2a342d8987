"""OpenAI's Responses API (`POST /v1/responses`) over the same router request as chat.

A Responses body becomes the chat-completions body it stands for (instructions as the system
message, input items as messages and tool calls, tools and tool_choice in chat's form), which
`openai_format.parse` validates and turns into the router's request: a conversation finds its
KV the same way whichever API it comes through.

A custom (freeform) tool, as Codex's `apply_patch`, is offered to the model as a function with
one string argument, `input`, and its format (free text, or a Lark or regex grammar, checked
here) on that function (kvbank/custom_tools.py); its call comes back as a `custom_tool_call`
whose input is that string, and a custom call in the input goes back to the model as a call
with that argument.

A `namespace` tool (Codex's sub-agent tools) offers its functions as the model's own, and a
call of one names its namespace. A `reasoning` item in the input is the next answer's
reasoning, for the template (`reasoning_content`). `previous_response_id` prepends the stored
conversation's items (`prior`, apps/shim/responses_store.py), and a stored response is kept
once answered.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from dataclasses import dataclass, field

from kvbank.apps.shim.openai_answer import usage_body as openai_usage
from kvbank.apps.shim.openai_format import (OpenAIRequest, invalid, parse as parse_chat,
                                            reasoning_switch)
from kvbank.contracts.failures import InvalidRequest
from kvbank.custom_tools import CUSTOM_ARG, chat_function
from kvbank.v1 import api_pb2

# Handled here: each becomes a chat-completions field, or is read below.
FIELDS = ("model", "input", "instructions", "tools", "tool_choice", "max_output_tokens",
          "temperature", "top_p", "text", "stream", "prompt_cache_key", "user", "reasoning",
          "store", "previous_response_id")
# Accepted, and without effect: no background runs, and these describe OpenAI's service or
# its bookkeeping, not the answer's tokens.
NO_EFFECT = ("metadata", "parallel_tool_calls", "include", "truncation", "service_tier",
             "client_metadata", "background", "safety_identifier", "prompt_cache_retention",
             "stream_options", "top_logprobs")
# Tools OpenAI's servers run for the model: a local server has none to run. Those a client
# sends by default (Codex's web search) are left out of the prompt, with a warning the client
# sees (the `x-kvbank-warning` header) and a log line; any other is refused.
LEFT_OUT = ("web_search", "web_search_preview")
HOSTED = ("web_search", "web_search_preview", "file_search", "code_interpreter",
          "image_generation", "computer_use_preview", "mcp", "local_shell")


@dataclass(frozen=True)
class ResponsesRequest:
    chat: OpenAIRequest
    custom_tools: frozenset[str]  # names of the freeform tools
    echo: dict  # what the response object repeats of the request
    namespaces: dict = field(default_factory=dict)  # tool name -> its namespace tool's name
    left_out: tuple[str, ...] = ()  # hosted tools left out of the prompt (LEFT_OUT)


def parse(body: object, *, session_header: str | None, default_max_tokens: int,
          prior: list = ()) -> ResponsesRequest:
    """`prior`: the items `previous_response_id` continues from (apps/shim/responses_store.py)."""
    if not isinstance(body, dict):
        raise invalid(None, f"the body must be a JSON object; given {type(body).__name__}")
    unknown = [k for k in body if k not in FIELDS and k not in NO_EFFECT
               and body[k] is not None]
    if unknown:
        raise invalid(unknown[0], f"unsupported field{'s' if len(unknown) > 1 else ''} "
                                  f"{', '.join(unknown)}; kvbank's Responses API takes "
                                  f"{', '.join(FIELDS + NO_EFFECT)}")
    tools, custom, namespaces, left_out = _tools(body.get("tools"))
    given = body.get("input")
    if prior:
        given = list(prior) + ([{"role": "user", "content": given}] if isinstance(given, str)
                               else list(given or []))
    chat = {"messages": _messages(body.get("instructions"), given, custom),
            "stream": body.get("stream", False)}
    for src, dst in (("model", "model"), ("max_output_tokens", "max_tokens"),
                     ("temperature", "temperature"), ("top_p", "top_p"), ("user", "user")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    name = session_header or body.get("prompt_cache_key") or None
    echo = {k: body.get(k) for k in ("instructions", "max_output_tokens", "temperature",
                                     "top_p", "tool_choice", "tools", "metadata",
                                     "previous_response_id")}
    echo["store"] = body.get("store") is not False  # OpenAI's default: stored
    parsed = parse_chat("chat", chat, session_header=name, default_max_tokens=default_max_tokens)
    thinking = _reasoning(body.get("reasoning"))
    if thinking is not None:
        parsed.generate.enable_thinking = thinking
    return ResponsesRequest(parsed, frozenset(custom), echo, namespaces, tuple(left_out))


def _reasoning(value: object) -> bool | None:
    """`reasoning.effort` as the template's reasoning switch (`reasoning_switch`). `summary`
    is accepted: the reasoning comes back whole, as a reasoning item."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("reasoning", f"reasoning must be an object; given {type(value).__name__}")
    return reasoning_switch(value.get("effort"), "reasoning.effort")


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, f"{where} must be a string or an array of content parts")
    out = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text",
                                                                  "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise invalid(f"{where}[{i}]", f"{where}[{i}] is {kind!r}: kvbank serves a "
                                           f"text-only model (input_text, output_text)")
        out.append(str(part.get("text", "")))
    return "".join(out)


def _messages(instructions, items, custom: set[str]) -> list[dict]:
    """Input items as chat messages: calls join the assistant message before them, outputs
    are tool messages."""
    out: list[dict] = []
    if instructions:
        out.append({"role": "system", "content": _text(instructions, "instructions")})
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise invalid("input", "input must be a string or a non-empty array of items")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(where, f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("system", "user", "assistant"):
                raise invalid(f"{where}.role", f"{where}.role must be user, assistant, system "
                                               f"or developer; given {item.get('role')!r}")
            content = _text(item.get("content", ""), f"{where}.content")
            if role == "assistant" and out and out[-1].get("pending_reasoning"):
                out[-1]["content"] = content  # the answer its reasoning item came before
                del out[-1]["pending_reasoning"]
            else:
                out.append({"role": role, "content": content})
        elif kind in ("function_call", "custom_tool_call"):
            args = (item.get("arguments", "{}") if kind == "function_call"
                    else json.dumps({CUSTOM_ARG: item.get("input", "")}))
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": args}}
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1].pop("pending_reasoning", None)
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output", "")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str)
                        else _text(output, f"{where}.output")})
        elif kind == "reasoning":  # the next answer's reasoning, for the template to render
            parts = item.get("content") or item.get("summary") or []
            text = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
            out.append({"role": "assistant", "content": "", "reasoning_content": text,
                        "pending_reasoning": True})
        else:
            raise invalid(f"{where}.type", f"{where}.type {kind!r} is not supported: kvbank "
                                           f"takes message, function_call, "
                                           f"function_call_output, custom_tool_call, "
                                           f"custom_tool_call_output and reasoning items")
    for m in out:
        m.pop("pending_reasoning", None)
    return out


def _tools(tools) -> tuple[list[dict], set[str], dict[str, str], list[str]]:
    """Chat tools, the names of the freeform (custom) ones, the namespace of each tool a
    `namespace` tool groups (Codex's sub-agent tools: the model sees those as plain
    functions, and its calls of them name their namespace), and the hosted tools left out."""
    if tools is None or tools == []:
        return [], set(), {}, []
    if not isinstance(tools, list):
        raise invalid("tools", "tools must be an array")
    out, custom, namespaces, left_out = [], set(), {}, []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind in LEFT_OUT:
            left_out.append(kind)
        elif kind == "namespace" and isinstance(t.get("tools"), list):
            for j, inner in enumerate(t["tools"]):
                out.append(_tool(inner, f"tools[{i}].tools[{j}]", custom))
                namespaces[out[-1]["function"]["name"]] = str(t.get("name", ""))
        else:
            out.append(_tool(t, f"tools[{i}]", custom))
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise invalid("tools", f"tools name {', '.join(map(repr, twice))} more than once "
                               f"(namespaces included): give each tool its own name")
    return out, custom, namespaces, left_out


def _tool(t, where: str, custom: set[str]) -> dict:
    kind = t.get("type") if isinstance(t, dict) else None
    if kind == "function":
        fn = {"name": t.get("name"), "parameters": t.get("parameters") or
              {"type": "object", "properties": {}}}
        if t.get("description"):
            fn["description"] = t["description"]
    elif kind == "custom":
        custom.add(t.get("name"))
        try:
            fn = chat_function(t.get("name"), t.get("description"), t.get("format"), where)
        except InvalidRequest as e:
            raise invalid(e.param, str(e)) from None
    elif kind in HOSTED:
        raise invalid(f"{where}.type", f"{where}.type {kind!r} is a tool OpenAI's servers run, "
                                       f"and kvbank runs none: send the request without it "
                                       f"(Codex: web_search = \"disabled\" in config.toml)")
    else:
        raise invalid(f"{where}.type", f"{where}.type {kind!r} is not supported: kvbank runs "
                                       f"function and custom tools, and namespaces of them")
    return {"type": "function", "function": fn}


def _tool_choice(choice):
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise invalid("tool_choice", "tool_choice must be auto, none, required, or "
                                 "{type: function|custom, name}")


def _text_format(text):
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema",
                "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise invalid("text.format.type", "text.format.type must be text, json_object or "
                                      "json_schema")


# -- answers --------------------------------------------------------------------------------


def usage_body(u: api_pb2.Usage) -> dict:
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "kvbank": openai_usage(u)["kvbank"]}


_PART = {"message": "output_text", "reasoning": "reasoning_text"}


def _part(kind: str) -> dict:
    return ({"type": "output_text", "text": "", "annotations": []} if kind == "message"
            else {"type": "reasoning_text", "text": ""})


@dataclass
class ResponseAnswer:
    """One request's answer: the response object, or its stream of events. Output items in
    the order they came: a reasoning item for the model's reasoning, a message for the
    text, one item per tool call."""

    model: str
    custom_tools: frozenset[str]
    echo: dict
    namespaces: dict = field(default_factory=dict)
    id: str = field(default_factory=lambda: "resp_" + uuid.uuid4().hex)
    created_at: int = field(default_factory=lambda: int(time.time()))
    items: list[dict] = field(default_factory=list)
    status: str = "in_progress"
    incomplete: str | None = None
    usage: dict | None = None
    _seq: int = 0

    def body(self) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": self.status, "model": self.model, "output": self.items,
                "error": None, "incomplete_details": ({"reason": self.incomplete}
                                                      if self.incomplete else None),
                "parallel_tool_calls": True, "previous_response_id": None, "store": False,
                "text": {"format": {"type": "text"}}, "truncation": "disabled",
                "reasoning": {"effort": None, "summary": None}, "user": None,
                **{k: v for k, v in self.echo.items()},
                "tool_choice": self.echo.get("tool_choice") or "auto",
                "tools": self.echo.get("tools") or [], "metadata": self.echo.get("metadata") or {},
                "usage": self.usage}

    def add(self, msg: api_pb2.GenerateResponse) -> None:
        self.events(msg)

    def opening(self) -> list[dict]:
        return [self._event("response.created", response=self.body()),
                self._event("response.in_progress", response=self.body())]

    def events(self, msg: api_pb2.GenerateResponse) -> list[dict]:
        out = []
        if msg.reasoning:
            out += self._delta("reasoning", msg.reasoning)
        if msg.text:
            out += self._delta("message", msg.text)
        for call in msg.tool_calls:
            out += self._close_open()
            out += self._tool_call(call)
        if msg.HasField("usage"):
            out += self._close_open()
            self.usage = usage_body(msg.usage)
            self.status = "completed"
            if msg.finish_reason == api_pb2.FINISH_REASON_LENGTH:
                self.status, self.incomplete = "incomplete", "max_output_tokens"
            # `response.completed` even when max_output_tokens cut it (its status says so):
            # the SDKs' stream helpers and Codex wait for that event alone.
            out.append(self._event("response.completed", response=self.body()))
        return out

    def _delta(self, kind: str, text: str) -> list[dict]:
        """`text` added to the open item of `kind` ("message" or "reasoning"), which opens
        (closing the one before) if the answer has just turned to it."""
        out = []
        last = self.items[-1] if self.items else None
        if last is None or last["type"] != kind or last["status"] == "completed":
            out += self._close_open()
            if kind == "message":
                last = {"type": "message", "id": "msg_" + uuid.uuid4().hex,
                        "status": "in_progress", "role": "assistant", "content": []}
            else:
                last = {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [],
                        "status": "in_progress", "content": []}
            self.items.append(last)
            i = len(self.items) - 1
            out.append(self._event("response.output_item.added", output_index=i, item=last))
            last["content"].append(_part(kind))
            out.append(self._event("response.content_part.added", item_id=last["id"],
                                   output_index=i, content_index=0, part=_part(kind)))
        last["content"][0]["text"] += text
        out.append(self._event(f"response.{_PART[kind]}.delta", item_id=last["id"],
                               output_index=len(self.items) - 1, content_index=0, delta=text))
        return out

    def _close_open(self) -> list[dict]:
        """The end of the message or reasoning item still open, if one is."""
        if not self.items or self.items[-1]["type"] not in _PART \
                or self.items[-1]["status"] == "completed":
            return []
        item, i = self.items[-1], len(self.items) - 1
        item["status"] = "completed"
        part = item["content"][0]
        return [self._event(f"response.{_PART[item['type']]}.done", item_id=item["id"],
                            output_index=i, content_index=0, text=part["text"]),
                self._event("response.content_part.done", item_id=item["id"], output_index=i,
                            content_index=0, part=part),
                self._event("response.output_item.done", output_index=i, item=item)]

    def _tool_call(self, call: api_pb2.ToolCall) -> list[dict]:
        i = len(self.items)
        if call.name in self.custom_tools:
            try:
                text = json.loads(call.arguments or "{}").get(CUSTOM_ARG, "")
            except (ValueError, AttributeError):
                text = call.arguments
            item = {"type": "custom_tool_call", "id": "ctc_" + uuid.uuid4().hex,
                    "call_id": call.id, "name": call.name, "input": str(text),
                    "status": "completed"}
            kind, value = "response.custom_tool_call_input", {"input": item["input"]}
            delta = {"delta": item["input"]}
        else:
            item = {"type": "function_call", "id": "fc_" + uuid.uuid4().hex,
                    "call_id": call.id, "name": call.name, "arguments": call.arguments,
                    "status": "completed"}
            if call.name in self.namespaces:
                item["namespace"] = self.namespaces[call.name]
            kind, value = "response.function_call_arguments", {"arguments": call.arguments}
            delta = {"delta": call.arguments}
        self.items.append(item)
        opened = {**item, "status": "in_progress",
                  **({"input": ""} if "input" in item else {"arguments": ""})}
        return [self._event("response.output_item.added", output_index=i, item=opened),
                self._event(f"{kind}.delta", item_id=item["id"], output_index=i, **delta),
                self._event(f"{kind}.done", item_id=item["id"], output_index=i, **value),
                self._event("response.output_item.done", output_index=i, item=item)]

    def _event(self, kind: str, **fields) -> dict:
        """A copy: the items it shows go on changing after it is sent."""
        self._seq += 1
        return copy.deepcopy({"type": kind, "sequence_number": self._seq - 1, **fields})
