"""Each model family's published chat template and tool-call format, end to end: its scripted
tiny model (kvbank/testing/family_models.py) behind a real stack, and an agent's tool loop
(tests/families.py): every answer one structured call, nothing leaked into the text, the
reasoning apart, and each request reading the whole previous turn from cache wherever the
template renders the model's tokens back (the answer splice: whatever the generation prompt
ends with, whatever the template writes the model's text back as). Where the template itself
changes the history (Nemotron drops the reasoning, Qwen3.5 and GLM drop earlier reasoning at a
new query), the loss is exactly that and its cause is named.

One stack per family (a module-scoped parametrized fixture: pytest runs a family's tests
together); each loop's query is its own, so none finds another's history. The chat API runs
the whole loop for every family; the Responses and Anthropic APIs a shorter one for the two
formats kvbank reads itself (harmony, Nemotron's <TOOLCALL>)."""

from __future__ import annotations

import pytest

from kvbank.testing.family_models import (CALL, FAMILIES, FINAL, REASONING, TOOLS,
                                           conversation, scripted_model)
from tests.conftest import matrix, start_stack
from tests.families import check_loop, forced, loop, streamed

OWN_FORMATS = ("gpt_oss", "nemotron_nano_v2")  # read by worker/compute/call_formats.py
# `make test`: harmony, <TOOLCALL>, and an mlx-lm parser with reasoning (the rest: make test-all)
KEPT = ("gpt_oss", "nemotron_nano_v2", "qwen3_5")


@pytest.fixture(scope="module", params=matrix(FAMILIES, keep=KEPT))
def family(request, tmp_path_factory, cache_dir):
    """(name, stack, tokens of the family's generation prompt, of its system part)."""
    from kvbank.router.tokenizer import PromptTokenizer

    name = request.param
    model = scripted_model(name, cache_dir=cache_dir)
    tok = PromptTokenizer(model)
    messages = conversation(FAMILIES[name])
    prompt = tok.chat(messages, tools=TOOLS)
    gen = len(prompt) - len(tok.encode(tok._render_open(messages, TOOLS)))
    stack = start_stack(model, tmp_path_factory.mktemp(name), cache_dir=cache_dir)
    yield name, stack, gen, tok.shared_end(messages, prompt, TOOLS)
    stack.stop()


def test_a_tool_loop_reads_each_turn_from_cache(family):
    name, s, gen, system_part = family
    f = FAMILIES[name]
    for api in ("chat", "responses", "anthropic") if name in OWN_FORMATS else ("chat",):
        steps = loop(s, f, api, requests=9 if api == "chat" else 4)
        losses = check_loop(f, steps, gen, system_part)
        if name == "nemotron_nano_v2":
            assert len(losses) == len(steps) - 1  # every turn: the template drops the reasoning
        elif name in ("qwen3_5", "glm4_5", "glm4_6") and api == "chat":
            assert list(losses) == [6]  # only where the new query drops earlier reasoning
        else:
            assert not losses, (api, losses)
    if name in OWN_FORMATS:  # kvbank's own parsers, streamed: the call whole, reasoning apart
        calls, text, reasoning = streamed(s)
        assert calls == [CALL] and not text.strip(), (calls, text)
        assert reasoning.strip() == REASONING


def test_a_forced_call_is_one_call_in_the_familys_syntax(family):
    """`required` (Anthropic `any`) gets the model's own call; a named function it would
    never call by itself (Anthropic `tool`) is written in the family's syntax all the same,
    constrained by a grammar of that syntax, and read back by the family's parser."""
    s = family[1]
    for api in ("chat", "responses", "anthropic"):
        calls, text, _ = forced(s, api, "required")
        assert calls == [CALL] and not text.strip(), (api, calls, text)
        calls, text, _ = forced(s, api, "mode")
        assert len(calls) == 1 and not text.strip(), (api, calls, text)
        name, args = calls[0]
        assert name == "mode" and set(args) == {"level", "fast"}, (api, calls)
        assert args["level"] in ("low", "high") and args["fast"] in (True, False), (api, args)


def test_a_forced_custom_tool_keeps_its_grammar_in_the_familys_syntax(family):
    """Codex's freeform tools: the input, in the tool's own Lark grammar, where the family's
    call puts a string (raw, no escaping); Nemotron's calls are JSON strings, which cannot hold
    it, and the refusal names the family and its syntax."""
    import openai

    name, s = family[:2]
    c = openai.OpenAI(base_url=s.shim_url + "/v1", api_key="none", max_retries=0)
    calc = {"type": "custom", "name": "calc", "description": "Arithmetic.",
            "format": {"type": "grammar", "syntax": "lark",
                       "definition": 'start: "1+1" | "2+2" | "3+3"'}}
    ask = dict(model="kvbank", input="Add.", tools=[calc], store=False, temperature=0,
               tool_choice={"type": "custom", "name": "calc"}, max_output_tokens=80)
    if name == "nemotron_nano_v2":
        with pytest.raises(openai.BadRequestError) as info:
            c.responses.create(**ask)
        assert "nemotron" in str(info.value) and "TOOLCALL" in str(info.value)
        return
    r = c.responses.create(**ask)
    [call] = [o for o in r.output if o.type == "custom_tool_call"]
    assert call.name == "calc" and call.input in ("1+1", "2+2", "3+3"), r.output


def test_tool_choice_none_gets_the_answer_and_it_comes_back_from_cache(family):
    """`tool_choice: none`: the call's opening (its special token, or harmony's commentary
    message) is ruled out, and the model answers in text. Sent back with a new query, that
    answer (reasoning and all) is read from cache where the template writes it back; where it
    drops the reasoning (every family here that reasons, at a new query), the previous prompt
    is, up to its generation prompt."""
    import uuid

    import openai

    name, s, gen, _ = family
    f = FAMILIES[name]
    c = openai.OpenAI(base_url=s.shim_url + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": f"[{uuid.uuid4().hex[:8]}] List the files here."}]
    ask = dict(model="kvbank", tools=TOOLS, max_tokens=120, temperature=0)
    r = c.chat.completions.create(messages=messages, tool_choice="none", **ask)
    m, first = r.choices[0].message, r.usage
    assert not m.tool_calls and m.content.strip() == FINAL, m
    assert ((m.model_extra or {}).get("reasoning_content") or "").strip() == \
        (REASONING if f.reasoning else "")
    messages += [m.model_dump(exclude_none=True), {"role": "user", "content": "And tests/?"}]
    u = c.chat.completions.create(messages=messages, **ask).usage
    cached = u.prompt_tokens_details.cached_tokens
    if f.reasoning:
        assert cached >= first.prompt_tokens - gen, (cached, first)
    else:
        assert cached >= first.prompt_tokens + first.completion_tokens, (cached, first)
