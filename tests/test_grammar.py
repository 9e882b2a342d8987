"""Structured output (worker/compute/grammar.py) on real MLX: the tiny random model writes noise, so only
the grammar makes its answers parse. Each request runs through mlx-lm's BatchGenerator with the
grammar's logits processor, as the scheduler runs it."""

from __future__ import annotations

import json

import pytest

from tests.conftest import lark_accepts

pytestmark = pytest.mark.unit  # make test-fast

SCHEMA = {"type": "object", "properties": {
    "color": {"type": "string", "enum": ["red", "green", "blue"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
    "required": ["color", "count", "tags"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city {today}.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}}
SEEDS = (None, 1, 2, 3)  # None: greedy; the others sample at temperature 1


@pytest.fixture(scope="module")
def setup(tiny_model):
    from mlx_lm import load

    from kvbank.worker.compute.grammar import Grammars

    model, tokenizer = load(str(tiny_model))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                           add_generation_prompt=True)
    return model, tokenizer, Grammars(tokenizer), prompt


def generate(setup, grammars, seeds=SEEDS, max_tokens=120, split=0):
    """One request per (grammar, seed), all in one batch. Returns (text, finish, tokens,
    processor) per request. `split`: prompt tokens passed as `all_tokens` (the cached prefix)."""
    from mlx_lm.generate import BatchGenerator

    from kvbank.worker.compute.decoding import make_request_sampler

    model, tokenizer, _, prompt = setup
    jobs = [(g.processor(), s) for g in grammars for s in seeds]
    gen = BatchGenerator(model, stop_tokens=[[t] for t in tokenizer.eos_token_ids],
                         completion_batch_size=len(jobs), prefill_batch_size=len(jobs))
    uids = gen.insert([prompt[split:]] * len(jobs), max_tokens=[max_tokens] * len(jobs),
                      all_tokens=[prompt[:split] for _ in jobs],
                      samplers=[make_request_sampler(0.0 if s is None else 1.0, 1.0, s)
                                for _, s in jobs],
                      logits_processors=[[p] for p, _ in jobs])
    tokens = {u: [] for u in uids}
    finish = {}
    while len(finish) < len(uids):
        for r in gen.next()[1]:
            tokens[r.uid].append(r.token)
            if r.finish_reason:
                finish[r.uid] = r.finish_reason
    gen.close()
    eos = tokenizer.eos_token_ids
    return [(tokenizer.decode([t for t in tokens[u] if t not in eos]), finish[u], tokens[u], p)
            for u, (p, _) in zip(uids, jobs)]


def check_schema_answer(value):
    assert set(value) == {"color", "count", "tags"}
    assert value["color"] in ("red", "green", "blue")
    assert isinstance(value["count"], int) and 0 <= value["count"] <= 999
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
    assert all(isinstance(t, str) and len(t) <= 8 for t in value["tags"])


def parse_tool_call(text):
    """What mlx-lm's server does with a Hermes/Qwen tool call."""
    from mlx_lm.tool_parsers import json_tools

    assert text.startswith(json_tools.tool_call_start) and text.endswith(json_tools.tool_call_end)
    inner = text[len(json_tools.tool_call_start):-len(json_tools.tool_call_end)]
    return json_tools.parse_tool_call(inner)


def check_tool_call(call):
    assert set(call) == {"name", "arguments"}
    args = call["arguments"]
    if call["name"] == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
        assert isinstance(args["city"], str) and len(args["city"]) <= 12
    else:
        assert call["name"] == "add" and set(args) == {"a", "b"}
        assert all(isinstance(v, int) and 0 <= v <= 99 for v in args.values())


def test_json_schema_answers_validate(setup):
    grammar = setup[2].for_response_format(
        {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}})
    for text, finish, tokens, processor in generate(setup, [grammar]):
        assert finish == "stop", text
        check_schema_answer(json.loads(text))
        assert processor.completed(tokens) and processor.error is None


def test_json_object_answer_is_an_object(setup):
    grammar = setup[2].for_response_format({"type": "json_object"})
    ((text, finish, tokens, processor),) = generate(setup, [grammar], seeds=(None,))
    assert finish == "stop" and isinstance(json.loads(text), dict)
    assert processor.completed(tokens)


def test_tool_call_by_name_and_required(setup):
    grammars = setup[2]
    by_name = grammars.for_tool_call([WEATHER, ADD], "get_weather")
    required = grammars.for_tool_call([WEATHER, ADD], "required")
    # the prompt split into a cached prefix (all_tokens) and the rest, as the scheduler has it
    answers = generate(setup, [by_name, required], split=5)
    names = set()
    for i, (text, finish, tokens, processor) in enumerate(answers):
        assert finish == "stop", text
        call = parse_tool_call(text)
        check_tool_call(call)
        if i < len(SEEDS):
            assert call["name"] == "get_weather"
        names.add(call["name"])
        assert processor.completed(tokens)
    assert "add" in names  # "required" is free to pick either


def test_completed_sees_the_last_token_and_reports_a_cut(setup):
    grammar = setup[2].for_tool_call([ADD], "add")
    ((_, finish, tokens, _),) = generate(setup, [grammar], seeds=(None,))
    assert finish == "stop"
    # stopped by max_tokens right after the closing tag: complete, though the processor was
    # never called after that last token
    ((_, finish, cut, processor),) = generate(setup, [grammar], seeds=(None,),
                                              max_tokens=len(tokens) - 1)
    assert finish == "length" and processor.completed(cut)
    ((_, _, cut, processor),) = generate(setup, [grammar], seeds=(None,),
                                         max_tokens=len(tokens) - 3)
    assert not processor.completed(cut)


@pytest.mark.parametrize("response_format, message", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}},
     "response_format.json_schema.schema: Invalid type: strnig"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}},
     "'/$defs/missing' does not exist"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "minimum": 5, "maximum": 2}}}, "minimum (5) is greater than maximum"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema must be"),
    ({"type": "xml"}, "response_format.type must be"),
])
def test_bad_response_format_says_why(setup, response_format, message):
    with pytest.raises(ValueError) as info:
        setup[2].for_response_format(response_format)
    assert message in str(info.value)


def test_bad_tools_say_why(setup):
    grammars = setup[2]
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
    with pytest.raises(ValueError, match=r"tools\[1\]\.function\.parameters: Invalid type"):
        grammars.for_tool_call([ADD, bad], "required")
    with pytest.raises(ValueError, match="'nope': neither 'required' nor the name"):
        grammars.for_tool_call([ADD], "nope")
    with pytest.raises(ValueError, match="at least one function"):
        grammars.for_tool_call([], "required")
    assert grammars.for_response_format({"type": "text"}) is None
    assert grammars.for_response_format(None) is None


# -- custom tools (kvbank/custom_tools.py): a raw call whose input is in the tool's grammar ----

CALC_LARK = 'start: NUM (OP NUM){0,2}\nOP: "+" | "*"\nNUM: /[0-9]{1,3}/\n'
SLUG_REGEX = r"[a-z]{1,6}(-[a-z]{1,6}){0,2}"


def custom(name, fmt):
    from kvbank.custom_tools import chat_function

    return {"type": "function", "function": chat_function(name, "", fmt, "tools[0]")}


CALC = custom("calc", {"type": "grammar", "syntax": "lark", "definition": CALC_LARK})
SLUG = custom("slug", {"type": "grammar", "syntax": "regex", "definition": SLUG_REGEX})
NOTE = custom("note", None)  # free text


def accepts(grammar, text, tokenize):
    """Whether `grammar`'s matcher takes `text`, as tokens, to a finished sentence."""
    matcher = grammar.processor().matcher
    return matcher.consume_tokens(tokenize(text)) and matcher.is_accepting()


def raw_call(name, text):
    return f'<tool_call>\n{{"name": "{name}"}}\n{text}\n</tool_call>'


def test_a_forced_custom_call_takes_only_its_grammars_sentences(setup):
    grammars = setup[2]
    tokenize = grammars.tokenizer.tokenize_str
    calc = grammars.for_tool_call([ADD, CALC], "calc")
    assert accepts(calc, raw_call("calc", "12+3*7"), tokenize)
    for bad in ("12+", "1 + 2", "1234", "1+2+3+4"):
        assert not accepts(calc, raw_call("calc", bad), tokenize), bad
    assert not accepts(calc, '<tool_call>\n{"name": "calc", "arguments": {"input": "1"}}'
                             '\n</tool_call>', tokenize)
    slug = grammars.for_tool_call([SLUG], "slug")
    assert accepts(slug, raw_call("slug", "ab-cd"), tokenize)
    for bad in ("ab-", "Ab", "ab-cd-ef-gh", "abcdefg"):
        assert not accepts(slug, raw_call("slug", bad), tokenize), bad
    # "required": a function's JSON call or a custom tool's raw one, each in its own grammar
    anyone = grammars.for_tool_call([ADD, CALC, NOTE], "required")
    for good in ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
                 raw_call("calc", "4*5"), raw_call("note", "any\ntext, </x> too")):
        assert accepts(anyone, good, tokenize), good
    assert not accepts(anyone, raw_call("add", "1"), tokenize)


# Codex's apply_patch grammar (codex-rs/core/src/tools/handlers/tool_apply_patch.lark)
APPLY_PATCH_LARK = """start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
"""


def test_codexs_apply_patch_grammar_holds_a_patch_that_reads_back_whole(setup):
    from mlx_lm.tool_parsers import json_tools

    from kvbank.worker.compute.decoding import ToolCallText

    patch = custom("apply_patch", {"type": "grammar", "syntax": "lark",
                                   "definition": APPLY_PATCH_LARK})
    grammar = setup[2].for_tool_call([ADD, patch], "apply_patch")
    tokenize = setup[2].tokenizer.tokenize_str
    text = ("*** Begin Patch\n*** Update File: a.py\n@@ def f():\n-    return 1\n"
            "+    return {\"json\": \"quotes\"}\n*** End Patch\n")
    assert accepts(grammar, raw_call("apply_patch", text), tokenize)
    assert not accepts(grammar, raw_call("apply_patch", "*** Begin Patch\n*** End Patch"),
                       tokenize)  # no hunk
    split = ToolCallText("<tool_call>", "</tool_call>", json_tools.parse_tool_call,
                         [ADD, patch])
    _, [call] = split.feed(raw_call("apply_patch", text))
    assert json.loads(call.arguments) == {"input": text}  # its last line break too


def test_the_model_writes_raw_calls_that_parse_back_under_the_grammar(setup):
    """The random model, forced: every answer ends, and reads back (worker/compute/decoding.py) as a
    call whose input the client's grammar, or regex, accepts."""
    import re

    from mlx_lm.tool_parsers import json_tools

    from kvbank.worker.compute.decoding import ToolCallText

    grammars = setup[2]
    for tool, ok in ((CALC, lambda s: lark_accepts(grammars.tokenizer, CALC_LARK, s)),
                     (SLUG, lambda s: re.fullmatch(SLUG_REGEX, s))):
        name = tool["function"]["name"]
        for text, finish, tokens, processor in generate(
                setup, [grammars.for_tool_call([ADD, tool], name)]):
            assert finish == "stop" and processor.completed(tokens), text
            split = ToolCallText("<tool_call>", "</tool_call>", json_tools.parse_tool_call,
                                 [ADD, tool])
            rest, calls = split.feed(text)
            [call] = calls
            assert not rest.strip() and call.name == name
            assert ok(json.loads(call.arguments)["input"]), text


def test_bad_custom_formats_say_which_field_and_why(setup):
    from kvbank.contracts.failures import InvalidRequest
    from kvbank.custom_tools import chat_function

    def error(fmt):
        with pytest.raises(InvalidRequest) as info:
            chat_function("f", "", fmt, "tools[2]")
        return info.value.param, str(info.value)

    param, message = error({"type": "grammar", "syntax": "lark", "definition": "start: foo"})
    assert param == "tools[2].format.definition" and 'unknown name: "foo"' in message
    param, message = error({"type": "grammar", "syntax": "regex", "definition": "[a-"})
    assert param == "tools[2].format.definition" and "unclosed character class" in message
    assert error({"type": "grammar", "syntax": "gbnf", "definition": "x"}) == (
        "tools[2].format.syntax", "tools[2].format.syntax must be 'lark' or 'regex'; given "
                                  "'gbnf'")
    assert error({"type": "json"})[1] == ("tools[2].format.type must be 'text' or 'grammar'; "
                                          "given 'json'")
    # the worker's own check of what reaches it (a ValueError, as for a bad schema)
    bad = {"type": "function", "function": {**CALC["function"], "format": {
        "type": "grammar", "syntax": "lark", "definition": "start: /[/"}}}
    with pytest.raises(ValueError, match=r"tools\[1\]\.function\.format\.definition: "):
        setup[2].for_tool_call([ADD, bad], "calc")
