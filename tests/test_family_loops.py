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
the whole loop for every family but gpt-oss, whose chat loop tests/test_model_kinds.py runs
(ten turns, checked against mlx-lm); the Responses and Anthropic APIs a shorter one for the two
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
    # gpt-oss's chat loop is tests/test_model_kinds.py's, eight turns checked against mlx-lm
    apis = ("chat",) if name not in OWN_FORMATS else (
        ("responses", "anthropic") if name == "gpt_oss" else ("chat", "responses", "anthropic"))
    for api in apis:
        # chat: the new query at the seventh request (NEW_QUERY_AT) and one turn after it
        steps = loop(s, f, api, requests=8 if api == "chat" else 4)
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


PRERENDERED = ("qwen3_5", "glm4_5", "glm4_6")  # templates that drop reasoning at a new query
LISTING = 100  # lines of each tool result: the history a pre-render computes is ~5 chunks


def _events(s) -> list[dict]:
    import json

    with open(s.layout.events_path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_the_next_query_is_prerendered_while_the_user_reads(family, cache_dir):
    """A tool loop, then an answer with no call (`tool_choice: none`): while the user reads,
    the worker computes the history their next query will carry (the template drops the
    loop's reasoning then), below any request: a request that comes meanwhile waits for one
    prefill chunk at most (the event log's order: its arrival, at most one chunk, its
    admission), and the pre-render goes on after it. The new query then restores all of that
    history (before: only up to the checkpoint before the first dropped reasoning) and its
    answer equals mlx-lm's from scratch: tokens equal, logprobs within 1e-4."""
    import json
    import uuid

    import mlx.core as mx
    import openai
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from kvbank.router.tokenizer import PromptTokenizer
    from tests.waiting import wait_until

    name, s = family[:2]
    if name not in PRERENDERED:
        pytest.skip(f"{name}'s template keeps the history a new query carries")
    c = openai.OpenAI(base_url=s.shim_url + "/v1", api_key="none", max_retries=0)
    listing = "\n".join(f"src/module_{i}.py" for i in range(LISTING))
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": f"[{uuid.uuid4().hex[:8]}] List the files here."}]
    ask = dict(model="kvbank", tools=TOOLS, max_tokens=120, temperature=0)
    for _ in range(2):
        m = c.chat.completions.create(messages=messages, **ask).choices[0].message
        assert m.tool_calls, m
        messages += [m.model_dump(exclude_none=True)] + [
            {"role": "tool", "tool_call_id": t.id, "content": listing} for t in m.tool_calls]
    seen = len(_events(s))
    r = c.chat.completions.create(messages=messages, tool_choice="none", **ask)
    m = r.choices[0].message
    assert m.content.strip() == FINAL and not m.tool_calls, m
    messages.append(m.model_dump(exclude_none=True))

    def mine(kind: str, events: list[dict]) -> list[tuple[int, dict]]:
        return [(i, e) for i, e in enumerate(events) if i >= seen and e["kind"] == kind
                and e.get("session_id") == conversation]

    queued = wait_until(lambda: [e for e in _events(s)[seen:]
                                 if e["kind"] == "prerender_queued"], "the pre-render's start")
    conversation = queued[0]["session_id"]
    wait_until(lambda: mine("prerender_chunk", _events(s)), "its first chunk", every_s=0.005)
    probe = f"probe-{uuid.uuid4().hex[:8]}"  # another conversation's request comes meanwhile
    with s.client() as k:
        k.generate(session_id=probe, prompt="Hello there.", max_tokens=2)
    done = wait_until(lambda: mine("prerender_done", _events(s)), "the pre-render's end")[0]
    events = _events(s)
    [arrived] = [i for i, e in enumerate(events)
                 if e["kind"] == "request_during_prerender" and e["session_id"] == probe]
    admitted = next(i for i, e in enumerate(events)
                    if e["kind"] == "admission" and e.get("session_id") == probe)
    chunks = [i for i, _ in mine("prerender_chunk", events)]
    assert len([i for i in chunks if arrived < i < admitted]) <= 1, (arrived, admitted, chunks)
    assert any(i < arrived for i in chunks) and any(i > admitted for i in chunks), chunks
    assert done[0] > admitted  # it went on after the request, and ended
    prerendered = done[1]["tokens"]

    messages.append({"role": "user", "content": "Now the tests folder."})
    r = c.chat.completions.create(messages=messages, logprobs=True, **ask)
    u = r.usage
    # The whole re-rendered history is restored: only the user's text and the generation
    # prompt are computed.
    assert u.prompt_tokens_details.cached_tokens >= prerendered >= u.prompt_tokens - 24, \
        (u, prerendered)
    path = scripted_model(name, cache_dir=cache_dir)
    model, tokenizer = load(str(path))
    as_rendered = [{**m, "tool_calls": [  # the router gives the template objects
        {**t, "function": {**t["function"], "arguments": json.loads(t["function"]["arguments"])}}
        for t in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    ids = PromptTokenizer(path).chat(as_rendered, tools=TOOLS)
    assert len(ids) == u.prompt_tokens
    cache = make_prompt_cache(model)
    logits = model(mx.array(ids)[None], cache=cache)[0, -1]
    want, want_lps = [], []
    while len(want) < 120:
        lps = logits - mx.logsumexp(logits)
        token = int(lps.argmax().item())
        if token in tokenizer.eos_token_ids:
            break
        want.append(token)
        want_lps.append(float(lps[token].item()))
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    got = r.choices[0].logprobs.content
    assert [t.token for t in got] == [tokenizer.decode([t]) for t in want]
    assert max(abs(a.logprob - b) for a, b in zip(got, want_lps)) < 1e-4
