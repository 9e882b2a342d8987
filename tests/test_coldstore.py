"""The coldstore as a user notices it: what lands on SSD, when, and what survives a crash.

Real LMDB, real ZeroMQ and, wherever the behaviour is the process's (lanes, deadlines, crash),
the real coldstore process started as the supervisor starts it. The "worker" is this test: the
engine's own KV manager (bank, writer, records, link; worker/tiers/manager.py) over a fake cache
kind (a test seam: full-attention caches holding synthetic KV, no model needed), committing
turns with the engine's commit and saying busy or quiet on the worker-state channel exactly as
the engine does.
"""

from __future__ import annotations

import signal
import time

import mlx.core as mx
import numpy as np
import pytest

from kvbank.coldstore.store import ColdStore
from kvbank.blocks import chain_block_ids, tail_block_id
from kvbank.contracts.coldstore_wire import outcome_of
from tests.coldstore_rig import (B, TENANT, Disk, assert_kv_bit_equal, check_record_against_kv,
                                 concat_kv, make_kv, root_for, start, tokens)  # noqa: F401
from tests.waiting import wait_until
from kvbank.worker.kv import codec

pytestmark = pytest.mark.unit  # make test-fast


# -- 1. shared prefixes are stored once ---------------------------------------------------------

def test_blocks_shared_by_two_sessions_are_stored_once(start):
    _, link = start()
    prefix_t, prefix_kv = tokens(3 * B, seed=1), make_kv(3 * B, seed=1)  # 3 shared full blocks
    a_t = np.concatenate([prefix_t, tokens(B + 5, seed=2)])  # + 1 own full block + tail of 5
    b_t = np.concatenate([prefix_t, tokens(7, seed=3)])  # + tail of 7
    a_kv = concat_kv(prefix_kv, make_kv(B + 5, seed=2))
    b_kv = concat_kv(prefix_kv, make_kv(7, seed=3))
    ea = link.turn("a", a_t, a_kv)
    link.turn("b", b_t, b_kv)
    link.set_busy(False)
    link.wait_durable("a", len(a_t))
    link.wait_durable("b", len(b_t))

    shared = [bid.hex() for bid in chain_block_ids(prefix_t, root_for(TENANT), B)]
    st = link.disk.stats()
    assert st["sessions"] == 2
    assert st["blocks"] == 3 + 1 + 1 + 1, f"shared blocks stored more than once: {st}"
    ma = check_record_against_kv(link.disk, "a", a_kv, a_t, "session a")
    mb = check_record_against_kv(link.disk, "b", b_kv, b_t, "session b")
    assert ma.blocks[:3] == shared and mb.blocks[:3] == shared
    assert ma.blocks[3] == ea.block_ids[3].hex() and len(mb.blocks) == 3
    assert ma.tail and mb.tail and ma.tail != mb.tail

    # Deleting one session keeps what the other still names.
    assert link.client.delete_session(TENANT, "a")
    assert link.disk.record("a") is None
    st = link.disk.stats()
    assert st["blocks"] == 3 + 1, f"after deleting a: {st}"
    check_record_against_kv(link.disk, "b", b_kv, b_t, "session b after a was deleted")

    assert link.client.delete_session(TENANT, "b")
    st = link.disk.stats()
    assert st["blocks"] == 0 and st["sessions"] == 0, f"after deleting both: {st}"


# -- 2. a second turn writes only what is new ----------------------------------------------------

def test_second_turn_writes_only_its_new_blocks(start):
    _, link = start()
    t1, kv1 = tokens(40, seed=10), make_kv(40, seed=10)  # 2 full blocks + tail of 8
    e1 = link.turn("s", t1, kv1)
    link.set_busy(False)
    link.wait_durable("s", 40)
    link.bank.mark_durable(e1.session, 40)
    meta1 = check_record_against_kv(link.disk, "s", kv1, t1, "turn 1")
    old_full = link.disk.blocks(meta1.block_ids()[:2])
    old_tail = meta1.block_ids()[2]
    assert link.disk.stats()["blocks"] == 3
    link.set_busy(True)

    t2 = np.concatenate([t1, tokens(32, seed=11)])  # 72 tokens: 4 full blocks + tail of 8
    kv2 = concat_kv(kv1, make_kv(32, seed=11))
    link.sent.clear()
    e2 = link.turn("s", t2, kv2)
    assert e2.durable_tokens == 40, "the bank forgot turn 1 is durable"
    (write,) = link.sent_writes()
    assert [b.start for b in write.blocks] == [32, 48, 64], (
        "turn 2's write must start at the old tail, not re-send turn 1's full blocks")
    link.set_busy(False)
    assert outcome_of(link.wait_done(e2.write_job)) == "written"
    assert len(link.progress(e2.write_job)) == 3, "one commit per new block"

    meta2 = check_record_against_kv(link.disk, "s", kv2, t2, "turn 2")
    assert meta2.blocks[:2] == meta1.blocks, "turn 1's full blocks changed id"
    assert link.disk.blocks(meta2.block_ids()[:2]) == old_full, "turn 1's full blocks rewritten"
    assert link.disk.blocks([old_tail]) == [None], "turn 1's tail block was not collected"
    assert meta2.durable_tokens == 72 and meta2.tail_tokens == 8
    assert link.disk.stats()["blocks"] == 5, link.disk.stats()


def test_partial_tail_waits_so_quick_turns_write_each_token_once(start):
    """With --tail-delay-s, turn 1's tail is never written: turn 2 rewrote it first."""
    _, link = start(tail_delay_s=5)
    link.set_busy(False)
    t1, kv1 = tokens(40, seed=12), make_kv(40, seed=12)  # 2 full blocks + tail of 8
    link.turn("q", t1, kv1)
    link.wait_durable("q", 32, what="turn 1's full blocks")
    block = link.block_bytes(kv1)
    assert link.ping().written_bytes == 2 * block
    assert link.disk.durable("q") == 32, "the young tail was written at once"

    t2 = np.concatenate([t1, tokens(32, seed=13)])  # 4 full blocks + tail of 8
    kv2 = concat_kv(kv1, make_kv(32, seed=13))
    e2 = link.turn("q", t2, kv2)
    link.wait_durable("q", 64, what="turn 2's full blocks")
    assert outcome_of(link.wait_done(e2.write_job, timeout_s=20)) == "written"
    check_record_against_kv(link.disk, "q", kv2, t2, "after the tail delay")
    tail = link.block_bytes(kv2, 64, 72)
    assert link.ping().written_bytes == 4 * block + tail, "some KV was written twice"


# -- 3. busy means no writes (until staleness) ---------------------------------------------------

def test_no_writes_while_busy_then_quiet_writes(start):
    _, link = start(max_dirty_s=3600)
    t, layers = tokens(40, seed=20), make_kv(40, seed=20)
    e = link.turn("busy", t, layers)
    # The job is at the coldstore; the next answer comes after a loop turn that could have
    # written its first block (whose `progress` would have come first).
    link.wait_queued(e.write_job)
    assert link.ping().worker_state == "busy"
    assert link.disk.durable("busy") == 0, "the idle lane wrote while the worker was busy"
    assert link.disk.stats()["blocks"] == 0
    assert link.ping().queued_jobs == 1
    assert not link.progress(e.write_job)

    link.set_busy(False)
    assert outcome_of(link.wait_done(e.write_job)) == "written"
    check_record_against_kv(link.disk, "busy", layers, t, "after the quiet window")
    assert link.disk.durable("busy") == 40


# -- 4. bounded staleness --------------------------------------------------------------------

def test_dirty_conversation_past_max_dirty_is_written_while_busy(start):
    _, link = start(max_dirty_s=1)
    t, layers = tokens(40, seed=30), make_kv(40, seed=30)
    t0 = time.monotonic()
    e = link.turn("stale", t, layers)
    link.wait_queued(e.write_job)
    assert link.disk.durable("stale") == 0, "written before max_dirty_s while busy"
    link.wait_durable("stale", 40, timeout_s=6, what="stale conversation while busy")
    assert time.monotonic() - t0 >= 0.9, "written before max_dirty_s while busy"
    assert link.ping().worker_state == "busy", "the worker was not busy throughout"
    assert outcome_of(link.wait_done(e.write_job)) == "written"
    check_record_against_kv(link.disk, "stale", layers, t, "stale write")


# -- 5. write-out deadlines ---------------------------------------------------------------------

def test_write_out_beats_a_generous_deadline_while_busy(start):
    _, link = start()
    t, layers = tokens(72, seed=40), make_kv(72, seed=40)
    e = link.turn("w", t, layers)
    job = e.write_job  # the entry forgets it once its end is heard (write_out applies it)
    link.wait_queued(job)
    assert link.disk.durable("w") == 0
    t0 = time.time()
    assert link.writer.write_out(e, give_up_at=t0 + 10) == "written"
    assert time.time() - t0 < 5
    assert outcome_of(link.wait_done(job)) == "written"
    assert link.ping().worker_state == "busy"
    check_record_against_kv(link.disk, "w", layers, t, "written out")
    assert link.disk.durable("w") == 72


def test_write_out_gives_up_at_a_past_deadline(start):
    _, link = start()
    t1, kv1 = tokens(40, seed=50), make_kv(40, seed=50)
    e1 = link.turn("d", t1, kv1)
    link.set_busy(False)
    link.wait_durable("d", 40)
    link.bank.mark_durable(e1.session, 40)
    before = link.disk.record("d")[0]
    link.set_busy(True)

    t2 = np.concatenate([t1, tokens(40, seed=51)])
    kv2 = concat_kv(kv1, make_kv(40, seed=51))
    e2 = link.turn("d", t2, kv2)
    job = e2.write_job  # the entry forgets it once its end is heard
    assert link.writer.write_out(e2, give_up_at=time.time() - 0.5) == "deadline"
    done = link.wait_done(job)
    assert outcome_of(done) == "deadline", f"the coldstore did not report the deadline: {done}"
    assert not link.progress(job), "a block was committed past the deadline"
    assert link.ping().queued_jobs == 0
    after = check_record_against_kv(link.disk, "d", kv2, t2, "after the deadline")
    assert after.durable_tokens == 40 and after.blocks == before.blocks
    assert after.tail == before.tail


# -- 6. the stored form is bit-exact ----------------------------------------------------------

@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["bfloat16", "float32"])
def test_kv_round_trips_bit_exactly(tmp_path, dtype):
    n = 2 * B + 5
    t, layers = tokens(n, seed=60), make_kv(n, seed=60, dtype=dtype, n_layers=3, heads=2, dim=16)
    root = root_for(TENANT)
    ids = chain_block_ids(t, root, B)
    ids.append(tail_block_id(ids[-1], t[2 * B:]))
    store = ColdStore(tmp_path / "store")
    try:
        store.put_session_tokens(TENANT, "rt", t, B)
        for i, bid in enumerate(ids):
            s = i * B
            payload = codec.encode_range(layers, s, min(s + B, n))
            assert store.commit_block(TENANT, "rt", root, bid, s, payload) is not None
        meta, _ = store.get_session(TENANT, "rt")
        assert meta.durable_tokens == n
        payloads = store.get_blocks(meta.block_ids())
    finally:
        store.close()
    got = codec.decode_blocks(payloads)
    assert_kv_bit_equal(got, layers, f"{dtype} round trip")
    # The worker's own read path (a fresh read-only open) sees the same bits.
    disk = Disk(tmp_path / "store")
    assert_kv_bit_equal(codec.decode_blocks(disk.blocks(ids)), layers, f"{dtype} read-only reopen")


# -- 7. kill -9 mid-write ----------------------------------------------------------------------

def test_kill_9_during_a_write_leaves_only_correct_blocks(start):
    proc, link = start(n_layers=4)
    n = 2048 + 8  # 128 full blocks and a tail
    t = tokens(n, seed=70)
    layers = make_kv(n, seed=70, n_layers=4, heads=4, dim=64)  # 128 KiB per block
    e = link.turn("crash", t, layers)
    job = e.write_job
    link.set_busy(False)
    # Kill on the first acknowledgement past a few blocks: the coldstore is mid-stream.
    wait_until(lambda: any(p.durable_tokens >= 4 * B for p in link.progress(job)),
               "the coldstore to start writing (4 blocks acknowledged)", 20, every_s=0.001)
    proc.kill9()
    link.close()

    meta = check_record_against_kv(link.disk, "crash", layers, t, "after kill -9")
    d = meta.durable_tokens
    assert 0 < d < n, f"kill -9 did not land mid-write (durable {d} of {n}); make blocks bigger"
    assert d % B == 0 and meta.tail is None, f"durable extent {d} is not a block boundary"
    assert meta.token_count == n
    assert link.disk.stats()["blocks"] == len(meta.blocks), "blocks no record names survived"

    # A restarted coldstore on the same store takes the job again and finishes it.
    proc2, link2 = start(n_layers=4)
    e2 = link2.bank.insert((TENANT, "crash"), t, layers, durable_tokens=d)
    job2 = link2.writer.write_behind(e2)
    link2.writer.drain()
    (write,) = link2.sent_writes()
    assert write.blocks[0].start == d, "the re-sent job rewrites what is already durable"
    link2.set_busy(False)
    assert outcome_of(link2.wait_done(job2, timeout_s=20)) == "written"
    meta2 = check_record_against_kv(link2.disk, "crash", layers, t, "after the restart")
    assert meta2.durable_tokens == n and meta2.blocks[: len(meta.blocks)] == meta.blocks
    assert link2.disk.stats()["blocks"] == n // B + 1
    assert proc2.proc.poll() is None


# -- 8. a stale job writes nothing that the record's history does not give ------------------------

@pytest.mark.parametrize("edit_at", [5, 2 * B + 3, 3 * B + 3], ids=["block0", "block2", "tail"])
def test_stale_job_writes_nothing_for_an_edited_history(start, edit_at):
    _, link = start()
    t1, layers = tokens(3 * B + 8, seed=80), make_kv(3 * B + 8, seed=80)
    e = link.turn("edit", t1, layers)  # queued while busy
    t2 = t1.copy()
    t2[edit_at] += 1  # the client edited its history before the write ran
    link.put_session("edit", t2)
    link.set_busy(False)
    done = link.wait_done(e.write_job)
    assert outcome_of(done) == "stale", done

    meta, toks = link.disk.record("edit")
    assert np.array_equal(toks, t2)
    chain2 = [bid.hex() for bid in chain_block_ids(t2, root_for(TENANT), B)]
    keep = edit_at // B
    assert meta.blocks == chain2[:keep], "the record names a block of the old history"
    assert meta.tail is None
    assert meta.durable_tokens == keep * B
    assert link.disk.stats()["blocks"] == keep, "a block of the old history was stored"
    if keep:
        check_record_against_kv(link.disk, "edit", layers, t2, "the unedited prefix")


# -- 9. a write-out reports "written" only once its own blocks are committed ---------------------

def test_write_out_after_an_edit_waits_for_its_own_commit(start):
    proc, link = start()
    t1, kv1 = tokens(40, seed=90), make_kv(40, seed=90)
    link.turn("ed", t1, kv1)
    link.set_busy(False)
    link.wait_durable("ed", 40)
    link.set_busy(True)

    t2 = t1.copy()
    t2[5] += 1  # edited history, same length: the record keeps none of t1's blocks
    kv2 = make_kv(40, seed=91)
    e2 = link.turn("ed", t2, kv2)
    assert link.disk.durable("ed") == 0
    proc.proc.send_signal(signal.SIGSTOP)  # the coldstore cannot commit anything now
    try:
        outcome = link.writer.write_out(e2, give_up_at=time.time() + 0.3)
        durable_then = link.disk.durable("ed")
    finally:
        proc.proc.send_signal(signal.SIGCONT)
    assert outcome != "written" or durable_then >= 40, (
        f"write_out said {outcome!r} while {durable_then} of 40 tokens were durable")


def test_a_workers_first_quiet_report_starts_the_quiet_grace():
    """The worker's first `busy` can be lost (a PUB socket drops what it sends before its
    subscriber joins); its first `quiet` then starts the grace, it is not quiet since 1970."""
    from collections import deque

    from kvbank.coldstore.lanes import Lanes, PendingBlock, WriteJob

    now = time.time()
    lanes = Lanes(quiet_grace_s=60, max_dirty_s=3600, tail_delay_s=0)
    lanes.submit(WriteJob(1, b"peer", TENANT, "s", b"root",
                          deque([PendingBlock(b"b", 0, 8, payload=memoryview(b"x" * 8))]),
                          dirty_since=now))
    lanes.on_worker_state(False, now)
    assert lanes.next_job(now + 1) is None  # quiet for 1 s of a 60 s grace
    assert lanes.next_job(now + 61) is not None


def test_a_worker_that_needs_the_memory_has_every_queued_write_written_now_tails_too():
    """A young tail waits `tail_delay_s` (its next turn rewrites it), and writes wait for a
    quiet worker; a worker whose batch join waits for the memory the queued writes hold says
    `write-now`, and the tail is written at once, busy or not. Agents taking turns keep the
    worker busy: at every turn's start four tails held 31-65 MB and a join of two lacked 8."""
    from collections import deque

    from kvbank.coldstore.lanes import Lanes, PendingBlock, WriteJob

    now = time.time()
    lanes = Lanes(quiet_grace_s=0.25, max_dirty_s=3600, tail_delay_s=30)
    tail = PendingBlock(b"b", 0, 8, payload=memoryview(b"x" * 8), tail=True)
    lanes.submit(WriteJob(1, b"peer", TENANT, "s", b"root", deque([tail]), dirty_since=now))
    lanes.on_worker_state(False, now)
    assert lanes.next_job(now + 1) is None  # quiet, but a young tail
    lanes.on_worker_state(True, now + 1)
    assert lanes.next_job(now + 2) is None
    lanes.on_worker_state(False, now + 2, write_now=True)
    assert lanes.next_job(now + 2) is not None
    lanes.on_worker_state(True, now + 3)  # the join happened: busy as before
    assert lanes.next_job(now + 3) is None
