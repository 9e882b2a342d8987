"""An agent's tool loop on a model family's scripted model (kvbank/testing/family_models.py), through
the shim's three APIs, as a client sends it: each request the whole history back exactly as
it was returned (reasoning, text, calls, a tool result), a new user query at the seventh.

`loop(stack, family, api)` runs it and returns one `Step` per request; `check_loop` asserts
what a user of that family would notice: every answer one structured call of `run`, nothing
leaked into the text, the reasoning apart, and each request reading from cache the previous
prompt and the whole previous answer, except where the family's template itself changes the
history (`expected_loss` names where and why)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

import anthropic
import openai

from kvbank.testing.family_models import CALL, REASONING, TOOLS, Family

SYSTEM = "You are a coding agent."
REQUESTS = 9          # the query, then eight more
NEW_QUERY_AT = 6      # the seventh request carries a new user query
MAX_TOKENS = 120      # the longest script is about 60 tokens
GREEDY = {"temperature": 0}


@dataclass
class Step:
    prompt: int          # prompt tokens (cached ones included)
    cached: int
    completion: int
    text: str            # what the client reads
    reasoning: str
    calls: list          # (name, arguments as an object)
    new_query: bool = False
    body: dict | None = None     # the request's body as sent
    kvbank: dict | None = None   # kvbank's facts in the usage (session_id, cache_source, ...)
    logprobs: list | None = None  # each token's, where asked (chat: `logprobs: true`)
    tops: list | None = None      # each token's `top_logprobs` values, most likely first


def anthropic_tools() -> list[dict]:
    return [{"name": t["function"]["name"], "description": t["function"]["description"],
             "input_schema": t["function"]["parameters"]} for t in TOOLS]


def responses_tools() -> list[dict]:
    return [{"type": "function", **t["function"]} for t in TOOLS]


def loop(stack, f: Family, api: str, requests: int = REQUESTS, *, system: str = SYSTEM,
         after=None, **extra) -> list[Step]:
    """The tool loop on `api` ("chat", "responses", "anthropic"); `extra` goes into every
    request body (tool_choice, ...); `after(i, step)` runs once request i is answered, before
    the next is sent."""
    query = f"[{uuid.uuid4().hex[:8]}] List the files here."
    steps: list[Step] = []

    def done(step: Step) -> None:
        steps.append(step)
        if after is not None:
            after(len(steps) - 1, step)

    {"chat": _chat_loop, "responses": _responses_loop,
     "anthropic": _anthropic_loop}[api](stack, system, query, requests, extra, done)
    return steps


def generate_request(api: str, body: dict):
    """The GenerateRequest the shim sends the router for this body on `api` (how a test
    sees the messages the router renders)."""
    from kvbank.apps.shim import anthropic_format, openai_format, responses_format

    if api == "chat":
        return openai_format.parse("chat", body, session_header=None).generate
    if api == "responses":
        return responses_format.parse(body, session_header=None,
                                      default_max_tokens=MAX_TOKENS).chat.generate
    return anthropic_format.parse(body, session_header=None).generate


def _extra(usage) -> dict:
    return (usage.model_extra or {}).get("kvbank") or {}


def _openai(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.shim_url + "/v1", api_key="none", max_retries=0)


def _chat_loop(stack, system: str, query: str, requests: int, extra: dict, done) -> None:
    c = _openai(stack)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": query}]
    for i in range(requests):
        body = dict(model="kvbank", messages=list(messages), tools=TOOLS,
                    max_tokens=MAX_TOKENS, **GREEDY, **extra)
        r = c.chat.completions.create(**body)
        m, u = r.choices[0].message, r.usage
        lps = r.choices[0].logprobs
        done(Step(u.prompt_tokens, u.prompt_tokens_details.cached_tokens,
                  u.completion_tokens, m.content or "",
                  (m.model_extra or {}).get("reasoning_content") or "",
                  [(t.function.name, json.loads(t.function.arguments))
                   for t in m.tool_calls or ()], new_query=i == NEW_QUERY_AT, body=body,
                  kvbank=_extra(u),
                  logprobs=None if lps is None else [t.logprob for t in lps.content or ()],
                  tops=None if lps is None else [[a.logprob for a in t.top_logprobs or ()]
                                                 for t in lps.content or ()]))
        messages.append(m.model_dump(exclude_none=True))
        for t in m.tool_calls or ():
            messages.append({"role": "tool", "tool_call_id": t.id, "content": f"a.py\nb{i}.py"})
        if i + 1 == NEW_QUERY_AT:
            messages.append({"role": "user", "content": "Now the tests folder."})


def _responses_loop(stack, system: str, query: str, requests: int, extra: dict, done) -> None:
    c = _openai(stack)
    items: list = [{"role": "user", "content": query}]
    for i in range(requests):
        body = dict(model="kvbank", instructions=system, input=list(items),
                    tools=responses_tools(), store=False, max_output_tokens=MAX_TOKENS,
                    **GREEDY, **extra)
        r = c.responses.create(**body)
        u = r.usage
        calls = [o for o in r.output if o.type == "function_call"]
        reasoning = "".join(p.text for o in r.output if o.type == "reasoning"
                            for p in o.content or ())
        done(Step(u.input_tokens, u.input_tokens_details.cached_tokens,
                  u.output_tokens, r.output_text, reasoning,
                  [(o.name, json.loads(o.arguments)) for o in calls],
                  new_query=i == NEW_QUERY_AT, body=body, kvbank=_extra(u)))
        items += [o.model_dump(exclude_none=True) for o in r.output]
        items += [{"type": "function_call_output", "call_id": o.call_id,
                   "output": f"a.py\nb{i}.py"} for o in calls]
        if i + 1 == NEW_QUERY_AT:
            items.append({"role": "user", "content": "Now the tests folder."})


def _anthropic_loop(stack, system: str, query: str, requests: int, extra: dict, done) -> None:
    c = anthropic.Anthropic(base_url=stack.shim_url, api_key="none", max_retries=0)
    messages: list = [{"role": "user", "content": query}]
    for i in range(requests):
        body = dict(model="kvbank", system=system, messages=list(messages),
                    tools=anthropic_tools(), max_tokens=MAX_TOKENS, **extra)
        m = c.messages.create(**body, extra_body=GREEDY)
        u = m.usage
        uses = [b for b in m.content if b.type == "tool_use"]
        done(Step(u.input_tokens + u.cache_read_input_tokens, u.cache_read_input_tokens,
                  u.output_tokens,
                  "".join(b.text for b in m.content if b.type == "text"),
                  "".join(b.thinking for b in m.content if b.type == "thinking"),
                  [(b.name, b.input) for b in uses], new_query=i == NEW_QUERY_AT,
                  body={**body, **GREEDY}, kvbank=_extra(u)))
        messages.append({"role": "assistant",
                         "content": [b.model_dump(exclude_none=True) for b in m.content]})
        results = [{"type": "tool_result", "tool_use_id": b.id, "content": f"a.py\nb{i}.py"}
                   for b in uses]
        if i + 1 == NEW_QUERY_AT:
            results.append({"type": "text", "text": "Now the tests folder."})
        messages.append({"role": "user", "content": results})


def expected_loss(f: Family, step: Step) -> str | None:
    """Why the family's template changes what the model saw before this request (None: it
    renders the model's tokens back, and the whole previous turn is read from cache)."""
    if f.name == "nemotron_nano_v2":
        return "Nemotron's template renders neither the reasoning nor the <think> its " \
               "generation prompt opened"
    if step.new_query and f.name in ("qwen3_5", "glm4_5", "glm4_6"):
        return "the template drops earlier reasoning at a new user query"
    return None


def check_loop(f: Family, steps: list[Step], gen_prompt: int, system_part: int) -> dict:
    """What a user notices (module doc); returns the losses it saw, with their causes.
    `gen_prompt`: the tokens of the family's generation prompt; `system_part`: of the system
    prompt and tools every conversation shares."""
    losses = {}
    for i, s in enumerate(steps):
        assert s.calls == [CALL], (i, s)
        assert s.text.strip() == "", (i, s)  # nothing leaked into the text
        assert s.reasoning.strip() == (REASONING if f.reasoning else ""), (i, s)
        if not i:
            continue
        prev = steps[i - 1]
        cause = expected_loss(f, s)
        if cause is None:
            assert s.cached >= prev.prompt + prev.completion, (i, s, prev)
        else:
            # Restored up to where the template's history parts from the model's: before the
            # last generation prompt; at a new query, where the loop began (a model with
            # recurrent layers restores at a checkpoint: the system part's at least).
            at_query = s.new_query and f.name != "nemotron_nano_v2"
            parts = (steps[0].prompt if at_query else prev.prompt) - gen_prompt
            assert s.cached >= (min(parts, system_part) if at_query else parts), (i, s, prev)
            assert s.cached < prev.prompt + prev.completion, (i, s, prev)
            losses[i] = cause
    return losses


# A tool the scripted models never call by themselves: forcing it shows the grammar writes
# the family's syntax (its values are chosen from an enum and a boolean, so the call ends).
MODE = {"type": "function", "function": {
    "name": "mode", "description": "Set the agent's mode.",
    "parameters": {"type": "object", "required": ["level", "fast"], "properties": {
        "level": {"type": "string", "enum": ["low", "high"]},
        "fast": {"type": "boolean"}}}}}


def forced(stack, api: str, choice: str) -> tuple[list, str, str]:
    """One request forcing a call (`choice`: "required", or "mode" for that function by
    name) on `api`; (calls as (name, arguments), text, reasoning)."""
    query = f"[{uuid.uuid4().hex[:8]}] List the files here."
    tools = TOOLS + [MODE]
    if api == "chat":
        tc = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
        r = _openai(stack).chat.completions.create(
            model="kvbank", messages=[{"role": "user", "content": query}], tools=tools,
            tool_choice=tc, max_tokens=MAX_TOKENS, **GREEDY)
        m = r.choices[0].message
        return ([(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls or ()],
                m.content or "", (m.model_extra or {}).get("reasoning_content") or "")
    if api == "responses":
        tc = choice if choice == "required" else {"type": "function", "name": choice}
        r = _openai(stack).responses.create(
            model="kvbank", input=query, tools=[{"type": "function", **t["function"]}
                                                for t in tools],
            tool_choice=tc, max_output_tokens=MAX_TOKENS, store=False, **GREEDY)
        calls = [o for o in r.output if o.type == "function_call"]
        return ([(o.name, json.loads(o.arguments)) for o in calls], r.output_text,
                "".join(p.text for o in r.output if o.type == "reasoning"
                        for p in o.content or ()))
    tc = {"type": "any"} if choice == "required" else {"type": "tool", "name": choice}
    c = anthropic.Anthropic(base_url=stack.shim_url, api_key="none", max_retries=0)
    m = c.messages.create(model="kvbank", messages=[{"role": "user", "content": query}],
                          tools=[{"name": t["function"]["name"],
                                  "description": t["function"]["description"],
                                  "input_schema": t["function"]["parameters"]} for t in tools],
                          tool_choice=tc, max_tokens=MAX_TOKENS, extra_body=GREEDY)
    return ([(b.name, b.input) for b in m.content if b.type == "tool_use"],
            "".join(b.text for b in m.content if b.type == "text"),
            "".join(b.thinking for b in m.content if b.type == "thinking"))


def streamed(stack) -> tuple[list, str, str]:
    """One chat request streamed: (calls as (name, arguments), text, reasoning) from its
    deltas, as a streaming client assembles them."""
    query = f"[{uuid.uuid4().hex[:8]}] List the files here."
    chunks = _openai(stack).chat.completions.create(
        model="kvbank", messages=[{"role": "user", "content": query}], tools=TOOLS,
        max_tokens=MAX_TOKENS, stream=True, **GREEDY)
    text, reasoning, calls = [], [], {}
    for chunk in chunks:
        for choice in chunk.choices:
            d = choice.delta
            text.append(d.content or "")
            reasoning.append((d.model_extra or {}).get("reasoning_content") or "")
            for t in d.tool_calls or ():
                call = calls.setdefault(t.index, ["", ""])
                call[0] += (t.function.name or "") if t.function else ""
                call[1] += (t.function.arguments or "") if t.function else ""
    return ([(n, json.loads(a)) for n, a in calls.values()], "".join(text), "".join(reasoning))
