"""Write jobs that stream, and blocks dropped for a failed checksum, through the real
coldstore and the worker's link, writer and bank (the Link rig of tests/coldstore_rig.py)."""

from __future__ import annotations

import numpy as np
import psutil
import pytest

from kvbank import heap
from kvbank.blocks import chain_block_ids
from kvbank.contracts.coldstore_wire import pb
from kvbank.contracts.pricing import coldstore_write_bytes
from tests.coldstore_rig import (B, TENANT, check_record_against_kv, concat_kv, make_kv,  # noqa: F401
                                  root_for, start, tokens)
from tests.waiting import wait_until

pytestmark = pytest.mark.unit  # make test-fast


def test_a_corrupt_block_shared_by_two_sessions_is_dropped_from_both(start):
    """DropBlocks (a restore found the block's checksum wrong): the block goes, and each
    record that names it keeps only what comes before it; the others' blocks stay."""
    _, link = start()
    prefix_t, prefix_kv = tokens(3 * B, seed=1), make_kv(3 * B, seed=1)
    a_t = np.concatenate([prefix_t, tokens(B + 5, seed=2)])
    b_t = np.concatenate([prefix_t, tokens(7, seed=3)])
    link.turn("a", a_t, concat_kv(prefix_kv, make_kv(B + 5, seed=2)))
    link.turn("b", b_t, concat_kv(prefix_kv, make_kv(7, seed=3)))
    link.set_busy(False)
    link.wait_durable("a", len(a_t))
    link.wait_durable("b", len(b_t))
    shared = [bid.hex() for bid in chain_block_ids(prefix_t, root_for(TENANT), B)]

    link.client.send(drop_blocks=pb.DropBlocks(ids=[bytes.fromhex(shared[1])]))
    wait_until(lambda: len(link.disk.record("a")[0].blocks) == 1
               and len(link.disk.record("b")[0].blocks) == 1, "both records cut short")
    for name in ("a", "b"):
        meta = link.disk.record(name)[0]
        assert meta.blocks == shared[:1] and meta.tail is None and meta.durable_tokens == B
    st = link.disk.stats()
    assert st["blocks"] == 1 and st["sessions"] == 2, st  # the first shared block alone


def test_a_write_streams_a_window_of_blocks_ahead_of_the_commits(start):
    """The coldstore is handed a window of blocks, and each commit lets the next go: it never
    holds the entry whole. The record ends up whole and bitwise equal."""
    _, link = start()  # the rig says busy: the idle lane commits nothing yet
    n = 10 * B
    t, layers = tokens(n, seed=20), make_kv(n, seed=20)
    block = link.block_bytes(layers)
    link.writer.window_bytes = 2 * block
    link.turn("big", t, layers)
    wait_until(lambda: link.ping().staged_bytes == 2 * block, "the first window staged")
    assert link.payloads_sent() == 2  # the window; the third block waits for a commit
    # The worker's ledger counts what the coldstore holds for the write: the window, and
    # LMDB's copy and the pages it keeps for the next (`coldstore_write_bytes`).
    link.writer.pump()
    assert link.writer.handed_over_bytes == 2 * block
    assert link.writer.staged_bytes == 2 * block + coldstore_write_bytes(block)
    link.set_busy(False)
    wait_until(lambda: link.writer.pump() >= 0 and link.disk.durable("big") >= n,
               "the whole entry written, a window at a time")
    wait_until(lambda: link.writer.pump() >= 0 and link.writer.staged_bytes == 0,
               "the ledger's share of the write to go with it")
    check_record_against_kv(link.disk, "big", layers, t, "streamed")
    assert link.payloads_sent() == 10


def test_a_stream_stops_when_a_request_takes_its_entry_and_goes_on_when_given_back(start):
    """The conversation's next turn takes the entry over: the stream stops at the next
    commit (its job cancelled, the entry marked to be sent again); given back, it is."""
    _, link = start()
    n = 8 * B
    t, layers = tokens(n, seed=21), make_kv(n, seed=21)
    link.writer.window_bytes = link.block_bytes(layers)
    e = link.turn("taken", t, layers)
    link.bank.hand_over(e)
    link.set_busy(False)
    wait_until(lambda: link.writer.pump() >= 0 and e.write_job is None, "the stream to stop")
    link.writer.drain()  # the cancel leaves through the kv-encode thread
    assert e.write_pending and any("cancel" in op for op in link.sent)
    assert link.disk.durable("taken") < n
    link.bank.take_back(e)
    assert link.writer.write_behind(e) is not None  # what retry_writes does with it
    wait_until(lambda: link.writer.pump() >= 0 and link.disk.durable("taken") >= n,
               "the rest written")
    check_record_against_kv(link.disk, "taken", layers, t, "given back")


def test_an_encode_buffer_is_written_again_only_once_zeromq_let_go_of_its_frame():
    """The kv-encode thread encodes blocks into buffers it reuses (worker/link/writer.py
    `EncodeBuffers`). A frame still queued in ZeroMQ keeps its buffer: the next block goes into
    another, so what arrives is what was encoded; once ZeroMQ let go, the buffer is reused."""
    import zmq

    from kvbank.worker.link.writer import EncodeBuffers

    n = 256 << 10  # above pyzmq's copy threshold: the frame is the buffer itself
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    pull.bind("inproc://buffers-test")
    push.connect("inproc://buffers-test")
    try:
        buffers = EncodeBuffers(keep_bytes=4 * n)
        address = lambda frame: np.frombuffer(frame.buffer, np.uint8).ctypes.data  # noqa: E731
        sent, trackers = [], []
        for fill in (1, 2):
            frame = buffers.frame(n, lambda out, fill=fill: out.__setitem__(slice(None),
                                                                            bytes([fill]) * n))
            sent.append(address(frame))
            trackers.append(frame.tracker)
            push.send(frame, copy=False)
            del frame  # as the kv-encode thread lets go of its frames once sent
        assert sent[0] != sent[1]  # the first frame is still in ZeroMQ's queue
        got = [pull.recv(copy=False) for _ in range(2)]
        assert [bytes(g.buffer) for g in got] == [b"\x01" * n, b"\x02" * n]
        del got
        wait_until(lambda: all(t.done for t in trackers), "ZeroMQ letting go of both frames")
        again = buffers.frame(n, lambda out: out.__setitem__(slice(None), b"\x03" * n))
        assert address(again) in sent  # a buffer back from ZeroMQ, not a new one
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


def _minor_faults(pid: int) -> int:
    """Pages a process has faulted in so far (/proc's minflt)."""
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[7])


@pytest.mark.skipif(not heap.glibc(), reason="glibc's allocator settings")
def test_blocks_past_glibcs_mmap_threshold_reuse_the_coldstores_pages_then_go_back(start):
    """Blocks larger than any mmap threshold glibc takes (as a hybrid model's checkpoints
    are: 154 MB for Qwen3.6-27B): the coldstore receives and commits each into pages the ones
    before it freed, not pages faulted in afresh (CPU a write shares with decode), and once it
    is idle its memory is back where it was."""
    proc, link = start(n_layers=1)
    pid = proc.proc.pid
    n = 6 * B
    t, layers = tokens(n, seed=30), make_kv(n, seed=30, n_layers=1, heads=72, dim=4096)
    block = link.block_bytes(layers)
    assert block > 32 << 20
    rss = lambda: psutil.Process(pid).memory_info().rss  # noqa: E731
    before_rss, before_faults = rss(), _minor_faults(pid)
    link.set_busy(False)
    link.turn("big", t, layers)
    wait_until(lambda: link.writer.pump() >= 0 and link.disk.durable("big") >= n,
               "the whole entry written, a window at a time")
    faults = _minor_faults(pid) - before_faults
    # Afresh, each block is faulted in twice (ZeroMQ's buffer, LMDB's pages): 12 blocks' pages.
    assert faults < 4 * block // 4096, f"{faults} page faults for 6 blocks of {block} bytes"
    check_record_against_kv(link.disk, "big", layers, t, "large blocks")
    wait_until(lambda: rss() < before_rss + block // 2,
               f"the coldstore's freed pages to go back (RSS {rss()}, {before_rss} before)")
