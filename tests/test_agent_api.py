"""What coding agents ask of the API beyond text: logprobs, logit_bias, penalties, stop
sequences, tool calls (OpenAI and Anthropic), driven by the official SDKs against the real
stack on the tiny model with a tool-calling chat template (kvbank/testing/templates/qwen_tools.jinja).

The tiny model is random: what it says is never checked, only what the API promises about it.
Its logprobs and penalties are checked against mlx-lm running the same weights in this
process; its tool calls are forced by tool_choice (the worker's grammar), since a random model
never calls a tool of its own accord.
"""

from __future__ import annotations

import json
import uuid

import anthropic
import openai
import pytest

from tests.conftest import lark_accepts, start_stack

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone.",
    "parameters": {"type": "object", "properties": {"tz": {"type": "integer", "minimum": -12,
                                                           "maximum": 14}},
                   "required": ["tz"], "additionalProperties": False}}}
MAX_TOKENS = 64  # room for a whole forced call


@pytest.fixture(scope="module")
def agent_stack(tool_model, tmp_path_factory, cache_dir):
    s = start_stack(tool_model, tmp_path_factory.mktemp("agents") / "data", cache_dir=cache_dir)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(tool_model):
    """mlx-lm with the same weights, in this process: what the worker's numbers must equal."""
    from mlx_lm import load

    return load(str(tool_model))


def _openai(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.shim_url + "/v1", api_key="none", max_retries=0)


def _anthropic(stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.shim_url, api_key="none", max_retries=0)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": f"[{uuid.uuid4().hex}] {text}"}]


def _greedy(reference, prompt: list[int], n: int, processors=()) -> tuple[list[int], list]:
    """mlx-lm's own greedy tokens and log-softmax values for `prompt`."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    model, _ = reference
    tokens, logprobs = [], []
    for (token, lp), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n,
                                            sampler=lambda x: mx.argmax(x, axis=-1),
                                            logits_processors=list(processors)), range(n)):
        tokens.append(int(token))
        logprobs.append(lp)
    return tokens, logprobs


def _prompt_ids(reference) -> list[int]:
    _, tok = reference
    return tok.encode(f"[{uuid.uuid4().hex}] The quick brown fox", add_special_tokens=False)


# -- logprobs, logit_bias, penalties, stop sequences ----------------------------------------


def test_logprobs_are_the_models_log_softmax(agent_stack, reference):
    prompt = _prompt_ids(reference)
    r = _openai(agent_stack).completions.create(model="kvbank", prompt=prompt, max_tokens=6,
                                                temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    want, values = _greedy(reference, prompt, len(lp.tokens))
    _, tok = reference
    assert lp.tokens == [tok.decode([t]) for t in want]
    for got, chosen, ref, top in zip(lp.token_logprobs, want, values, lp.top_logprobs):
        assert got == pytest.approx(ref[chosen].item(), abs=2e-3)
        assert len(top) == 3 and max(top.values()) == pytest.approx(got, abs=1e-6)  # greedy


def test_chat_logprobs_stream_with_each_token(agent_stack):
    chunks = list(_openai(agent_stack).chat.completions.create(
        model="kvbank", messages=_user("Count."), max_tokens=6, temperature=0, stream=True,
        logprobs=True, top_logprobs=2, stream_options={"include_usage": True}))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert 0 < len(entries) <= usage.completion_tokens
    assert "".join(e.token for e in entries) == text
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert bytes(e.bytes) == e.token.encode()


def test_logit_bias_forces_and_forbids_tokens(agent_stack, reference):
    c = _openai(agent_stack)
    _, tok = reference
    prompt = _prompt_ids(reference)
    forced = tok.encode(" banana", add_special_tokens=False)[0]
    r = c.completions.create(model="kvbank", prompt=prompt, max_tokens=4, temperature=0,
                             logit_bias={str(forced): 100}, logprobs=0)
    assert r.choices[0].logprobs.tokens == [tok.decode([forced])] * 4
    plain = c.completions.create(model="kvbank", prompt=prompt, max_tokens=1, temperature=0,
                                 logprobs=0)
    first = plain.choices[0].logprobs.tokens[0]
    banned = tok.encode(first, add_special_tokens=False)[0]
    r = c.completions.create(model="kvbank", prompt=prompt, max_tokens=1, temperature=0,
                             logit_bias={str(banned): -100}, logprobs=0)
    assert r.choices[0].logprobs.tokens[0] != first


def test_penalties_act_as_mlx_lms(agent_stack, reference):
    from mlx_lm.sample_utils import make_logits_processors

    _, tok = reference
    prompt = _prompt_ids(reference)
    c = _openai(agent_stack)
    plain = c.completions.create(model="kvbank", prompt=prompt, max_tokens=12, temperature=0)
    penalized = c.completions.create(model="kvbank", prompt=prompt, max_tokens=12,
                                     temperature=0, presence_penalty=1.5, frequency_penalty=0.5,
                                     extra_body={"repetition_penalty": 1.3}, logprobs=0)
    processors = make_logits_processors(repetition_penalty=1.3, presence_penalty=1.5,
                                        frequency_penalty=0.5)
    want, _ = _greedy(reference, prompt, 12, processors)
    assert penalized.choices[0].logprobs.tokens == [tok.decode([t]) for t in want]
    assert penalized.choices[0].text != plain.choices[0].text  # they changed the answer


def test_top_k_1_and_min_p_1_sample_the_most_likely_token(agent_stack, reference):
    """mlx-lm's filters: hot sampling from the top 1 token, or from the tokens as likely as
    the most likely one, is greedy decoding."""
    _, tok = reference
    prompt = _prompt_ids(reference)
    c = _openai(agent_stack)
    greedy = c.completions.create(model="kvbank", prompt=prompt, max_tokens=8, temperature=0,
                                  logprobs=0).choices[0].logprobs.tokens
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        hot = c.completions.create(model="kvbank", prompt=prompt, max_tokens=8, temperature=2,
                                   seed=11, logprobs=0, extra_body=extra)
        assert hot.choices[0].logprobs.tokens == greedy, extra


def test_anthropic_reports_the_stop_sequence_that_ended_the_answer(agent_stack):
    c = _anthropic(agent_stack)
    messages = _user("Say something.")
    free = c.messages.create(model="kvbank", max_tokens=16, messages=messages,
                             extra_body={"temperature": 0})
    text = free.content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2].strip() or text[-1]
    cut = c.messages.create(model="kvbank", max_tokens=16, messages=messages,
                            extra_body={"temperature": 0},
                            stop_sequences=["never-in-this-text-\u2603", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]


# -- response_format -----------------------------------------------------------------------


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "enum": ["Ada", "Grace"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "langs": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
    "required": ["name", "age", "langs"], "additionalProperties": False}


def test_json_schema_answers_parse_and_fit_the_schema(agent_stack):
    c = _openai(agent_stack)
    r = c.chat.completions.create(
        model="kvbank", messages=_user("Who?"), max_tokens=80, temperature=0.8, seed=7,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    person = json.loads(r.choices[0].message.content)
    assert r.choices[0].finish_reason == "stop"
    assert person["name"] in ("Ada", "Grace") and 0 <= person["age"] <= 120
    assert len(person["langs"]) <= 3 and all(len(x) <= 8 for x in person["langs"])
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(
            model="kvbank", messages=_user("Who?"), max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {
                "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": 5}}}}})
    assert info.value.body["param"] == "response_format"


# -- tool calls -----------------------------------------------------------------------------


def test_a_named_tool_choice_is_a_valid_call_and_the_loop_reuses_its_kv(agent_stack):
    c = _openai(agent_stack)
    messages = _user("What is the weather in Oslo?")
    t1 = c.chat.completions.create(
        model="kvbank", messages=messages, tools=[WEATHER, CLOCK], max_tokens=MAX_TOKENS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = t1.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert args["city"] in ("Paris", "Oslo", "Lima") and args["unit"] in ("c", "f")
    # The agent runs the tool and sends the whole conversation back, as OpenAI clients do.
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "-3 C, snow"}]
    t2 = c.chat.completions.create(model="kvbank", messages=messages, tools=[WEATHER, CLOCK],
                                   tool_choice="none", max_tokens=8, temperature=0)
    assert not t2.choices[0].message.tool_calls
    assert t2.usage.prompt_tokens_details.cached_tokens >= (
        t1.usage.prompt_tokens + t1.usage.completion_tokens - 1)  # the call, token for token
    assert t2.usage.model_extra["kvbank"]["recomputed_tokens"] == 0


def test_required_tool_choice_streams_the_call_as_a_delta(agent_stack):
    chunks = list(_openai(agent_stack).chat.completions.create(
        model="kvbank", messages=_user("Weather or time?"), tools=[WEATHER, CLOCK],
        tool_choice="required", max_tokens=MAX_TOKENS, stream=True))
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    [delta] = deltas
    assert delta.index == 0 and delta.id and delta.type == "function"
    assert delta.function.name in ("get_weather", "get_time")
    args = json.loads(delta.function.arguments)
    assert set(args) == ({"city", "unit"} if delta.function.name == "get_weather" else {"tz"})
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_anthropic_tool_use_loop(agent_stack):
    c = _anthropic(agent_stack)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in (WEATHER, CLOCK)]
    messages = _user("What time is it in Tokyo?")
    with c.messages.stream(model="kvbank", max_tokens=MAX_TOKENS, messages=messages,
                           tools=tools, tool_choice={"type": "tool", "name": "get_time"}) as s:
        events = [e.type for e in s]
        m1 = s.get_final_message()
    assert "input_json" in events or "content_block_delta" in events
    assert m1.stop_reason == "tool_use"
    [use] = [b for b in m1.content if b.type == "tool_use"]
    assert use.name == "get_time" and -12 <= use.input["tz"] <= 14
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                   for b in m1.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": "09:41"}]}]
    m2 = c.messages.create(model="kvbank", max_tokens=8, messages=messages, tools=tools,
                           tool_choice={"type": "none"},
                           extra_body={"temperature": 0})
    assert m2.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in m2.content)
    prompt_1 = m1.usage.input_tokens + m1.usage.cache_read_input_tokens
    assert m2.usage.cache_read_input_tokens >= prompt_1 + m1.usage.output_tokens - 1


def test_tools_and_tool_choice_are_validated(agent_stack):
    c = _openai(agent_stack)
    for fields, param in [({"tools": [{"type": "function"}]}, "tools"),
                          ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                                                "function": {"name": "nope"}}},
                           "tool_choice")]:
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model="kvbank", messages=_user("hi"), max_tokens=4,
                                      **fields)
        assert info.value.body["param"] == param and param in info.value.body["message"]


def test_tool_calls_are_parsed_out_of_the_text_however_it_streams():
    """The parser boundary with a scripted model output: mlx-lm's json_tools parser, the text
    arriving in pieces of every size."""
    from mlx_lm.tool_parsers import json_tools

    from kvbank.worker.compute.decoding import ToolCallText

    answer = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
              '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
              '{"tz": 9}}\n</tool_call><tool_call>\n{"name": "get_ti')
    for size in (1, 2, 5, 11, len(answer)):
        split = ToolCallText("<tool_call>", "</tool_call>", json_tools.parse_tool_call,
                             [WEATHER, CLOCK])
        text, calls = "", []
        for i in range(0, len(answer), size):
            more, found = split.feed(answer[i:i + size])
            text, calls = text + more, calls + found
        more, found = split.finish()  # the last call never closed (max_tokens): given back
        text, calls = text + more, calls + found
        assert text == 'Let me check.\n<tool_call>\n{"name": "get_ti'
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", {"city": "Oslo", "unit": "c"}), ("get_time", {"tz": 9})]
        assert len({c.id for c in calls}) == 2 and split.made_calls


# -- OpenAI's Responses API (Codex, the Agents SDK) ------------------------------------------

RESPONSES_TOOLS = [{"type": "function", **WEATHER["function"]},
                   {"type": "custom", "name": "apply_patch",
                    "description": "Apply a patch to the files."}]


def test_responses_a_tool_loop_reads_its_history_from_cache(agent_stack):
    """Codex's shape: instructions, function and custom tools, store false, the whole
    history sent back as items each turn; the second turn reads the first from cache."""
    c = _openai(agent_stack)
    ask = f"[{uuid.uuid4().hex}] What is the weather in Oslo?"
    first = dict(model="gpt-5-codex", instructions="You are a coding agent.",
                 tools=RESPONSES_TOOLS, store=False, temperature=0,
                 max_output_tokens=MAX_TOKENS, prompt_cache_key=None,
                 reasoning={"effort": "medium"}, include=[], parallel_tool_calls=False)
    r1 = c.responses.create(input=ask, tool_choice={"type": "function", "name": "get_weather"},
                            **first)
    assert r1.object == "response" and r1.status == "completed" and r1.id.startswith("resp_")
    [call] = [o for o in r1.output if o.type == "function_call"]
    assert call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Oslo", "Lima")
    items = [{"role": "user", "content": ask},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call", "call_id": call.call_id, "name": call.name,
              "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "12 C, rain"}]
    r2 = c.responses.create(input=items, tool_choice="none", **{**first, "max_output_tokens": 8})
    u1, u2 = r1.usage, r2.usage
    assert u2.input_tokens_details.cached_tokens >= u1.input_tokens, u2
    assert u2.model_extra["kvbank"]["recomputed_tokens"] == 0, u2
    assert r2.output_text == "".join(p.text for o in r2.output if o.type == "message"
                                     for p in o.content)


def test_codexs_defaults_are_taken_and_a_namespaced_tools_call_names_its_namespace(agent_stack):
    """What Codex sends with its defaults: `client_metadata`, and its sub-agent tools grouped
    in a `namespace` tool. The model sees them as plain functions; a call of one comes back
    naming its namespace, as Codex routes it."""
    c = _openai(agent_stack)
    spawn = {"type": "function", "name": "spawn_agent", "description": "Start a sub-agent.",
             "strict": False, "parameters": {"type": "object", "required": ["task"],
                                             "properties": {"task": {"enum": ["tests", "docs"]}}}}
    tools = [*RESPONSES_TOOLS, {"type": "namespace", "name": "multi_agent_v1",
                                "description": "Tools for sub-agents.", "tools": [spawn]}]
    r = c.responses.create(model="gpt-5-codex", input=f"[{uuid.uuid4().hex}] Split the work.",
                           tools=tools, tool_choice={"type": "function", "name": "spawn_agent"},
                           store=False, temperature=0, max_output_tokens=MAX_TOKENS,
                           extra_body={"client_metadata": {"x-codex-turn": "1"}})
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.name == "spawn_agent" and call.namespace == "multi_agent_v1"
    assert json.loads(call.arguments)["task"] in ("tests", "docs")
    with pytest.raises(openai.BadRequestError) as info:
        c.responses.create(model="kvbank", input="hi", tools=[*tools, spawn])
    assert info.value.body["param"] == "tools" and "spawn_agent" in info.value.body["message"]


def test_responses_stream_the_standard_events(agent_stack):
    c = _openai(agent_stack)
    with c.responses.stream(model="kvbank", input=_user("Say hi.")[0]["content"],
                            max_output_tokens=8, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text and final.usage.output_tokens > 0
    assert final.status in ("completed", "incomplete")
    if deltas:
        assert "response.output_item.added" in kinds and "response.output_item.done" in kinds


def test_responses_refuse_what_they_cannot_honour_in_openais_shape(agent_stack):
    c = _openai(agent_stack)
    with pytest.raises(openai.NotFoundError) as info:  # stored responses: test_responses_store
        c.responses.create(model="kvbank", input="hi", previous_response_id="resp_123")
    assert info.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as info:
        c.responses.create(model="kvbank", input="hi", tools=[{"type": "file_search"}])
    assert "tools[0].type" in info.value.body["param"]
    # Codex's default web search: left out of the prompt, and the client is told
    raw = c.responses.with_raw_response.create(
        model="kvbank", input="hi", max_output_tokens=4, store=False,
        tools=[{"type": "web_search"}, {"type": "function", "name": "f",
                                        "parameters": {"type": "object"}}])
    assert "web_search" in raw.headers["x-kvbank-warning"]
    assert raw.parse().status in ("completed", "incomplete")
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve("resp_unknown")


def test_a_custom_tool_call_comes_back_as_one_and_goes_back_to_the_model():
    """The shim's side alone (no model would call a freeform tool of its own accord, and a
    forced string never has to end): a call of a custom tool is a `custom_tool_call` whose
    input is the string, and one in the next input is a call the template renders."""
    from kvbank.apps.shim import responses_format
    from kvbank.v1 import api_pb2

    answer = responses_format.ResponseAnswer("kvbank", frozenset({"apply_patch"}), {})
    answer.add(api_pb2.GenerateResponse(tool_calls=[api_pb2.ToolCall(
        id="call_1", name="apply_patch", arguments='{"input": "*** Begin Patch"}')]))
    answer.add(api_pb2.GenerateResponse(finish_reason=api_pb2.FINISH_REASON_TOOL_CALLS,
                                        usage=api_pb2.Usage(prompt_tokens=5)))
    [item] = answer.body()["output"]
    assert item["type"] == "custom_tool_call" and item["input"] == "*** Begin Patch"
    req = responses_format.parse({"input": [
        {"role": "user", "content": "fix it"},
        {"type": "custom_tool_call", "call_id": "call_1", "name": "apply_patch",
         "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "call_1", "output": "done"}],
        "tools": RESPONSES_TOOLS}, session_header=None, default_max_tokens=16)
    msgs = req.chat.generate.chat.messages
    assert [m.role for m in msgs] == ["user", "assistant", "tool"]
    assert json.loads(msgs[1].tool_calls[0].arguments) == {"input": "*** Begin Patch"}


CALC_LARK = 'start: NUM (OP NUM){0,2}\nOP: "+" | "*"\nNUM: /[0-9]{1,3}/\n'
CALC = {"type": "custom", "name": "calc", "description": "Evaluate arithmetic.",
        "format": {"type": "grammar", "syntax": "lark", "definition": CALC_LARK}}


@pytest.fixture(scope="module")
def llg_tokenizer(tool_model):
    import llguidance as llg
    from tokenizers import Tokenizer

    return llg.LLTokenizer(Tokenizer.from_file(str(tool_model / "tokenizer.json")).to_str())


def test_a_custom_tool_with_a_lark_grammar_is_answered_as_a_custom_tool_call(agent_stack,
                                                                             llg_tokenizer):
    """Forced, the call is written under the tool's grammar (worker/compute/grammar.py), comes back as
    a `custom_tool_call` (streamed as its input's delta and done), and goes back to the model
    in the next turn's history, which reads it from cache token for token."""
    c = _openai(agent_stack)
    ask = f"[{uuid.uuid4().hex}] What is 6 times 7?"
    first = dict(model="gpt-5-codex", tools=[*RESPONSES_TOOLS, CALC], store=False,
                 temperature=0, max_output_tokens=MAX_TOKENS)
    r1 = c.responses.create(input=ask, tool_choice={"type": "custom", "name": "calc"}, **first)
    assert r1.status == "completed"
    [call] = r1.output
    assert call.type == "custom_tool_call" and call.name == "calc" and call.call_id
    assert lark_accepts(llg_tokenizer, CALC_LARK, call.input), call.input
    with c.responses.stream(input=ask + " Again.", tool_choice={"type": "custom", "name": "calc"},
                            **first) as stream:
        events = list(stream)
        final = stream.get_final_response()
    [streamed] = final.output
    deltas = [e.delta for e in events if e.type == "response.custom_tool_call_input.delta"]
    [done] = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert streamed.type == "custom_tool_call" and "".join(deltas) == done.input == streamed.input
    assert lark_accepts(llg_tokenizer, CALC_LARK, streamed.input), streamed.input
    items = [{"role": "user", "content": ask},
             {"type": "custom_tool_call", "call_id": call.call_id, "name": "calc",
              "input": call.input},
             {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "42"}]
    r2 = c.responses.create(input=items, tool_choice="none", **{**first, "max_output_tokens": 8})
    assert r2.usage.input_tokens_details.cached_tokens >= (
        r1.usage.input_tokens + r1.usage.output_tokens - 1), r2.usage  # the raw call, as written


def test_a_grammar_call_cut_by_max_output_tokens_ends_and_bad_formats_are_refused(agent_stack):
    c = _openai(agent_stack)
    r = c.responses.create(model="kvbank", input=_user("Add.")[0]["content"], tools=[CALC],
                           tool_choice={"type": "custom", "name": "calc"}, max_output_tokens=16)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    # a raw call cut before its end marker may have lost part of its input: it is no call
    assert [o.type for o in r.output] == ["message"]
    assert r.output_text.startswith('<tool_call>\n{"name": "calc"}\n'), r.output_text
    for fmt, param, says in [
            ({"type": "grammar", "syntax": "lark", "definition": "start: nope"},
             "tools[0].format.definition", 'unknown name: "nope"'),
            ({"type": "grammar", "syntax": "ebnf", "definition": "x"},
             "tools[0].format.syntax", "must be 'lark' or 'regex'"),
            ({"type": "json"}, "tools[0].format.type", "must be 'text' or 'grammar'")]:
        with pytest.raises(openai.BadRequestError) as info:
            c.responses.create(model="kvbank", input="hi", tools=[{**CALC, "format": fmt}])
        assert info.value.body["param"] == param and says in info.value.body["message"]


def test_the_openai_agents_sdk_runs_a_tool_loop_on_its_default_responses_model(agent_stack):
    """The Agents SDK as its users run it (its Responses model, tracing off): a run that calls
    a function tool (forced once: a random model calls none of its own accord), then a second
    run on the first's history, which reads that history from cache. Its answers are a
    structured output (a JSON schema the worker's grammar holds), so that a random model ends
    them: the SDK takes an answer cut by max_output_tokens for an error."""
    import asyncio

    from agents import ModelSettings, Runner

    from kvbank.apps.bench.agent_record import weather_agent

    calls = []
    client = openai.AsyncOpenAI(base_url=agent_stack.shim_url + "/v1", api_key="none",
                                max_retries=0)
    agent, Done = weather_agent(client, MAX_TOKENS, on_call=calls.append)

    async def runs():
        first = await Runner.run(agent, f"[{uuid.uuid4().hex}] Weather in Oslo?", max_turns=4)
        history = first.to_input_list() + [{"role": "user", "content": "And tomorrow?"}]
        again = agent.clone(model_settings=ModelSettings(tool_choice="none", temperature=0,
                                                         max_tokens=MAX_TOKENS))
        return first, await Runner.run(again, history, max_turns=2)

    first, second = asyncio.run(runs())
    assert len(calls) == 1 and len(first.raw_responses) == 2  # the call, then its answer
    assert isinstance(first.final_output, Done) and isinstance(second.final_output, Done)
    before = first.raw_responses[-1].usage
    after = second.raw_responses[0].usage
    assert after.input_tokens_details.cached_tokens >= before.input_tokens, after
