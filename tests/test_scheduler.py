"""The worker's BatchScheduler on the tiny model (real mlx-lm, real caches): an answer does not
depend on what else runs beside it, and a request that arrives while another reads its prompt
alone does not make that one wait."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvbank.v1 import api_pb2, worker_pb2
from worker import commands as cmd
from worker.decoding import Decoding, make_request_sampler
from worker.scheduler import LAST_FORWARD_TOKENS, BatchScheduler, Running

ANSWER = 8


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model):
    from mlx_lm import load

    return load(str(tiny_model))


def _request(tokenizer, tokens: np.ndarray) -> Running:
    job = cmd.Generate(worker_pb2.WorkerGenerateRequest(), emit=lambda ev: None)
    return Running(job=job, tokens=tokens, bank_key=("", "test"), session=None, cached=0,
                   source=api_pb2.CACHE_SOURCE_NONE, known=0, started=time.monotonic(),
                   stops=[], detok=tokenizer.detokenizer,
                   decoding=Decoding(make_request_sampler(0.0, 0.0, None)))


def _scheduler(model, tokenizer, chunk: int) -> BatchScheduler:
    return BatchScheduler(model, max_active=4, eos_token_ids=[], decode=tokenizer.decode,
                          prefill_step_tokens=chunk)


def _drain(s: BatchScheduler) -> list[Running]:
    ended = []
    while s:
        ended += [r for r, _ in s.step()]
    return ended


def _alone(model, tokenizer, tokens: np.ndarray) -> list[int]:
    from mlx_lm.models.cache import make_prompt_cache

    s = _scheduler(model, tokenizer, chunk=64)
    r = _request(tokenizer, tokens)
    s.add(r, make_prompt_cache(model), ANSWER)
    _drain(s)
    return r.completion


@pytest.mark.parametrize("first_prompt", [100, 300], ids=["on-its-last-forward", "mid-prompt"])
def test_a_request_that_joins_the_batch_answers_as_it_would_alone(model_and_tokenizer,
                                                                  first_prompt):
    """A reads its prompt alone; B arrives after A's first chunk. With A on its last prompt
    forward, A takes that forward alone at once (its first token comes before B's prompt is
    read, and its last tokens are not padded to B's length); mid-prompt, A joins the batch as
    it stands. Either way both answer exactly as alone."""
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = model_and_tokenizer
    rng = np.random.default_rng(first_prompt)
    a_tokens = rng.integers(256, tokenizer.vocab_size, size=first_prompt, dtype=np.uint32)
    b_tokens = rng.integers(256, tokenizer.vocab_size, size=200, dtype=np.uint32)

    s = _scheduler(model, tokenizer, chunk=64)
    a, b = _request(tokenizer, a_tokens), _request(tokenizer, b_tokens)
    s.add(a, make_prompt_cache(model), ANSWER)
    assert s.step() == [] and a.first_token_at is None  # A's first chunk, alone
    s.add(b, make_prompt_cache(model), ANSWER)
    left = first_prompt - min(64, first_prompt - LAST_FORWARD_TOKENS)  # after A's chunk
    on_last_forward = left <= LAST_FORWARD_TOKENS
    assert (a.first_token_at is not None) == on_last_forward
    ended = _drain(s)

    assert sorted(map(id, ended)) == sorted([id(a), id(b)])
    assert a.completion == _alone(model, tokenizer, a_tokens)
    assert b.completion == _alone(model, tokenizer, b_tokens)


def test_a_request_that_ends_during_a_join_and_is_cancelled_is_not_committed(
        model_and_tokenizer):
    """A one-token answer ends in the join's forward; its client goes away before the next
    step. The engine hears of it as cancelled (not committed, like any cancelled turn), and
    the step hands out only what is still wanted."""
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = model_and_tokenizer
    rng = np.random.default_rng(7)
    s = _scheduler(model, tokenizer, chunk=64)
    a = _request(tokenizer, rng.integers(256, tokenizer.vocab_size, 100, dtype=np.uint32))
    b = _request(tokenizer, rng.integers(256, tokenizer.vocab_size, 50, dtype=np.uint32))
    s.add(a, make_prompt_cache(model), 1)
    s.step()
    s.add(b, make_prompt_cache(model), ANSWER)
    assert len(a.completion) == 1 and a.uid not in s.running  # ended in the join
    a.job.cancelled.set()
    assert s.take_cancelled() == [a]
    assert a not in [r for r, _ in s.step()]
    assert [r for r in _drain(s)] == [b] and len(b.completion) == ANSWER
