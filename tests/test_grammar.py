"""Structured output (worker/grammar.py) on real MLX: the tiny random model writes noise, so only
the grammar makes its answers parse. Each request runs through mlx-lm's BatchGenerator with the
grammar's logits processor, as the scheduler runs it."""

from __future__ import annotations

import json

import pytest

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

    from worker.grammar import Grammars

    model, tokenizer = load(str(tiny_model))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                           add_generation_prompt=True)
    return model, tokenizer, Grammars(tokenizer), prompt


def generate(setup, grammars, seeds=SEEDS, max_tokens=120, split=0):
    """One request per (grammar, seed), all in one batch. Returns (text, finish, tokens,
    processor) per request. `split`: prompt tokens passed as `all_tokens` (the cached prefix)."""
    from mlx_lm.generate import BatchGenerator

    from worker.decoding import make_request_sampler

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
