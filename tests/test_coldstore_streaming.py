"""Write jobs whose payloads stream in behind their header: the coldstore starts committing
before the whole job has arrived, and a job whose payloads stop coming does not wait forever.

The rig of tests/coldstore_rig.py: the real coldstore process, real ZeroMQ and LMDB, the
engine's KV manager driven by this test as the worker.
"""

from __future__ import annotations

import time

import pytest
import zmq

from kvbank.contracts.coldstore_wire import outcome_of, pb
from tests.coldstore_rig import (B, TENANT, Link, check_record_against_kv, make_kv,  # noqa: F401
                                 start, tokens)  # start: the fixture

pytestmark = pytest.mark.unit  # make test-fast


class HeldPayloads:
    """Keeps the worker's streamed `payload` messages from leaving, until `release`. Its
    payloads go as frames: the first block's with the header, the others streamed behind
    (in shared memory, a window's names go in one message)."""

    def __init__(self, link: Link):
        self.link, self.send, self.held = link, link.client.send, []
        link.client.send = self._send
        link.writer.shared_memory = False

    def _send(self, frames=(), **op):
        if "payload" in op:
            self.held.append((op, frames))
        else:
            self.send(frames=frames, **op)

    def release(self) -> None:
        self.link.client.send = self.send
        for op, frames in self.held:
            self.send(frames=frames, **op)


def test_the_first_block_is_committed_while_the_rest_are_in_transit(start):
    _, link = start()
    held = HeldPayloads(link)
    n = 4 * B
    t, layers = tokens(n, seed=80), make_kv(n, seed=80)
    job = link.turn("stream", t, layers).write_job
    assert held.held, "the job's later blocks did not travel behind it"
    link.set_busy(False)
    link.wait_durable("stream", B, what="the first block, the rest still held back")
    assert job in link.ping().jobs, "the job ended before the rest of its payloads came"
    held.release()
    assert outcome_of(link.wait_done(job)) == "written"
    assert check_record_against_kv(link.disk, "stream", layers, t, "streamed").durable_tokens == n


def test_a_job_whose_payloads_stop_arriving_ends_and_keeps_what_it_committed(start):
    _, link = start(payload_stall_s=0.5)
    held = HeldPayloads(link)  # the sender "dies" after the job's first message
    n = 4 * B
    t, layers = tokens(n, seed=81), make_kv(n, seed=81)
    e = link.turn("stall", t, layers)
    link.set_busy(False)
    done = link.wait_done(e.write_job)
    assert outcome_of(done) == "error" and "never arrived" in done.error, done
    assert link.ping().staged_bytes == 0, "the stalled job's payloads are still held"
    assert check_record_against_kv(link.disk, "stall", layers, t, "stalled").durable_tokens == B
    held.held.clear()
    held.release()  # the sender is back, and sends the job again
    job = link.writer.write_behind(e)
    assert outcome_of(link.wait_done(job)) == "written"
    assert link.disk.durable("stall") == n


def test_a_write_out_whose_payloads_stop_is_taken_back_whole(start):
    _, link = start(payload_stall_s=0.5)
    HeldPayloads(link)  # never released
    n = 4 * B
    t, layers = tokens(n, seed=82), make_kv(n, seed=82)
    link.put_session("out", t)
    e = link.bank.insert((TENANT, "out"), t, layers)
    job = link.writer.write_behind(e, give_up_at=time.time() + 60)  # a release's write-out
    link.wait_durable("out", B, what="the write-out's first block, before its stall")
    done = link.wait_done(job)
    assert outcome_of(done) == "error" and done.taken_back, done
    assert done.durable_tokens == 0 and link.disk.durable("out") == 0, (
        "a write-out that failed left part of the entry restorable")


def test_a_malformed_write_job_ends_with_an_error_and_the_coldstore_carries_on(start):
    _, link = start()
    # A header that is no request at all: answered ok=False with what failed.
    with zmq.Context.instance().socket(zmq.DEALER) as other:
        other.setsockopt(zmq.LINGER, 0)
        other.connect(link.layout.coldstore_address)
        other.send_multipart([b"\xff not a protobuf header", b"x"])
        assert other.poll(10_000), "the coldstore did not answer a malformed header"
        reply = pb.Message.FromString(other.recv_multipart()[0]).reply
        assert not reply.ok and "not a coldstore request" in reply.error, reply
    write = pb.Write(job=999, tenant=TENANT, session_id="bad", root=b"\0" * 32,
                     blocks=[pb.Block(id=b"\x11" * 32, start=0)])  # no size, no payload
    link.client.send(write=write)
    write = pb.Write(job=1000, tenant=TENANT, session_id="bad", root=b"\0" * 32,
                     blocks=[pb.Block(id=b"\x11" * 32, start=0, nbytes=64)])
    link.client.send(write=write, frames=[b"x" * 65])  # not the size it announced
    assert "announced as 64" in link.wait_done(1000).error
    assert link.ping().queued_jobs == 0  # answered: the coldstore carries on
