"""Speculative decoding with the model's MTP head, as a user of `kvbank up --mtp auto` meets it:
one stack serving the tiny qwen3_5 whose head was trained to draft its own trunk's tokens
(kvbank/testing/tiny_mtp.py), so that drafts are kept, rejected, and kept in part.

Its answers equal decoding without MTP (the worker's own forwards replayed with mlx-lm, one
token at a time: tokens equal, logprobs within 1e-4) on an unnamed conversation from scratch,
from RAM, from SSD after a release and after a kill -9 of the worker; the head's history
comes back with the conversation; four agents at once answer as each alone; usage says what
the head drafted and the model kept; a request with a history-dependent processor (a
penalty) decodes without drafts.
"""

from __future__ import annotations

import pytest

from tests.conftest import start_stack
from tests.test_model_kinds import MAX_TOKENS, Reference, _check, send_back

DEPTH = 2


@pytest.fixture(scope="module")
def served(tmp_path_factory, cache_dir):
    from kvbank.testing.tiny_mtp import mtp_model

    model = mtp_model("tiny", cache_dir)
    s = start_stack(model, tmp_path_factory.mktemp("mtp") / "data", cache_dir=cache_dir,
                    extra=["--mtp", "auto", "--mtp-depth", str(DEPTH)])
    yield model, s
    s.stop()


def test_the_start_log_and_status_say_mtp_is_on_with_its_depth(served):
    _, s = served
    assert f"MTP on: depth {DEPTH}" in s.log.read_text(errors="replace")
    with s.client() as c:
        assert c.status().mtp.startswith(f"on, depth {DEPTH}: "), c.status().mtp


def test_speculative_answers_equal_plain_decoding_from_scratch_ram_ssd_and_after_kill_9(served):
    """Four unnamed turns; each answer is the worker's forwards without MTP, replayed."""
    model, s = served
    ref = Reference(model)
    messages = [{"role": "user", "content": "Count on from the parser's line numbers."}]
    session, drafted, accepted = None, 0, 0
    for turn, where in enumerate(("first", "ram", "ssd after a release", "ssd after kill -9")):
        with s.client() as c:
            send_back(s, c, session, where)
            prompt = c.render(messages=messages, max_tokens=MAX_TOKENS)
            got = c.generate(messages=messages, max_tokens=MAX_TOKENS, logprobs=True)
        session = got.usage["session_id"]
        assert got.usage["cache_source"] == ("none" if turn == 0 else where.split()[0])
        _check(ref, got, prompt, ref.prompts.checkpoints(messages, prompt), True,
               f"turn {turn} ({where})", unsplit=False)
        u = got.usage
        assert u["accepted_tokens"] <= u["drafted_tokens"] <= DEPTH * u["completion_tokens"]
        drafted, accepted = drafted + u["drafted_tokens"], accepted + u["accepted_tokens"]
        messages += [{"role": "assistant", "content": got.text},
                     {"role": "user", "content": f"And on from line {turn + 2}."}]
    assert drafted and accepted, "the trained head drafted nothing the model kept"


def test_usage_reports_drafts_and_a_penalty_decodes_without_them(served):
    """OpenAI's SDK, as an agent calls it: usage.kvbank has the drafted and accepted tokens;
    a frequency penalty reads the answer's history, so that request does not speculate; a
    seeded sampled request drafts and gives the same answer twice."""
    import openai

    _, s = served
    client = openai.OpenAI(base_url=s.shim_url + "/v1", api_key="none", max_retries=0)
    ask = [{"role": "user", "content": "Number the tests from one."}]
    plain = client.chat.completions.create(model="kvbank", messages=ask, max_tokens=24,
                                           temperature=0)
    mtp = plain.usage.model_extra["kvbank"]
    assert mtp["drafted_tokens"] > 0 and 0 <= mtp["accepted_tokens"] <= mtp["drafted_tokens"]
    penalized = client.chat.completions.create(model="kvbank", messages=ask, max_tokens=24,
                                               temperature=0, frequency_penalty=0.5)
    assert penalized.usage.model_extra["kvbank"]["drafted_tokens"] == 0
    sampled = [client.chat.completions.create(model="kvbank", messages=ask, max_tokens=24,
                                              temperature=0.7, top_p=0.9, seed=5)
               for _ in range(2)]  # the speculative-sampling rule, seeded: reproducible
    assert sampled[0].choices[0].message == sampled[1].choices[0].message
    assert sampled[0].usage.model_extra["kvbank"]["drafted_tokens"] > 0


def test_a_conversation_restored_from_ram_or_ssd_drafts_as_one_read_whole(served):
    """The head's history is part of the conversation. Two copies of one conversation, each
    read from scratch, then a second turn that appends to it: one from RAM, one from SSD after
    a release (the RAM copy is released after its turn, so the other finds neither in RAM).
    Both answer and draft as a third request that reads the whole second prompt from scratch,
    its head folding every pair: the same tokens, the same drafts kept."""
    _, s = served
    turns = {}
    for name, where in (("mtp-kept", "ram"), ("mtp-released", "ssd after a release")):
        with s.client() as c:
            prompt = c.render(messages=[{"role": "user", "content": "Walk the call graph."}])
            one = c.generate(session_id=name, token_ids=prompt, max_tokens=MAX_TOKENS,
                             no_cache=True)
            send_back(s, c, name, where)
            turns[where] = two = c.generate(session_id=name, token_ids=[700, 701, 702],
                                            append=True, max_tokens=MAX_TOKENS)
            c.release(name)
        assert two.usage["cache_source"] == where.split()[0], two.usage
        assert two.usage["cached_tokens"] >= len(prompt) + len(one.token_ids), two.usage
    with s.client() as c:
        whole = c.generate(session_id="mtp-whole", no_cache=True, max_tokens=MAX_TOKENS,
                           token_ids=prompt + one.token_ids + [700, 701, 702])
    for where, got in turns.items():
        assert got.token_ids == whole.token_ids, where
        assert got.usage["drafted_tokens"] == whole.usage["drafted_tokens"] > 0, where
        assert got.usage["accepted_tokens"] == whole.usage["accepted_tokens"], (
            where, got.usage, whole.usage)


def test_four_agents_at_once_answer_as_each_alone(served):
    """Four requests decoding together (each drafts only while it decodes alone, then decodes
    beside the others or in mlx-lm's batch) answer as each does alone, and all four finish."""
    from concurrent.futures import ThreadPoolExecutor

    _, s = served
    prompts = [[300 + 50 * i + j for j in range(12)] for i in range(4)]

    def ask(prompt):
        with s.client() as c:
            return c.generate(token_ids=prompt, max_tokens=MAX_TOKENS, no_cache=True,
                              timeout_s=120)

    alone = [ask(p) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(ask, prompts))
    for a, t in zip(alone, together):
        assert t.token_ids == a.token_ids
    assert sum(a.usage["drafted_tokens"] for a in alone) > 0


@pytest.mark.matrix  # make test-all: two more stacks (~18 s under the suite's load);
# tests/test_mtp.py checks the same blocks through LMDB and the restorer in `make test`
def test_a_conversation_kept_with_mtp_off_returns_from_ssd_with_it_on(tmp_path, cache_dir):
    """A user who turns MTP on keeps the conversations kept without it: written by a stack
    with `--mtp off`, the next turn on a `--mtp auto` stack over the same data restores from
    SSD (not recomputed), answers as the plain stack did reading the whole prompt (tokens
    equal, logprobs within 1e-4), drafts over the part the head never saw, and the worker
    counts those tokens."""
    import httpx
    import numpy as np

    from kvbank.testing.tiny_mtp import mtp_model

    model, data = mtp_model("tiny", cache_dir), tmp_path / "data"
    s = start_stack(model, data, cache_dir=cache_dir, extra=["--mtp", "off"])
    try:
        with s.client() as c:
            prompt = c.render(messages=[{"role": "user", "content": "Walk the call graph."}])
            one = c.generate(session_id="kept", token_ids=prompt, max_tokens=MAX_TOKENS)
            history = prompt + one.token_ids + [700, 701, 702]
            plain = c.generate(session_id="plain", token_ids=history, no_cache=True,
                               max_tokens=MAX_TOKENS, logprobs=True)
            c.release("kept")  # written out first: on SSD, then out of RAM
    finally:
        s.stop()
    s = start_stack(model, data, cache_dir=cache_dir, extra=["--mtp", "auto"])
    try:
        with s.client() as c:
            two = c.generate(session_id="kept", token_ids=[700, 701, 702], append=True,
                             max_tokens=MAX_TOKENS, logprobs=True)
        assert two.usage["cache_source"] == "ssd", two.usage
        assert two.usage["cached_tokens"] >= len(prompt) + len(one.token_ids), two.usage
        assert two.token_ids == plain.token_ids
        assert np.abs(np.subtract(two.logprobs, plain.logprobs)).max() < 1e-4
        assert two.usage["drafted_tokens"] > 0, two.usage
        text = httpx.get(s.metrics_url("worker"), timeout=10).text
        missing = [line for line in text.splitlines()
                   if line.startswith("kvbank_mtp_history_missing_tokens_total ")]
        assert missing and float(missing[0].split()[1]) >= two.usage["cached_tokens"], missing
    finally:
        s.stop()


@pytest.mark.matrix  # make test-all: two more stacks; the fallback itself is checked above
def test_bench_decode_agents_drafts_alone_and_falls_back_to_plain_together(tmp_path, cache_dir):
    """`kvbank bench decode --mtp --agents 1,2` on the tiny trained head: one request alone
    drafts, two at once decode plainly (the fallback), and every answer equals the same
    request's without the head."""
    from kvbank.apps.bench.components.decode import run_agents
    from kvbank.testing.tiny_mtp import mtp_model

    r = run_agents(model_dir=mtp_model("tiny", cache_dir), agents=[1, 2], depth=2, tokens=12,
                   prompt_tokens=16, repeats=1, argv=["kvbank", "bench", "decode"])
    assert r["same_tokens"] is True
    assert r["agents"]["1"]["drafted_tokens"] > 0 and r["agents"]["1"]["accepted_tokens"] > 0
    assert r["agents"]["2"]["drafted_tokens"] == 0
    assert all(x > 0 for n in ("1", "2") for x in r["agents"][n]["mtp_tok_s"]
               + r["agents"][n]["plain_tok_s"])
    assert r["not_slower"] in (True, False) and r["loadavg_end"]
