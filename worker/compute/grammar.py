"""Structured output: JSON (`response_format`) and forced tool calls, as mlx-lm logits processors.

The model may only write tokens that keep its output inside a grammar, so the answer parses
whatever the model is. llguidance does the matching: it fills the allowed-token bitmask for the
whole vocabulary in ~10-15 µs a token here (xgrammar needs torch; outlines-core is regex only
and takes seconds to compile `json_object`), a fraction of a percent of a decode step.

Per worker: `Grammars(tokenizer)` (the vocabulary setup is the slow part). Per request:
`grammars.for_response_format(...)` or `grammars.for_tool_call(...)` gives a `Grammar`, and
`grammar.processor()` a fresh `GrammarProcessor` for BatchGenerator's `logits_processors`.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Sequence

import llguidance as llg
import llguidance.numpy as llg_numpy
import mlx.core as mx
import numpy as np

from kvbank.custom_tools import FORMAT_KEY, custom_format, input_grammar, raw_header

# No free whitespace: a model may otherwise pad JSON with blanks until max_tokens. One space
# after ',' and ':' reads like json.dumps, the JSON models have seen most.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The Qwen/Hermes tool-call format, which mlx-lm's `json_tools` parser reads.
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>\n", "\n</tool_call>"
END = json.dumps(TOOL_CALL_END)  # as a Lark string


class Grammars:
    """Compiles grammars for one tokenizer (an mlx-lm TokenizerWrapper).

    llguidance's view of the vocabulary takes ~0.3 s to build for 49K tokens, so a worker makes
    one of these at start and keeps it; each grammar after that compiles in about a millisecond.
    """

    def __init__(self, tokenizer: Any):
        hf = tokenizer._tokenizer
        if not hasattr(hf, "backend_tokenizer"):
            raise ValueError("structured output needs a Hugging Face fast tokenizer "
                             f"(tokenizer.json); this model has {type(hf).__name__}")
        backend = copy.copy(hf.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        self.eos_token_ids = sorted(tokenizer.eos_token_ids)
        self.tokenizer = llg.LLTokenizer(backend.to_str(), eos_token=self.eos_token_ids)
        # single tokens a grammar names by id, <[id]>; plain text can never match them
        self.specials = {t.content: i for i, t in hf.added_tokens_decoder.items()}
        think = (getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None))
        self.think = think if all(t in self.specials for t in think if t) and all(think) \
            else None

    def for_response_format(self, response_format: dict | None) -> Grammar | None:
        """The grammar for an OpenAI `response_format`; None for plain text.

        Raises ValueError, with a message for the client, when the shape or schema is wrong.
        """
        if response_format is None:
            return None
        if not isinstance(response_format, dict):
            raise ValueError("response_format must be an object")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return self._json({"type": "object"}, "response_format")
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ValueError("response_format.json_schema.schema must be a JSON Schema "
                                 "object")
            return self._json(spec["schema"], "response_format.json_schema.schema")
        raise ValueError("response_format.type must be 'text', 'json_object' or 'json_schema', "
                         f"not {kind!r}")

    def for_tool_call(self, tools: list[dict], choice: str | dict) -> Grammar:
        """The grammar that forces one call, `<tool_call>\\n{"name": ..., "arguments": {...}}
        \\n</tool_call>`, then end of turn. A custom tool's call is its raw form
        (kvbank/custom_tools.py): `{"name": ...}`, a line break, then an input in the tool's
        own grammar, nested as llguidance nests grammars (`@name`), or any text.

        `choice` is "required" (any of `tools`), a function name, or OpenAI's
        {"type": "function", "function": {"name": ...}}.
        """
        functions = self._chosen(tools, choice)
        # Every alternative starts with literal text, so the parser tells them apart by name
        # before it enters a nested grammar (a %json that began at `{` would be chosen first).
        rules, nested = [], []
        for i, f in functions:
            fmt = custom_format(tools[i])
            if fmt is None:
                head = f'{{"name": {json.dumps(f["name"])}, "arguments": '
                rules.append(f"call_{i}: {json.dumps(head)} %json "
                             f"{json.dumps({**f['parameters'], 'x-guidance': JSON_STYLE})} "
                             f'"}}" {END}')
                continue
            grammar = input_grammar(fmt, f"tools[{i}].function.{FORMAT_KEY}")
            head = json.dumps(raw_header(f["name"]))
            if grammar is None:  # free text, up to the first end marker
                rules += [f"call_{i}: {head} input_{i}", f"input_{i}[suffix={END}]: /(?s:.*)/"]
            else:
                rules.append(f"call_{i}: {head} @input_{i} {END}")
                nested.append({**grammar, "name": f"input_{i}"})
        lark = "\n".join([f"start: {json.dumps(TOOL_CALL_START)} call",
                          "call: " + " | ".join(f"call_{i}" for i, _ in functions), *rules])
        matcher = llg.LLMatcher(self.tokenizer,
                                json.dumps({"grammars": [{"lark_grammar": lark}, *nested]}),
                                log_level=0)
        if matcher.is_error():
            for i, f in functions:  # name the tool whose schema is at fault
                if custom_format(tools[i]) is None:
                    self._json(f["parameters"], f"tools[{i}].function.parameters")
            raise ValueError(f"tools: {matcher.get_error()}")
        return Grammar(matcher, self.tokenizer.vocab_size, self.eos_token_ids)

    def for_family_call(self, family: str, tools: list[dict], choice: str | dict,
                        reasoning: str = "none") -> Grammar:
        """The grammar that forces one call in the model family's own syntax (`family`: the
        call format, worker/compute/call_formats.py), then end of turn: the markers and the argument
        encoding the family's parser reads back. `reasoning`: "open" where the prompt opened
        the model's reasoning (the call comes after its end marker), "optional" where the
        model may reason first, "none". Raises ValueError naming the family and its syntax
        where the call cannot be constrained there."""
        functions = self._chosen(tools, choice)
        build = _FAMILY_CALLS.get(family)
        if build is None:
            raise ValueError(f"tool_choice forces a call, and kvbank cannot constrain calls in "
                             f"the {family!r} format: send tool_choice auto")
        rules, nested, calls = [], [], []
        for i, f in functions:
            fmt = custom_format(tools[i])
            grammar = input_grammar(fmt, f"tools[{i}].function.{FORMAT_KEY}") if fmt else None
            if fmt is not None and grammar is not None:
                nested.append({**grammar, "name": f"input_{i}"})
            body = build(self, i, f, fmt is not None, grammar is not None, rules)
            calls.append(f"call_{i}")
            rules.append(f"call_{i}: {body}")
        lark = "\n".join([f"start: {self._reasoning(family, reasoning)}call",
                          "call: " + " | ".join(calls), *rules,
                          r"WS: /[ \t\r\n]*/", r"TEXT: /(?s:.*)/"])
        matcher = llg.LLMatcher(self.tokenizer,
                                json.dumps({"grammars": [{"lark_grammar": lark}, *nested]}),
                                log_level=0)
        if matcher.is_error():
            for i, f in functions:
                if custom_format(tools[i]) is None:
                    self._json(f["parameters"], f"tools[{i}].function.parameters")
            raise ValueError(f"tools: {matcher.get_error()}")
        return Grammar(matcher, self.tokenizer.vocab_size, self.eos_token_ids)

    def for_no_call(self, family: str, reasoning: str) -> Grammar | None:
        """tool_choice none as a grammar where the family's calls are not one special token
        that can simply be ruled out (harmony: analysis, then a final message; the role
        between them as the model spells it, a literal would force one spelling)."""
        if family != "harmony":
            return None
        m = self.mark
        lark = "\n".join([f'start: ({m("<|channel|>")} "analysis" {m("<|message|>")} TEXT '
                          f'{m("<|end|>")} {m("<|start|>")} ROLE)? {m("<|channel|>")} '
                          f'"final" {m("<|message|>")} TEXT', r"TEXT: /(?s:.*)/",
                          r"ROLE: /[a-z]+/"])
        matcher = llg.LLMatcher(self.tokenizer, json.dumps({"grammars": [{"lark_grammar": lark}]}),
                                log_level=0)
        return Grammar(matcher, self.tokenizer.vocab_size, self.eos_token_ids)

    def _chosen(self, tools: list[dict], choice: str | dict) -> list[tuple[int, dict]]:
        functions = [_function(t, i) for i, t in enumerate(tools or [])]
        if not functions:
            raise ValueError("tools must list at least one function to call")
        if isinstance(choice, dict):
            choice = (choice.get("function") or {}).get("name")
        if choice != "required":
            functions = [(i, f) for i, f in functions if f["name"] == choice]
            if not functions:
                raise ValueError(f"tool_choice {choice!r}: neither 'required' nor the name of "
                                 "a function in tools")
        return functions

    def _reasoning(self, family: str, reasoning: str) -> str:
        """What may stand before the call: the rest of an opened reasoning and its end
        marker, or an optional reasoning block of the family's."""
        if family == "harmony":
            m = self.mark
            return (f'({m("<|channel|>")} "analysis" {m("<|message|>")} TEXT {m("<|end|>")} '
                    f'{m("<|start|>")} "assistant")? ')
        if reasoning == "open":
            return f"TEXT {self.mark(self.think[1])} WS "
        if reasoning == "optional" and self.think:
            return f"(WS {self.mark(self.think[0])} TEXT {self.mark(self.think[1])})? WS "
        return "WS "

    def mark(self, text: str) -> str:
        """A marker in a lark grammar: the special token it is in this vocabulary, else text."""
        return f"<[{self.specials[text]}]>" if text in self.specials else json.dumps(text)

    def _json(self, schema: dict, where: str) -> Grammar:
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{where}: {matcher.get_error()}")
        return Grammar(matcher, self.tokenizer.vocab_size, self.eos_token_ids)


def _function(tool: Any, i: int) -> tuple[int, dict]:
    """One OpenAI `tools` entry, checked: its name, and its parameters schema."""
    f = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(f, dict) or tool.get("type", "function") != "function":
        raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
    if not isinstance(f.get("name"), str) or not f["name"]:
        raise ValueError(f"tools[{i}].function.name must be a non-empty string")
    params = f.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise ValueError(f"tools[{i}].function.parameters must be a JSON Schema object")
    return i, {"name": f["name"], "parameters": params}


# Arguments as JSON in a family's call: its parameters' schema, one space or none after ','
# and ':' (models write both; never more, or a model could pad until max_tokens).
CALL_JSON_STYLE = {"whitespace_flexible": True, "whitespace_pattern": "[ ]?"}


def _json_args(f: dict) -> str:
    """A function's arguments as JSON: its declared parameters only (unless its schema says
    otherwise), or a forced call would never have to end."""
    schema = {"additionalProperties": False, **f["parameters"], "x-guidance": CALL_JSON_STYLE}
    return f"%json {json.dumps(schema)}"


def _scalar(schema: dict, text_until: str) -> str:
    """A parameter's value as an XML-ish format writes it (Qwen's <parameter=...>, GLM's
    <arg_value>): a string is raw text, anything else its JSON."""
    kind = schema.get("type")
    if kind == "string" and "enum" not in schema:
        return text_until
    if kind == "string":
        return "(" + " | ".join(json.dumps(str(v)) for v in schema["enum"]) + ")"
    if kind == "boolean":
        return '("true" | "false")'
    return f"%json {json.dumps({**schema, 'x-guidance': CALL_JSON_STYLE})}"


def _params(f: dict) -> list[tuple[str, dict, bool]]:
    """(name, schema, required) of a function's parameters, in the schema's order."""
    params = f["parameters"]
    required = set(params.get("required") or ())
    return [(k, v if isinstance(v, dict) else {}, k in required)
            for k, v in (params.get("properties") or {}).items()]


def _qwen_xml(g: Grammars, i: int, f: dict, custom: bool, nested: bool, rules: list) -> str:
    """Qwen3.5 / Qwen3-Coder: <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>
    \n...</function>\n</tool_call>, a string value raw, others as JSON."""
    end = "\n</parameter>\n"
    parts = []
    for j, (key, schema, required) in enumerate(_params(f)):
        value = f"value_{i}_{j}"
        if custom and nested:
            rules.append(f"{value}: @input_{i}")
        else:
            rules.append(f"{value}: {_scalar(schema, f'text_{i}_{j}')}")
            if schema.get("type") == "string" and "enum" not in schema:
                rules.append(f"text_{i}_{j}[suffix={json.dumps(end)}]: /(?s:.*)/")
        piece = f'"<parameter={key}>\\n" {value}' + (
            f" {json.dumps(end)}" if custom and nested or schema.get("type") != "string"
            or "enum" in schema else "")
        parts.append(piece if required else f"({piece})?")
    return (f'{g.mark("<tool_call>")} "\\n<function={f["name"]}>\\n" {" ".join(parts)} '
            f'"</function>\\n" {g.mark("</tool_call>")}')


def _glm(g: Grammars, i: int, f: dict, custom: bool, nested: bool, rules: list) -> str:
    """GLM-4.5 / 4.6: <tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n
    ...</tool_call>, a string value raw, others as JSON."""
    parts = []
    for j, (key, schema, required) in enumerate(_params(f)):
        value = f"@input_{i}" if custom and nested else _scalar(schema, "TEXT")
        piece = (f'{g.mark("<arg_key>")} {json.dumps(key)} {g.mark("</arg_key>")} "\\n" '
                 f'{g.mark("<arg_value>")} {value} {g.mark("</arg_value>")} "\\n"')
        parts.append(piece if required else f"({piece})?")
    return f'{g.mark("<tool_call>")} "{f["name"]}\\n" {" ".join(parts)} {g.mark("</tool_call>")}'


def _gemma(g: Grammars, i: int, f: dict, custom: bool, nested: bool, rules: list) -> str:
    """Gemma 4: <|tool_call>call:NAME{KEY:VALUE,...}<tool_call|>, a string between <|"|>
    marks, a number or boolean bare, objects and lists in Gemma's own braces and brackets."""
    quote = g.mark('<|"|>')
    if not any(r.startswith("gvalue:") for r in rules):
        rules += [f'gvalue: {quote} TEXT {quote} | GNUM | "true" | "false" | "null" | gobj | glist',
                  r'gobj: "{" (GKEY ":" gvalue ("," GKEY ":" gvalue)*)? "}"',
                  r'glist: "[" (gvalue ("," gvalue)*)? "]"',
                  r"GNUM: /-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?/", r"GKEY: /[A-Za-z_][A-Za-z0-9_]*/"]
    parts = []
    for key, schema, required in _params(f):
        kind = schema.get("type")
        value = (f"{quote} @input_{i} {quote}" if custom and nested else
                 f"{quote} {_scalar(schema, 'TEXT')} {quote}" if kind == "string" else
                 '("true" | "false")' if kind == "boolean" else
                 "GNUM" if kind in ("integer", "number") else "gvalue")
        parts.append((f'"{key}:" {value}', required))
    # the template writes keys in sorted order; the model as it likes: any order is read
    body = " \",\" ".join(p for p, _ in parts)
    if any(not r for _, r in parts):
        body = " (\",\" | \"\") ".join(p if r else f"({p})?" for p, r in parts)
    return f'{g.mark("<|tool_call>")} "call:{f["name"]}{{" {body} "}}" {g.mark("<tool_call|>")}'


def _harmony(g: Grammars, i: int, f: dict, custom: bool, nested: bool, rules: list) -> str:
    """gpt-oss: <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS; the
    end of turn (<|call|>) follows. A custom tool's input is the message itself."""
    m = g.mark
    if custom:
        body = f"@input_{i}" if nested else "TEXT"
        return f'{m("<|channel|>")} "commentary to=functions.{f["name"]}" {m("<|message|>")} {body}'
    return (f'{m("<|channel|>")} "commentary to=functions.{f["name"]} " {m("<|constrain|>")} '
            f'"json" {m("<|message|>")} {_json_args(f)}')


def _nemotron(g: Grammars, i: int, f: dict, custom: bool, nested: bool, rules: list) -> str:
    """Nemotron: <TOOLCALL>[{"name": NAME, "arguments": ARGS}]</TOOLCALL>."""
    if custom and nested:
        raise ValueError("the nemotron family writes its calls as JSON in <TOOLCALL>[...]"
                         "</TOOLCALL>, and a custom tool's grammar cannot be kept inside a "
                         "JSON string: send tool_choice auto")
    head = json.dumps(f'[{{"name": {json.dumps(f["name"])}, "arguments": ')
    return (f'{g.mark("<TOOLCALL>")} {head} {_json_args(f)} "}}]" '
            f'{g.mark("</TOOLCALL>")}')


_FAMILY_CALLS = {"qwen3_coder": _qwen_xml, "glm47": _glm, "gemma4": _gemma,
                 "harmony": _harmony, "nemotron": _nemotron}


class Grammar:
    """A compiled grammar: the factory of per-request processors (a copy costs ~1 µs)."""

    def __init__(self, matcher: llg.LLMatcher, vocab_size: int, eos_token_ids: Sequence[int]):
        self._matcher = matcher
        self.eos_token_ids = list(eos_token_ids)
        # What a matcher in error allows: only the end of turn (the caller reports `error`).
        allowed = np.zeros((vocab_size + 31) // 32 * 32, dtype=np.uint8)
        allowed[self.eos_token_ids] = 1
        self._eos_only = np.packbits(allowed, bitorder="little").view(np.int32).reshape(1, -1)
        # llguidance builds its lexer's states at a matcher's first masks, and every copy
        # shares them: built here, where the grammar is compiled (off the engine thread). A
        # 5,000-field schema's first masks took 0.1-0.4 s each on the engine thread, every
        # other answer's step waiting; after this one, a copy's masks take under 1 ms.
        if not matcher.is_error():
            llg_numpy.fill_next_token_bitmask(matcher, np.empty_like(self._eos_only))

    def processor(self) -> GrammarProcessor:
        return GrammarProcessor(self._matcher.deep_copy(), self.eos_token_ids, self._eos_only)


class GrammarProcessor:
    """One request's matcher, as an mlx-lm logits processor: `(tokens, logits) -> logits`.

    mlx-lm calls it once per generated position with the whole context: first the prompt alone
    (its length is what to skip), then the prompt and one more generated token each call. It
    feeds the matcher only generated tokens, counted by length, and masks every token the
    grammar does not allow to -inf; EOS is allowed once the output is complete.
    """

    def __init__(self, matcher: llg.LLMatcher, eos_token_ids: Sequence[int],
                 eos_only: np.ndarray):
        self.matcher = matcher
        self.eos_token_ids = set(eos_token_ids)
        self.consumed = 0  # generated tokens the matcher has seen
        self._prompt_len: int | None = None
        self._eos_only = eos_only
        self._bitmask = np.empty_like(eos_only)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        # Start the forward pass now: it does not need the mask, which is computed meanwhile.
        mx.async_eval(logits)
        if self._prompt_len is None:
            self._prompt_len = len(tokens)
        else:  # reading the last token waits for the step that sampled it
            self._consume(tokens[self._prompt_len + self.consumed:].tolist())
        if self.matcher.is_error():
            return apply_bitmask(logits, self._eos_only)
        llg_numpy.fill_next_token_bitmask(self.matcher, self._bitmask)
        return apply_bitmask(logits, self._bitmask)

    def completed(self, generated: Sequence[int]) -> bool:
        """Whether `generated`, the request's whole completion, is a finished sentence of the
        grammar. mlx-lm shows a processor each token only when it asks for the next one, so the
        last token (the one that hit max_tokens) is caught up here."""
        self._consume(list(generated[self.consumed:]))
        return not self.matcher.is_error() and self.matcher.is_accepting()

    @property
    def error(self) -> str | None:
        """Why the matcher gave up (a token it could not take), if it did."""
        return self.matcher.get_error() if self.matcher.is_error() else None

    def _consume(self, new: list[int]) -> None:
        for t in new:
            self.consumed += 1
            if t in self.eos_token_ids or self.matcher.is_stopped():
                continue  # the end of the turn is not part of the grammar's text
            self.matcher.consume_token(t)


def apply_bitmask(logits: mx.array, bitmask: np.ndarray) -> mx.array:
    """-inf for every token whose bit is 0. Ids past the tokenizer's vocabulary (models pad
    their embedding table) are never allowed."""
    allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little")
    width = logits.shape[-1]
    if allowed.size < width:
        allowed = np.pad(allowed, (0, width - allowed.size))
    return mx.where(mx.array(allowed[:width].view(np.bool_)), logits,
                    mx.array(-np.inf, dtype=logits.dtype))
