"""Each budget refuses with its reason, and the size cap retires old KV instead of refusing.

Real coldstore process with small limits, real LMDB and ZeroMQ; entries from the tiny model.
"""

from __future__ import annotations

import pytest

from kvbank.coldstore.store import ColdStore
from kvbank.contracts.coldstore_wire import outcome_of, pb
from tests.coldstore_rig import ColdstoreProc
from tests.test_release_write_out import Rig
from tests.waiting import wait_until

pytestmark = pytest.mark.unit  # make test-fast


@pytest.fixture(scope="module")
def model(tiny_model):
    from mlx_lm import load

    return load(str(tiny_model))[0]


def recording_rig(layout, model):
    rig = Rig(layout, model)
    rig.events = []
    forward = rig.client.on_event
    rig.client.on_event = lambda m: (rig.events.append(m), forward(m))
    return rig


def done_event(rig, timeout_s=10) -> pb.Done:
    return wait_until(lambda: next((m.done for m in list(rig.events)
                                    if m.WhichOneof("kind") == "done"), None),
                      "the coldstore's 'done'", timeout_s, every_s=0.02)


@pytest.mark.parametrize("flag,value,reason", [
    ("--entry-max-bytes", "1000", "entry_too_large"),
    ("--write-budget-bytes-per-hour", "1000", "write_budget"),
    ("--free-disk-floor-bytes", str(10**18), "disk_floor"),
])
def test_each_budget_refuses_with_its_reason(tmp_path, model, flag, value, reason):
    cs = ColdstoreProc(tmp_path / "data", flag, value)
    rig = recording_rig(cs.layout, model)
    try:
        rig.turn("a", 40, seed=1)
        r = rig.eviction.release_sessions(None, reason="admission", write_out_before_release=True)
        assert r.written_out_entries == 0 and r.unwritten_dropped == 1
        assert rig.bank.eviction_log[-1].release_write_out == "refused"
        done = done_event(rig)
        assert outcome_of(done) == "refused" and done.reason == reason
        assert flag in done.error  # the sentence names the flag to change
        assert rig.durable_on_disk("a") == 0
    finally:
        rig.close()
        cs.stop()


def test_store_cap_retires_the_least_recently_used_kv_and_keeps_its_history(tmp_path, model):
    probe = ColdstoreProc(tmp_path / "probe")
    rig = Rig(probe.layout, model)
    e = rig.turn("size", 40, seed=1)
    rig.let_idle_lane_write(e)
    one = rig.kv.restorer.store().block_bytes()  # the worker's read-only view
    rig.close()
    probe.stop()

    cs = ColdstoreProc(tmp_path / "data", "--store-max-bytes", str(int(one * 1.5)))
    rig = Rig(cs.layout, model)
    try:
        first = rig.turn("first", 40, seed=2)
        rig.let_idle_lane_write(first)
        second = rig.turn("second", 40, seed=3)
        rig.let_idle_lane_write(second)
        assert rig.durable_on_disk("first") == 0  # retired: its KV left the store...
        store = rig.kv.restorer.store()
        meta, toks = store.get_session("", "first")
        assert len(toks) == 40  # ...but its token history stays
        assert store.block_bytes() <= one * 1.5
    finally:
        rig.close()
        cs.stop()


def test_a_store_over_its_cap_at_start_is_brought_under_it(tmp_path, model):
    cs = ColdstoreProc(tmp_path / "data")
    rig = Rig(cs.layout, model)
    for i in range(3):
        rig.let_idle_lane_write(rig.turn(f"s{i}", 40, seed=10 + i))
    rig.close()
    cs.stop()
    before = ColdStore(cs.layout.store_dir, readonly=True).block_bytes()
    cap = before // 2
    cs = ColdstoreProc(tmp_path / "data", "--store-max-bytes", str(cap))
    try:
        store = ColdStore(cs.layout.store_dir, readonly=True)
        assert store.block_bytes() <= cap
        assert len(store.list_sessions()) == 3  # histories kept
        store.close()
    finally:
        cs.stop()
