"""Hands bank entries' KV to the coldstore: write-behind after each turn, write-out before a
release. The worker's side of a write job; the coldstore's is coldstore/lanes.py.

A write streams: the coldstore is handed a job's header (every block's id and size) and the
payloads of its first blocks, up to `window_bytes`; each block it commits (`progress`) lets
the next ones go. A write's extra memory is that window (and up to as much again of encode
buffers kept for the next blocks, `EncodeBuffers`), whatever the entry's size, and views of
the entry's arrays live only while a batch of blocks is encoded. A stream goes on while its
entry is in the bank: an entry a request took over (its next turn) stops its stream, and that
turn's commit writes on from the durable extent.

The writer's state belongs to one thread, its owner (the engine thread in the worker; a
test's own thread in a rig). Two other threads only post to its `inbox`: the coldstore link's
I/O thread (acknowledgements: progress, done, retired) and the `kv-encode` thread (a job's
blocks are encoded and on their way). The owner applies them in order (`pump`), at every turn
of its loop and while a write-out waits, so nothing here needs a lock.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import zmq

from kvbank.blocks import tail_block_id
from kvbank.contracts import coldstore_wire as wire
from kvbank.contracts.pricing import coldstore_write_bytes
from kvbank.contracts.vocabulary import FAILED_OUTCOMES, Outcome
from kvbank.worker.kv.arrays import dtype_name, layer_views
from kvbank.worker.kv.codec import encode_views, encoded_views_nbytes
from kvbank.worker.link.client import ColdstoreClient, ColdstoreUnavailable
from kvbank.worker.link.shared_buffers import (MIN_BYTES, PAGE, SharedBuffers, make_buffer,
                                               release)

logger = logging.getLogger(__name__)

RELEASE_WRITE_OUT_MAX_S = 30.0
STREAM_WINDOW_BYTES = 64 << 20  # a job's blocks sent and not yet committed (at least one)
_KEEP_OUTCOMES = 4096  # finished jobs remembered (a write-out may ask after its job ended)
SHM_PROBE_EVERY_S = 5.0  # while the coldstore does not answer whether it sees shared memory
BUFFERS_IDLE_S = 1.0  # the kv-encode thread's buffers go back this long after its last send


class Records(Protocol):
    """Where the writer reports what became of an entry's write (worker/tiers/bank.py, the
    one writer of an entry's fields, records it)."""

    def write_queued(self, entry, job: int) -> None: ...
    def write_deferred(self, entry) -> None: ...
    def write_stopped(self, entry, job: int) -> None: ...
    def write_cancelled(self, entry) -> None: ...
    def written(self, entry) -> None: ...


def default_staging_max_bytes() -> int:
    """1 GiB or 10 % of RAM, whichever is smaller."""
    import psutil

    return min(1 << 30, psutil.virtual_memory().total // 10)


@dataclass(slots=True)
class _Stream:
    """A write job's blocks still to send (the owner's): `ranges` [start, end) and encoded
    `sizes` of every block, the first `sent` of them handed to the kv-encode thread."""

    entry: object  # worker/tiers/bank.py BankEntry
    write: object  # its pb.Write header
    ranges: list[tuple[int, int]]
    sizes: list[int]
    sent: int = 0
    committed: int = 0


class EncodeBuffers:
    """Buffers the kv-encode thread encodes blocks into and reuses (its own state).

    A new 16 MB buffer is faulted in page by page, and on a VM that costs more than the copy
    into it: sending one 16 MB block of Qwen3.6-27B's KV took the kv-encode thread 4-14 ms of
    CPU into new buffers and 2.2-2.6 ms into reused ones (this 2-core VM, Dec 2026), CPU the
    engine's decode shares. A buffer is written again only once ZeroMQ has let go of the frame
    made of it (its tracker is done). Free ones are kept up to `keep_bytes` (the smallest
    first), and all go back after BUFFERS_IDLE_S without a send (`clear`)."""

    def __init__(self, keep_bytes: int):
        self.keep_bytes = keep_bytes
        self._free: list[bytearray] = []
        self._lent: list[tuple[bytearray, zmq.MessageTracker]] = []

    def frame(self, nbytes: int, fill: Callable[[memoryview], object]) -> zmq.Frame:
        """A frame of `nbytes` that `fill` writes, in a buffer of ours."""
        buf = self._take(nbytes)
        view = memoryview(buf)[:nbytes]
        fill(view)
        frame = zmq.Frame(view, track=True)
        self._lent.append((buf, frame.tracker))
        return frame

    def _take(self, nbytes: int) -> bytearray:
        back = [b for b, t in self._lent if t.done]
        self._lent = [(b, t) for b, t in self._lent if not t.done]
        free, kept = [], 0
        for buf in sorted(self._free + back, key=len):  # the smallest, up to keep_bytes
            if kept + len(buf) <= self.keep_bytes:
                free.append(buf)
                kept += len(buf)
        self._free = free
        for i, buf in enumerate(free):
            if len(buf) >= nbytes:
                return free.pop(i)
        return bytearray(nbytes)

    def clear(self) -> None:
        self._free.clear()
        self._lent = [(b, t) for b, t in self._lent if not t.done]


@dataclass(frozen=True, slots=True)
class Encoded:
    """Posted by the kv-encode thread: the job's blocks are encoded (`nbytes`) and sent."""

    job: int
    nbytes: int


class KVWriter:
    """Hands bank entries' KV to the coldstore.

    `write_behind` queues an entry's blocks past its durable extent on the idle lane (the
    default after every turn). `write_out` is the release's path: it promotes the queued job
    to a deadline job, which jumps the lane and ignores the busy signal, and waits for it,
    applying the acknowledgements as they come.

    The owner thread only takes zero-copy views of the entry's arrays; the `kv-encode` thread
    turns them into blocks (one copy, NumPy), into shared memory the coldstore maps where it
    can (worker/link/shared_buffers.py) and into frames where not, and sends them; every
    message about a job (write, promote, cancel) leaves through it, in order.

    Staging is bounded: bytes handed over but not yet committed stay under
    `staging_max_bytes`. At the cap `write_behind` hands nothing over and reports the entry as
    waiting to be sent (`records.write_deferred`): it stays protected, and the engine sends it
    again (`retry_writes`) once the coldstore has drained. The owner never waits for staging room,
    so requests keep running. A write-out goes whatever the cap: its bytes leave RAM right
    after.
    """

    def __init__(self, client: ColdstoreClient, *, block_tokens: int, root_for,
                 records: Records,
                 kinds=None, staging_max_bytes: int | None = None,
                 window_bytes: int = STREAM_WINDOW_BYTES,
                 on_message: Callable[[object], None] = lambda msg: None,
                 wake: Callable[[], None] = lambda: None):
        self.client = client
        self.records = records  # the bank: it records each job's fate in its entry
        self.kinds = kinds  # worker/kv/cache_kinds.py (None: full-attention caches only)
        self.staging_max_bytes = staging_max_bytes or default_staging_max_bytes()
        self.staging_deferred = 0  # hand-overs put off because staging was at its cap
        self.window_bytes = window_bytes
        self._streams: dict[int, _Stream] = {}  # jobs with blocks still to send
        self.block_tokens = block_tokens
        self.root_for = root_for
        self.on_message = on_message  # the owner's handler for each coldstore message, after ours
        self.inbox: queue.Queue = queue.Queue()
        self._pumping = False
        self._wake = wake  # tells the owner that the inbox has mail
        self._outcome: dict[int, Outcome] = {}
        self._staged: dict[int, int] = {}  # job -> bytes handed over, not yet committed
        self._largest: dict[int, int] = {}  # job -> its largest block's bytes
        self._job_durable: dict[int, int] = {}  # job -> the record's durable extent it reached
        self._superseded_by: dict[int, int] = {}
        self._unsent: set[int] = set()  # jobs still being encoded
        self._ahead: dict[int, None] = {}  # jobs promoted by write_ahead (oldest first)
        self._outbox: queue.Queue = queue.Queue()
        self._buffers = EncodeBuffers(keep_bytes=window_bytes)  # the kv-encode thread's
        self._shared = SharedBuffers(keep_bytes=window_bytes)  # its, lent until committed
        # Payloads go in shared memory the coldstore maps (False: as frames; None: ask it)
        self.shared_memory: bool | None = None
        self.shared_min_bytes = MIN_BYTES  # smaller blocks go as frames (tests lower it)
        self._shm_probe_at = 0.0
        self._job_shares: dict[int, bool] = {}  # kv-encode thread's: job -> payloads shared
        self._thread = threading.Thread(target=self._send_loop, name="kv-encode", daemon=True)
        self._thread.start()

    # -- any thread ---------------------------------------------------------------------------

    def deliver(self, msg) -> None:
        """A coldstore message (I/O thread) or an `Encoded` (kv-encode thread), for the owner."""
        self.inbox.put(msg)
        self._wake()

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until every write and message handed over so far has left for the coldstore."""
        sent = threading.Event()
        self._outbox.put(sent.set)
        return sent.wait(timeout_s)

    def close(self, timeout_s: float = 5.0) -> bool:
        """Send what was handed over, then stop the kv-encode thread: the link's sockets are
        not thread-safe, and one closed under a send aborts the process. Call before the
        link's `close`. Whether everything was sent in time."""
        sent = self.drain(timeout_s)
        self._outbox.put(None)
        self._thread.join(timeout_s)
        self._shared.close()
        return sent

    def _send_loop(self) -> None:
        while True:
            try:
                send = self._outbox.get(timeout=BUFFERS_IDLE_S)
            except queue.Empty:  # no write for a while: its buffers go back
                self._buffers.clear()
                self._shared.clear()
                continue
            if send is None:  # close()
                return
            try:
                send()
            except Exception:  # the job is not lost: retry_writes sends it again
                logger.exception("kv-encode: a write could not be sent")
            # Let go of its views now, not when the next write comes: while they live, the
            # conversation's next turn, writing into the entry's buffer, copies it whole first
            # (377 MB at 8K tokens: a RAM hit 0.8 s slower than one from SSD).
            del send

    # -- the owner thread ---------------------------------------------------------------------

    def pump(self, timeout_s: float = 0.0) -> int:
        """Apply what the inbox holds (waiting up to `timeout_s` for the first); returns how
        many messages were applied."""
        if self._pumping:  # a handler asked for a reading mid-apply: the order stands
            return 0
        self._pumping, n = True, 0
        try:
            while True:
                try:
                    msg = (self.inbox.get(timeout=timeout_s) if timeout_s > 0 and not n
                           else self.inbox.get_nowait())
                except queue.Empty:
                    return n
                self._apply(msg)
                n += 1
        finally:
            self._pumping = False

    def _apply(self, msg) -> None:
        if isinstance(msg, Encoded):
            self._unsent.discard(msg.job)
            if msg.job in self._staged:  # not cancelled meanwhile
                self._staged[msg.job] = msg.nbytes
            return
        kind = msg.WhichOneof("kind")
        if kind == "progress":
            p = msg.progress
            self._job_durable[p.job] = max(self._job_durable.get(p.job, 0), p.durable_tokens)
            self._shared.committed(p.job)
            self._advance(p.job)
        elif kind == "done":
            d = msg.done
            self._shared.ended(d.job)
            self._staged.pop(d.job, None)
            self._streams.pop(d.job, None)
            self._outcome[d.job] = wire.outcome_of(d)
            if d.HasField("by"):
                self._superseded_by[d.job] = d.by
            for book in (self._outcome, self._job_durable, self._superseded_by):
                while len(book) > _KEEP_OUTCOMES:
                    book.pop(next(iter(book)))
        try:
            self.on_message(msg)
        except Exception:  # the owner's loop outlives a bad message: writes depend on it
            logger.exception("applying a coldstore message failed: %s", msg)

    def unsent(self, job: int | None) -> bool:
        """The job is still being encoded (the coldstore cannot know it yet)."""
        return job in self._unsent

    @property
    def staged_bytes(self) -> int:
        """KV bytes the coldstore holds for us in memory until it commits them, and what
        committing them takes there: LMDB's copy of the block it commits and the pages it keeps
        for the next (kvbank/contracts/pricing.py `coldstore_write_bytes`). As of the
        last `pump` (the owner pumps at every turn of its loop; a reading never applies
        messages, so a ledger taken mid-admission stands still)."""
        if not self._staged:
            return 0
        return (sum(self._staged.values())
                + coldstore_write_bytes(max(self._largest.get(j, 0) for j in self._staged)))

    def shared_lent_bytes(self) -> int:
        """Shared buffers holding payloads the coldstore has not committed yet."""
        return self._shared.lent_bytes()

    @property
    def handed_over_bytes(self) -> int:
        """KV bytes handed to the coldstore and not committed yet (the staging cap's)."""
        return sum(self._staged.values())

    def has_room(self, nbytes: int) -> bool:
        """`nbytes` more fit under the staging cap (one job larger than the cap goes alone)."""
        return not self._staged or self.handed_over_bytes + nbytes <= self.staging_max_bytes

    def write_behind(self, entry, *, give_up_at: float | None = None) -> int | None:
        """Queue the entry's unwritten blocks; the job id, or None when there was nothing to
        write or (at the staging cap) it waits to be sent again (`records.write_deferred`)."""
        B = self.block_tokens
        start = (entry.durable_tokens // B) * B
        n = entry.n_tokens
        if start >= n:
            return None
        # The blocks in order, each anchor (a checkpoint inside a block where a conversation
        # comes back: the system prompt's end, a prompt's end before its generation prompt)
        # just before the block it falls in: its chain is written by then.
        anchors = [(p // B * B, p) for p, c in entry.checkpoints.items()
                   if c.anchored and p % B and start <= p // B * B and p < n]
        anchor = set(anchors)
        ranges = sorted([(s, min(s + B, n)) for s in range(start, n, B)] + anchors,
                        key=lambda r: (r[0], r not in anchor))
        views, dtype = layer_views(entry.layers), dtype_name(entry.layers)
        sizes = [encoded_views_nbytes(views, dtype, s, e, layout=self._layout(),
                                      state=self._state(entry, e), bits=self._bits())
                 for s, e in ranges]
        del views
        estimate = min(sum(sizes), self.window_bytes  # in flight at once (`_feed`)
                       + (max(sizes) if max(sizes) > self.window_bytes else 0))
        if give_up_at is None and not self.has_room(estimate):
            self.staging_deferred += 1
            self.records.write_deferred(entry)
            logger.info("session %s: staging at its cap (%d bytes): its KV waits in RAM, "
                        "protected, to be sent again", entry.session[1], self.staging_max_bytes)
            return None
        root = self.root_for(entry.session[0])
        write = wire.pb.Write(tenant=entry.session[0], session_id=entry.session[1],
                              root=bytes(root), dirty_since=time.time())
        for (s, e), size in zip(ranges, sizes):
            if e - s == B and (s, e) not in anchor:
                write.blocks.add(id=bytes(entry.block_ids[s // B]), start=s, nbytes=size)
            else:
                parent = entry.block_ids[s // B - 1] if s else root
                write.blocks.add(id=bytes(tail_block_id(parent, entry.tokens[s:e])), start=s,
                                 tail=(s, e) not in anchor, anchor=(s, e) in anchor,
                                 nbytes=size)
        if give_up_at is not None:
            write.give_up_at = give_up_at
        job = write.job = self.client.next_id()
        self.records.write_queued(entry, job)
        self._staged[job] = estimate
        self._largest = {j: n for j, n in self._largest.items() if j in self._staged}
        self._largest[job] = max(sizes)
        self._unsent.add(job)
        self._streams[job] = _Stream(entry, write, ranges, sizes)
        self._feed(job)
        return job

    def _layout(self) -> str:
        return self.kinds.layout if self.kinds else ""

    def _bits(self) -> int | None:
        return self.kinds.block_bits() if self.kinds else None

    def _state(self, entry, end: int):
        """The checkpoint standing where a block ends goes into that block."""
        if self.kinds is None or end not in entry.checkpoints:
            return None
        return self.kinds.checkpoint_views(entry.checkpoints[end])

    def _advance(self, job: int) -> None:
        """The coldstore committed one more of the job's blocks (one `progress` each): the
        stream's next blocks may go; or, its entry no longer in the bank (a request took it
        over), the stream stops."""
        stream = self._streams.get(job)
        if stream is None:
            return
        stream.committed = min(stream.committed + 1, stream.sent)
        if stream.sent == len(stream.ranges):
            del self._streams[job]
        elif not stream.entry.in_bank:
            self._stop(job, stream.entry)
        else:
            self._feed(job)

    def _stop(self, job: int, entry) -> None:
        """A stream whose entry left the bank: the job ends here (its committed blocks
        stay); an entry given back later is sent again (`write_pending`)."""
        del self._streams[job]
        self._send(cancel=wire.pb.Cancel(job=job))
        self._staged.pop(job, None)
        self.records.write_stopped(entry, job)

    def _feed(self, job: int) -> None:
        """Hand the kv-encode thread the stream's next blocks, as many as the window holds
        beside those sent and not yet committed (one at least). A block larger than the
        window (one that carries a hybrid model's checkpoint: 171 MB for Qwen3.6-27B) goes
        once what is in flight is under the window, not once nothing is: the coldstore commits
        the blocks before it while it is encoded and sent."""
        st = self._streams[job]
        in_flight = sum(st.sizes[st.committed:st.sent])
        first, end = st.sent, st.sent
        while end < len(st.ranges) and (in_flight + st.sizes[end] <= self.window_bytes
                                        or end == st.committed
                                        or (st.sizes[end] > self.window_bytes
                                            and in_flight < self.window_bytes)):
            in_flight += st.sizes[end]
            end += 1
        if end == first:
            return
        st.sent = end
        ranges = st.ranges[first:end]
        views, dtype = layer_views(st.entry.layers), dtype_name(st.entry.layers)
        layout, bits = self._layout(), self._bits()
        states = {e: self._state(st.entry, e) for _, e in ranges}
        write = st.write if first == 0 else None

        def encode(s: int, e: int, shared: bool) -> tuple[object, int]:
            """A block encoded: the name of the shared buffer it went into, or a frame."""
            kw = dict(layout=layout, state=states[e], bits=bits)
            nbytes = encoded_views_nbytes(views, dtype, s, e, **kw)

            def fill(out):
                encode_views(views, dtype, s, e, out=out, **kw)
            name = (self._shared.take(job, nbytes, fill)
                    if shared and nbytes >= self.shared_min_bytes else None)
            return (name or self._buffers.frame(nbytes, fill)), nbytes

        def send() -> None:
            shared = self._shares(job)
            payloads, sizes = zip(*(encode(s, e, shared) for s, e in ranges))
            released = self._shared.released()
            if write is None:
                if not self._shared.gone(job):
                    self.client.send_payloads(job, list(payloads), released)
                return
            self.deliver(Encoded(job, sum(sizes)))
            self.client.send_write(write, list(payloads), released)

        self._outbox.put(send)

    # -- the kv-encode thread -------------------------------------------------------------

    def _shares(self, job: int) -> bool:
        """Whether the job's payloads go in shared memory: decided at its first send, once
        the coldstore has said it sees our buffers (a job keeps one way: the coldstore's
        `progress` messages give its buffers back in order)."""
        if job not in self._job_shares:
            self._job_shares[job] = self._coldstore_sees_shared_memory()
            while len(self._job_shares) > _KEEP_OUTCOMES:
                self._job_shares.pop(next(iter(self._job_shares)))
        return self._job_shares[job]

    def _coldstore_sees_shared_memory(self) -> bool:
        """Asked once (again every SHM_PROBE_EVERY_S while the coldstore does not answer):
        it maps a buffer of ours holding SHM_PROBE. Not on the same machine, or in another
        IPC namespace (a container of its own), payloads go as frames."""
        if self.shared_memory is None and time.monotonic() >= self._shm_probe_at:
            self._shm_probe_at = time.monotonic() + SHM_PROBE_EVERY_S
            probe = make_buffer(f"kvbprobe{os.getpid()}{secrets.token_hex(3)}", PAGE)
            if probe is None:
                self.shared_memory = False
                return False
            try:
                probe.buf[:len(wire.SHM_PROBE)] = wire.SHM_PROBE
                self.shared_memory = self.client.sees_shared_memory(probe.name)
            except ColdstoreUnavailable:  # not up yet: frames until it answers
                pass
            finally:
                release(probe)
            if self.shared_memory is False:
                logger.info("the coldstore cannot map this worker's shared memory: KV goes to "
                            "it as ZeroMQ frames")
        return bool(self.shared_memory)

    # -- the owner thread -----------------------------------------------------------------

    def write_ahead(self, entry, give_up_at: float) -> bool:
        """The entry's queued write goes now, not at a quiet window or its deadline: a
        release will want it soon (`EvictionPolicy.write_ahead`); nothing waits for it. False
        when it has no queued job (nothing to write, or it waits to be sent again)."""
        job = entry.write_job
        if job is None:
            return False
        if job not in self._ahead:
            self._ahead[job] = None
            while len(self._ahead) > _KEEP_OUTCOMES:
                self._ahead.pop(next(iter(self._ahead)))
            self._send(promote=wire.pb.Promote(job=job, give_up_at=give_up_at))
        return True

    def forget_lost_jobs(self, live: set[int]) -> None:
        """Jobs the coldstore no longer holds (it restarted) stop counting as staged, and
        stop streaming."""
        for job in [j for j in self._staged if j not in live and j not in self._unsent]:
            self._staged.pop(job)
            self._streams.pop(job, None)
            self._shared.ended(job)

    def write_out(self, entry, give_up_at: float) -> Outcome:
        """Write the entry now, by `give_up_at` (unix s): written | deadline | refused | error."""
        if entry.write_job is None:
            job = self.write_behind(entry, give_up_at=give_up_at)
            if job is None:
                return Outcome.WRITTEN if entry.durable else Outcome.ERROR
        else:
            job = entry.write_job
            self._send(promote=wire.pb.Promote(job=job, give_up_at=give_up_at))
        while True:
            self.pump()
            outcome = self._outcome.get(job)
            # Progress of this job, not of the session: an edited history or a branch of the
            # same session must not count as this entry's write.
            if outcome == Outcome.WRITTEN or (outcome is None and
                                              self._job_durable.get(job, 0) >= entry.n_tokens):
                self.records.written(entry)
                self._staged.pop(job, None)  # committed: the coldstore holds it no more
                return Outcome.WRITTEN
            if outcome == Outcome.SUPERSEDED and self._superseded_by.get(job) is not None:
                job = self._superseded_by[job]  # a newer job took over our blocks
                continue
            if outcome == Outcome.UNKNOWN_JOB:  # the coldstore restarted and lost it: again
                break
            if outcome in FAILED_OUTCOMES:
                return outcome if outcome in (Outcome.DEADLINE, Outcome.REFUSED) \
                    else Outcome.ERROR
            left = give_up_at - time.time()  # one hard bound for the whole release
            if left <= 0:
                return Outcome.DEADLINE
            self.pump(timeout_s=left)
        if time.time() >= give_up_at:
            return Outcome.DEADLINE
        self.records.write_cancelled(entry)  # lost with the coldstore's restart: sent again
        return self.write_out(entry, give_up_at)

    def _send(self, **op) -> None:
        """A message about a job, behind the job itself."""
        self._outbox.put(lambda: self.client.send(**op))

    def cancel(self, entry) -> None:
        if entry.write_job is not None:
            self._send(cancel=wire.pb.Cancel(job=entry.write_job))
            self._staged.pop(entry.write_job, None)
            self._streams.pop(entry.write_job, None)
            self.records.write_cancelled(entry)
