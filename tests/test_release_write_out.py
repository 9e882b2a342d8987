"""The seed PRs' scenarios: release with write-out, and trims that keep unwritten work.

The engine's own KV manager (worker/tiers/manager.py: its bank, writer, records and coldstore link)
over the tiny model's real MLX caches, a real coldstore process, real ZeroMQ and LMDB. Each
turn is committed by `KVManager.commit`, the code the engine runs. The engine's thread is this
test: it pumps the coldstore's word as the engine's loop does, and it says busy on the
worker-state channel, so the coldstore's idle lane writes nothing unless a test lets it
(quiet) or a release promotes a job to a deadline.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvbank.blocks import chain_root
from kvbank.config import Layout
from tests.coldstore_rig import ColdstoreProc
from tests.waiting import wait_until
from kvbank.worker.tiers.bank import SessionBank
from kvbank.worker.kv.cache_kinds import CacheKinds
from kvbank.worker.tiers.eviction import EvictionPolicy
from kvbank.worker.tiers.manager import KVManager

pytestmark = pytest.mark.unit  # make test-fast

B = 16
FP = b"test-release-fingerprint"


def root_for(tenant: str):
    return chain_root(FP, tenant)


@pytest.fixture(scope="module")
def model(tiny_model):
    from mlx_lm import load

    return load(str(tiny_model))[0]


@pytest.fixture
def coldstore(tmp_path):
    proc = ColdstoreProc(tmp_path / "data")
    yield proc.layout
    proc.stop()


def forward(model, n_tokens: int, seed: int) -> tuple[np.ndarray, list]:
    """`n_tokens` random prompt tokens and the model's caches after reading them."""
    from mlx_lm.models.cache import make_prompt_cache
    import mlx.core as mx

    tokens = np.random.default_rng(seed).integers(100, 5000, n_tokens).astype(np.uint32)
    cache = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    return tokens, cache


def bank_without_coldstore(model, session_id: str, n_tokens: int, seed: int) -> SessionBank:
    """A bank with no writer (no coldstore configured) holding one turn."""
    bank = SessionBank(block_tokens=B, root_for=root_for, max_bytes=1 << 30, active_pin_s=0)
    tokens, cache = forward(model, n_tokens, seed)
    bank.insert(("", session_id), tokens, CacheKinds.of(model).freeze(cache, n_tokens)[0])
    return bank


class Rig:
    """The engine's KV manager wired to the coldstore at `layout`, owned by the test's thread."""

    def __init__(self, layout: Layout, model):
        self.model = model
        self.layout = layout
        self.kv = KVManager(layout, kinds=CacheKinds.of(model), fingerprint=FP,
                                 block_tokens=B, bank_bytes=1 << 30, active_pin_s=0)
        self.client, self.writer = self.kv.coldstore, self.kv.writer
        self.bank, self.eviction = self.kv.bank, self.kv.eviction
        self.client.set_busy(True)
        self.wait_worker_state("busy")

    def turn(self, session_id: str, n_tokens: int, seed: int):
        """A finished turn of `n_tokens`, committed."""
        return self.commit(session_id, *forward(self.model, n_tokens, seed))

    def commit(self, session_id: str, tokens: np.ndarray, cache: list):
        """As the engine commits a turn: record, bank entry, write-behind job, the cap's
        policies. Its bank entry."""
        session = ("", session_id)
        self.kv.commit(session, tokens, cache)
        return self.bank.terminal(session)

    def wait_worker_state(self, state: str, timeout_s: float = 10) -> None:
        """Until the coldstore has heard our busy/quiet signal (PUB/SUB joins late)."""
        wait_until(lambda: self.client.ping().worker_state == state,
                   f"the coldstore to see the worker {state}", timeout_s, every_s=0.02)

    def durable_on_disk(self, session_id: str) -> int:
        """The record in LMDB, read through the worker's own read-only view of the store (one
        process opens an LMDB environment once)."""
        got = self.kv.restorer.store().get_session("", session_id)
        return got[0].durable_tokens if got else 0

    def heard(self, e) -> bool:
        """Applies the coldstore's word (the engine's loop does it every turn): `e` known
        written in full."""
        self.writer.pump()
        return e.durable_tokens >= e.n_tokens and not e.awaits_queued_write

    def let_idle_lane_write(self, e, timeout_s: float = 20) -> None:
        self.client.set_busy(False)
        wait_until(lambda: self.heard(e), f"the idle lane to write {e.session[1]}", timeout_s)
        self.client.set_busy(True)
        self.wait_worker_state("busy")

    def close(self):
        self.kv.close()


@pytest.fixture
def rig(coldstore, model):
    r = Rig(coldstore, model)
    yield r
    r.close()


def test_unwritten_entry_is_written_before_it_goes(rig):
    e = rig.turn("a", 40, seed=1)
    assert e.awaits_queued_write
    r = rig.eviction.release_sessions(None, reason="admission", write_out_before_release=True)
    assert r.written_out_entries == 1 and r.unwritten_dropped == 0
    assert r.rows[0].on_ssd_entries == 1
    assert rig.durable_on_disk("a") == 40
    assert rig.bank.eviction_log[-1].release_write_out == "written"
    assert not rig.bank.entries


def test_every_queued_entry_of_a_released_conversation_is_written(rig):
    """A branched conversation has two entries with queued writes: both reach SSD."""
    rig.turn("b", 40, seed=2)
    rig.turn("other", 24, seed=3)
    r = rig.eviction.release_sessions(None, reason="admission", write_out_before_release=True)
    assert r.written_out_entries == 2
    assert rig.durable_on_disk("b") == 40 and rig.durable_on_disk("other") == 24


def test_out_of_time_the_entry_is_dropped_as_before(rig):
    rig.turn("c", 64, seed=4)
    r = rig.eviction.release_sessions(None, reason="admission", write_out_before_release=True,
                                      max_write_out_s=0.0)
    assert r.written_out_entries == 0 and r.unwritten_dropped == 1
    assert rig.bank.eviction_log[-1].release_write_out == "deadline"
    assert rig.durable_on_disk("c") == 0


def test_without_write_out_the_release_cancels_the_write(rig):
    e = rig.turn("d", 40, seed=5)
    job = e.write_job
    wait_until(lambda: job in rig.client.ping().jobs, f"the coldstore to hold job {job}")
    r = rig.eviction.release_sessions(None, reason="admission")
    assert r.unwritten_dropped == 1 and r.written_out_entries == 0
    rig.client.set_busy(False)  # a quiet window: a write still queued would run now
    rig.wait_worker_state("quiet")
    # The cancel follows the job: once the coldstore no longer holds it (cancelled, or
    # written if the cancel were lost), nothing more of it can be written.
    wait_until(lambda: job not in rig.client.ping().jobs, f"the coldstore to drop job {job}")
    assert rig.durable_on_disk("d") == 0
    assert e.write_job is None


def test_an_entry_already_on_disk_is_not_written_again(rig):
    e = rig.turn("e", 40, seed=6)
    rig.let_idle_lane_write(e)
    r = rig.eviction.release_sessions(None, reason="admission", write_out_before_release=True)
    assert r.written_out_entries == 0 and r.rows[0].on_ssd_entries == 1
    assert rig.bank.eviction_log[-1].release_write_out is None


def test_no_coldstore_changes_nothing(model):
    bank = bank_without_coldstore(model, "f", 40, seed=7)
    r = EvictionPolicy(bank).release_sessions(None, reason="admission",
                                              write_out_before_release=True)
    assert r.written_out_entries == 0 and r.rows[0].dropped_entries == 1
    assert not bank.entries


def test_a_session_that_starts_a_request_is_not_written(rig):
    e = rig.turn("g", 40, seed=8)
    rig.bank.begin_request(e.session)
    r = rig.eviction.release_sessions(None, reason="admission", write_out_before_release=True)
    assert r.skipped_busy_sessions == 1 and r.written_out_entries == 0
    assert e.key in rig.bank.entries
    assert rig.durable_on_disk("g") == 0


def test_warning_trim_keeps_the_unwritten_and_takes_one_on_ssd(rig):
    on_ssd = rig.turn("newer-on-ssd", 40, seed=10)
    rig.let_idle_lane_write(on_ssd)  # before: the idle lane writes all that is queued
    unwritten = rig.turn("old-unwritten", 40, seed=9)
    rig.bank.touch(on_ssd)  # the unwritten one is the least recently used
    receipt = rig.eviction.shrink_to_bytes(unwritten.nbytes, reason="pressure_trim:warning",
                                           protect_unwritten=True)
    assert list(rig.bank.entries) == [unwritten.key]
    assert receipt.unwritten_kept == 1 and receipt.evicted_entries == 1
    # Now only the unwritten one is left: a deeper trim keeps it and says so.
    receipt = rig.eviction.shrink_to_bytes(0, reason="pressure_trim:warning",
                                           protect_unwritten=True)
    assert receipt.unwritten_kept == 1 and receipt.evicted_entries == 0
    assert unwritten.awaits_queued_write and unwritten.key in rig.bank.entries

    # Once its write has run, a later trim takes it.
    rig.let_idle_lane_write(unwritten)
    receipt = rig.eviction.shrink_to_bytes(0, reason="pressure_trim:warning",
                                           protect_unwritten=True)
    assert receipt.evicted_entries == 1 and receipt.unwritten_dropped == 0
    assert not rig.bank.entries


def test_without_coldstore_the_trim_takes_the_entry_as_before(model):
    bank = bank_without_coldstore(model, "h", 40, seed=11)
    receipt = EvictionPolicy(bank).shrink_to_bytes(0, reason="pressure_trim:warning",
                                                   protect_unwritten=True)
    assert receipt.evicted_entries == 1 and receipt.unwritten_kept == 0


def test_critical_trim_takes_everything_idle_and_counts_the_unwritten(rig):
    durable = rig.turn("j", 40, seed=13)
    rig.let_idle_lane_write(durable)  # before: the idle lane writes all that is queued
    rig.turn("i", 40, seed=12)
    receipt = rig.eviction.shrink_to_bytes(0, reason="pressure_trim:critical")
    assert receipt.evicted_entries == 2 and receipt.unwritten_dropped == 1
    assert rig.bank.total_nbytes == 0


@pytest.mark.parametrize("source", ["ledger", "system"])
def test_critical_pressure_from_kvbanks_own_ledger_writes_out_instead_of_dropping(rig,
                                                                                 source):
    """Critical because kvbank's ledger reached its own budget: every idle conversation still
    leaves RAM, but an unwritten one goes to SSD first and is not lost. Critical because the
    machine is short of memory (`system`, `psi`): memory comes first, the unwritten is dropped
    and counted."""
    durable = rig.turn("d", 40, seed=16)
    rig.let_idle_lane_write(durable)
    unwritten = rig.turn("u", 40, seed=15)  # after: the idle lane writes all that is queued
    receipt = rig.eviction.pressure_trim("critical", source, deferred_s=0.0)
    assert receipt.bank_entries_evicted == 2 and rig.bank.total_nbytes == 0
    kept_on_ssd = source == "ledger"
    assert receipt.bank_unwritten_dropped == (0 if kept_on_ssd else 1)
    assert rig.durable_on_disk("u") == (unwritten.n_tokens if kept_on_ssd else 0)


def test_ledger_counts_entries_running_requests_and_staged_bytes(rig):
    """What RAM really holds: a queued write's bytes count until the coldstore commits them."""
    e = rig.turn("k", 40, seed=14)
    led = rig.bank.ledger()
    assert led["entries_bytes"] == e.nbytes == rig.bank.total_nbytes
    assert led["staged_bytes"] >= e.nbytes  # every block of the entry, plus block headers
    rig.bank.begin_request(("", "busy"))
    rig.bank.reserve_active(("", "busy"), 1000)
    assert rig.bank.ledger()["active_bytes"] == 1000
    rig.bank.end_request(("", "busy"))
    rig.let_idle_lane_write(e)
    # the rig's thread owns the writer: it applies the acknowledgements, as the engine's loop
    wait_until(lambda: rig.writer.pump() >= 0 and not rig.bank.ledger()["staged_bytes"],
               "the staged bytes to be released after the commit", 10)
    assert rig.bank.ledger() == {"entries_bytes": e.nbytes, "active_bytes": 0,
                                 "forward_bytes": 0, "staged_bytes": 0, "held_bytes": e.nbytes}


def test_staging_at_its_cap_puts_the_hand_over_off_and_keeps_the_entry_protected(rig):
    """Bounded staging, without stalling the engine: at the cap the second hand-over waits in
    RAM marked to be sent again, protected from trims, and goes once the first is on SSD."""
    first = rig.turn("s1", 40, seed=21)  # its commit hands its write over
    assert first.write_job is not None and rig.writer.staged_bytes > 0
    rig.writer.staging_max_bytes = rig.writer.handed_over_bytes + 1  # room for one entry
    assert rig.durable_on_disk("s1") == 0  # busy: the idle lane has not written it

    tokens, cache = forward(rig.model, 40, seed=22)
    t0 = time.monotonic()
    second = rig.commit("s2", tokens, cache)
    assert second.write_job is None  # at the cap: nothing handed over...
    assert time.monotonic() - t0 < 1.0  # ...and no wait on the committing thread
    assert rig.writer.staging_deferred == 1
    assert second.write_pending and second.awaits_queued_write

    receipt = rig.eviction.shrink_to_bytes(0, reason="bank_budget", protect_unwritten=True)
    assert second.key in rig.bank.entries and receipt.unwritten_kept == 2

    rig.let_idle_lane_write(first)  # the coldstore drains: room again
    wait_until(lambda: rig.writer.pump() >= 0 and rig.writer.has_room(second.nbytes),
               "the staged bytes to be released after the commit", 10)
    assert rig.writer.write_behind(second) is not None  # what Engine.retry_writes does
    rig.let_idle_lane_write(second)
    assert rig.durable_on_disk("s2") == 40 and not second.write_pending


def test_over_the_cap_with_only_unwritten_entries_the_bank_writes_out_and_releases(rig):
    """The commit's cap policy: when what stands above --bank-bytes is KV not on SSD yet, it
    is written out and released, not kept (the bank never grows past its cap)."""
    older = rig.turn("older", 48, seed=31)
    newest = rig.turn("newest", 48, seed=32)
    assert older.awaits_queued_write and newest.awaits_queued_write  # busy: nothing written
    rig.bank.max_bytes = newest.nbytes + older.nbytes // 2  # room for one and a half
    r = rig.eviction.keep_within_cap(protect_keys=(newest.key,))
    assert rig.bank.total_nbytes <= rig.bank.max_bytes
    assert [row.session_id for row in r.rows] == ["older"]
    assert r.kind == "release_write_out" and r.reason == "bank_budget"
    assert r.written_out_entries == 1 and r.unwritten_dropped == 0
    assert rig.durable_on_disk("older") == 48  # on SSD before it left RAM
    assert newest.key in rig.bank.entries  # the turn just committed stays
    last = rig.bank.eviction_log[-1]
    assert (last.session_id, last.reason, last.release_write_out) == ("older", "bank_budget",
                                                                       "written")


def test_under_a_binding_cap_the_next_release_is_written_ahead_and_then_does_not_wait(rig):
    """Three conversations' turns fill a cap of three: room for one more conversation beside
    the two most recent leaves none for the oldest, so its write goes now, while the worker
    is busy (nothing else would write it); the other two wait for a quiet window. The next
    commit (a conversation back from SSD) then releases the oldest, on SSD already, without
    writing anything out."""
    old = rig.turn("old", 48, seed=41)
    mid = rig.turn("mid", 48, seed=42)
    newest = rig.turn("newest2", 48, seed=43)
    rig.bank.max_bytes = 3 * newest.nbytes
    assert rig.eviction.keep_within_cap(protect_keys=(newest.key,)) is None  # all three fit
    assert rig.eviction.write_ahead() == 1
    wait_until(lambda: rig.heard(old), "the oldest conversation to be written ahead", 20)
    assert mid.awaits_queued_write and newest.awaits_queued_write
    assert rig.durable_on_disk("mid") == rig.durable_on_disk("newest2") == 0
    released = len(rig.bank.receipts)
    back = rig.turn("back", 48, seed=44)  # its commit keeps the bank within the cap
    assert rig.bank.total_nbytes <= rig.bank.max_bytes
    # The LRU trim took the oldest, on SSD: no release, no write-out, no wait.
    assert not [r for r in list(rig.bank.receipts)[released:] if r.kind == "release_write_out"]
    last = rig.bank.eviction_log[-1]
    assert (last.session_id, last.reason, last.release_write_out) == ("old", "bank_budget",
                                                                       None)
    assert set(rig.bank.entries) == {mid.key, newest.key, back.key}
    # And again: the commit wrote the next one to go ahead, while the worker is busy.
    wait_until(lambda: rig.durable_on_disk("mid") == 48, "mid to be written ahead", 20)
    assert rig.durable_on_disk("newest2") == 0


def test_under_the_cap_nothing_is_written_out(rig):
    e = rig.turn("small", 24, seed=33)
    assert rig.eviction.keep_within_cap(protect_keys=(e.key,)) is None
    assert e.key in rig.bank.entries and rig.durable_on_disk("small") == 0


@pytest.fixture
def slow_rig(tmp_path, model):
    """The rig over a coldstore whose every block commit takes 0.8 s (a stand-in disk)."""
    proc = ColdstoreProc(tmp_path / "slow", slow_disk_s=0.8)
    r = Rig(proc.layout, model)
    yield r
    r.close()
    proc.stop()


def test_one_release_of_two_sessions_ends_at_its_deadline_and_counts_what_missed(slow_rig):
    """RELEASE_WRITE_OUT_MAX_S bounds the whole release, not each write: two conversations of
    ~10 blocks each on a slow disk, a 1 s deadline, one release."""
    for i, sid in enumerate(("w1", "w2")):
        slow_rig.turn(sid, 160, seed=30 + i)
    t0 = time.monotonic()
    r = slow_rig.eviction.release_sessions(None, reason="admission", write_out_before_release=True,
                                           max_write_out_s=1.0)
    took = time.monotonic() - t0
    assert took < 1.0 + 0.3, f"the release took {took:.2f} s against a 1 s deadline"
    assert r.released_entries == 2 and r.written_out_entries == 0
    assert r.unwritten_dropped == 2
    assert [e.release_write_out for e in slow_rig.bank.eviction_log] == ["deadline"] * 2
    assert 0.9 <= r.write_out_s < 1.3


def test_a_write_ahead_that_runs_out_of_time_keeps_the_entry_protected(slow_rig):
    """A write promoted ahead (nothing waits for it) that misses its deadline on a slow disk:
    the coldstore takes its blocks back, and the entry, RAM's only copy again, stays protected
    from trims and is sent again, as the engine marks it on the coldstore's answer."""
    from kvbank.contracts import coldstore_wire as wire

    ended, engine_hears = {}, slow_rig.writer.on_message
    slow_rig.writer.on_message = lambda m: (
        m.WhichOneof("kind") == "done" and ended.setdefault(m.done.job, m.done),
        engine_hears(m))  # as the engine marks the entry on the coldstore's answer
    e = slow_rig.turn("ahead", 160, seed=51)
    job = e.write_job
    assert slow_rig.writer.write_ahead(e, give_up_at=time.time() + 1.0)
    wait_until(lambda: slow_rig.writer.pump() is not None and job in ended,
               "the promoted write to end", 20)
    outcome = wire.outcome_of(ended[job])
    assert outcome == "deadline"
    assert slow_rig.durable_on_disk("ahead") == 0  # all or nothing
    assert e.awaits_queued_write and e.write_pending
    r = slow_rig.eviction.shrink_to_bytes(0, reason="test", protect_unwritten=True)
    assert e.key in slow_rig.bank.entries and r.unwritten_kept == 1
