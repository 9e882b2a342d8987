"""The router's messages in, OpenAI's bodies and stream chunks out (chat and completions).

A tool call arrives parsed (the worker ran the model's tool parser) and goes out whole, in
one delta per call: `index`, `id`, `type`, the function's name and all of its arguments, which
is how OpenAI's own stream opens a call and what the SDKs' stream helpers accumulate. The
model's reasoning, split off by the worker, is the message's `reasoning_content` (as vLLM,
SGLang and DeepSeek's API name it) and present only when there is some.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from kvbank.client import CACHE_SOURCES, FINISH_REASONS
from kvbank.v1 import api_pb2


def usage_body(u: api_pb2.Usage) -> dict:
    """OpenAI's usage, plus kvbank's own facts under `kvbank` (clients ignore unknown keys)."""
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "kvbank": {"cache_source": CACHE_SOURCES[u.cache_source],
                   "recomputed_tokens": u.recomputed_tokens,
                   "prefix_lost_tokens": u.prefix_lost_tokens, "ttft_s": round(u.ttft_s, 4),
                   "queue_s": round(u.queue_s, 4), "durable": u.durable,
                   "session_id": u.session_id, "drafted_tokens": u.drafted_tokens,
                   "accepted_tokens": u.accepted_tokens},
    }


def tool_call_body(c: api_pb2.ToolCall, index: int | None = None) -> dict:
    out = {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
    return out if index is None else {"index": index, **out}


def _chat_logprob(lp: api_pb2.TokenLogprob, with_top: bool) -> dict:
    out = {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode())}
    if with_top:
        out["top_logprobs"] = [_chat_logprob(t, False) for t in lp.top]
    return out


@dataclass
class Answer:
    """One request's answer as the router streams it, shaped for its endpoint."""

    kind: str
    model: str
    include_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[api_pb2.ToolCall] = field(default_factory=list)
    logprobs: list[api_pb2.TokenLogprob] | None = None  # None: not asked for
    finish_reason: str | None = None
    usage: dict | None = None

    def add(self, msg: api_pb2.GenerateResponse) -> None:
        if msg.text:
            self.text.append(msg.text)
        if msg.reasoning:
            self.reasoning.append(msg.reasoning)
        self.tool_calls.extend(msg.tool_calls)
        if msg.logprobs:
            self.logprobs = (self.logprobs or []) + list(msg.logprobs)
        if msg.HasField("usage"):
            self.usage = usage_body(msg.usage)
            self.finish_reason = FINISH_REASONS.get(msg.finish_reason, "stop")

    def body(self) -> dict:
        text = "".join(self.text)
        if self.kind == "chat":
            message = {"role": "assistant", "content": text or (None if self.tool_calls else ""),
                       "refusal": None}
            if self.reasoning:
                message["reasoning_content"] = "".join(self.reasoning)
            if self.tool_calls:
                message["tool_calls"] = [tool_call_body(c) for c in self.tool_calls]
            choice = {"index": 0, "message": message}
        else:
            choice = {"index": 0, "text": text}
        choice |= {"logprobs": self._logprobs(self.logprobs), "finish_reason": self.finish_reason}
        return self._envelope([choice], "chat.completion" if self.kind == "chat"
                              else "text_completion") | {"usage": self.usage}

    def first_chunk(self) -> dict | None:
        """OpenAI's chat streams open with the role and empty content."""
        if self.kind != "chat":
            return None
        return self._chunk({"role": "assistant", "content": "", "refusal": None}, None)

    def chunks(self, msg: api_pb2.GenerateResponse) -> list[dict]:
        """The chunks one router message becomes (a text delta with its tokens' logprobs; the
        tool calls; the finish; the usage)."""
        calls_before = len(self.tool_calls)
        self.add(msg)
        out = []
        if msg.reasoning and self.kind == "chat":
            out.append(self._chunk({"reasoning_content": msg.reasoning}, None))
        if msg.text or msg.logprobs:
            logprobs = self._logprobs(list(msg.logprobs)) if msg.logprobs else None
            delta = {"content": msg.text} if self.kind == "chat" else msg.text
            out.append(self._chunk(delta, None, logprobs))
        if msg.tool_calls:
            out.append(self._chunk({"tool_calls": [
                tool_call_body(c, calls_before + i) for i, c in enumerate(msg.tool_calls)]},
                None))
        if msg.HasField("usage"):
            out.append(self._chunk({} if self.kind == "chat" else "", self.finish_reason))
            if self.include_usage:
                out.append(self._envelope([], self._chunk_object()) | {"usage": self.usage})
        return out

    def _logprobs(self, entries: list[api_pb2.TokenLogprob] | None) -> dict | None:
        if entries is None:
            return None
        if self.kind == "chat":
            with_top = any(e.top for e in entries)
            return {"content": [_chat_logprob(e, with_top) for e in entries], "refusal": None}
        offsets, at = [], len("".join(self.text)) - sum(len(e.token) for e in entries)
        for e in entries:
            offsets.append(max(0, at))
            at += len(e.token)
        return {"tokens": [e.token for e in entries],
                "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
                "text_offset": offsets}

    def _chunk(self, delta: dict | str, finish_reason: str | None,
               logprobs: dict | None = None) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": delta}
        choice |= {"logprobs": logprobs, "finish_reason": finish_reason}
        body = self._envelope([choice], self._chunk_object())
        return body | {"usage": None} if self.include_usage else body

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def _envelope(self, choices: list, obj: str) -> dict:
        prefix = "chatcmpl-" if self.kind == "chat" else "cmpl-"
        return {"id": prefix + self.id, "object": obj, "created": self.created,
                "model": self.model, "system_fingerprint": None, "choices": choices}
