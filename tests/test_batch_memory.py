"""What the worker's BatchScheduler allocates against what the engine prices it at (Pricing),
read by MLX's own counter (it tracks CPU allocations too) on the tiny model: MLX on CPU does
not enforce a memory limit, so a price below what runs is memory the budget never saw."""

from __future__ import annotations

import numpy as np
import pytest

from kvbank.worker.compute.scheduler import LAST_FORWARD_TOKENS
from tests.test_scheduler import _request, _scheduler, _tokens

pytestmark = pytest.mark.unit  # make test-fast


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model):
    from mlx_lm import load

    return load(str(tiny_model))


def _calibrated(model, chunk: int, chunks: int):
    """The price list as the worker measures it at start, over the contexts a test reaches
    (one forward's peak varies by ~100 KB: a slope from a span of 256 tokens, extrapolated to
    1,500, priced it 117 KB short one run in ten)."""
    from kvbank.contracts.pricing import Pricing
    from kvbank.worker.kv.cache_kinds import CacheKinds
    from kvbank.worker.memory.pricing import calibrate

    kinds = CacheKinds.of(model)
    per_token, _, _ = kinds.measure()
    pricing = Pricing(per_token, 0, chunk, kv_layers=kinds.full_count,
                      logits_bytes_per_query=4 * model.args.vocab_size)  # as the engine's
    return calibrate(model, pricing, last_forward_tokens=LAST_FORWARD_TOKENS, chunks=chunks)


def test_a_request_on_its_own_cache_allocates_no_more_than_its_price(model_and_tokenizer):
    """A request is priced at its cache once, with its prefill transients: read in chunks and
    answered on its own cache, what MLX allocates for it peaks within that price (its last
    prompt forward's logits over the vocabulary included: unpriced, they took it past by
    12 MB here)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = model_and_tokenizer
    chunk, prompt, answer = 64, 1500, 40
    pricing = _calibrated(model, chunk, chunks=24)
    tokens = _tokens(tokenizer, np.random.default_rng(15), prompt)
    s = _scheduler(model, tokenizer, chunk=chunk)
    r = _request(tokenizer, tokens)
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    s.add(r, make_prompt_cache(model), answer)
    while s:
        s.step()
    used = mx.get_peak_memory() - before
    price = pricing.request_bytes(prompt, answer)
    assert len(r.completion) == answer
    assert used <= price, (used, price)


def test_answers_in_the_batch_hold_their_caches_and_one_copy_not_a_copy_each(
        model_and_tokenizer):
    """Three answers on their own caches join mlx-lm's batch mid-answer, then end at different
    steps. While they join, MLX's peak stays within their caches and the join's copies; once
    the scheduler says the copies are made (`take_joined`), within their caches, their padding
    and a layer of the batch as members leave (`Pricing.leave_bytes`: copied out a layer at
    a time). The engine used to hold a copy per member for as long as it ran: four agents'
    answers at 1.3 GB were refused the join and decoded beside each other (bench compare
    n-agents)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = model_and_tokenizer
    chunk = 64
    pricing = _calibrated(model, chunk, chunks=26)
    rng = np.random.default_rng(7)
    prompts, answers = (1500, 1400, 1300), (12, 40, 26)
    tokens = [_tokens(tokenizer, rng, n) for n in prompts]
    room = [False]
    s = _scheduler(model, tokenizer, chunk=chunk, may_join=lambda joining: room[0])
    rs = [_request(tokenizer, t) for t in tokens]
    mx.clear_cache()
    before = mx.get_active_memory()
    for r, t, n in zip(rs, tokens, answers):
        s.add(r, make_prompt_cache(model), n)
    while any(r.first_token_at is None for r in rs):
        s.step()
    s.step()
    assert all(r.uid < 0 for r in rs)  # refused: each on its own cache, beside the others

    caches = sum(pricing.cache_bytes(p + n) for p, n in zip(prompts, answers))
    lens = [len(r.tokens) + len(r.completion) for r in rs]
    joins = sum(pricing.join_bytes(n, batch_len=max(lens[:i], default=0), batch_size=i)
                for i, n in enumerate(lens))
    padding = sum(pricing.padding_bytes(n, batch_len=max(lens[:i], default=0), batch_size=i)
                  for i, n in enumerate(lens))
    decode = pricing.decode_transient(max(lens) + max(answers), len(rs))
    room[0] = True
    mx.clear_cache()
    mx.reset_peak_memory()
    assert s.join_beside()
    s.step()  # mlx-lm merges the three into a batch of their own (a copy)
    assert s.take_joined() == []
    s.step()  # and extends its running batch with it (a copy a layer at a time)
    assert sorted(r.uid for r in s.take_joined()) == sorted(r.uid for r in rs)
    used = mx.get_peak_memory() - before
    assert used <= caches + joins + pricing.leave_bytes(lens) + decode, used

    ended = []
    mx.clear_cache()
    mx.reset_peak_memory()
    while s:
        for r, cache in s.step():
            mx.eval([c.state for c in cache])  # as its commit does, at once
            ended.append((r, cache))  # kept, as the bank keeps its entry
    used = mx.get_peak_memory() - before
    held = caches + padding + pricing.leave_bytes([n + max(answers) for n in lens]) + decode
    assert [len(r.completion) for r, _ in ended] == sorted(answers)
    assert used <= held, (used, held)
