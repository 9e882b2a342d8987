"""Admission, the pressure guard and the scheduler modes, on real processes (tiny model).

Pressure is injected through the admin RPC; memory budgets are set small with the `+N` form
(N bytes for KV beyond the model and one prefill chunk), and the idle lane is kept from
writing (huge quiet grace and staleness) so a test decides what is on SSD (`flush`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import grpc
import httpx
import numpy as np
import pytest

from tests.conftest import rpc_error, start_stack
from tests.waiting import wait_until
from kvbank.contracts.pricing import Pricing

NO_IDLE_WRITES = ["--quiet-grace-s", "3600", "--max-dirty-s", "3600"]


def _stack(tiny_model, tmp_path, cache_dir, *extra):
    return start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir, shim=False,
                       extra=[*NO_IDLE_WRITES, *extra])


def _turn(c, session, n_tokens, seed, max_tokens=4, **kw):
    toks = np.random.default_rng(seed).integers(1000, 20000, n_tokens).tolist()
    return c.generate(session_id=session, token_ids=toks, append=True, max_tokens=max_tokens,
                      **kw)


def _receipts(c, kind):
    return [r for r in map(json.loads, c.status().recent_receipts_json) if r.get("kind") == kind]


def _wait_receipt(c, kind, n=1, timeout_s=60):
    def enough():
        got = _receipts(c, kind)
        return got if len(got) >= n else None

    return wait_until(enough, f"{n} {kind} receipt(s)", timeout_s=timeout_s, every_s=0.1)[-1]


def _sessions(c):
    return {s.session_id: s for s in c.list_sessions()}


LONG_ANSWER = 600  # tokens: seconds of decoding, for the one RPC each test sends meanwhile


def _long_request(stack, session, n_tokens, seed) -> tuple[threading.Thread, dict]:
    """A long answer (LONG_ANSWER tokens) running in a thread, returned once it streams; the
    dict gets its turn and the time it ended."""
    first_text, done = threading.Event(), {}

    def run():
        with stack.client() as c2:
            done["turn"] = _turn(c2, session, n_tokens, seed=seed, max_tokens=LONG_ANSWER,
                                 on_text=lambda _: first_text.set())
            done["at"] = time.time()

    t = threading.Thread(target=run)
    t.start()
    assert first_text.wait(60), "the long request never streamed"
    return t, done


@pytest.fixture
def idle_stack(tiny_model, tmp_path, cache_dir):
    """The default active pin (600 s): every conversation here was used a moment ago, and
    still a pressure trim may take it once its request has ended (the pin orders the LRU; it
    does not veto a trim)."""
    s = _stack(tiny_model, tmp_path, cache_dir)
    yield s
    s.stop()


def test_warning_keeps_an_unwritten_conversation_and_takes_one_on_ssd(idle_stack):
    with idle_stack.client() as c:
        _turn(c, "on-ssd", 40, seed=1)
        assert c.flush().written_entries == 1
        _turn(c, "unwritten", 400, seed=2)
        before = _sessions(c)
        assert before["on-ssd"].state == "resident-clean"
        assert before["unwritten"].state == "resident-dirty"

        assert c.set_pressure("warning").source == "injected"
        r = _wait_receipt(c, "pressure_trim")
        assert r["level"] == "warning" and r["source"] == "injected"
        assert r["bank_entries_evicted"] == 1 and r["bank_unwritten_kept"] == 1
        assert r["bank_unwritten_dropped"] == 0
        after = _sessions(c)
        assert after["on-ssd"].state == "cold" and after["on-ssd"].ram_bytes == 0
        assert after["unwritten"].state == "resident-dirty"
        assert after["unwritten"].ram_bytes == before["unwritten"].ram_bytes
        # The conversation that left RAM comes back from SSD, whole.
        t = _turn(c, "on-ssd", 8, seed=3)
        assert t.usage["cache_source"] == "ssd" and t.usage["recomputed_tokens"] == 0


def test_warning_waits_for_a_busy_engine_then_acts(idle_stack):
    with idle_stack.client() as c:
        _turn(c, "idle-one", 40, seed=4)
        c.flush()
        t, done = _long_request(idle_stack, "busy-one", 20, seed=5)
        c.set_pressure("warning")
        t.join(120)
        r = _wait_receipt(c, "pressure_trim")
        assert r["deferred_s"] > 0, "the guard trimmed while a request was running"
        assert r["at"] >= done["at"] - 0.5, "the trim happened before the request ended"
        assert r["bank_entries_evicted"] >= 1
        assert _sessions(c)["idle-one"].state == "cold"


def test_critical_takes_every_idle_entry_and_counts_the_unwritten(idle_stack):
    with idle_stack.client() as c:
        _turn(c, "a", 40, seed=6)
        c.flush()
        _turn(c, "b", 60, seed=7)
        _turn(c, "c", 80, seed=8)
        c.set_pressure("critical")
        r = _wait_receipt(c, "pressure_trim")
        assert r["level"] == "critical"
        assert r["bank_entries_evicted"] == 3 and r["bank_unwritten_dropped"] == 2, (
            _receipts(c, "pressure_trim"), _sessions(c))
        assert r["bytes_after"] == 0
        s = _sessions(c)
        assert s["a"].state == "cold"
        # Their history stays (the record is on disk); only the KV that never reached SSD went.
        # A write already on its way when the trim came may land after it (the receipt counted
        # the entry unwritten, as it was): that conversation is then cold, and reads it back.
        assert s["b"].token_count == 64 and s["b"].state in ("gone", "cold"), (
            s["b"], _receipts(c, "pressure_trim"))
        t = _turn(c, "b", 8, seed=9)
        if s["b"].state == "gone":
            assert t.usage["cache_source"] == "none" and t.usage["recomputed_tokens"] > 0
        else:
            assert t.usage["cache_source"] == "ssd", t.usage


def test_critical_spares_only_a_conversation_with_a_request_in_flight(idle_stack):
    """The seed: at critical the trim takes everything idle, recently used or not; only a
    conversation whose request is running keeps its KV (the running turn holds it, out of the
    bank's reach), its turn reads it from RAM, and the conversation is back in RAM after."""
    with idle_stack.client() as c:
        _turn(c, "recent", 60, seed=10)
        _turn(c, "running", 100, seed=11)
        held = _sessions(c)["running"].ram_bytes
        t, done = _long_request(idle_stack, "running", 8, seed=12)
        c.set_pressure("critical")
        r = _wait_receipt(c, "pressure_trim")
        t.join(120)
        assert r["level"] == "critical" and r["bank_entries_evicted"] == 1
        # Every idle entry went; the running conversation's stayed: in the bank while its turn
        # reads a copy (the entry's buffer had no room for the prompt), or handed to the turn.
        assert r["bytes_after"] <= held
        s = _sessions(c)
        assert s["recent"].ram_bytes == 0
        assert done["turn"].usage["cache_source"] == "ram"
        assert s["running"].ram_bytes >= held > 0  # its turn's commit, in RAM


def test_a_prompt_that_needs_room_releases_an_idle_conversation_after_writing_it(
        tiny_model, tmp_path, cache_dir):
    s = _stack(tiny_model, tmp_path, cache_dir, "--active-pin-s", "0",
               "--prefill-chunk-tokens", "32", "--memory-budget", "+2000000")
    try:
        with s.client() as c:
            first = _turn(c, "older", 500, seed=12)
            assert first.usage["durable"]
            st = c.status()
            assert st.bank_bytes > 0 and st.staged_bytes > 0  # in RAM, not on SSD
            assert _sessions(c)["older"].state == "resident-dirty"
            pricing = Pricing(st.kv_bytes_per_token, st.fixed_bytes, st.prefill_chunk_tokens,
                              st.transient_base_bytes, st.transient_per_context_token)
            free = st.memory_budget_bytes - st.held_bytes
            freed_by_release = st.bank_bytes + st.staged_bytes
            want = free + freed_by_release // 2  # needs the release, fits after it
            prompt, max_tokens = next(((p, m) for p in range(100, 1900, 100)
                                       for m in range(1, 2000 - p, 10)
                                       if pricing.request_bytes(p, m) >= want), (None, None))
            assert prompt is not None, (st, want)

            big = c.generate(token_ids=np.random.default_rng(99).integers(
                1000, 20000, prompt).tolist(), max_tokens=max_tokens)
            assert big.usage["completion_tokens"] > 0
            r = [x for x in _receipts(c, "admission") if x["released_sessions"]][-1]
            assert r["released_sessions"] == 1 and r["written_out"] == 1
            assert r["decision"] == "admitted" and r["write_out_s"] > 0
            # The release step's own receipt and the eviction log leave the process too.
            rel = _receipts(c, "release_write_out")[-1]
            assert [row["session_id"] for row in rel["rows"]] == ["older"]
            assert rel["written_out_entries"] == 1 and rel["write_out_s"] == r["write_out_s"]
            (ev,) = [e for e in map(json.loads, c.status().recent_evictions_json)
                     if e["session_id"] == "older"]
            assert ev["release_write_out"] == "written" and ev["write_out_s"] > 0
            older = _sessions(c)["older"]
            assert older.state == "cold" and older.durable_tokens == older.token_count

            t = _turn(c, "older", 8, seed=13)
            assert t.usage["cache_source"] == "ssd"
            assert t.usage["cached_tokens"] == older.token_count
            assert t.usage["recomputed_tokens"] == 0
    finally:
        s.stop()


def _fits_only_with(st, history: int, free: int, extra: int, most_new: int = 200
                    ) -> tuple[int, int]:
    """New tokens (fewer than `most_new`) and max_tokens for a turn on `history` whose price
    (the worker's own list, from its Status) is more than `free` bytes and at most
    `free + extra`."""
    pricing = Pricing(st.kv_bytes_per_token, st.fixed_bytes, st.prefill_chunk_tokens,
                      st.transient_base_bytes, st.transient_per_context_token)
    found = next(((n, m) for n in range(1, most_new) for m in range(1, 400, 4)
                  if free < pricing.request_bytes(history + n, m) <= free + extra), None)
    assert found is not None, (pricing, free, extra)
    return found


def test_a_conversations_next_turn_is_not_charged_twice_for_the_history_it_takes_over(
        tiny_model, tmp_path, cache_dir):
    """A returning turn whose prompt fits in the room its conversation's entry has takes the
    entry out of the bank as its own cache, and its price already counts that history. Its
    admission counts the entry as room for it: a turn that fits the budget once its history
    moves over is served from RAM, not refused for memory that its own history holds (the
    entry is not on SSD yet, so nothing could make room for it)."""
    s = _stack(tiny_model, tmp_path, cache_dir, "--prefill-chunk-tokens", "32",
               "--memory-budget", "+1500000")
    try:
        with s.client() as c:
            _turn(c, "mine", 460, seed=21)  # 464 tokens: a 512-token buffer, kept whole
            st = c.status()
            assert _sessions(c)["mine"].state == "resident-dirty"  # in RAM alone
            history = _sessions(c)["mine"].token_count
            free, own = st.memory_budget_bytes - st.held_bytes, st.bank_bytes
            room = own // st.kv_bytes_per_token - history  # the entry's buffer past its tokens
            assert room > 8, (own, history)
            new, max_tokens = _fits_only_with(st, history, free, own * 9 // 10, most_new=room)

            t = _turn(c, "mine", new, seed=22, max_tokens=max_tokens)
            assert t.usage["cache_source"] == "ram" and t.usage["cached_tokens"] == history
            r = _receipts(c, "admission")[-1]
            assert r["decision"] == "admitted" and r["taken_over_bytes"] == own
            assert r["need_bytes"] > r["free_before"] - own  # it would not fit without
    finally:
        s.stop()


def test_a_conversation_sharing_only_a_prefix_with_the_prompt_is_released_for_it(
        tiny_model, tmp_path, cache_dir):
    """Two conversations share a system prompt. One comes back with its history on SSD, while
    RAM holds the other, not yet written: the prompt's longest RAM hit is the other's entry
    (the shared prefix). When nothing else makes room, that entry is written out and
    released rather than the returning turn refused: it reads its whole history from SSD."""
    s = _stack(tiny_model, tmp_path, cache_dir, "--prefill-chunk-tokens", "32",
               "--memory-budget", "+2000000")
    rng = np.random.default_rng(31)
    shared = rng.integers(1000, 20000, 300).tolist()
    try:
        with s.client() as c:
            c.generate(session_id="a", token_ids=shared + rng.integers(1000, 20000, 200).tolist(),
                       append=True, max_tokens=4)
            c.release("a")  # written out first
            c.generate(session_id="b", token_ids=shared + rng.integers(1000, 20000, 200).tolist(),
                       append=True, max_tokens=4)
            sessions = _sessions(c)
            assert sessions["a"].state == "cold" and sessions["b"].state == "resident-dirty"
            history = sessions["a"].token_count
            st = c.status()
            free, other = st.memory_budget_bytes - st.held_bytes, st.bank_bytes
            new, max_tokens = _fits_only_with(st, history, free, other * 8 // 10)

            t = c.generate(session_id="a", token_ids=rng.integers(1000, 20000, new).tolist(),
                           append=True, max_tokens=max_tokens)
            assert t.usage["cache_source"] == "ssd" and t.usage["cached_tokens"] == history
            r = _receipts(c, "admission")[-1]
            assert r["decision"] == "admitted" and r["released_sessions"] == 1
            assert r["written_out"] == 1  # b's turn went to SSD before it left RAM
            b = _sessions(c)["b"]
            assert b.state == "cold" and b.durable_tokens == b.token_count
    finally:
        s.stop()


def test_a_request_that_can_never_fit_is_refused_up_front(tiny_model, tmp_path, cache_dir):
    s = _stack(tiny_model, tmp_path, cache_dir, "--prefill-chunk-tokens", "32",
               "--memory-budget", "+500000")
    try:
        with s.client() as c:
            err = rpc_error(lambda: c.generate(token_ids=list(range(1000, 2000)),
                                               max_tokens=500))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "never_at_this_limit" in err.details() and "--memory-budget" in err.details()
            md = dict(err.trailing_metadata())
            assert md["x-kvbank-verdict"] == "never_at_this_limit"
            assert "retry-after" not in md  # waiting will not help
            assert c.status().running_requests == 0  # refused before any work
            ok = c.generate(token_ids=list(range(1000, 1020)), max_tokens=4)  # still serving
            assert ok.usage["completion_tokens"] > 0
    finally:
        s.stop()


@pytest.mark.matrix  # make test-all: the test below checks the same refusal on its way
def test_a_full_queue_refuses_with_retry_after(tiny_model, tmp_path, cache_dir):
    s = _stack(tiny_model, tmp_path, cache_dir, "--max-active-requests", "1",
               "--max-queue", "0")
    try:
        t, result = _long_request(s, "long", 20, seed=14)
        with s.client() as c:
            err = rpc_error(lambda: c.generate(token_ids=[1000, 1001], max_tokens=2))
        t.join(120)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        md = dict(err.trailing_metadata())
        assert int(md["retry-after"]) >= 1 and md["x-kvbank-reason"] == "queue_full"
        assert "--max-queue" in err.details()
        assert result["turn"].usage["completion_tokens"] > 0  # the running one was not affected
    finally:
        s.stop()


def test_a_full_queue_keeps_a_conversation_this_machine_holds(tiny_model, tmp_path, cache_dir):
    """Behind a gateway a refusal sends the request to another machine, which recomputes the
    whole conversation: a full queue takes a request whose KV is here, and it waits its turn.
    A request whose KV is not here is refused with a Retry-After, naming the flag."""
    s = _stack(tiny_model, tmp_path, cache_dir, "--max-active-requests", "1",
               "--max-queue", "0")
    try:
        with s.client() as c:
            _turn(c, "held", 120, seed=16)
        t, result = _long_request(s, "long", 20, seed=17)
        with s.client() as c:
            err = rpc_error(lambda: c.generate(token_ids=list(range(3000, 3120)), max_tokens=2))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-queue" in err.details()
            md = dict(err.trailing_metadata())
            assert md["x-kvbank-reason"] == "queue_full" and int(md["retry-after"]) >= 1
            again = _turn(c, "held", 6, seed=18, max_tokens=2)  # waits for the slot
            served_at = time.time()
        t.join(120)
        assert again.usage["cached_tokens"] >= 120 and again.usage["cache_source"] == "ram"
        assert served_at >= result["at"], "it ran while the slot was taken"
        assert result["turn"].usage["completion_tokens"] > 0  # the running one went on
        text = httpx.get(s.metrics_url("router"), timeout=10).text
        assert "kvbank_queued_not_refused_total 1.0" in text
    finally:
        s.stop()


def test_router_ceilings_refuse_at_once_naming_the_flag(tiny_model, tmp_path, cache_dir):
    s = _stack(tiny_model, tmp_path, cache_dir, "--max-prompt-tokens", "50",
               "--max-request-tokens", "80")
    try:
        with s.client() as c:
            for n, max_tokens, flag in ((60, 4, "--max-prompt-tokens"),
                                        (40, 50, "--max-request-tokens")):
                err = rpc_error(lambda: c.generate(token_ids=list(range(1000, 1000 + n)),
                                                   max_tokens=max_tokens))
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert flag in err.details(), err.details()
            ok = c.generate(token_ids=list(range(1000, 1040)), max_tokens=30)
            assert ok.usage["completion_tokens"] > 0
            # Refused at the router: the worker priced only the request that fits.
            assert len(_receipts(c, "admission")) == 1
    finally:
        s.stop()


def test_hyper_refuses_a_flag_that_would_allow_more_at_start(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvbank.apps.cli", "up", "--data-dir",
                          str(tmp_path / "d"), "--scheduler-mode", "hyper",
                          "--max-active-requests", "2"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0
    assert "--max-active-requests 2" in out.stderr and "hyper" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_negative_decode_wait_is_refused_at_start(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvbank.apps.cli", "up", "--data-dir",
                          str(tmp_path / "d"), "--decode-wait-s", "-1"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0
    assert "--decode-wait-s -1" in out.stderr and "Traceback" not in out.stderr


def test_hyper_runs_exactly_one_request_at_a_time(tiny_model, tmp_path, cache_dir):
    """A second request waits in line while the first runs, and the worker admits it only
    once it has committed the first turn: the order of the worker's own event log, no clock."""
    from kvbank.v1 import api_pb2

    s = _stack(tiny_model, tmp_path, cache_dir, "--scheduler", "hyper")
    try:
        first, done = _long_request(s, "h0", 30, seed=20)

        def run_second():
            with s.client() as c2:
                done["second"] = _turn(c2, "h1", 30, seed=21, max_tokens=200)

        second = threading.Thread(target=run_second)
        second.start()
        with s.client() as c:
            def in_line():
                load = c.generation.Load(api_pb2.LoadRequest(), timeout=30)
                return load.running == 1 and load.waiting == 1

            wait_until(in_line, "the second request in line while the first runs")
            first.join(120)
            second.join(120)
            assert done["turn"].finish_reason and done["second"].finish_reason
            assert c.status().scheduler == "hyper"
        order = [(e["kind"], e["session_id"]) for e in map(json.loads,
                 s.layout.events_path.read_text().splitlines())
                 if e["kind"] in ("admission", "kv_resident")]
        assert order == [("admission", "h0"), ("kv_resident", "h0"),
                         ("admission", "h1"), ("kv_resident", "h1")], order
    finally:
        s.stop()


def test_batch_short_request_during_a_long_prefill_finishes_first(tiny_model, tmp_path,
                                                                   cache_dir):
    # --decode-wait-s 0: the short answer's second token must not pause for the long prompt
    s = _stack(tiny_model, tmp_path, cache_dir, "--prefill-chunk-tokens", "32",
               "--decode-wait-s", "0")
    try:
        done = {}

        def run(name, n_tokens, seed):
            with s.client() as c2:
                _turn(c2, name, n_tokens, seed=seed, max_tokens=2)
                done[name] = time.monotonic()

        long = threading.Thread(target=run, args=("long", 1900, 30))
        long.start()
        with s.client() as c:
            wait_until(lambda: c.status().running_requests, "the long request to start running",
                       every_s=0.005)
        run("short", 10, 31)
        long.join(120)
        assert done["short"] < done["long"], "the short request waited for the whole prefill"
    finally:
        s.stop()


def test_serial_is_hypers_alias():
    """The two single-request modes were one policy under two names: serial now says so."""
    from kvbank.worker.compute.scheduler_config import SchedulerConfig

    assert SchedulerConfig.from_flags("serial", None) == SchedulerConfig.from_flags("hyper", None)
    assert SchedulerConfig.from_flags("serial", None).max_active == 1
    for mode in ("serial", "hyper"):
        with pytest.raises(SystemExit, match="hyper runs exactly one request.*--max-active"):
            SchedulerConfig.from_flags(mode, 2)
