"""The worker's side of the coldstore for tests: synthetic KV, the store read as the worker
reads it, the coldstore process as the supervisor starts it, and `Link`, the engine's own
KV manager (bank, writer, records, link; worker/tiers/manager.py) over a fake cache kind (a test
seam: full-attention caches holding synthetic KV, no model needed). The test's thread is the
engine's: it commits turns with the engine's commit, pumps the coldstore's word and says busy
or quiet on the worker-state channel as the engine does.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache
from kvbank.coldstore.store import ColdStore
from kvbank.contracts.coldstore_wire import pb
from kvbank.contracts.health import coldstore_up
from kvbank.blocks import chain_root
from kvbank.config import Layout
from kvbank.contracts.store_layout import StoreReader
from tests.waiting import wait_until
from kvbank.worker.kv import arrays, codec
from kvbank.worker.kv.cache_kinds import CacheKinds
from kvbank.worker.tiers.manager import KVManager

B = 16
FP = b"test-coldstore-fingerprint"
TENANT = "acme"


def root_for(tenant: str):
    return chain_root(FP, tenant)


# -- synthetic KV -----------------------------------------------------------------------------

def make_kv(n: int, seed: int, *, dtype=mx.float32, n_layers: int = 2, heads: int = 2,
            dim: int = 8) -> arrays.Layers:
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


def concat_kv(a: arrays.Layers, b: arrays.Layers) -> arrays.Layers:
    out = [(mx.concatenate([ka, kb], axis=2), mx.concatenate([va, vb], axis=2))
           for (ka, va), (kb, vb) in zip(a, b)]
    mx.eval(out)
    return out


def slice_kv(layers: arrays.Layers, start: int, end: int) -> arrays.Layers:
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


def assert_kv_bit_equal(got: arrays.Layers, want: arrays.Layers, what: str) -> None:
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
    """Read-only views of the store. `reader`: the worker's own (one process opens an LMDB
    environment once, and a Link's KV manager holds one); else one opened for each read."""

    def __init__(self, store_dir: Path, reader: Callable[[], StoreReader | None] | None = None):
        self.store_dir, self.reader = store_dir, reader

    def _read(self, how: Callable[[StoreReader], Any]) -> Any:
        if self.reader is not None:
            return how(self.reader())
        s = ColdStore(self.store_dir, readonly=True)
        try:
            return how(s)
        finally:
            s.close()

    def record(self, session_id: str, tenant: str = TENANT):
        return self._read(lambda s: s.get_session(tenant, session_id))

    def durable(self, session_id: str, tenant: str = TENANT) -> int:
        got = self.record(session_id, tenant)
        return got[0].durable_tokens if got else 0

    def stats(self) -> dict:
        return self._read(lambda s: s.stats())

    def blocks(self, ids) -> list[bytes | None]:
        return self._read(lambda s: s.get_blocks(list(ids)))


def check_record_against_kv(disk: Disk, session_id: str, want: arrays.Layers, want_tokens,
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
        assert_kv_bit_equal(codec.decode_blocks([p]), slice_kv(want, start, end),
                            f"{what}: block {i} [{start}, {end})")
    if payloads:
        assert_kv_bit_equal(codec.decode_blocks(payloads), slice_kv(want, 0, meta.durable_tokens),
                            f"{what}: all blocks concatenated")
    return meta


# -- the coldstore process and the worker's side of the link ----------------------------------


class ColdstoreProc:
    """`kvbank coldstore` on `data_dir` with `flags` beside the timings given, or with
    `slow_disk_s` the same on a slow test disk (each block commit takes that long:
    tests/slow_coldstore.py). Answering once constructed."""

    def __init__(self, data_dir: Path, *flags: str, max_dirty_s: float = 3600.0,
                 quiet_grace_s: float = 0.05, tail_delay_s: float = 0.0,
                 payload_stall_s: float = 30.0, slow_disk_s: float | None = None):
        self.layout = Layout(data_dir).ensure()
        cmd = (["-m", "tests.slow_coldstore", "--delay-s", str(slow_disk_s)] if slow_disk_s
               else ["-m", "kvbank.apps.cli", "coldstore"])
        self.proc = subprocess.Popen(
            [sys.executable, *cmd, "--data-dir", str(data_dir),
             "--quiet-grace-s", str(quiet_grace_s), "--max-dirty-s", str(max_dirty_s),
             "--tail-delay-s", str(tail_delay_s), "--payload-stall-s", str(payload_stall_s),
             *flags])
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


class FullAttention:
    """A fake model (a test seam) whose caches are `n_layers` full-attention KVCaches."""

    def __init__(self, n_layers: int):
        self.n_layers = n_layers

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in range(self.n_layers)]


def caches_holding(layers: arrays.Layers) -> list[KVCache]:
    """A finished request's caches, as if it had computed `layers`."""
    cache = FullAttention(len(layers)).make_cache()
    for c, (k, v) in zip(cache, layers):
        c.state = (k, v, k.shape[2])
    return cache


class Link:
    """The worker's side: the engine's KV manager over `n_layers` full-attention layers, and a
    log of the coldstore's acknowledgements (`progress`, `done`, `retired` messages) and of the
    ops the worker sent unasked. The test's thread is the engine's: it pumps the writer."""

    def __init__(self, layout: Layout, n_layers: int = 2):
        self.layout = layout
        self.events: list[pb.Message] = []
        self.sent: list[dict] = []  # each send's op, e.g. {"write": pb.Write(...)}
        self.sent_frames: list[int] = []  # and how many frames went with it
        self._lock = threading.Lock()
        self.kv = KVManager(layout, kinds=CacheKinds(FullAttention(n_layers), "fake"),
                                 fingerprint=FP, block_tokens=B,
                                 bank_bytes=1 << 40,  # no cap's policy acts unasked
                                 active_pin_s=0)
        self.client, self.writer = self.kv.coldstore, self.kv.writer
        self.bank, self.eviction = self.kv.bank, self.kv.eviction
        self.disk = Disk(layout.store_dir, reader=self.kv.restorer.store)
        hear = self.client.on_event  # into the writer's inbox: the test's thread applies it

        def recording(msg: pb.Message) -> None:
            hear(msg)
            with self._lock:
                self.events.append(msg)

        self.client.on_event = recording
        send = self.client.send

        def recording_send(frames=(), **op):
            self.sent.append(op)
            self.sent_frames.append(len(frames))
            send(frames=frames, **op)

        self.client.send = recording_send
        self.set_busy(True)

    def sent_writes(self) -> list[pb.Write]:
        return [op["write"] for op in self.sent if "write" in op]

    def payloads_sent(self) -> int:
        """Block payloads handed to the coldstore: frames, or names of shared memory."""
        n = 0
        for op, frames in zip(self.sent, self.sent_frames):
            msg = op.get("write") or op.get("payload")
            if msg is not None:
                n += len(msg.shm) or frames
        return n

    def close(self) -> None:
        if self.kv is not None:
            self.kv.close()
            self.kv = None
            self.disk.reader = None  # its reads open the store themselves now

    def block_bytes(self, layers: arrays.Layers, start: int = 0, end: int = B) -> int:
        """What one block of `layers` weighs as the writer encodes it (its header names the
        cache layout)."""
        return codec.encoded_views_nbytes(arrays.layer_views(layers), arrays.dtype_name(layers), start, end,
                                       layout=self.kv.kinds.layout)

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

    def turn(self, session_id: str, toks: np.ndarray, layers: arrays.Layers):
        """A turn that computed `layers`, committed by the engine's commit: record, bank
        entry, write-behind job. Its bank entry, its write handed over."""
        session = (TENANT, session_id)
        assert self.kv.commit(session, toks, caches_holding(layers)), "not durable"
        e = self.bank.terminal(session)
        assert e.write_job is not None
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

    def _start(n_layers: int = 2, **kw) -> tuple[ColdstoreProc, Link]:
        p = ColdstoreProc(tmp_path / "data", **kw)
        procs.append(p)
        link = Link(p.layout, n_layers)
        links.append(link)
        return p, link

    yield _start
    for link in links:
        link.close()
    for p in procs:
        p.stop()


