"""The model's reasoning, split off its answer on all three APIs: `reasoning_content` on chat
completions, a `thinking` block on Messages, a `reasoning` item on Responses; each API's
reasoning switch; and reasoning sent back with the history is taken.

One stack on a tiny random llama whose tokenizer has `<think>` / `</think>` and whose
template (kvbank/testing/tiny.py's Qwen3.5-style one) opens the reasoning in the generation prompt, so a
greedy answer of a few tokens is all reasoning; with the switch off, the template closes it
and the answer is all text. What the model wrote is checked against /v1/completions on the
same prompt text, whose raw answer nothing splits."""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import openai
import pytest

from tests.conftest import start_stack
from kvbank.worker.compute.decoding import ReasoningText

MAX_TOKENS = 8
GREEDY = {"temperature": 0}  # the Anthropic SDK takes it only as extra_body


def test_reasoning_is_split_off_as_it_streams():
    r = ReasoningText("<think>", "</think>", reasoning=True)
    parts = [r.feed(t) for t in ["Let me", " see</th", "ink>\n", "\nHello", " <thi",
                                 "nk>again</think> x"]] + [r.finish()]
    assert "".join(p[0] for p in parts) == "Let me seeagain"
    assert "".join(p[1] for p in parts) == "Hello x"  # blank lines after an end are not text
    assert parts[1] == (" see", "")  # a marker's start is held until it is known
    r = ReasoningText("<think>", "</think>", reasoning=False)
    assert r.feed("plain <thin") == ("", "plain ")
    assert r.feed("g>") == ("", "<thing>")
    assert r.feed("<think>unfinished") == ("unfinished", "")
    assert r.finish() == ("", "")


def test_reasoning_tokens_are_counted_on_tokens_markers_included():
    """`usage.completion_tokens_details.reasoning_tokens`: 7 and 8 mark the reasoning here."""
    opened = ReasoningText("<think>", "</think>", reasoning=True, start_ids=[7], end_ids=[8])
    assert opened.count([1, 2, 8, 3, 4]) == 3  # 1, 2 and the end marker
    closed = ReasoningText("<think>", "</think>", reasoning=False, start_ids=[7], end_ids=[8])
    assert closed.count([1, 7, 2, 8, 3, 7, 4]) == 5  # 7 2 8, then 7 4 left open
    assert closed.count([1, 2]) == 0
    two = ReasoningText("<think>", "</think>", reasoning=False, start_ids=[5, 6],
                        end_ids=[8, 9])
    assert two.count([5, 6, 1, 8, 9, 2]) == 5


@pytest.fixture(scope="module")
def stack(tmp_path_factory, cache_dir):
    from kvbank.testing.tiny import make_arch_model

    model = make_arch_model(tmp_path_factory.mktemp("reasoning-model") / "model", "llama",
                            seed=3, context=4096, cache_dir=cache_dir)
    s = start_stack(model, tmp_path_factory.mktemp("reasoning-data"), cache_dir=cache_dir)
    yield s
    s.stop()


def _question() -> list[dict]:
    return [{"role": "user", "content": f"[{uuid.uuid4().hex}] Which file holds the parser?"}]


def _raw_answer(stack, messages: list[dict], thinking: bool | None = None) -> str:
    """What the model writes after the prompt's text, unsplit (/v1/completions)."""
    body = {"model": "kvbank", "messages": messages}
    if thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": thinking}
    ids = httpx.post(stack.shim_url + "/v1/chat/completions/render", json=body,
                     timeout=60).json()["token_ids"]
    c = openai.OpenAI(base_url=stack.shim_url + "/v1", api_key="none", max_retries=0)
    return c.completions.create(model="kvbank", prompt=ids, max_tokens=MAX_TOKENS,
                                temperature=0).choices[0].text


def _chat(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.shim_url + "/v1", api_key="none", max_retries=0)


def test_chat_completions_return_the_reasoning_apart_and_take_it_back(stack):
    messages = _question()
    raw = _raw_answer(stack, messages)
    assert "</think>" not in raw and raw.strip()  # this model's few tokens: all reasoning
    r = _chat(stack).chat.completions.create(model="kvbank", messages=messages,
                                             max_tokens=MAX_TOKENS, temperature=0)
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] == raw and m.content == ""
    details = r.usage.completion_tokens_details
    assert details.reasoning_tokens == r.usage.completion_tokens > 0, r.usage  # all reasoning
    streamed = _chat(stack).chat.completions.create(
        model="kvbank", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == raw
    assert "".join(d.content or "" for d in deltas) == ""
    # the next turn sends it back; the template keeps the last turn's reasoning out of the
    # history, and the turn reads the previous prompt from cache
    first = r.usage.prompt_tokens
    again = _chat(stack).chat.completions.create(
        model="kvbank", max_tokens=MAX_TOKENS, temperature=0,
        messages=messages + [{"role": "assistant", "content": "", "reasoning_content": raw},
                             {"role": "user", "content": "And the tests?"}])
    assert again.usage.prompt_tokens_details.cached_tokens >= first - 8, again.usage


def test_the_switch_off_closes_the_reasoning_and_the_answer_is_text(stack):
    messages = _question()
    raw = _raw_answer(stack, messages, thinking=False)
    for body in ({"chat_template_kwargs": {"enable_thinking": False}},
                 {"reasoning_effort": "none"}):
        r = _chat(stack).chat.completions.create(model="kvbank", messages=messages,
                                                 max_tokens=MAX_TOKENS, temperature=0,
                                                 extra_body=body)
        m = r.choices[0].message
        assert m.content == raw and "reasoning_content" not in (m.model_extra or {})
        assert r.usage.completion_tokens_details.reasoning_tokens == 0, r.usage


def _anthropic(stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.shim_url, api_key="none", max_retries=0)


def test_messages_return_a_thinking_block_and_take_it_back(stack):
    messages = _question()
    raw = _raw_answer(stack, messages)
    r = _anthropic(stack).messages.create(model="claude-sonnet-4-5", max_tokens=MAX_TOKENS,
                                          messages=messages, extra_body=GREEDY,
                                          thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in r.content] == ["thinking"]
    assert r.content[0].thinking == raw and r.content[0].signature == ""
    with httpx.stream("POST", stack.shim_url + "/v1/messages", timeout=120, json={
            "model": "kvbank", "max_tokens": MAX_TOKENS, "messages": messages,
            "temperature": 0, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "content_block_start", "ping"]
    assert events[1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == raw
    assert deltas[-1] == {"type": "signature_delta", "signature": ""}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    # Claude Code sends the block back as it got it
    again = _anthropic(stack).messages.create(
        model="kvbank", max_tokens=MAX_TOKENS, extra_body=GREEDY,
        messages=messages + [{"role": "assistant", "content": [b.model_dump()
                                                               for b in r.content]},
                             {"role": "user", "content": "And the tests?"}])
    prompt = r.usage.input_tokens + r.usage.cache_read_input_tokens
    assert again.usage.cache_read_input_tokens >= prompt - 8, again.usage
    off = _anthropic(stack).messages.create(model="kvbank", max_tokens=MAX_TOKENS,
                                            messages=messages, extra_body=GREEDY,
                                            thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]
    assert off.content[0].text == _raw_answer(stack, messages, thinking=False)


def test_responses_return_a_reasoning_item_and_take_it_back(stack):
    messages = _question()
    raw = _raw_answer(stack, messages)
    c = _chat(stack)
    r = c.responses.create(model="kvbank", input=messages, max_output_tokens=MAX_TOKENS,
                           temperature=0, reasoning={"effort": "medium", "summary": "auto"})
    [item] = r.output
    assert item.type == "reasoning" and item.content[0].type == "reasoning_text"
    assert item.content[0].text == raw and r.output_text == ""
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens > 0
    with c.responses.stream(model="kvbank", input=messages, max_output_tokens=MAX_TOKENS,
                            temperature=0) as s:
        events = list(s)
        final = s.get_final_response()
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == raw
    assert final.output[0].type == "reasoning"
    again = c.responses.create(model="kvbank", max_output_tokens=MAX_TOKENS, temperature=0,
                               input=messages + [item.model_dump(exclude_none=True),
                                                 {"role": "user", "content": "And the tests?"}])
    assert again.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens - 8
    off = c.responses.create(model="kvbank", input=messages, max_output_tokens=MAX_TOKENS,
                             temperature=0, reasoning={"effort": "none"})
    assert [i.type for i in off.output] == ["message"]
    with pytest.raises(openai.BadRequestError) as info:
        c.responses.create(model="kvbank", input=messages, reasoning={"effort": "extreme"})
    assert info.value.body["param"] == "reasoning.effort"
