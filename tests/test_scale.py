"""Scale: a conversation of a gigabyte through the real bank, writer and coldstore (the Link
rig of tests/coldstore_rig.py), its memory sampled through the write. Apart from the unit
tier (`make test-fast`): it moves a gigabyte."""

from __future__ import annotations

import threading
import time

from tests.coldstore_rig import B, make_kv, start, tokens  # noqa: F401 (start: a fixture)
from tests.waiting import wait_until


def test_a_gigabyte_conversation_is_written_without_a_copy_of_it(start):
    """1 GiB of KV (16K tokens of 64 KiB) through the real bank, writer and coldstore: the
    worker's side never grows by more than the write's window and a few blocks, nor does the
    coldstore's (RSS sampled every few ms through the write), and every block lands whole."""
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
