"""Scale: a conversation of a gigabyte through the real bank, writer and coldstore (the Link
rig of tests/coldstore_rig.py), its memory sampled through the write. Apart from the unit
tier (`make test-fast`): it moves a gigabyte."""

from __future__ import annotations

import threading
import time

from kvbank.blocks import chain_block_ids
from tests.coldstore_rig import (B, TENANT, assert_kv_bit_equal, make_kv, root_for,  # noqa: F401
                                 start, tokens)  # start: a fixture
from tests.waiting import wait_until


def test_a_gigabyte_conversation_is_written_and_restored_without_a_copy_of_it(start):
    """1 GiB of KV (16K tokens of 64 KiB) through the real bank, writer and coldstore: the
    worker's side never grows by more than the write's window and a few blocks, nor does the
    coldstore's (RSS sampled every few ms through the write), and every block lands whole;
    then restored from LMDB by the worker's restorer, holding a few blocks of the file at a
    time."""
    import psutil

    proc, link = start(n_layers=8)
    n = 1024 * B
    t, layers = tokens(n, seed=30), make_kv(n, seed=30, n_layers=8, heads=8, dim=128)
    block = link.block_bytes(layers)
    assert sum(k.nbytes + v.nbytes for k, v in layers) == 1 << 30
    slack = link.writer.window_bytes + 8 * block + (48 << 20)  # the window, a few blocks, noise
    me, coldstore = psutil.Process(), psutil.Process(proc.proc.pid)
    base = (me.memory_info().rss, coldstore.memory_info().rss)
    peak = list(base)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for i, p in enumerate((me, coldstore)):
                peak[i] = max(peak[i], p.memory_info().rss)
            time.sleep(0.003)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        link.set_busy(False)
        link.turn("gig", t, layers)
        wait_until(lambda: link.writer.pump() >= 0 and link.disk.durable("gig") >= n,
                   "1 GiB written", timeout_s=300)
    finally:
        done.set()
        sampler.join()
    assert peak[0] - base[0] <= slack, f"the worker grew by {(peak[0] - base[0]) >> 20} MiB"
    assert peak[1] - base[1] <= slack, f"the coldstore grew by {(peak[1] - base[1]) >> 20} MiB"
    assert link.disk.stats()["block_bytes"] >= 1 << 30

    # Back from SSD: what the worker maps of LMDB's file while it reads the gigabyte stays a
    # small part of it (each block's pages leave its resident set once read, and again once
    # copied; a few blocks here, up to 71 MiB on a loaded machine), beside the arrays it
    # restores into. Its pages of the file sampled through the restore (smaps).
    import numpy as np

    released = link.eviction.release_sessions(None, reason="test", write_out_before_release=True)
    assert released.released_entries == 1 and not link.bank.entries
    prompt = np.concatenate([t, tokens(1, seed=31)])
    ids = chain_block_ids(prompt, root_for(TENANT), B)
    data = link.layout.store_dir / "data.mdb"
    file_base = _rss_of(data)
    file_peak, done = [file_base], threading.Event()

    def sample_file() -> None:
        while not done.is_set():
            file_peak[0] = max(file_peak[0], _rss_of(data))
            time.sleep(0.003)

    sampler = threading.Thread(target=sample_file, daemon=True)
    sampler.start()
    try:
        got = link.kv.restorer.ssd_prefix(prompt, ids, TENANT, (TENANT, "gig"),
                                                better_than=0)
    finally:
        done.set()
        sampler.join()
    restored, _, n_restored = got
    assert n_restored == n
    assert_kv_bit_equal(restored[:1], [tuple(a for a in layers[0])], "layer 0 restored")
    assert file_peak[0] - file_base <= (1 << 30) // 8, (  # without: all of it (1,028 MiB)
        f"the restore mapped {(file_peak[0] - file_base) >> 20} MiB of LMDB's file at once")


def _rss_of(path) -> int:
    """This process's resident pages of the file at `path` (LMDB's map of it), in bytes."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if not line[0].isupper():  # a mapping's first line: its range and file
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total
