"""`kvbank bench scale`'s yardsticks: the disk beside each restore and each write, and the
memory of every process through each phase.

- `ReadProbe`: a restore's read phase. The restore reads through the store's
  `StoreReader.get_blocks(ids, decode=...)` (kvbank/contracts/store_layout.py): py-lmdb faults
  every page of a value in as it is got, so the get loop, on a thread of its own, is the read,
  and `decode` copies each block once it is got (the two overlap). The probe wraps that one
  call: the block ids read, their bytes (the sum of the values' lengths: what was read, every
  checkpoint-bearing block in the chain included), the get loop's seconds (`Reading.read_s`)
  and the call's I/O counters.
- `Disk`: a process of its own (spawned; its memory is not the worker's) that reads the same
  blocks of the same store file cold with a no-copy `get` loop (apps/bench/disk.py
  `raw_get`), writes as the
  coldstore writes (`raw_lmdb_write`: one synced commit a block, the coldstore's env flags and
  heap settings) and as fast as a file takes bytes (`file_write`: sequential, one fsync at the
  end: the ceiling), and times the VM's fresh memory (`fresh_page_mb_s`: how fast new pages
  are handed out, which moved writes by 3x here from one minute to the next).
- `Memory`: the worker's process (this one) and the coldstore's, summed, through named phases:
  the sampled peak of what they hold themselves (RssAnon + RssShmem, every 20 ms) and the sum
  of their kernel high-water marks (VmHWM, reset at each phase's start: file pages mapped
  included, and no spike between samples missed).

I/O counters (apps/bench/disk.py `io_counters`) are the kernel's for a process: /proc/PID/io
`read_bytes` (bytes it caused to be fetched from storage) and /proc/PID/stat's major faults.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from kvbank.apps.bench.disk import cpu_s, delta, io_counters


class ReadProbe:
    """Wraps a `StoreReader`'s `get_blocks` (the restorer's own reader) and records each call
    made with `decode`: ids, bytes, the read phase's and decode's seconds and I/O."""

    def __init__(self):
        self.calls: list[dict] = []
        self._wrapped: set[int] = set()

    def attach(self, store) -> None:
        if store is None or id(store) in self._wrapped:
            return
        self._wrapped.add(id(store))
        inner = store.get_blocks
        probe = self

        def get_blocks(ids, decode=None):
            if decode is None:
                return inner(ids)
            call = {"ids": [bytes(b) for b in ids], "io0": io_counters()}
            seen = []

            def timed(views, done_with=None):
                seen.append(views)
                return decode(views, done_with=done_with)

            try:
                return inner(ids, decode=timed)
            finally:  # the gets have ended: `get_blocks` joins them before it returns
                call["io_read"] = delta(io_counters(), call.pop("io0"))
                if seen:
                    call["read_s"], call["bytes"] = seen[0].read_s, seen[0].nbytes
                probe.calls.append(call)

        store.get_blocks = get_blocks

    def take(self) -> list[dict]:
        got, self.calls = self.calls, []
        return got


class Disk:
    """The yardsticks' process (module docstring)."""

    def __init__(self):
        from concurrent.futures import ProcessPoolExecutor
        from multiprocessing import get_context

        self.child = ProcessPoolExecutor(1, mp_context=get_context("spawn"))

    def call(self, fn, *args):
        return self.child.submit(fn, *args).result()

    def close(self) -> None:
        self.child.shutdown()


def _coldstore_heap() -> str:
    """The coldstore's heap settings in this process (coldstore/server.py), so the matched
    writer allocates as the coldstore does."""
    from kvbank import heap
    from kvbank.coldstore.server import KEEP_FREED_BYTES

    ok = heap.glibc() and (heap.mallopt(heap.M_ARENA_MAX, 1) and heap.mallopt(heap.M_MMAP_MAX, 0)
                           and heap.mallopt(heap.M_TRIM_THRESHOLD, KEEP_FREED_BYTES))
    return "the coldstore's (one arena, no mmap, freed pages kept)" if ok else "glibc defaults"


def raw_lmdb_write(path: Path, n_blocks: int, block_bytes: int) -> dict:
    """The matched writer: `n_blocks` blocks of `block_bytes` put into a new LMDB environment
    with the coldstore's flags (readahead, sync, metasync; no writemap), one synced commit a
    block, under the coldstore's heap settings: seconds and CPU seconds."""
    import lmdb

    heap = _coldstore_heap()
    path.mkdir(parents=True, exist_ok=True)
    payload = os.urandom(block_bytes)
    env = lmdb.open(str(path), map_size=1 << 40, readahead=True, sync=True, metasync=True)
    cpu0, io0 = cpu_s(), io_counters()
    t0 = time.perf_counter()
    for i in range(n_blocks):
        with env.begin(write=True) as txn:
            txn.put(i.to_bytes(16, "big"), payload)
    dt = time.perf_counter() - t0
    env.close()
    return {"s": dt, "bytes": n_blocks * block_bytes, "cpu_s": cpu_s() - cpu0,
            "io": delta(io_counters(), io0), "heap": heap}


def file_write(path: Path, n_blocks: int, block_bytes: int) -> dict:
    """The ceiling: `n_blocks` blocks of `block_bytes` written to one new file in order, one
    fsync at the end (what the disk takes from a writer with nothing to commit between)."""
    payload = os.urandom(block_bytes)
    path.parent.mkdir(parents=True, exist_ok=True)
    cpu0, io0 = cpu_s(), io_counters()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(n_blocks):
            os.write(fd, payload)
        os.fsync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    return {"s": dt, "bytes": n_blocks * block_bytes, "cpu_s": cpu_s() - cpu0,
            "io": delta(io_counters(), io0)}


def fresh_page_mb_s(nbytes: int = 256 << 20) -> float:
    """MB/s at which this VM hands out new pages: `nbytes` of anonymous memory mapped, one
    byte written in each page, unmapped (the memory phase a write pair ran in)."""
    import mmap

    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        page = mmap.PAGESIZE
        t0 = time.perf_counter()
        for off in range(0, nbytes, page):
            m[off] = 1
        return nbytes / (time.perf_counter() - t0) / 1e6
    finally:
        m.close()


def remove(path: Path) -> None:
    import shutil

    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


def _status(pid: int | str, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def own_bytes(pid: int | str = "self") -> int:
    """What a process holds itself: RssAnon + RssShmem (its file pages are the page cache's)."""
    return _status(pid, "RssAnon") + _status(pid, "RssShmem")


def held_bytes(pids) -> int:
    """What the processes hold together: each one's RssAnon, and shared memory once (the
    largest RssShmem: the coldstore maps a part of the worker's payload buffers,
    worker/link/shared_buffers.py)."""
    pids = list(pids)
    return (sum(_status(p, "RssAnon") for p in pids)
            + max((_status(p, "RssShmem") for p in pids), default=0))


class Memory:
    """The worker's and the coldstore's memory through named phases (module docstring)."""

    def __init__(self, pids: dict[str, int | str], every_s: float = 0.02):
        self.pids, self.every_s = pids, every_s
        self.phases: dict[str, dict] = {}
        self._phase: str | None = None
        self._peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            now = held_bytes(self.pids.values())
            with self._lock:
                self._peak = max(self._peak, now)

    def _reset_hwm(self) -> bool:
        """VmHWM back to the present RSS (writing 5 to clear_refs), for each process."""
        ok = True
        for pid in self.pids.values():
            try:
                Path(f"/proc/{pid}/clear_refs").write_text("5")
            except OSError:
                ok = False
        return ok

    def phase(self, name: str | None) -> None:
        """The phase `name` begins (None: the last one ends)."""
        if self._phase is not None:
            with self._lock:
                peak, self._peak = self._peak, 0
            hwm = {k: _status(p, "VmHWM") for k, p in self.pids.items()}
            was = self.phases.get(self._phase)  # a phase met again: its peaks over both
            if was is not None and was["hwm_sum_bytes"] > sum(hwm.values()):
                hwm = was["hwm_bytes"]
            self.phases[self._phase] = {
                "peak_own_bytes": max(peak, was["peak_own_bytes"] if was else 0),
                "hwm_bytes": hwm, "hwm_sum_bytes": sum(hwm.values()),
                "hwm_reset": self._hwm_reset}
        self._phase = name
        if name is not None:
            self._hwm_reset = self._reset_hwm()
            with self._lock:
                self._peak = held_bytes(self.pids.values())

    def stop(self) -> dict:
        self.phase(None)
        self._stop.set()
        self._thread.join()
        return self.phases
