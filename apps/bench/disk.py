"""The disk as a yardstick: cold reads of a store's blocks, and the kernel's counters that say
whether a read reached the disk.

- `drop_caches`: the next read of a file comes from the disk: the whole page cache dropped
  where this process may (root, /proc/sys/vm/drop_caches), else the file's own pages
  (posix_fadvise), which the kernel may keep; it says which. Pages a process has mapped stay
  either way: a cold read needs every other reader to have let go of them.
- `raw_get`: blocks of a kvbank store read in order with py-lmdb's `get`, in one read txn, no
  copy: py-lmdb faults every page of a value in as it returns it, so this is the read a
  restore's `get` loop does, and nothing after it.
- `io_counters`: /proc/PID/io `read_bytes` (what a process caused to be fetched from storage)
  and its major faults, to put beside every timed read.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def io_counters(pid: int | str = "self") -> dict:
    """The kernel's I/O and fault counters of a process (all its threads)."""
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return {"read_bytes": int(io["read_bytes"]), "write_bytes": int(io["write_bytes"]),
            "rchar": int(io["rchar"]), "minflt": int(stat[7]), "majflt": int(stat[9])}


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def drop_caches(path: Path | None = None) -> str:
    """Make the next read of `path` (a file) come from the disk (module docstring)."""
    if path is not None and Path(path).is_file():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return "dropped (drop_caches)"
    except OSError:
        return "this file's pages dropped (posix_fadvise): the kernel may keep some"


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def raw_get(store_dir: Path, ids: list[bytes]) -> dict:
    """The blocks `ids` of the store at `store_dir` read with py-lmdb's `get` in order, in one
    read txn, no copy: seconds, bytes, I/O counters, CPU seconds."""
    import lmdb

    env = lmdb.open(str(store_dir), readonly=True, lock=False, readahead=True, max_dbs=16)
    try:
        db = env.open_db(b"blocks", create=False)
        io0, cpu0 = io_counters(), cpu_s()
        t0 = time.perf_counter()
        n = 0
        with env.begin(db=db, buffers=True) as txn:
            for i, bid in enumerate(ids):
                got = txn.get(bid)
                if got is None:
                    raise KeyError(f"block {i} of {len(ids)} ({bid.hex()}) is not in the store")
                n += len(got)
        dt = time.perf_counter() - t0
        return {"s": dt, "bytes": n, "io": delta(io_counters(), io0), "cpu_s": cpu_s() - cpu0}
    finally:
        env.close()


def session_blocks(store_dir: Path, tenant: str, session_id: str) -> list[bytes]:
    """The ids of a conversation's stored full blocks, in order, from its record: what a
    restore of it reads, less its tail block (fewer than a block's tokens), which the turn's
    commit replaces, so that a read after the turn finds it no more."""
    from kvbank.contracts.store_layout import StoreReader

    reader = StoreReader(store_dir, readonly=True)
    try:
        got = reader.get_session(tenant, session_id)
        return [bytes.fromhex(h) for h in got[0].blocks] if got else []
    finally:
        reader.close()
