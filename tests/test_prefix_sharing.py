"""Concurrent prefill sharing: a request whose prompt shares a prefix with one still reading
its prompt waits for that KV rather than computing it again (the real stack, the tiny model,
prefill in 16-token chunks so a long prompt takes many steps to read)."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest

from tests.conftest import start_stack
from tests.waiting import wait_until


@pytest.fixture
def slow_prefill(tiny_model, tmp_path, cache_dir):
    s = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir,
                    extra=["--prefill-chunk-tokens", "16"])
    yield s
    s.stop()


def test_a_request_waits_for_the_prefix_a_running_one_is_reading(slow_prefill):
    shared = f"[{uuid.uuid4().hex}] You are a coding agent. " + "Follow the rules. " * 300
    answers = {}

    def ask(name: str, text: str) -> None:
        with slow_prefill.client() as c:
            answers[name] = c.generate(prompt=shared + text, max_tokens=4, temperature=0.0)

    first = threading.Thread(target=ask, args=("first", "Task one: fix the bug."))
    first.start()
    with slow_prefill.client() as c:  # the first is reading its prompt, chunk by chunk
        wait_until(lambda: c.status().running_requests == 1, "the first request running")
        ask("second", "Task two: write the docs.")
    first.join(timeout=120)
    one, two = answers["first"].usage, answers["second"].usage
    assert one["cached_tokens"] == 0
    # The second computed only its own end: the shared prompt came from the first's KV.
    prompt_shared = one["prompt_tokens"] - 10
    assert two["cache_source"] == "ram" and two["cached_tokens"] >= prompt_shared - 16, two
    with slow_prefill.client() as c:
        metrics = c.status()
    assert metrics.running_requests == 0


@pytest.fixture
def big_blocks(tiny_model, tmp_path, cache_dir):
    s = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir,
                    extra=["--prefill-chunk-tokens", "16", "--block-tokens", "256"])
    yield s
    s.stop()


def test_a_few_held_tokens_do_not_hide_a_shared_prompt(big_blocks):
    """Agents whose system prompt is a block and a bit (300 tokens at 256-token blocks), on a
    server whose bank already holds the prompts' first few tokens (an earlier conversation
    opened the same way): the second agent still waits for the first's KV."""
    tag = f"[{uuid.uuid4().hex}]"
    with big_blocks.client() as c:
        c.generate(prompt=tag + " Hi", max_tokens=1, temperature=0.0)  # holds the opening
    shared = tag + " You are a coding agent. " + "Follow the rules. " * 70
    answers = {}

    def ask(name: str, text: str) -> None:
        with big_blocks.client() as c:
            answers[name] = c.generate(prompt=shared + text, max_tokens=4, temperature=0.0)

    first = threading.Thread(target=ask, args=("first", "Task one: " + "fix the bug. " * 150))
    first.start()
    with big_blocks.client() as c:
        wait_until(lambda: c.status().running_requests == 1, "the first request running")
        ask("second", "Task two: write the docs.")
    first.join(timeout=120)
    one, two = answers["first"].usage, answers["second"].usage
    assert 0 < one["cached_tokens"] < 64, one  # the opening, from the earlier conversation
    assert 256 < len(shared) // 4 and two["cache_source"] == "ram", two
    assert two["cached_tokens"] >= 256 + 32, two  # the shared prompt, not just the opening


def test_a_request_takes_the_prefix_of_one_already_answering(slow_prefill):
    """Agents whose first turns overlap: the second arrives after the first has read its
    prompt, while it is still answering. The second computes only its own end, from the
    first's prompt KV, rather than the shared system prompt again, and answers as if it had
    computed everything."""
    shared = "[answering] You are a coding agent. " + "Follow the rules. " * 100
    answers, answering, done = {}, threading.Event(), {}

    def first() -> None:
        with slow_prefill.client() as c:
            answers["first"] = c.generate(prompt=shared + "Task one: fix the bug.",
                                          max_tokens=1200, temperature=0.0,
                                          on_text=lambda _: answering.set())
        done["first"] = time.monotonic()

    t = threading.Thread(target=first)
    t.start()
    assert answering.wait(120), "the first request never answered"
    with slow_prefill.client() as c:
        second = c.generate(prompt=shared + "Task two: write the docs.", max_tokens=4,
                            temperature=0.0)
        done["second"] = time.monotonic()
        alone = c.generate(prompt=shared + "Task two: write the docs.", max_tokens=4,
                           temperature=0.0, no_cache=True)
    t.join(timeout=120)
    one, two = answers["first"].usage, second.usage
    assert done["second"] < done["first"], "the first had ended: nothing was shared mid-answer"
    assert one["cached_tokens"] == 0
    prompt_shared = one["prompt_tokens"] - 10
    assert two["cache_source"] == "ram" and two["cached_tokens"] >= prompt_shared - 16, two
    assert second.token_ids == alone.token_ids


def test_a_cancelled_turn_takes_back_the_prompt_it_shared(slow_prefill):
    """A returning turn is answering when another request takes the prefix it shares; then
    its client goes away. The cancelled turn's prompt is not kept (the bank holds no more of
    it than the other request's own conversation), and the conversation is as it was: its
    next turn reads its whole history from RAM."""
    from kvbank.v1 import api_pb2

    rng = np.random.default_rng(5)
    ids = lambda n: rng.integers(1000, 20000, n).tolist()  # noqa: E731
    with slow_prefill.client() as c:
        c.generate(session_id="a", token_ids=ids(400), append=True, max_tokens=2)
        history = list(c.get_session("a").token_ids)
        new = ids(300)
        # It may answer until the model's context is full (about 7,500 tokens), so it is still
        # answering when the other request ends, however slowly the machine runs (a loaded
        # machine can decode a bound of a thousand tokens or so before that).
        req = api_pb2.GenerateRequest(session_id="a", append=True, max_tokens=1 << 20,
                                      fit_max_tokens=True)
        req.tokens.ids.extend(new)
        call = c.generation.Generate(req)  # the stub's own call, so the test can cancel it
        next(ev for ev in call if ev.token_ids)  # it is answering
        other = c.generate(token_ids=history + new[:200] + ids(30), max_tokens=2).usage
        assert other["cache_source"] == "ram", other
        assert other["cached_tokens"] >= len(history) + 200 - 16, other
        assert c.status().running_requests == 1, "the turn ended before its client went away"
        call.cancel()
        wait_until(lambda: c.status().running_requests == 0, "the cancelled turn to leave")
        assert list(c.get_session("a").token_ids) == history  # not committed
        again = c.generate(token_ids=history + new + ids(10), max_tokens=1).usage
        assert again["cached_tokens"] <= len(history) + 200, again  # the other's, no more
        back = c.generate(session_id="a", token_ids=ids(5), append=True, max_tokens=1).usage
        assert back["cache_source"] == "ram" and back["cached_tokens"] == len(history), back
