"""A restore from SSD runs beside the decode batch (issue #35): real processes, MLX, LMDB.

The worker's test seam (`KVBANK_TEST_HOLD_RESTORE`, worker/tiers/restore_threads.py) holds a restore's
read on its thread until the test releases it, so the test sees, by events and never by
time, that a streaming request kept receiving tokens while another conversation's restore
was in flight; then that the restored conversation answers as from scratch (greedy), and
that a request cancelled while its restore is held ends cleanly; and that a prefetch hint's
read runs the same way, its conversation's request waiting for it.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvbank.apps.bench.restore import Stream
from kvbank.v1 import api_pb2
from tests.conftest import start_stack
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def held_stack(tiny_model, tmp_path_factory, cache_dir):
    hold = tmp_path_factory.mktemp("hold")
    s = start_stack(tiny_model, tmp_path_factory.mktemp("bg") / "data", cache_dir=cache_dir,
                    shim=False, env={"KVBANK_TEST_HOLD_RESTORE": str(hold),
                                     "KVBANK_RESTORE_THREAD_MIN_BYTES": "0"})
    s.hold = hold
    yield s
    (hold / "release").touch()
    s.stop()


def _armed(s):
    """The seam's folder, cleared: the next read on a thread is held until `release`."""
    for name in ("release", "held"):
        (s.hold / name).unlink(missing_ok=True)
    return s.hold


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1000, 20000, n).tolist()


def _on_ssd_only(c, s, name: str, n: int, seed: int) -> list[int]:
    """A conversation of `n` tokens, written out and gone from RAM: its history."""
    c.generate(session_id=name, token_ids=_tokens(n, seed), append=True, max_tokens=4)
    s.wait_durable(name)
    c.release(name)
    return list(c.get_session(name).token_ids)


def _metric(s, name: str, **labels) -> float:
    text = httpx.get(s.metrics_url("worker"), timeout=10).text
    return sum(m.value for f in text_string_to_metric_families(text) for m in f.samples
               if m.name == name and all(m.labels.get(k) == v for k, v in labels.items()))


def test_a_request_keeps_decoding_while_another_restores_from_ssd(held_stack):
    s, hold = held_stack, _armed(held_stack)
    with s.client() as c:
        history = _on_ssd_only(c, s, "long", 300, seed=1)
        streaming = Stream(c, session_id="streaming", token_ids=_tokens(40, seed=2),
                           max_tokens=800)
        wait_until(lambda: streaming.tokens, "the streaming request's first token")
        prompt = history + _tokens(8, seed=3)
        returning = Stream(c, session_id="long", token_ids=prompt, max_tokens=6)
        wait_until((hold / "held").exists, "the returning conversation's restore to be held")
        n0 = len(streaming.tokens)
        wait_until(lambda: len(streaming.tokens) >= n0 + 30,
                   "30 more tokens streamed while the restore is held")
        assert returning.usage is None and streaming.usage is None  # both still running
        assert c.status().running_requests == 2  # the held one counts as running
        (hold / "release").touch()
        returning.ended.wait(60)
        assert returning.usage is not None
        assert returning.usage.cache_source == api_pb2.CACHE_SOURCE_SSD
        assert returning.usage.cached_tokens > 0
        scratch = c.generate(token_ids=prompt, max_tokens=6, no_cache=True)
        assert returning.tokens == scratch.token_ids
        streaming.ended.wait(120)
        alone = c.generate(token_ids=_tokens(40, seed=2), max_tokens=800, no_cache=True)
        assert streaming.tokens == alone.token_ids  # the restore beside it changed nothing
    assert _metric(s, "kvbank_worker_restore_stall_seconds_count", where="thread") >= 1


def test_a_request_cancelled_while_its_restore_is_in_flight_ends_cleanly(held_stack):
    s, hold = held_stack, _armed(held_stack)
    with s.client() as c:
        history = _on_ssd_only(c, s, "gone", 200, seed=4)
        prompt = history + _tokens(8, seed=5)
        going = Stream(c, session_id="gone", token_ids=prompt, max_tokens=6)
        wait_until((hold / "held").exists, "the restore to be held")
        assert c.status().running_requests == 1
        going.call.cancel()
        wait_until(lambda: c.status().running_requests == 0,
                   "the cancelled request to leave while its restore is held")
        assert list(c.get_session("gone").token_ids) == history  # the turn never committed
        (hold / "release").touch()
        t = c.generate(session_id="gone", token_ids=prompt, max_tokens=6)
        assert t.usage["cache_source"] == "ssd" and t.usage["cached_tokens"] > 0
        assert t.token_ids == c.generate(token_ids=prompt, max_tokens=6, no_cache=True).token_ids


def test_a_hints_read_runs_beside_the_batch_and_its_conversation_waits_for_it(held_stack):
    s, hold = held_stack, _armed(held_stack)
    with s.client() as c:
        history = _on_ssd_only(c, s, "hinted", 300, seed=6)
        hint = c.prefetch(session_id="hinted")
        assert hint.status == "restoring" and hint.ssd_tokens >= 256, hint  # answered at once
        wait_until((hold / "held").exists, "the hint's read to be held")
        other = c.generate(session_id="other", token_ids=_tokens(20, seed=7), max_tokens=5)
        assert len(other.token_ids) == 5  # served while the hint reads
        prompt = history + _tokens(8, seed=8)
        returning = Stream(c, session_id="hinted", token_ids=prompt, max_tokens=6)
        wait_until(lambda: c.status().waiting_requests == 1,
                   "the hinted conversation's request to wait for the hint's read")
        assert c.status().running_requests == 0  # it reserved nothing, read nothing
        (hold / "release").touch()
        returning.ended.wait(60)
        assert returning.usage is not None
        assert returning.usage.cache_source == api_pb2.CACHE_SOURCE_RAM  # the hint's read
        assert returning.usage.cached_tokens >= 256
        assert returning.tokens == c.generate(token_ids=prompt, max_tokens=6,
                                              no_cache=True).token_ids
    assert _metric(s, "kvbank_prefetched_tokens_total") >= 256


def test_bench_restore_runs_and_reports_the_gaps(tiny_model):
    """`kvbank bench restore` (README), with tiny settings: the gaps before, during, after."""
    from kvbank.apps.bench import restore

    got = restore.run(model=tiny_model, tokens=400, repeats=1, around=8, stream_tokens=1200)
    assert got["restored_tokens"] >= 256, got  # from SSD: at least its first whole block
    assert got["gaps_during"] >= 1 and got["gap_before_p50_ms"] > 0, got
