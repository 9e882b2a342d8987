"""Each model family's tool-call syntax, as the worker reads it from the model's output.

mlx-lm picks a tool parser from the chat template (`qwen3_coder` for Qwen3.5 and Qwen3-Coder,
`glm47` for GLM-4.5/4.6, `gemma4`, `json_tools`, ...): those are used as they are. Two families
mlx-lm 0.32 does not read are read here:

- **harmony** (gpt-oss): the answer is a run of messages, `<|channel|>CHANNEL ...<|message|>
  BODY` ended by `<|end|>` (and `<|start|>assistant` before the next), `<|call|>` or
  `<|return|>`. `analysis` is reasoning, `final` the answer, a `commentary` message addressed
  `to=functions.NAME` a tool call whose body is its JSON arguments (a commentary message to no
  one is a preamble the user reads). `HarmonyText` splits it as it streams.
- **nemotron** (NVIDIA Nemotron Nano v2): `<TOOLCALL>[{"name": ..., "arguments": {...}},
  ...]</TOOLCALL>`, a JSON list of calls, read by `parse_nemotron` through the same streaming
  split as mlx-lm's parsers (`worker/compute/decoding.py` `ToolCallText`).

openai-harmony (OpenAI's renderer and parser of harmony) is not used: it works on token ids of
its own o200k vocabulary, downloaded at first use, and a model served here may have other ids
(the tests' tiny gpt-oss has SmolLM2's); see docs/decisions.md.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Callable

from kvbank.custom_tools import CUSTOM_ARG, custom_format
from kvbank.v1 import api_pb2

HARMONY_END, HARMONY_CALL, HARMONY_RETURN = "<|end|>", "<|call|>", "<|return|>"
HARMONY_START, HARMONY_MESSAGE, HARMONY_CHANNEL = "<|start|>", "<|message|>", "<|channel|>"
HARMONY_CONSTRAIN = "<|constrain|>"
NEMOTRON_START, NEMOTRON_END = "<TOOLCALL>", "</TOOLCALL>"


@dataclass(frozen=True)
class CallFormat:
    """A family's call syntax: its name (what the worker reports as `tool_parser`), the
    markers around a call and the parser of what stands between them (None for harmony,
    whose calls are messages: `HarmonyText`)."""

    name: str
    start: str
    end: str
    parse: Callable | None


def call_format(tokenizer) -> CallFormat | None:
    """The model's call syntax, from its tokenizer (mlx-lm's parser where it has one) and
    chat template; None where the template writes no calls kvbank can read."""
    if getattr(tokenizer, "has_tool_calling", False):
        parser = tokenizer.tool_parser
        name = getattr(parser, "__module__", "").rsplit(".", 1)[-1] or "custom"
        return CallFormat(name, tokenizer.tool_call_start, tokenizer.tool_call_end, parser)
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):
        return None
    # the template first: `get_vocab` builds a dict of every token at each call
    if "to=" in template and "functions." in template:
        vocab = tokenizer.get_vocab()
        if all(m in vocab for m in (HARMONY_CHANNEL, HARMONY_MESSAGE, HARMONY_CALL)):
            return CallFormat("harmony", HARMONY_CHANNEL, HARMONY_CALL, None)
    if NEMOTRON_START in template and NEMOTRON_END in template:
        return CallFormat("nemotron", NEMOTRON_START, NEMOTRON_END, parse_nemotron)
    return None


def parse_nemotron(body: str, tools=None) -> list[dict]:
    """`[{"name": ..., "arguments": {...}}, ...]` between <TOOLCALL> and </TOOLCALL>."""
    calls = json.loads(body)
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not calls:
        raise ValueError("a TOOLCALL holds a JSON list of calls")
    out = []
    for c in calls:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            raise ValueError("each call has a name")
        args = c.get("arguments", {})
        if isinstance(args, str):
            args = json.loads(args)
        out.append({"name": c["name"], "arguments": args})
    return out


class HarmonyText:
    """Splits a harmony answer, as it streams, into reasoning (the analysis channel), the text
    the client reads (final, and commentary to no one) and tool calls (commentary to
    functions.NAME). The answer starts right after `<|start|>assistant` (the template's
    generation prompt): with a message's header. Text that could be the start of a marker is
    held back until it is known not to be."""

    def __init__(self, tools: list[dict] | None = None):
        self.tools = tools or []
        self._custom = {t["function"]["name"] for t in self.tools if custom_format(t)}
        self.buf = ""
        self.state = "header"   # header | body | between
        self.header = ""
        self.channel = ""
        self.recipient = ""
        self.call_body = ""
        self.made_calls = False

    def feed(self, text: str) -> tuple[str, str, list[api_pb2.ToolCall]]:
        self.buf += text
        reasoning, out, calls = [], [], []
        while self.buf:
            if self.state == "between":  # after <|end|>: <|start|>assistant, then a header
                at = self.buf.find(HARMONY_START)
                if at < 0:
                    keep = _partial_suffix(self.buf, HARMONY_START)
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                self.buf = self.buf[at + len(HARMONY_START):]
                self.state, self.header = "header", ""
                continue
            if self.state == "header":
                at = self.buf.find(HARMONY_MESSAGE)
                if at < 0:
                    keep = _partial_suffix(self.buf, HARMONY_MESSAGE)
                    self.header += self.buf[:len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                self.header += self.buf[:at]
                self.buf = self.buf[at + len(HARMONY_MESSAGE):]
                self.channel, self.recipient = _read_header(self.header)
                self.state, self.call_body = "body", ""
                continue
            # body: up to the first end marker
            ends = [(self.buf.find(m), m) for m in (HARMONY_END, HARMONY_CALL, HARMONY_RETURN)]
            ends = [(at, m) for at, m in ends if at >= 0]
            if ends:
                at, marker = min(ends)
                piece, self.buf = self.buf[:at], self.buf[at + len(marker):]
            else:
                keep = max(_partial_suffix(self.buf, m)
                           for m in (HARMONY_END, HARMONY_CALL, HARMONY_RETURN))
                piece, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                marker = None
            self._body(piece, reasoning, out)
            if marker is None:
                break
            call = self._end_message(out)
            if call is not None:
                calls.append(call)
            self.state = "between"
        return "".join(reasoning), "".join(out), calls

    def count(self, completion: list[int], decode) -> int:
        """How many of an answer's tokens are reasoning (the analysis channel's messages,
        their headers and ends included): a fresh split fed token by token."""
        split, n = HarmonyText(), 0
        for t in completion:
            analysis = split.channel == "analysis" and split.state != "between"
            split.feed(decode([t]))
            n += analysis or (split.channel == "analysis" and split.state != "between")
        return n

    def finish(self) -> tuple[str, str, list[api_pb2.ToolCall]]:
        """The end of the answer: what is held back, a call left unclosed (max_tokens) if its
        arguments parse, and text with no harmony header at all (a model that does not write
        harmony, as a random one) as text."""
        reasoning, out, calls = [], [], []
        if self.state == "body":
            self._body(self.buf, reasoning, out)
            call = self._end_message(out)
            if call is not None:
                calls.append(call)
        elif self.state == "header" and HARMONY_CHANNEL not in self.header + self.buf:
            out.append(self.header + self.buf)  # no message at all: text the model wrote
        self.buf, self.state = "", "between"
        return "".join(reasoning), "".join(out), calls

    def _body(self, piece: str, reasoning: list, out: list) -> None:
        if self.recipient:
            self.call_body += piece
        elif self.channel == "analysis":
            reasoning.append(piece)
        else:  # final, a preamble on commentary, or a channel harmony does not name
            out.append(piece)

    def _end_message(self, out: list) -> api_pb2.ToolCall | None:
        if not self.recipient:
            return None
        if not self.tools:  # no tools offered (or tool_choice none): nothing is a call
            out.append(self.call_body)
            self.recipient, self.call_body = "", ""
            return None
        name, body = self.recipient.removeprefix("functions."), self.call_body
        self.recipient, self.call_body = "", ""
        try:
            args = json.loads(body)
        except ValueError:
            args = None
        if name in self._custom:  # a custom tool's input is the message itself
            args = {CUSTOM_ARG: body} if not isinstance(args, dict) or set(args) != {
                CUSTOM_ARG} else args
        if not isinstance(args, dict):
            out.append(body)  # not a call after all: the client gets what was written
            return None
        self.made_calls = True
        return api_pb2.ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=name,
                                arguments=json.dumps(args, ensure_ascii=False))


def _read_header(header: str) -> tuple[str, str]:
    """(channel, recipient) of a message header: `<|channel|>commentary to=functions.x
    <|constrain|>json`, or the recipient before the channel (` to=functions.x<|channel|>...`)."""
    channel, recipient = "", ""
    words = header.replace(HARMONY_CHANNEL, " \0").replace(HARMONY_CONSTRAIN, " ").split()
    for i, word in enumerate(words):
        if word.startswith("to="):
            recipient = word[3:]
        elif word.startswith("\0"):
            channel = word[1:] or (words[i + 1] if i + 1 < len(words) else "")
    return channel, recipient


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
