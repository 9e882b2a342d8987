"""Concurrent prefill sharing: a request whose prompt shares a prefix with one still reading
its prompt waits for that KV rather than computing it again (the real stack, the tiny model,
prefill in 16-token chunks so a long prompt takes many steps to read)."""

from __future__ import annotations

import threading
import time
import uuid

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
    first's prompt KV, rather than the shared system prompt again."""
    shared = f"[{uuid.uuid4().hex}] You are a coding agent. " + "Follow the rules. " * 100
    answers, answering, times = {}, threading.Event(), {}

    def first() -> None:
        with slow_prefill.client() as c:
            answers["first"] = c.generate(prompt=shared + "Task one: fix the bug.",
                                          max_tokens=1200, temperature=0.0,
                                          on_text=lambda _: answering.set())
        times["first_done"] = time.monotonic()

    t = threading.Thread(target=first)
    t.start()
    assert answering.wait(120), "the first request never answered"
    times["second_sent"] = time.monotonic()
    with slow_prefill.client() as c:
        two = c.generate(prompt=shared + "Task two: write the docs.", max_tokens=4,
                         temperature=0.0).usage
    t.join(timeout=120)
    one = answers["first"].usage
    assert times["first_done"] > times["second_sent"], "the first ended before the second came"
    assert one["cached_tokens"] == 0 and one["completion_tokens"] > 4
    prompt_shared = one["prompt_tokens"] - 10
    assert two["cache_source"] == "ram" and two["cached_tokens"] >= prompt_shared - 16, two
