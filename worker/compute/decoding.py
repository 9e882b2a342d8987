"""What one request asks of decoding: its sampler, its logits processors (logit_bias,
penalties, a grammar), the log-probabilities it wants back, its reasoning and its tool calls.

All of it is mlx-lm's where mlx-lm has it (samplers, `make_logits_processors`, the model's
tool parser); what is ours is the per-request shape: a seeded sampler that draws from its own
key, and the split of an answer's text into what the client reads and the calls it made.
"""

from __future__ import annotations

import json
import math
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx

from kvbank.contracts.failures import InvalidRequest
from kvbank.custom_tools import parse_raw
from kvbank.v1 import api_pb2
from kvbank.worker.compute.call_formats import CallFormat, HarmonyText

PENALTY_WINDOW = 20    # mlx-lm's context size for the three penalties


def make_request_sampler(temperature: float, top_p: float, seed: int | None, *,
                         top_k: int = 0, min_p: float = 0.0) -> Callable:
    """A sampler of its own for each request; with a seed it draws from its own key, so the
    same request gives the same text whatever else runs in the batch. The filters are
    mlx-lm's, in its order (top_p, min_p, top_k)."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_sampler

    if temperature <= 0 or seed is None:
        return make_sampler(temp=temperature, top_p=top_p, min_p=min_p, top_k=top_k)
    key = mx.random.key(seed)

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        if 0 < top_p < 1:
            logprobs = apply_top_p(logprobs, top_p)
        if min_p:
            logprobs = apply_min_p(logprobs, min_p)
        if top_k:
            logprobs = apply_top_k(logprobs, top_k)
        return mx.random.categorical(logprobs * (1 / temperature), key=sub)

    return sample


def logits_processors(s: api_pb2.SamplingParams, vocab_size: int) -> list[Callable]:
    """logit_bias and the penalties, as mlx-lm applies them (bad values: InvalidRequest)."""
    from mlx_lm.sample_utils import make_logits_processors

    bad = next((t for t in s.logit_bias if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"logit_bias names token {bad}; the vocabulary has {vocab_size}")
    if s.repetition_penalty < 0:
        raise InvalidRequest(f"repetition_penalty must be >= 0; given {s.repetition_penalty}")
    window = s.penalty_window or PENALTY_WINDOW
    return make_logits_processors(
        logit_bias=dict(s.logit_bias) or None,
        repetition_penalty=s.repetition_penalty if s.repetition_penalty not in (0, 1) else None,
        repetition_context_size=window,
        presence_penalty=s.presence_penalty or None, presence_context_size=window,
        frequency_penalty=s.frequency_penalty or None, frequency_context_size=window)


def token_logprob(logprobs: mx.array, token: int, top_n: int, decode) -> api_pb2.TokenLogprob:
    """The chosen token's log-probability and the `top_n` most likely, most likely first."""
    out = api_pb2.TokenLogprob(token_id=token, token=decode([token]),
                               logprob=logprobs[token].item())
    if top_n > 0:
        top = mx.argpartition(-logprobs, kth=top_n - 1)[:top_n]
        values = logprobs[top].tolist()
        for lp, t in sorted(zip(values, top.tolist()), key=lambda p: -p[0]):
            if lp > -math.inf:  # a token a grammar or a bias of -inf ruled out is no choice
                out.top.append(api_pb2.TokenLogprob(token_id=t, token=decode([t]), logprob=lp))
    return out


class ReasoningText:
    """Splits an answer's text, as it streams, into the model's reasoning (between its think
    markers, mlx-lm's `think_start` / `think_end`) and the text the client reads. An answer
    whose prompt ends inside an open think marker (a template that starts the reasoning for
    the model) begins as reasoning, as mlx-lm's server decides it. The blank lines a model
    writes after its end marker, or before its reasoning opens (GLM's `\n<think>`), are not
    text."""

    def __init__(self, start: str, end: str, reasoning: bool, *,
                 start_ids: list[int] = (), end_ids: list[int] = ()):
        self.start, self.end, self.in_reasoning = start, end, reasoning
        self.buf = ""
        self.after_end = False  # strip the whitespace that follows an end marker
        self.opened = reasoning  # as the answer began (for `count`)
        self.blank = not reasoning  # nothing but whitespace so far (held back)
        self.start_ids, self.end_ids = list(start_ids), list(end_ids)

    @classmethod
    def after_prompt(cls, tokenizer, prompt: list[int]) -> "ReasoningText":
        opened = tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt)
        return cls(tokenizer.think_start, tokenizer.think_end, opened,
                   start_ids=tokenizer.think_start_tokens or (),
                   end_ids=tokenizer.think_end_tokens or ())

    def count(self, completion: list[int]) -> int:
        """How many of an answer's tokens are reasoning (`reasoning_tokens` in usage): from
        where it opens, through its end marker, the markers included. Counted on tokens, not
        on the text, so a marker split across detokenizer steps counts once."""
        n, inside, i = 0, self.opened, 0
        while i < len(completion):
            marker = self.end_ids if inside else self.start_ids
            hit = bool(marker) and list(completion[i:i + len(marker)]) == marker
            step = len(marker) if hit else 1
            if inside or hit:
                n += step
            inside ^= hit
            i += step
        return n

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, text) of what can be told apart so far."""
        self.buf += text
        reasoning, out = [], []
        while self.buf:
            marker = self.end if self.in_reasoning else self.start
            at = self.buf.find(marker)
            if at < 0:
                keep = _partial_suffix(self.buf, marker)
                if self.blank and not self.buf[:len(self.buf) - keep].strip():
                    break  # whitespace before anything: held until it is known what follows
                piece, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
            else:
                piece, self.buf = self.buf[:at], self.buf[at + len(marker):]
                if self.blank and not piece.strip():
                    piece = ""  # the blank before the reasoning opens
            self.blank = False
            if self.in_reasoning:
                reasoning.append(piece)
            else:
                if self.after_end:
                    piece = piece.lstrip()
                    self.after_end = not piece
                out.append(piece)
            if at < 0:
                break
            self.in_reasoning = not self.in_reasoning
            self.after_end = not self.in_reasoning
        return "".join(reasoning), "".join(out)

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        if self.in_reasoning:
            return rest, ""
        return "", rest.lstrip() if self.after_end else rest


class ToolCallText:
    """Splits an answer's text, as it streams, into the text the client reads and the tool
    calls between the model's call markers, parsed by the model's own tool parser.

    Text that could be the start of a marker is held back until it is known not to be. A call
    the answer left unclosed (max_tokens) is parsed if it parses, else given back as text; a
    custom tool's raw call (kvbank/custom_tools.py) only when closed, since its input may
    have been cut anywhere.
    """

    def __init__(self, start: str, end: str, parse: Callable, tools: list[dict]):
        self.start, self.end, self.parse, self.tools = start, end, parse, tools
        self.buf = ""
        self.in_call = False
        self.made_calls = False

    def feed(self, text: str) -> tuple[str, list[api_pb2.ToolCall]]:
        self.buf += text
        out: list[str] = []
        calls: list[api_pb2.ToolCall] = []
        while True:
            if not self.in_call:
                at = self.buf.find(self.start)
                if at < 0:
                    keep = _partial_suffix(self.buf, self.start)
                    out.append(self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                out.append(self.buf[:at])
                self.buf, self.in_call = self.buf[at + len(self.start):], True
            else:
                at = self.buf.find(self.end)
                if at < 0:
                    break
                body, self.buf, self.in_call = self.buf[:at], self.buf[at + len(self.end):], False
                parsed = self._parse(body)
                if parsed is None:  # not a call after all: the client gets what was written
                    out.append(self.start + body + self.end)
                calls += parsed or []
        return "".join(out), calls

    def finish(self) -> tuple[str, list[api_pb2.ToolCall]]:
        rest, self.buf = self.buf, ""
        if not self.in_call:
            return rest, []
        parsed = self._parse(rest, closed=False)
        return ("", parsed) if parsed else (self.start + rest, [])

    def _parse(self, body: str, closed: bool = True) -> list[api_pb2.ToolCall] | None:
        try:
            parsed = self.parse(body, self.tools)
        except (ValueError, KeyError, TypeError):
            parsed = parse_raw(body, self.tools) if closed else None
            if parsed is None:
                return None
        calls = []
        for call in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return None
            args = call.get("arguments", {})
            calls.append(api_pb2.ToolCall(
                id=call.get("id") or f"call_{uuid.uuid4().hex[:24]}", name=call["name"],
                arguments=args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
        self.made_calls = self.made_calls or bool(calls)
        return calls


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class Decoding:
    """One request's decoding: built once when it starts, consulted at every token."""

    sampler: Callable
    processors: list[Callable] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    tools: ToolCallText | None = None
    reasoning: ReasoningText | None = None
    grammar: Any = None  # the constraint's matcher, when the answer is constrained
    harmony: HarmonyText | None = None  # gpt-oss: channels and calls in one split

    @property
    def made_calls(self) -> bool:
        split = self.harmony or self.tools
        return bool(split and split.made_calls)

    @classmethod
    def for_request(cls, req, tokenizer, vocab_size: int, constraint=None,
                    fmt: CallFormat | None = None) -> "Decoding":
        """`req` is a WorkerGenerateRequest; `constraint` the grammar's logits processor
        (worker/compute/grammar.py), if the answer has one; `fmt` the model's call syntax."""
        s = req.sampling
        seed = s.seed if s.HasField("seed") else None
        processors = logits_processors(s, vocab_size)
        if constraint is not None:
            processors.append(constraint)  # last: nothing may lift a masked token back
        tools = reasoning = harmony = None
        calls_on = bool(req.tools_json) and req.tool_choice != "none" and fmt is not None
        if fmt is not None and fmt.name == "harmony" and (req.split_reasoning or calls_on):
            harmony = HarmonyText(json.loads(req.tools_json) if calls_on else None)
        elif calls_on:
            tools = ToolCallText(fmt.start, fmt.end, fmt.parse, json.loads(req.tools_json))
        if harmony is None and req.split_reasoning and getattr(tokenizer, "has_thinking", False):
            reasoning = ReasoningText.after_prompt(tokenizer, list(req.token_ids))
        if s.top_k >= vocab_size:
            raise InvalidRequest(f"top_k must be below the vocabulary size {vocab_size}; given "
                                 f"{s.top_k}", param="top_k")
        return cls(sampler=make_request_sampler(s.temperature, s.top_p, seed, top_k=s.top_k,
                                                min_p=s.min_p),
                   processors=processors, logprobs=s.logprobs or s.top_logprobs > 0,
                   top_logprobs=s.top_logprobs, tools=tools, reasoning=reasoning,
                   grammar=constraint, harmony=harmony)


class Decodings:
    """Each request's `Decoding`, for one model: what the model cannot do is refused here,
    before any memory is spent on the request; grammars compile against its vocabulary
    (llguidance's view of it is made once, on the first constrained answer).

    A grammar is compiled off the engine thread (`compile`, run by
    worker/compute/grammar_compile.py once per schema, within a time and size limit); the
    engine only takes a copy of it (`for_request`)."""

    def __init__(self, tokenizer, vocab_size: int, model_name: str):
        from kvbank.worker.compute.call_formats import call_format

        self.tokenizer, self.vocab_size, self.model_name = tokenizer, vocab_size, model_name
        self.format = call_format(tokenizer)  # the model's call syntax (None: none known)
        self._grammars = None  # worker/compute/grammar.py Grammars
        self._grammars_made = threading.Lock()  # compiles run on threads

    def for_request(self, req, grammar=None) -> Decoding:
        """`grammar`: the request's, compiled already (`compile`); when it needs one and none
        is given, compiled here."""
        if req.tools_json and self.format is None:
            raise InvalidRequest(f"the model {self.model_name} has no tool calling in its "
                                 f"chat template: send the request without tools",
                                 param="tools")
        if grammar is None and self.grammar_key(req) is not None:
            grammar = self.compile(req)
        return Decoding.for_request(req, self.tokenizer, self.vocab_size,
                                    constraint=grammar.processor() if grammar else None,
                                    fmt=self.format)

    def _kind(self, req) -> str | None:
        """What constrains the answer: "call" (a forced call in the model's own syntax),
        "format" (a JSON answer), "none" (tool_choice none: the answer must not call), or
        None (free)."""
        fmt, choice = req.response_format, req.tool_choice
        if req.tools_json and self.format is None:
            return None  # refused as any request with tools is (`for_request`)
        if req.tools_json and (choice == "required" or choice.startswith("function:")):
            return "call"
        if fmt.type in ("json_object", "json_schema"):
            return "format"
        if req.tools_json and choice == "none":
            return "none"
        return None

    def grammar_key(self, req) -> str | None:
        """What the request's grammar is compiled from (its cache key); None when its answer
        is free."""
        kind = self._kind(req)
        if kind is None:
            return None
        fmt = req.response_format
        if kind == "format":
            return f"format\0{fmt.type}\0{fmt.json_schema if fmt.type == 'json_schema' else ''}"
        return f"{kind}\0{req.tool_choice}\0{self._reasoning(req)}\0{req.tools_json}"

    def compile(self, req):
        """The grammar (worker/compute/grammar.py `Grammar`) for a JSON answer, a forced tool
        call in the model's own call syntax, or an answer that must not call (any thread; it
        may take seconds). A schema or grammar llguidance refuses is an InvalidRequest in our
        words (`in_our_words`)."""
        kind, fmt, choice = self._kind(req), req.response_format, req.tool_choice
        param = "tool_choice" if kind == "call" else "response_format"
        with self._grammars_made:
            if self._grammars is None:
                from kvbank.worker.compute.grammar import Grammars

                self._grammars = Grammars(self.tokenizer)
        family = self.format.name if self.format is not None else ""
        try:
            if kind == "call" and family == "json_tools":
                return self._grammars.for_tool_call(json.loads(req.tools_json),
                                                    choice.removeprefix("function:"))
            if kind == "call":
                return self._grammars.for_family_call(
                    family, json.loads(req.tools_json), choice.removeprefix("function:"),
                    self._reasoning(req))
            if kind == "none":
                grammar = self._grammars.for_no_call(family, self._reasoning(req))
                return grammar if grammar is not None else self._no_call_token()
            return self._grammars.for_response_format(
                {"type": fmt.type, "json_schema": {"schema": json.loads(fmt.json_schema)}}
                if fmt.type == "json_schema" else {"type": fmt.type})
        except ValueError as e:  # a custom tool's format names its own field
            raise InvalidRequest(in_our_words(str(e)), param=getattr(e, "param", param)) from None

    def _reasoning(self, req) -> str:
        """Where the answer starts relative to the model's reasoning (worker/compute/grammar.py)."""
        if not getattr(self.tokenizer, "has_thinking", False):
            return "none"
        prompt = list(req.token_ids)
        opened = self.tokenizer.rfind_think_start(prompt) > self.tokenizer.rfind_think_end(prompt)
        return "open" if opened else "optional"

    def _no_call_token(self):
        """tool_choice none where a call opens with one special token: that token ruled out
        (None where the call's start is plain text: the answer is left free)."""
        specials = {t.content: i for i, t in
                    self.tokenizer._tokenizer.added_tokens_decoder.items()}
        token = specials.get(self.format.start)
        return None if token is None else BanToken(token)


GRAMMAR_MESSAGE_MAX = 300


def in_our_words(message: str) -> str:
    """llguidance's reason for refusing a grammar, when it is a sentence a client can act on
    (`where: unknown keyword 'x'`); a panic, a backtrace or pages of its parser state become
    our own sentence naming the field."""
    where, _, why = message.partition(": ")
    if (not why or "panic" in why.lower() or "backtrace" in why.lower() or "\n" in why
            or len(why) > GRAMMAR_MESSAGE_MAX):
        return (f"{where if why else 'the grammar'}: the grammar compiler could not build a "
                f"grammar from it (too large or too complex for it): simplify it")
    return message


class BanToken:
    """A logits processor that rules one token out (tool_choice none: a call's first token).
    Stands where a grammar would (`processor()`), so the compile cache can hold it."""

    def __init__(self, token: int):
        self.token = token

    def processor(self) -> "BanToken":
        return self

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        mask = mx.arange(logits.shape[-1]) == self.token
        return mx.where(mask, mx.array(-float("inf"), dtype=logits.dtype), logits)
