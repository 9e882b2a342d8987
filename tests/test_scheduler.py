"""The worker's BatchScheduler on the tiny model (real mlx-lm, real caches): an answer does not
depend on what else runs beside it, a short prompt is not kept waiting behind a long one nor a
long one behind short ones, and one request's failure or cancellation leaves the others be."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvbank.v1 import api_pb2, worker_pb2
from kvbank.worker import commands as cmd
from kvbank.worker.compute.decoding import Decoding, make_request_sampler
from kvbank.worker.compute.scheduler import LAST_FORWARD_TOKENS, BatchScheduler, Running

pytestmark = pytest.mark.unit  # make test-fast

ANSWER = 8


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model):
    from mlx_lm import load

    return load(str(tiny_model))


def _request(tokenizer, tokens: np.ndarray, tenant: str = "") -> Running:
    job = cmd.Generate(worker_pb2.WorkerGenerateRequest(tenant=tenant), emit=lambda ev: None)
    return Running(job=job, tokens=tokens, bank_key=("", "test"), session=None, cached=0,
                   source=api_pb2.CACHE_SOURCE_NONE, known=0, started=time.monotonic(),
                   stops=[], detok=tokenizer.detokenizer,
                   decoding=Decoding(make_request_sampler(0.0, 0.0, None)))


def _scheduler(model, tokenizer, chunk: int, **kw) -> BatchScheduler:
    return BatchScheduler(model, max_active=4, eos_token_ids=[], decode=tokenizer.decode,
                          prefill_step_tokens=chunk, **kw)


def _drain(s: BatchScheduler) -> list[Running]:
    ended = []
    while s:
        ended += [r for r, _ in s.step()]
    return ended


def _alone(model, tokenizer, tokens: np.ndarray, n: int = ANSWER) -> list[int]:
    from mlx_lm.models.cache import make_prompt_cache

    s = _scheduler(model, tokenizer, chunk=64)
    r = _request(tokenizer, tokens)
    s.add(r, make_prompt_cache(model), n)
    _drain(s)
    return r.completion


def _tokens(tokenizer, rng, n: int) -> np.ndarray:
    return rng.integers(256, tokenizer.vocab_size, size=n, dtype=np.uint32)


def test_a_short_prompt_that_arrives_during_a_long_one_is_read_first(model_and_tokenizer):
    """A reads a 300-token prompt in 64-token chunks; B (20 tokens) arrives after A's first
    chunk and gets its first token at the next step, while A is still reading. B's answer
    waits for A's prompt, then both decode in the batch; both answer exactly as alone."""
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = model_and_tokenizer
    rng = np.random.default_rng(1)
    a_tokens, b_tokens = _tokens(tokenizer, rng, 300), _tokens(tokenizer, rng, 20)
    s = _scheduler(model, tokenizer, chunk=64)
    a, b = _request(tokenizer, a_tokens), _request(tokenizer, b_tokens)
    s.add(a, make_prompt_cache(model), ANSWER)
    assert s.step() == [] and a.first_token_at is None  # A's first chunk
    s.add(b, make_prompt_cache(model), ANSWER)
    s.step()
    assert b.first_token_at is not None and a.first_token_at is None
    ended = _drain(s)

    assert sorted(map(id, ended)) == sorted([id(a), id(b)])
    assert a.completion == _alone(model, tokenizer, a_tokens)
    assert b.completion == _alone(model, tokenizer, b_tokens)


def test_a_request_that_comes_while_the_batch_decodes_is_read_in_that_step(
        model_and_tokenizer):
    """Tenant a's answer decodes while c's long prompt is read in chunks beside it; b's short
    request comes during a step's decode (the engine adds it `between` the decode and the
    chunk) and gets its first token in that same step, c's chunk waiting one step.
    Before, it was read a step later, after a's chunk: on this CPU a decode, a shared chunk
    of 0.15 s and its own forward before its first token (bench tenants full_queue)."""
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = model_and_tokenizer
    rng = np.random.default_rng(21)
    s = _scheduler(model, tokenizer, chunk=64)
    answer = _request(tokenizer, _tokens(tokenizer, rng, 30), tenant="a")
    s.add(answer, make_prompt_cache(model), 40)
    while answer.first_token_at is None:
        s.step()
    long = _request(tokenizer, _tokens(tokenizer, rng, 640), tenant="c")
    s.add(long, make_prompt_cache(model), 1)
    s.step()
    s.step()  # c's long prompt is read a chunk a step beside a's answer
    b_tokens = _tokens(tokenizer, rng, 12)
    b = _request(tokenizer, b_tokens, tenant="b")
    decoded = len(answer.completion)
    s.step(between=lambda: s.add(b, make_prompt_cache(model), ANSWER))
    assert len(answer.completion) == decoded + 1  # the decode ran first
    assert b.first_token_at is not None and long.first_token_at is None
    _drain(s)
    assert b.completion == _alone(model, tokenizer, b_tokens)


def test_a_long_prompt_is_not_starved_by_short_ones(model_and_tokenizer):
    """A short prompt arrives before every step, each ahead of the long one by its length;
    the long one still gets its first token within twice its own number of chunks."""
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = model_and_tokenizer
    rng = np.random.default_rng(2)
    s = _scheduler(model, tokenizer, chunk=64)
    long = _request(tokenizer, _tokens(tokenizer, rng, 640))  # 10 chunks
    s.add(long, make_prompt_cache(model), 1)
    ended, steps = [], 0
    while long.first_token_at is None:
        s.add(_request(tokenizer, _tokens(tokenizer, rng, 60)), make_prompt_cache(model), 1)
        ended += [r for r, _ in s.step()]
        steps += 1
        assert steps <= 20, "the long prompt waited behind every short one"
    assert ended, "no short prompt was read before the long one ended"
    assert long in ended and len(long.completion) == 1


def test_equal_prompts_admitted_together_are_read_through_one_after_another(model_and_tokenizer):
    """Four 256-token prompts admitted at once, 256-token chunks (two forwards each: 192
    tokens, then the last 64 with the first token): the first gets its first token after its
    own two forwards, not after all eight (taking turns makes every first token as late as the
    last), and the first tokens come in the order the requests came."""
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = model_and_tokenizer
    rng = np.random.default_rng(4)
    s = _scheduler(model, tokenizer, chunk=256)
    rs = [_request(tokenizer, _tokens(tokenizer, rng, 256)) for _ in range(4)]
    for r in rs:
        s.add(r, make_prompt_cache(model), ANSWER)
    first_at_step = {}
    step = 0
    while s:
        step += 1
        s.step()
        for i, r in enumerate(rs):
            if r.first_token_at is not None:
                first_at_step.setdefault(i, step)
    assert first_at_step[0] == 2
    assert [first_at_step[i] for i in range(4)] == sorted(first_at_step.values())
    assert len(set(first_at_step.values())) == 4


@pytest.mark.parametrize("wait_s, pause_s, pauses", [(60.0, 0.0, True), (0.0, 0.0, False),
                                                     (0.05, 0.1, False)])
def test_an_answer_pauses_while_a_prompt_is_read_at_most_decode_wait_s(
        model_and_tokenizer, wait_s, pause_s, pauses):
    """B answers; A's 300-token prompt comes (five 64-token forwards). With room to wait, B
    takes no token while A is read, then both decode together and end in the same step; with
    `decode_wait_s` 0, or once it has passed since B's last token, B takes one every step and
    ends first. Both answer as alone."""
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = model_and_tokenizer
    rng = np.random.default_rng(11)
    a_tokens, b_tokens = _tokens(tokenizer, rng, 300), _tokens(tokenizer, rng, 20)
    s = _scheduler(model, tokenizer, chunk=64, decode_wait_s=wait_s)
    a, b = _request(tokenizer, a_tokens), _request(tokenizer, b_tokens)
    s.add(b, make_prompt_cache(model), ANSWER)
    s.step()
    assert len(b.completion) == 1
    s.add(a, make_prompt_cache(model), ANSWER)
    b_during = []
    while a.first_token_at is None:
        time.sleep(pause_s)
        s.step()
        b_during.append(len(b.completion))
    assert len(b_during) == 5
    assert b_during == ([1] * 5 if pauses else [2, 3, 4, 5, 6])
    ends = []  # the requests that ended, step by step
    while s:
        ends.append({id(r) for r, _ in s.step()})
    ends = [e for e in ends if e]
    # paused, B was as far as A: the two end in the same step; else B ends first
    assert ends == ([{id(a), id(b)}] if pauses else [{id(b)}, {id(a)}])
    assert a.completion == _alone(model, tokenizer, a_tokens)
    assert b.completion == _alone(model, tokenizer, b_tokens)


def test_another_tenants_request_neither_waits_behind_nor_pauses_for_a_long_prompt(
        model_and_tokenizer):
    """Tenant a reads a 640-token prompt in 256-token chunks (four forwards alone). Tenant b's
    20-token requests come one after another, each when the one before has answered: each gets
    its first token at its first step, its answer takes a token every step although a's prompt
    is being read (decode_wait_s is 60 s: a's own answers would pause), and a's prompt is read
    beside b's, by turns, never starved. All answer as alone. (A shared forward may last
    60 s here: a's chunks stay whole, whatever the machine's speed.)"""
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = model_and_tokenizer
    rng = np.random.default_rng(13)
    s = _scheduler(model, tokenizer, chunk=256, decode_wait_s=60.0, shared_forward_s=60.0)
    a_tokens = _tokens(tokenizer, rng, 640)
    a = _request(tokenizer, a_tokens, tenant="a")
    s.add(a, make_prompt_cache(model), ANSWER)
    s.step()  # a's first forward, alone: a whole chunk
    bs, steps = [], 0
    while a.first_token_at is None:
        if not bs or bs[-1].first_token_at is not None and len(bs[-1].completion) >= 3:
            b = _request(tokenizer, _tokens(tokenizer, rng, 20), tenant="b")
            s.add(b, make_prompt_cache(model), 3)
            bs.append(b)
            before = steps
        s.step()
        steps += 1
        if bs[-1].first_token_at is not None:
            assert len(bs[-1].completion) == steps - before, "b's answer paused or waited"
        assert steps <= 30, "a's prompt was starved"
    # 640 - 256 read alone; the rest (384, of which 64 with the first token) in 256-token
    # chunks: 2 forwards of a's, each beside a step of b's
    assert 2 <= steps <= 6
    _drain(s)
    assert a.completion == _alone(model, tokenizer, a_tokens)
    for b in bs:
        assert b.completion == _alone(model, tokenizer, np.asarray(b.tokens))[:3]


@pytest.mark.parametrize("shared_forward_s", [1e-6, 60.0])
def test_beside_another_tenants_request_a_prompt_forward_lasts_the_shared_time(
        model_and_tokenizer, shared_forward_s):
    """While tenant b runs a request or sent one lately, tenant a's 400-token prompt is read in
    forwards sized to last `shared_forward_s`: where every forward is longer (1 microsecond,
    b's answer streaming), in chunks of the smallest step, so b's next request would wait for
    no more than 8 tokens' forward; where every forward is shorter (60 s, b's answer ended
    just before), in whole chunks. (While b's answer streams, the forwards are also no longer
    than its step: `bench tenants` measures that.) Both answer as alone either way."""
    from mlx_lm.models.cache import make_prompt_cache

    from kvbank.worker.compute.scheduler import MIN_SHARED_STEP

    model, tokenizer = model_and_tokenizer
    rng = np.random.default_rng(17)
    s = _scheduler(model, tokenizer, chunk=128, shared_forward_s=shared_forward_s)
    a_tokens, b_tokens = _tokens(tokenizer, rng, 400), _tokens(tokenizer, rng, 8)
    b = _request(tokenizer, b_tokens, tenant="b")
    s.add(b, make_prompt_cache(model), ANSWER)
    s.step()  # b's prompt: one forward, its first token
    if shared_forward_s > 1:
        _drain(s)  # b sent a request lately: a still shares, but no stream bounds its forwards
    a, a_cache = _request(tokenizer, a_tokens, tenant="a"), make_prompt_cache(model)
    s.add(a, a_cache, ANSWER)
    read = [0]
    while a.first_token_at is None:
        s.step()
        read.append(a_cache[0].offset)
    chunks = [y - x for x, y in zip(read, read[1:])][:-1]  # the last forward: with logits
    assert chunks[0] == 128 // 4  # the first shared chunk, a quarter, is measured
    if shared_forward_s < 1:  # the one before the last forward: what the last leaves
        assert set(chunks[1:-1]) == {MIN_SHARED_STEP} and 0 < chunks[-1] <= MIN_SHARED_STEP
    else:
        assert chunks[1:3] == [128, 128]
    _drain(s)
    assert a.completion == _alone(model, tokenizer, a_tokens)
    assert b.completion == _alone(model, tokenizer, b_tokens)


def test_a_short_prompt_is_one_forward_whatever_the_shared_step(model_and_tokenizer):
    """Beside tenant b's stream, where every forward is longer than the shared time (the
    step at its smallest, 8 tokens), tenant a's new 30-token prompt is still read in one
    forward: its first token comes at its first step (in forwards of 8, 8, 8 and 6 it came
    after four, each behind a step of b's; 0.63 s on this CPU against 0.3 s)."""
    from mlx_lm.models.cache import make_prompt_cache

    from kvbank.worker.compute.scheduler import SHORT_PROMPT_TOKENS

    model, tokenizer = model_and_tokenizer
    rng = np.random.default_rng(29)
    s = _scheduler(model, tokenizer, chunk=64, shared_forward_s=1e-6)
    b = _request(tokenizer, _tokens(tokenizer, rng, 12), tenant="b")
    s.add(b, make_prompt_cache(model), 20)
    s.step()
    a_tokens = _tokens(tokenizer, rng, 30)
    assert 2 * 8 < len(a_tokens) <= SHORT_PROMPT_TOKENS
    a = _request(tokenizer, a_tokens, tenant="a")
    s.add(a, make_prompt_cache(model), ANSWER)
    s.step()
    assert a.first_token_at is not None
    _drain(s)
    assert a.completion == _alone(model, tokenizer, a_tokens)


class _Holding:
    """A test seam for a token that shows its client nothing (real tokenizers hold a lone space
    or part of a character until the next token): the real detokenizer, whose text of the
    tokens numbered in `at` comes out with the token after."""

    def __init__(self, detok):
        self.detok, self.at, self.n, self._held = detok, set(), 0, ""

    def add_token(self, token: int) -> None:
        self.n += 1
        self.detok.add_token(token)

    def finalize(self) -> None:
        self.detok.finalize()

    @property
    def last_segment(self) -> str:
        text, self._held = self._held + self.detok.last_segment, ""
        if self.n in self.at:
            text, self._held = "", text
        return text


def test_no_prompt_chunk_in_a_step_whose_text_another_tenants_client_waits_for(
        model_and_tokenizer):
    """Tenant b streams beside tenant a's answer while a's long prompt is read in chunks. Some
    of b's tokens show its client nothing (`_Holding`): it sees their text with b's next
    token, two steps apart. In the step of each such token a's chunk waits (else b's text
    would come three steps' time apart), unless a's prompt waited the two steps before. b's
    text and every answer are as alone."""
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = model_and_tokenizer
    rng = np.random.default_rng(31)
    b_tokens = _tokens(tokenizer, rng, 24)
    s = _scheduler(model, tokenizer, chunk=16, decode_wait_s=0.0)
    a1_tokens, a2_tokens = _tokens(tokenizer, rng, 20), _tokens(tokenizer, rng, 400)
    a1 = _request(tokenizer, a1_tokens, tenant="a")
    b = _request(tokenizer, b_tokens, tenant="b")
    b.detok = _Holding(b.detok)
    s.add(a1, make_prompt_cache(model), 60)
    s.add(b, make_prompt_cache(model), 30)
    while b.uid < 0 or a1.uid < 0:
        s.step()
    a2, a2_cache = _request(tokenizer, a2_tokens, tenant="a"), make_prompt_cache(model)
    s.add(a2, a2_cache, 1)
    s.step()
    n = len(b.completion)
    b.detok.at = {n + 4, n + 9, n + 11}  # the last two steps apart: the second after a wait
    offsets, held = [a2_cache[0].offset], []
    while b.uid in s.running:
        s.step()
        offsets.append(a2_cache[0].offset)
        held.append(b.quiet == 1)
    read = [y > x for x, y in zip(offsets, offsets[1:])]
    assert [i for i, h in enumerate(held) if h] == [3, 8, 10]  # one token a step
    assert not read[3] and not read[8] and not read[10]
    assert read[2] and read[4] and read[9], "a's prompt was not read beside b"
    _drain(s)
    alone, detok = _alone(model, tokenizer, b_tokens, 30), tokenizer.detokenizer
    for t in alone:
        detok.add_token(t)
    detok.finalize()
    assert b.completion == alone and b.text == detok.text
    assert a1.completion == _alone(model, tokenizer, a1_tokens, 60)


def test_a_cancelled_reader_leaves_and_the_others_go_on(model_and_tokenizer):
    """B's client goes away while its prompt is read beside A's: B leaves at once (not
    committed), A answers as alone."""
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = model_and_tokenizer
    rng = np.random.default_rng(7)
    a_tokens = _tokens(tokenizer, rng, 200)
    s = _scheduler(model, tokenizer, chunk=64)
    a, b = _request(tokenizer, a_tokens), _request(tokenizer, _tokens(tokenizer, rng, 200))
    s.add(a, make_prompt_cache(model), ANSWER)
    s.add(b, make_prompt_cache(model), ANSWER)
    s.step()
    b.job.cancelled.set()
    assert s.take_cancelled() == [b] and b.uid not in s.running
    assert _drain(s) == [a] and a.completion == _alone(model, tokenizer, a_tokens)


def test_a_request_whose_forward_fails_fails_alone(model_and_tokenizer):
    """B's sampler raises (a failing forward); B comes out of `take_failed` with the error,
    A, reading beside it, answers as alone."""
    from mlx_lm.models.cache import make_prompt_cache

    def failing_sampler(logprobs):
        raise RuntimeError("sampler failed")

    model, tokenizer = model_and_tokenizer
    rng = np.random.default_rng(9)
    a_tokens = _tokens(tokenizer, rng, 150)
    s = _scheduler(model, tokenizer, chunk=64)
    a, b = _request(tokenizer, a_tokens), _request(tokenizer, _tokens(tokenizer, rng, 30))
    b.decoding = Decoding(failing_sampler)
    s.add(a, make_prompt_cache(model), ANSWER)
    s.add(b, make_prompt_cache(model), ANSWER)
    ended, failed = [], []
    while s:
        ended += [r for r, _ in s.step()]
        failed += s.take_failed()
    assert [(r, str(e)) for r, e in failed] == [(b, "sampler failed")]
    assert ended == [a] and a.completion == _alone(model, tokenizer, a_tokens)


@pytest.mark.parametrize("max_tokens", [1, ANSWER])
def test_a_first_token_is_sent_before_the_next_forward_starts(
        model_and_tokenizer, monkeypatch, max_tokens):
    """The first token leaves before the forward after it (the next decode token, or the one
    that puts a one-token answer into the cache) takes the cores: the scheduler pauses
    `HANDOFF_S` once per answer, after its first token, and not after the later ones."""
    import kvbank.worker.compute.scheduler as scheduler
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = model_and_tokenizer
    timeline: list[tuple[str, float]] = []

    class Recorded:
        def __call__(self, *args, **kwargs):
            timeline.append(("forward", time.monotonic()))
            return model(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(model, name)

    pauses: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(scheduler.time, "sleep", lambda s: (pauses.append(s), real_sleep(s)))
    s = BatchScheduler(Recorded(), max_active=4, eos_token_ids=[], decode=tokenizer.decode,
                       prefill_step_tokens=64)
    tokens = _tokens(tokenizer, np.random.default_rng(3), 20)
    r = _request(tokenizer, tokens)
    r.job.emit = lambda ev: timeline.append(("token", time.monotonic()))
    s.add(r, make_prompt_cache(model), max_tokens)
    _drain(s)

    kinds = [k for k, _ in timeline]
    first = kinds.index("token")
    assert kinds[first + 1] == "forward"  # a forward follows the first token in both cases
    assert timeline[first + 1][1] - timeline[first][1] >= scheduler.HANDOFF_S
    assert pauses == [scheduler.HANDOFF_S]
    assert len(r.completion) == max_tokens
    assert r.completion == _alone(model, tokenizer, tokens)[:max_tokens]


def test_answers_whose_contexts_are_far_apart_decode_on_their_own_caches(model_and_tokenizer):
    """With `own_lead_tokens` 128: S (20 tokens) answers; L (300) reads its prompt and then
    decodes on its own cache beside S, not batched with it (no padding to 300, no merge);
    T (30), close to S, joins S in the batch, L still on its own. All three answer as alone."""
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = model_and_tokenizer
    rng = np.random.default_rng(12)
    s_tokens, l_tokens, t_tokens = (_tokens(tokenizer, rng, n) for n in (20, 300, 30))
    s = _scheduler(model, tokenizer, chunk=64, own_lead_tokens=128)
    short, long_, third = (_request(tokenizer, t) for t in (s_tokens, l_tokens, t_tokens))
    s.add(short, make_prompt_cache(model), ANSWER)
    s.step()
    s.add(long_, make_prompt_cache(model), ANSWER)
    while long_.first_token_at is None:
        s.step()
    s.step()
    assert len(long_.completion) == 2 and len(short.completion) == 2
    assert short.uid < 0 and long_.uid < 0  # both on their own caches: no batch
    s.add(third, make_prompt_cache(model), ANSWER)
    s.step()
    assert third.first_token_at is not None
    assert short.uid >= 0 and third.uid >= 0 and long_.uid < 0  # S and T batched, L alone
    assert sorted(map(id, _drain(s))) == sorted(map(id, [short, long_, third]))
    for r, tokens in ((short, s_tokens), (long_, l_tokens), (third, t_tokens)):
        assert r.completion == _alone(model, tokenizer, tokens)


def test_an_answer_that_joins_the_batch_takes_a_token_at_every_step(model_and_tokenizer):
    """S answers alone on its own cache; T's prompt is read and both join mlx-lm's batch. On
    a CPU every step from then on gives each of them a token: none waits a step for mlx-lm
    to hand out what it computed (an answer joining a batch waited two steps for its next
    token so). Each ends at the step after its last token; both answer as alone."""
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = model_and_tokenizer
    rng = np.random.default_rng(23)
    s_tokens, t_tokens = _tokens(tokenizer, rng, 20), _tokens(tokenizer, rng, 30)
    s = _scheduler(model, tokenizer, chunk=64, decode_wait_s=0.0)  # S never pauses for T
    assert s.takes_ahead  # this suite runs on a CPU
    short, third = _request(tokenizer, s_tokens), _request(tokenizer, t_tokens)
    s.add(short, make_prompt_cache(model), ANSWER)
    s.step()
    s.add(third, make_prompt_cache(model), ANSWER)
    s.step()  # T's prompt and first token; S's second, on its own cache; then they join
    assert (len(short.completion), len(third.completion)) == (2, 1)
    counts, ended = [], []
    while s:
        ended.append({id(r) for r, _ in s.step()})
        counts.append((len(short.completion), len(third.completion)))
        assert short.uid >= 0 and third.uid >= 0 or not s  # batched
    assert counts[:ANSWER - 2] == [(3 + i, 2 + i) for i in range(ANSWER - 2)]
    # S's last token came a step before T's: each ends the step after its last token
    assert ended[ANSWER - 2:] == [{id(short)}, {id(third)}]
    for r, tokens in ((short, s_tokens), (third, t_tokens)):
        assert r.completion == _alone(model, tokenizer, tokens)


def test_a_stop_string_in_a_token_taken_ahead_ends_the_answer_there(model_and_tokenizer):
    """In the batch a token is taken as soon as it is computed: a stop string it completes
    ends the answer at that token, as on its own cache. (This prompt's answer repeats one
    word: the stop string is four of them.)"""
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = model_and_tokenizer
    rng = np.random.default_rng(25)
    a_tokens, b_tokens = _tokens(tokenizer, rng, 20), _tokens(tokenizer, rng, 24)
    alone = _alone(model, tokenizer, b_tokens)
    stop = tokenizer.decode(alone[:4])
    assert stop not in tokenizer.decode(alone[:3])
    s = _scheduler(model, tokenizer, chunk=64)
    a, b = _request(tokenizer, a_tokens), _request(tokenizer, b_tokens)
    b.stops = [stop]
    s.add(a, make_prompt_cache(model), ANSWER)
    s.add(b, make_prompt_cache(model), ANSWER)
    while b.uid < 0:
        s.step()
    assert len(b.completion) < 4  # the rest comes from the batch
    ended = _drain(s)
    assert b.finish == api_pb2.FINISH_REASON_STOP and b.completion == alone[:4]
    assert b.stop_sequence == stop and b.sent == 0 and b in ended  # nothing of it sent
    assert a.completion == _alone(model, tokenizer, a_tokens)


def test_answers_with_no_memory_for_the_joins_copy_decode_beside_each_other(
        model_and_tokenizer):
    """Joining the batch copies every joining cache (mlx-lm's merge), so the engine is asked
    first (`may_join`, its memory for the copy). Refused, two close answers each decode on
    their own cache, and still answer exactly as alone; allowed, they join."""
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = model_and_tokenizer
    rng = np.random.default_rng(14)
    a_tokens, b_tokens = _tokens(tokenizer, rng, 40), _tokens(tokenizer, rng, 50)
    for allowed in (False, True):
        asked = []
        s = _scheduler(model, tokenizer, chunk=64,
                       may_join=lambda joining: asked.append(len(joining)) or allowed)
        a, b = _request(tokenizer, a_tokens), _request(tokenizer, b_tokens)
        s.add(a, make_prompt_cache(model), ANSWER)
        s.add(b, make_prompt_cache(model), ANSWER)
        while b.first_token_at is None or a.first_token_at is None:
            s.step()
        assert asked == [2]  # the second answer would start a batch with the first
        assert (a.uid >= 0 and b.uid >= 0) if allowed else (a.uid < 0 and b.uid < 0)
        _drain(s)
        assert a.completion == _alone(model, tokenizer, a_tokens)
        assert b.completion == _alone(model, tokenizer, b_tokens)


def test_answers_refused_the_join_join_later_as_many_as_memory_allows_and_answer_as_alone(
        model_and_tokenizer):
    """Answers refused the join's copy decode beside each other; asked again later (the
    engine asks once its ledger falls: a prompt read, writes landed), as many join mid-answer
    as the memory allows (here two of three, then the third), and each still answers exactly
    as alone. Before, they decoded beside each other to their ends, a forward each a step
    (bench compare n-agents at 1.3 GB: twice the decode time)."""
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = model_and_tokenizer
    rng = np.random.default_rng(15)
    tokens = [_tokens(tokenizer, rng, n) for n in (40, 50, 45)]
    room = [0]  # how many answers' copies the memory holds
    asked = []
    s = _scheduler(model, tokenizer, chunk=64,
                   may_join=lambda joining: asked.append(len(joining)) or len(joining) <= room[0])
    rs = [_request(tokenizer, t) for t in tokens]
    for r in rs:
        s.add(r, make_prompt_cache(model), ANSWER)
    while any(r.first_token_at is None for r in rs):
        s.step()
    s.step()
    assert all(r.uid < 0 and len(r.completion) < ANSWER for r in rs)
    asked.clear()
    assert not s.join_beside()  # still refused, three, two, then one to start a batch
    assert asked == [3, 2, 1]
    room[0] = 2
    assert s.join_beside()
    assert sorted(r.uid >= 0 for r in rs) == [False, True, True]
    room[0] = 0
    assert not s.join_beside()  # the third: no room for its copy yet
    room[0] = 1
    assert s.join_beside()  # one at a time, into the batch
    assert all(r.uid >= 0 for r in rs)
    _drain(s)
    for r, t in zip(rs, tokens):
        assert r.completion == _alone(model, tokenizer, t)
