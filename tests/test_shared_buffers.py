"""Block payloads in shared memory between the worker and the coldstore: the worker's buffers
are lent until the coldstore is done with them, and where shared memory cannot be had the
KV still goes, as frames. Real POSIX shared memory; the coldstore's side in this process."""

from __future__ import annotations

from multiprocessing import shared_memory

import pytest

from kvbank.coldstore.shared import SharedPayloads
from kvbank.contracts.coldstore_wire import SHM_PROBE, outcome_of
from kvbank.worker.link import shared_buffers, writer
from kvbank.worker.link.shared_buffers import SharedBuffers
from tests.coldstore_rig import (B, TENANT, check_record_against_kv, make_kv, start,  # noqa: F401
                                 tokens)
from tests.waiting import wait_until

pytestmark = pytest.mark.unit  # make test-fast

MB = 1 << 20


def fill(byte: int):
    return lambda out: out.__setitem__(slice(None), bytes([byte]) * len(out))


def exists(name: str) -> bool:
    try:
        shared_memory.SharedMemory(name=name).close()
    except FileNotFoundError:
        return False
    return True


@pytest.fixture
def buffers():
    b = SharedBuffers(keep_bytes=8 * MB)
    yield b
    b.close()


def test_a_buffer_is_reused_only_once_the_coldstore_committed_its_block(buffers):
    first = buffers.take(1, MB, fill(1))
    second = buffers.take(1, MB, fill(2))
    assert first != second
    coldstore = SharedPayloads()
    assert bytes(coldstore.view(first, MB)) == b"\1" * MB
    assert buffers.take(2, MB, fill(3)) not in (first, second), "a lent buffer was reused"
    buffers.committed(1)  # the job's first block: its buffer is free
    assert buffers.take(2, MB, fill(4)) == first
    assert bytes(coldstore.view(first, MB)) == b"\4" * MB  # what the coldstore now reads
    assert bytes(coldstore.view(second, MB)) == b"\2" * MB  # still lent, untouched
    coldstore.close_all()


def test_a_job_that_ended_gives_its_buffers_back_and_sends_nothing_more(buffers):
    buffers.take(1, MB, fill(1))
    buffers.take(1, 2 * MB, fill(1))
    assert buffers.lent_bytes() == 3 * MB
    buffers.ended(1)  # done at the coldstore (cancelled, superseded, failed)
    assert buffers.lent_bytes() == 0
    buffers.take(1, MB, fill(1))  # a send encoded before the news came
    assert buffers.gone(1) and buffers.lent_bytes() == 0
    assert not buffers.gone(2)


def test_buffers_let_go_are_unlinked_and_named_for_the_coldstore(buffers):
    names = [buffers.take(1, 3 * MB, fill(i)) for i in range(4)]
    for _ in names:
        buffers.committed(1)
    # Kept: 8 MB of the smallest, and the largest; the fourth 3 MB buffer goes.
    gone = buffers.released()
    assert len(gone) == 1 and gone[0] in names and not exists(gone[0])
    assert buffers.released() == []
    buffers.clear()  # a quiet second: every free one goes
    assert sorted(buffers.released()) == sorted(set(names) - set(gone))
    assert not any(exists(n) for n in names)


def test_without_room_in_shared_memory_a_block_goes_as_a_frame(buffers, monkeypatch):
    """A full /dev/shm (a container's 64 MB): writing into a buffer there would kill the
    worker with SIGBUS; none is made, and the block keeps its place in the job's order."""
    class Full:
        f_bavail, f_frsize = 0, 4096

    monkeypatch.setattr(shared_buffers.os, "statvfs", lambda path: Full)
    assert buffers.take(1, MB, fill(1)) is None
    monkeypatch.undo()
    second = buffers.take(1, MB, fill(2))
    buffers.committed(1)  # the frame's block
    assert buffers.lent_bytes() == MB  # the second block's buffer is still lent
    buffers.committed(1)
    assert buffers.lent_bytes() == 0 and buffers.take(2, MB, fill(3)) == second


def test_the_coldstore_reads_the_probe_and_refuses_what_is_not_there(buffers):
    coldstore = SharedPayloads()
    probe = shared_buffers.make_buffer("kvbtestprobe", shared_buffers.PAGE)
    try:
        probe.buf[:len(SHM_PROBE)] = SHM_PROBE
        assert coldstore.probe(probe.name, SHM_PROBE)
        probe.buf[:4] = b"nope"
        assert not coldstore.probe(probe.name, SHM_PROBE)
    finally:
        shared_buffers.release(probe)
    assert not coldstore.probe("kvbtestprobe", SHM_PROBE)
    with pytest.raises(ValueError, match="kvbnosuchbuffer"):
        coldstore.view("kvbnosuchbuffer", 10)
    name = buffers.take(1, MB, fill(1))
    with pytest.raises(ValueError, match="announced"):
        coldstore.view(name, 2 * MB)
    coldstore.close_all()


def written(link, name: str, n_blocks: int, seed: int):
    """A conversation of `n_blocks` blocks committed and written behind: its tokens and KV."""
    t, layers = tokens(n_blocks * B, seed=seed), make_kv(n_blocks * B, seed=seed)
    link.set_busy(False)
    e = link.turn(name, t, layers)
    assert outcome_of(link.wait_done(e.write_job)) == "written"
    return t, layers


def test_a_write_goes_in_shared_memory_and_its_buffers_come_back(start):
    _, link = start()
    link.writer.shared_min_bytes = 0  # the rig's blocks are a few KB: shared all the same
    t, layers = written(link, "shm", 6, seed=40)
    (write,) = link.sent_writes()
    assert len(write.shm) == len(write.blocks) and all(write.shm)
    check_record_against_kv(link.disk, "shm", layers, t, "through shared memory")
    wait_until(lambda: link.writer.pump() >= 0 and link.writer.shared_lent_bytes() == 0,
               "every buffer given back")


def test_a_coldstore_that_cannot_map_our_memory_gets_frames(start, monkeypatch):
    """The probe fails (another machine, another IPC namespace): the KV goes as frames."""
    monkeypatch.setattr(writer, "make_buffer", lambda name, nbytes: None)
    _, link = start()
    t, layers = written(link, "frames", 3, seed=41)
    assert link.writer.shared_memory is False
    assert not any(w.shm for w in link.sent_writes()) and link.payloads_sent() == 3
    check_record_against_kv(link.disk, "frames", layers, t, "as frames")


def test_a_write_naming_memory_that_is_gone_ends_in_error_and_the_coldstore_goes_on(start):
    """Its worker died and its buffers went with it: the job ends in error, named; the next
    write is written."""
    from kvbank.contracts.coldstore_wire import pb

    _, link = start()
    write = pb.Write(job=link.client.next_id(), tenant=TENANT, session_id="gone",
                     root=bytes(16))
    write.blocks.add(id=bytes(16), start=0, nbytes=1024)
    link.client.send_write(write, ["kvbnosuchbuffer"])
    done = link.wait_done(write.job)
    assert outcome_of(done) == "error" and "kvbnosuchbuffer" in done.error, done
    t, layers = written(link, "after", 2, seed=42)
    check_record_against_kv(link.disk, "after", layers, t, "after a bad write")
