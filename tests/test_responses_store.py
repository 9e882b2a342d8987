"""The Responses API's `store` and `previous_response_id`, through the official `openai` SDK
against the real stack: a stored response is kept in the coldstore's LMDB, so it outlives a
kill -9 of the worker (whose RAM held the conversation's KV) and of the coldstore itself, and
a request that continues it finds its KV by its tokens. The store's cap and TTL retire
responses as they retire conversations (coldstore/store.py, unit tests at the end)."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from tests.conftest import start_stack

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory, cache_dir):
    s = start_stack(tiny_model, tmp_path_factory.mktemp("responses") / "data",
                    cache_dir=cache_dir)
    yield s
    s.stop()


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.shim_url + "/v1", api_key="none", max_retries=0)


def _ask(text: str) -> str:
    return f"[{uuid.uuid4().hex}] {text}"


def test_a_stored_response_is_retrieved_continued_and_deleted(stack):
    c = _client(stack)
    ask = _ask("Name a file.")
    first = c.responses.create(model="kvbank", input=ask, temperature=0,
                               max_output_tokens=MAX_TOKENS, instructions="Be terse.")
    assert first.store is True and first.previous_response_id is None
    got = c.responses.retrieve(first.id)
    assert (got.id, got.output_text, got.usage.input_tokens) == \
        (first.id, first.output_text, first.usage.input_tokens)
    # the next turn names it, and sends only what is new (instructions are not carried over)
    nxt = c.responses.create(model="kvbank", previous_response_id=first.id, temperature=0,
                             input="And its size?", max_output_tokens=MAX_TOKENS,
                             instructions="Be terse.")
    assert nxt.previous_response_id == first.id
    assert nxt.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens, nxt.usage
    assert nxt.usage.model_extra["kvbank"]["recomputed_tokens"] == 0, nxt.usage
    # the same conversation sent whole is the same prompt: one conversation either way
    whole = c.responses.create(
        model="kvbank", temperature=0, max_output_tokens=MAX_TOKENS, instructions="Be terse.",
        input=[{"role": "user", "content": ask},
               *[o.model_dump(exclude_none=True) for o in first.output],
               {"role": "user", "content": "And its size?"}])
    assert whole.usage.input_tokens == nxt.usage.input_tokens
    deleted = httpx.delete(f"{stack.shim_url}/v1/responses/{first.id}", timeout=30)
    assert deleted.json() == {"id": first.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as info:
        c.responses.create(model="kvbank", previous_response_id=first.id, input="Again?")
    assert info.value.body["param"] == "previous_response_id"


def test_store_false_keeps_nothing(stack):
    c = _client(stack)
    r = c.responses.create(model="kvbank", input=_ask("Hi."), store=False,
                           max_output_tokens=MAX_TOKENS, temperature=0)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)


def test_a_streamed_response_is_stored_before_it_completes(stack):
    c = _client(stack)
    with c.responses.stream(model="kvbank", input=_ask("Count."), temperature=0,
                            max_output_tokens=MAX_TOKENS) as s:
        final = s.get_final_response()
    assert c.responses.retrieve(final.id).output_text == final.output_text


def test_previous_response_id_continues_after_kill_9_of_the_worker_and_the_coldstore(stack):
    """The worker dies with the conversation's KV in its RAM, then the coldstore dies: the
    stored response and the KV on SSD are LMDB's, so the next turn continues from SSD."""
    c = _client(stack)
    first = c.responses.create(model="kvbank", input=_ask("Plan the refactor."),
                               temperature=0, max_output_tokens=MAX_TOKENS)
    stack.wait_durable(first.usage.model_extra["kvbank"]["session_id"])
    for name in ("worker", "coldstore"):
        stack.wait_restarted(name, stack.kill9(name))
    nxt = c.responses.create(model="kvbank", previous_response_id=first.id, temperature=0,
                             input="Start with the parser.", max_output_tokens=MAX_TOKENS)
    kv = nxt.usage.model_extra["kvbank"]
    assert kv["cache_source"] == "ssd", nxt.usage
    assert nxt.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_the_store_retires_responses_by_age_and_by_its_cap(tmp_path):
    from kvbank.coldstore.store import ColdStore

    store = ColdStore(tmp_path / "s")
    for i in range(4):
        store.put_response("t", f"resp_{i}", created_at=100.0 + i, body=b"x" * 1000)
    assert store.response_bytes() == 4 * 1008
    assert store.retire_responses(before=101.5) == [("t", "resp_0"), ("t", "resp_1")]
    assert store.get_response("t", "resp_0") is None
    assert store.retire_responses(target_bytes=1008) == [("t", "resp_2")]
    assert store.get_response("t", "resp_3") == b"x" * 1000
    assert store.response_bytes() == 1008
    assert store.delete_response("t", "resp_3") and store.response_bytes() == 0
    store.close()
