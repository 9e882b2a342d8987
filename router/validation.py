"""Validate once, into a different type: a raw GenerateRequest becomes a `ValidRequest`.

Every refusal is an `InvalidRequest` whose message names the field, the bound and the value
given, so a client knows what to change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbank import json_input
from kvbank.contracts.failures import GrammarTooLarge, InvalidRequest
from kvbank.contracts.vocabulary import MAX_TOP_LOGPROBS
from kvbank.v1 import api_pb2

ROLES = ("system", "user", "assistant", "tool")
# In UTF-8 bytes, not characters: the coldstore's key is `tenant NUL session_id`, and LMDB
# refuses keys over 511 bytes (256 characters of emoji are 1 KiB).
MAX_SESSION_ID_BYTES = 256
MAX_STOP_STRINGS = 8
MAX_LOGIT_BIAS = 100.0      # OpenAI's bound on a bias
MAX_PENALTY = 2.0           # OpenAI's bound on presence / frequency penalties
MAX_REPETITION_PENALTY = 10.0
MAX_PENALTY_WINDOW = 4096
FORMATS = ("", "text", "json_object", "json_schema")


@dataclass(frozen=True)
class ValidRequest:
    session_id: str
    kind: str  # "chat" | "prompt" | "tokens"
    messages: tuple[dict, ...]
    prompt: str
    token_ids: tuple[int, ...]
    append: bool
    max_tokens: int
    stop: tuple[str, ...]
    no_cache: bool
    fit_max_tokens: bool = False
    sampling: api_pb2.SamplingParams = field(default_factory=api_pb2.SamplingParams)
    tools: tuple[dict, ...] = ()       # OpenAI's tools array, for the chat template
    tool_choice: str = ""              # auto | none | required | function:NAME ("" : auto)
    response_format: api_pb2.ResponseFormat = field(default_factory=api_pb2.ResponseFormat)
    enable_thinking: bool | None = None  # the template's reasoning switch (None: its default)
    # UTF-8 bytes of the text the model surely reads (the prompt; the user, system and tool
    # messages, ends trimmed as a template may): at least this / the longest token's bytes
    # tokens, known before tokenizing (router/server.py `prompt_tokens`)
    text_bytes: int = 0

    @property
    def template(self) -> dict:
        """What the chat template is rendered with beyond the messages and tools."""
        return {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}


def validate(req: api_pb2.GenerateRequest, *, vocab_size: int,
             max_grammar_bytes: int = 0) -> ValidRequest:
    """The request checked field by field; `max_grammar_bytes` (the worker's, 0: unknown)
    bounds a JSON schema before it is parsed."""
    sid = req.session_id
    if len(sid.encode()) > MAX_SESSION_ID_BYTES:
        raise InvalidRequest(f"session_id must be at most {MAX_SESSION_ID_BYTES} bytes of UTF-8; "
                             f"given {len(sid.encode())} bytes ({len(sid)} characters)")
    if "\0" in sid:
        raise InvalidRequest(f"session_id must not contain NUL; given one at character "
                             f"{sid.index(chr(0))}")
    kind = req.WhichOneof("input")
    if kind is None:
        raise InvalidRequest("the request has no input: set one of chat, prompt or tokens")
    messages: tuple[dict, ...] = ()
    if kind == "chat":
        if not req.chat.messages:
            raise InvalidRequest("chat.messages is empty: send at least one message")
        messages = tuple(_message(i, m) for i, m in enumerate(req.chat.messages))
        if all(not m["content"].strip() and not m.get("tool_calls") for m in messages):
            raise InvalidRequest("every chat message is empty: send some text")
    elif kind == "prompt":
        if not req.prompt:
            raise InvalidRequest("prompt is empty: send some text")
    elif kind == "tokens":
        if not req.tokens.ids:
            raise InvalidRequest("tokens.ids is empty: send at least one token id")
        bad = next((t for t in req.tokens.ids if t >= vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"tokens.ids must be < the vocabulary size {vocab_size}; given {bad}")
    if req.append and not sid:
        raise InvalidRequest("append needs a session_id: name the conversation to append to")
    if req.max_tokens <= 0:
        raise InvalidRequest(f"max_tokens must be > 0; given {req.max_tokens}")
    s = req.sampling
    if not (0.0 <= s.temperature <= 10.0) or s.temperature != s.temperature:
        raise InvalidRequest(f"sampling.temperature must be in [0, 10]; given {s.temperature}")
    if not (0.0 <= s.top_p <= 1.0) or s.top_p != s.top_p:
        raise InvalidRequest(f"sampling.top_p must be in [0, 1]; given {s.top_p}")
    if len(req.stop) > MAX_STOP_STRINGS or any(not x for x in req.stop):
        raise InvalidRequest(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings; "
                             f"given {len(req.stop)}")
    _sampling_extras(s, vocab_size)
    tools = _tools(req.chat.tools_json) if kind == "chat" else ()
    choice = _tool_choice(req.chat.tool_choice, tools)
    fmt = req.response_format
    if fmt.type not in FORMATS:
        raise InvalidRequest(f"response_format.type must be one of text, json_object, "
                             f"json_schema; given {fmt.type!r}", param="response_format")
    if (fmt.type == "json_schema" and max_grammar_bytes
            and len(fmt.json_schema) > max_grammar_bytes):  # characters: at most the bytes
        raise GrammarTooLarge("response_format", len(fmt.json_schema.encode()),
                              max_grammar_bytes, param="response_format")
    if fmt.type == "json_schema" and not isinstance(_json(fmt.json_schema,
                                                          "response_format.json_schema"), dict):
        raise InvalidRequest("response_format.json_schema must be a JSON object (a schema)",
                             param="response_format")
    forced_call = choice == "required" or choice.startswith("function:")
    if fmt.type in ("json_object", "json_schema") and forced_call:
        # The answer is the call, as OpenAI's is: the format is for text answers (an agent
        # framework sends its output schema with every request, a forced call's too).
        fmt = api_pb2.ResponseFormat()
    text_bytes = (len(req.prompt.encode()) if kind == "prompt" else
                  sum(len(m["content"].strip().encode()) for m in messages
                      if m["role"] != "assistant"))  # a template may drop an answer's part
    return ValidRequest(
        session_id=sid, kind=kind, messages=messages, prompt=req.prompt, text_bytes=text_bytes,
        token_ids=tuple(req.tokens.ids), append=req.append, max_tokens=req.max_tokens,
        stop=tuple(req.stop), no_cache=req.no_cache, fit_max_tokens=req.fit_max_tokens,
        sampling=s, tools=tools, tool_choice=choice, response_format=fmt,
        enable_thinking=req.enable_thinking if req.HasField("enable_thinking") else None,
    )


def _message(i: int, m: api_pb2.ChatMessage) -> dict:
    """One message as chat templates take it: tool calls with their arguments as objects."""
    where = f"chat.messages[{i}]"
    if m.role not in ROLES:
        raise InvalidRequest(f"{where}.role must be one of {', '.join(ROLES)}; given {m.role!r}")
    out: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:
        if m.role != "assistant":
            raise InvalidRequest(f"{where}.tool_calls: only assistant messages carry tool calls")
        out["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": _arguments(c.arguments, f"{where}."
                                                                  f"tool_calls[{j}]")}}
            for j, c in enumerate(m.tool_calls)]
    if m.reasoning:
        if m.role != "assistant":
            raise InvalidRequest(f"{where}.reasoning: only assistant messages carry reasoning")
        # `reasoning_content` for most templates, `thinking` for gpt-oss's
        out["reasoning_content"] = out["thinking"] = m.reasoning
    if m.role == "tool":
        if m.tool_call_id:
            out["tool_call_id"] = m.tool_call_id
        if m.name:
            out["name"] = m.name
    return out


def _arguments(text: str, where: str) -> dict:
    args = _json(text or "{}", f"{where}.arguments")
    if not isinstance(args, dict):
        raise InvalidRequest(f"{where}.arguments must be a JSON object; given {text[:80]!r}")
    return args


def _json(text: str, where: str, param: str | None = None):
    """Parsed, nested at most MAX_JSON_DEPTH deep (kvbank/json_input.py)."""
    try:
        return json_input.loads(text, where)
    except json_input.BadJson as e:
        raise InvalidRequest(str(e), param=param or where) from None
    except ValueError as e:
        raise InvalidRequest(f"{where} is not valid JSON ({e}); given {text[:80]!r}",
                             param=param or where) from None


def _tools(text: str) -> tuple[dict, ...]:
    """OpenAI's tools: an array of {"type": "function", "function": {"name", ...}}."""
    if not text:
        return ()
    tools = _json(text, "tools", param="tools")
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be an array of function tools", param="tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if (not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str) or not fn["name"]):
            raise InvalidRequest(f'tools[{i}] must be {{"type": "function", "function": '
                                 f'{{"name": ..., "parameters": {{...}}}}}}', param="tools")
        if not isinstance(fn.get("parameters", {}), dict):
                raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON schema object",
                                 param="tools")
    return tuple(tools)


def _tool_choice(choice: str, tools: tuple[dict, ...]) -> str:
    if not choice:
        return "auto" if tools else ""
    names = [t["function"]["name"] for t in tools]
    if not tools:
        raise InvalidRequest(f"tool_choice is {choice!r} but the request has no tools",
                             param="tool_choice")
    if choice in ("auto", "none", "required"):
        return choice
    name = choice.removeprefix("function:")
    if choice.startswith("function:") and name in names:
        return choice
    raise InvalidRequest(f"tool_choice must be auto, none, required or function:NAME with NAME "
                         f"one of {', '.join(names)}; given {choice!r}", param="tool_choice")


def _sampling_extras(s: api_pb2.SamplingParams, vocab_size: int) -> None:
    for token, bias in s.logit_bias.items():
        if token >= vocab_size:
            raise InvalidRequest(f"logit_bias names token {token}; the vocabulary has "
                                 f"{vocab_size} tokens", param="logit_bias")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias values must be in [-100, 100]; given {bias} for "
                                 f"token {token}", param="logit_bias")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise InvalidRequest(f"{name} must be in [-2, 2]; given {value}", param=name)
    if not 0 <= s.repetition_penalty <= MAX_REPETITION_PENALTY:
        raise InvalidRequest(f"repetition_penalty must be in [0, {MAX_REPETITION_PENALTY:g}] "
                             f"(1 or 0: off); given {s.repetition_penalty}",
                             param="repetition_penalty")
    if s.penalty_window > MAX_PENALTY_WINDOW:
        raise InvalidRequest(f"penalty_window must be at most {MAX_PENALTY_WINDOW}; given "
                             f"{s.penalty_window}", param="penalty_window")
    if not 0.0 <= s.min_p <= 1.0:
        raise InvalidRequest(f"min_p must be in [0, 1]; given {s.min_p}", param="min_p")
    if s.top_k >= vocab_size:
        raise InvalidRequest(f"top_k must be below the vocabulary size {vocab_size}; given "
                             f"{s.top_k}", param="top_k")
    if s.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs must be at most {MAX_TOP_LOGPROBS}; given "
                             f"{s.top_logprobs}", param="top_logprobs")
