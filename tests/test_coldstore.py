"""The coldstore as a user notices it: what lands on SSD, when, and what survives a crash.

Real LMDB, real ZeroMQ and, wherever the behaviour is the process's (lanes, deadlines, crash),
the real coldstore process started as the supervisor starts it. The "worker" is this test: a
ColdstoreClient + KVWriter + SessionBank with synthetic KV (no model needed), saying busy or
quiet on the worker-state channel exactly as the engine does.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest


from coldstore.store import ColdStore
from kvbank.contracts.coldstore_wire import outcome_of, pb
from kvbank.contracts.health import coldstore_up
from kvbank.blocks import chain_block_ids, chain_root, tail_block_id
from kvbank.config import Layout
from tests.waiting import wait_until
from worker import kv
from worker.bank import SessionBank
from worker.link import ColdstoreClient
from worker.writer import KVWriter

B = 16
FP = b"test-coldstore-fingerprint"
TENANT = "acme"


def root_for(tenant: str):
    return chain_root(FP, tenant)


# -- synthetic KV -----------------------------------------------------------------------------

def make_kv(n: int, seed: int, *, dtype=mx.float32, n_layers: int = 2, heads: int = 2,
            dim: int = 8) -> kv.Layers:
    """Per-layer (1, H, n, D) K and V whose bits are random (every pattern, NaNs included)."""
    rng = np.random.default_rng(seed)
    shape = (1, heads, n, dim)
    layers = []
    for _ in range(n_layers):
        pair = []
        for _ in range(2):
            if dtype == mx.bfloat16:
                a = mx.array(rng.integers(0, 1 << 16, shape, dtype=np.uint16)).view(mx.bfloat16)
            elif dtype == mx.float32:
                a = mx.array(rng.integers(0, 1 << 32, shape, dtype=np.uint32)).view(mx.float32)
            else:
                raise ValueError(dtype)
            pair.append(a)
        layers.append(tuple(pair))
    mx.eval(layers)
    return layers


def concat_kv(a: kv.Layers, b: kv.Layers) -> kv.Layers:
    out = [(mx.concatenate([ka, kb], axis=2), mx.concatenate([va, vb], axis=2))
           for (ka, va), (kb, vb) in zip(a, b)]
    mx.eval(out)
    return out


def slice_kv(layers: kv.Layers, start: int, end: int) -> kv.Layers:
    return [(k[:, :, start:end, :], v[:, :, start:end, :]) for k, v in layers]


def bits(a: mx.array) -> np.ndarray:
    a = mx.contiguous(a)
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    elif a.dtype == mx.float32:
        a = a.view(mx.uint32)
    else:
        raise AssertionError(f"unexpected dtype {a.dtype}")
    return np.array(a)


def assert_kv_bit_equal(got: kv.Layers, want: kv.Layers, what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} layers, want {len(want)}"
    for i, ((gk, gv), (wk, wv)) in enumerate(zip(got, want)):
        for name, g, w in (("K", gk, wk), ("V", gv, wv)):
            assert g.dtype == w.dtype, f"{what}: layer {i} {name} dtype {g.dtype} != {w.dtype}"
            assert g.shape == w.shape, f"{what}: layer {i} {name} shape {g.shape} != {w.shape}"
            assert np.array_equal(bits(g), bits(w)), f"{what}: layer {i} {name} bits differ"


def tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(100, 50_000, n).astype(np.uint32)


# -- the store on disk, read as the worker reads it (read-only, beside the writer) ------------

class Disk:
    def __init__(self, store_dir: Path):
        self.store_dir = store_dir

    def _open(self) -> ColdStore:
        return ColdStore(self.store_dir, readonly=True)

    def record(self, session_id: str, tenant: str = TENANT):
        s = self._open()
        try:
            return s.get_session(tenant, session_id)
        finally:
            s.close()

    def durable(self, session_id: str, tenant: str = TENANT) -> int:
        got = self.record(session_id, tenant)
        return got[0].durable_tokens if got else 0

    def stats(self) -> dict:
        s = self._open()
        try:
            return s.stats()
        finally:
            s.close()

    def blocks(self, ids) -> list[bytes | None]:
        s = self._open()
        try:
            return s.get_blocks(list(ids))
        finally:
            s.close()


def check_record_against_kv(disk: Disk, session_id: str, want: kv.Layers, want_tokens,
                            what: str):
    """Every block the record names exists, decodes, and equals its slice of `want` bitwise."""
    got = disk.record(session_id)
    assert got is not None, f"{what}: no record for {session_id}"
    meta, toks = got
    assert np.array_equal(toks, want_tokens), f"{what}: record's tokens differ"
    ids = meta.block_ids()
    payloads = disk.blocks(ids)
    missing = [i for i, p in enumerate(payloads) if p is None]
    assert not missing, f"{what}: record names blocks {missing} that the store lacks"
    for i, p in enumerate(payloads):
        start = i * meta.block_tokens
        end = start + (meta.tail_tokens if (meta.tail and i == len(ids) - 1) else meta.block_tokens)
        assert_kv_bit_equal(kv.decode_blocks([p]), slice_kv(want, start, end),
                            f"{what}: block {i} [{start}, {end})")
    if payloads:
        assert_kv_bit_equal(kv.decode_blocks(payloads), slice_kv(want, 0, meta.durable_tokens),
                            f"{what}: all blocks concatenated")
    return meta


# -- the coldstore process and the worker's side of the link ----------------------------------


class ColdstoreProc:
    def __init__(self, data_dir: Path, *, max_dirty_s: float = 3600.0,
                 quiet_grace_s: float = 0.05, tail_delay_s: float = 0.0,
                 payload_stall_s: float = 30.0):
        self.layout = Layout(data_dir).ensure()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "apps.cli", "coldstore", "--data-dir", str(data_dir),
             "--quiet-grace-s", str(quiet_grace_s), "--max-dirty-s", str(max_dirty_s),
             "--tail-delay-s", str(tail_delay_s), "--payload-stall-s", str(payload_stall_s)])
        wait_up(self.proc, self.layout)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def wait_up(proc: subprocess.Popen, layout: Layout, timeout_s: float = 30) -> None:
    """Until the coldstore process answers a ping (it must not exit meanwhile)."""
    def up() -> bool:
        assert proc.poll() is None, f"coldstore exited with {proc.returncode}"
        return coldstore_up(layout.coldstore_address)

    wait_until(up, "the coldstore to answer a ping", timeout_s)


class Link:
    """The worker's side: client, writer, bank, and a log of the coldstore's acknowledgements
    (`progress`, `done`, `retired` messages) and of the ops the worker sent unasked."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.disk = Disk(layout.store_dir)
        self.events: list[pb.Message] = []
        self.sent: list[dict] = []  # each send's op, e.g. {"write": pb.Write(...)}
        self._lock = threading.Lock()
        self.client = ColdstoreClient(layout, on_event=self._on_event)
        self.client.start()
        self.writer = KVWriter(self.client, block_tokens=B, root_for=root_for)
        self.bank = SessionBank(block_tokens=B, root_for=root_for, max_bytes=1 << 30,
                                active_pin_s=0, writer=self.writer)
        send = self.client.send

        def recording_send(frames=(), **op):
            self.sent.append(op)
            send(frames=frames, **op)

        self.client.send = recording_send
        self.set_busy(True)

    def _on_event(self, msg: pb.Message) -> None:
        self.writer.deliver(msg)  # the test thread (its owner) applies it
        with self._lock:
            self.events.append(msg)

    def sent_writes(self) -> list[pb.Write]:
        return [op["write"] for op in self.sent if "write" in op]

    def close(self) -> None:
        if self.client is not None:
            self.writer.close()  # its thread sends no more before the link's sockets close
            self.client.close()
            self.client = None

    def ping(self) -> pb.PingReply:
        return self.client.ping(timeout_s=5)

    def set_busy(self, busy: bool, timeout_s: float = 10) -> None:
        """Say busy/quiet and wait until the coldstore has heard it (PUB/SUB joins late)."""
        self.client.set_busy(busy)
        want = "busy" if busy else "quiet"
        wait_until(lambda: self.ping().worker_state == want,
                   f"the coldstore to see the worker {want}", timeout_s, every_s=0.02)

    def put_session(self, session_id: str, toks: np.ndarray) -> int:
        return self.client.put_session(TENANT, session_id, B, toks.tobytes())

    def wait_queued(self, job: int, timeout_s: float = 10) -> None:
        """Until the coldstore holds the job, its first block's payload with it (that block
        could be written from then on)."""
        wait_until(lambda: job in self.ping().jobs, f"the coldstore to hold job {job}",
                   timeout_s, every_s=0.01)

    def turn(self, session_id: str, toks: np.ndarray, layers: kv.Layers, *, write: bool = True):
        """Commit a turn as the engine does: record, bank entry, queued write-behind."""
        self.put_session(session_id, toks)
        e = self.bank.insert((TENANT, session_id), toks, layers)
        if write:
            assert self.writer.write_behind(e) is not None
            self.writer.drain()  # encoded and sent (the kv-encode thread)
        return e

    def done(self, job: int) -> pb.Done | None:
        with self._lock:
            return next((m.done for m in self.events
                         if m.WhichOneof("kind") == "done" and m.done.job == job), None)

    def wait_done(self, job: int, timeout_s: float = 10) -> pb.Done:
        return wait_until(lambda: self.done(job), f"the coldstore's 'done' for job {job}",
                          timeout_s, every_s=0.01)

    def progress(self, job: int) -> list[pb.Progress]:
        with self._lock:
            return [m.progress for m in self.events
                    if m.WhichOneof("kind") == "progress" and m.progress.job == job]

    def wait_durable(self, session_id: str, n: int, timeout_s: float = 10, what: str = "") -> None:
        wait_until(lambda: self.disk.durable(session_id) >= n,
                   f"{what or session_id}: {n} tokens durable", timeout_s, every_s=0.02)


@pytest.fixture
def start(tmp_path):
    """start(max_dirty_s=...) -> (ColdstoreProc, Link); everything is stopped afterwards."""
    procs: list[ColdstoreProc] = []
    links: list[Link] = []

    def _start(**kw) -> tuple[ColdstoreProc, Link]:
        p = ColdstoreProc(tmp_path / "data", **kw)
        procs.append(p)
        link = Link(p.layout)
        links.append(link)
        return p, link

    yield _start
    for link in links:
        link.close()
    for p in procs:
        p.stop()


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
    block = len(kv.encode_range(kv1, 0, B))
    assert link.ping().written_bytes == 2 * block
    assert link.disk.durable("q") == 32, "the young tail was written at once"

    t2 = np.concatenate([t1, tokens(32, seed=13)])  # 4 full blocks + tail of 8
    kv2 = concat_kv(kv1, make_kv(32, seed=13))
    e2 = link.turn("q", t2, kv2)
    link.wait_durable("q", 64, what="turn 2's full blocks")
    assert outcome_of(link.wait_done(e2.write_job, timeout_s=20)) == "written"
    check_record_against_kv(link.disk, "q", kv2, t2, "after the tail delay")
    tail = len(kv.encode_range(kv2, 64, 72))
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
    link.wait_queued(e.write_job)
    assert link.disk.durable("w") == 0
    t0 = time.time()
    assert link.writer.write_out(e, give_up_at=t0 + 10) == "written"
    assert time.time() - t0 < 5
    assert outcome_of(link.wait_done(e.write_job)) == "written"
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
    assert link.writer.write_out(e2, give_up_at=time.time() - 0.5) == "deadline"
    done = link.wait_done(e2.write_job)
    assert outcome_of(done) == "deadline", f"the coldstore did not report the deadline: {done}"
    assert not link.progress(e2.write_job), "a block was committed past the deadline"
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
            payload = kv.encode_range(layers, s, min(s + B, n))
            assert store.commit_block(TENANT, "rt", root, bid, s, payload) is not None
        meta, _ = store.get_session(TENANT, "rt")
        assert meta.durable_tokens == n
        payloads = store.get_blocks(meta.block_ids())
    finally:
        store.close()
    got = kv.decode_blocks(payloads)
    assert_kv_bit_equal(got, layers, f"{dtype} round trip")
    # The worker's own read path (a fresh read-only open) sees the same bits.
    disk = Disk(tmp_path / "store")
    assert_kv_bit_equal(kv.decode_blocks(disk.blocks(ids)), layers, f"{dtype} read-only reopen")


# -- 7. kill -9 mid-write ----------------------------------------------------------------------

def test_kill_9_during_a_write_leaves_only_correct_blocks(start):
    proc, link = start()
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
    proc2, link2 = start()
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
