"""Hands bank entries' KV to the coldstore: write-behind after each turn, write-out before a
release. The worker's side of a write job; the coldstore's is coldstore/lanes.py."""

from __future__ import annotations

import logging
import queue
import threading
import time

from worker.link import ColdstoreClient

logger = logging.getLogger(__name__)

RELEASE_WRITE_OUT_MAX_S = 30.0


def default_staging_max_bytes() -> int:
    """1 GiB or 10 % of RAM, whichever is smaller."""
    import psutil

    return min(1 << 30, psutil.virtual_memory().total // 10)
_FAILED = {"deadline", "error", "refused", "stale", "unknown_job", "cancelled"}


class KVWriter:
    """Hands bank entries' KV to the coldstore.

    `write_behind` queues an entry's blocks past its durable extent on the idle lane (the
    default after every turn). `write_out` is the release's path: it promotes the queued job
    to a deadline job, which jumps the lane and ignores the busy signal, and waits for it.
    Waits end on the coldstore's acknowledgements (`on_event`, I/O thread).

    The engine thread only takes zero-copy views of the entry's arrays; one `kv-encode`
    thread turns them into blocks (one copy, NumPy, off the engine thread) and sends them, and
    every message about a job (write, promote, cancel) leaves through it, in order.

    Staging is bounded: bytes handed over but not yet committed stay under
    `staging_max_bytes`. At the cap `write_behind` hands nothing over and marks the entry as
    waiting to be sent (`write_pending`): it stays protected, and the engine sends it again
    (`Engine.retry_writes`) once the coldstore has drained. The engine thread never waits for
    staging room, so requests keep running. A write-out goes whatever the cap: its bytes leave
    RAM right after.
    """

    def __init__(self, client: ColdstoreClient, *, block_tokens: int, root_for,
                 staging_max_bytes: int | None = None):
        self.client = client
        self.staging_max_bytes = staging_max_bytes or default_staging_max_bytes()
        self.staging_deferred = 0  # hand-overs put off because staging was at its cap
        self.block_tokens = block_tokens
        self.root_for = root_for
        self._cond = threading.Condition()
        self._outcome: dict[int, str] = {}
        self._staged: dict[int, int] = {}  # job -> bytes handed over, not yet committed
        self._job_durable: dict[int, int] = {}  # job -> the record's durable extent it reached
        self._superseded_by: dict[int, int] = {}
        self._unsent: set[int] = set()  # jobs still being encoded
        self._outbox: queue.Queue = queue.Queue()
        threading.Thread(target=self._send_loop, name="kv-encode", daemon=True).start()

    def _send_loop(self) -> None:
        while True:
            send = self._outbox.get()
            try:
                send()
            except Exception:  # the job is not lost: retry_writes sends it again
                logger.exception("kv-encode: a write could not be sent")

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until every write and message handed over so far has left for the coldstore."""
        sent = threading.Event()
        self._outbox.put(sent.set)
        return sent.wait(timeout_s)

    def unsent(self, job: int | None) -> bool:
        """The job is still being encoded (the coldstore cannot know it yet)."""
        with self._cond:
            return job in self._unsent

    @property
    def staged_bytes(self) -> int:
        """KV bytes the coldstore holds for us in memory until it commits them."""
        with self._cond:
            return sum(self._staged.values())

    def has_room(self, nbytes: int) -> bool:
        """`nbytes` more fit under the staging cap (one job larger than the cap goes alone)."""
        with self._cond:
            return not self._staged or self.staged_bytes + nbytes <= self.staging_max_bytes

    def write_behind(self, entry, *, give_up_at: float | None = None) -> int | None:
        """Queue the entry's unwritten blocks; the job id, or None when there was nothing to
        write or (at the staging cap) it waits to be sent again, marked `write_pending`."""
        from kvbank.blocks import tail_block_id
        from worker.kv import dtype_name, encode_views, layer_views

        B = self.block_tokens
        start = (entry.durable_tokens // B) * B
        n = entry.n_tokens
        if start >= n:
            return None
        estimate = (n - start) * entry.nbytes // n  # staged until its blocks are encoded
        if give_up_at is None and not self.has_room(estimate):
            self.staging_deferred += 1
            entry.write_pending = True
            logger.info("session %s: staging at its cap (%d bytes): its KV waits in RAM, "
                        "protected, to be sent again", entry.session[1], self.staging_max_bytes)
            return None
        root = self.root_for(entry.session[0])
        blocks, ranges = [], []
        for s in range(start, n, B):
            e = min(s + B, n)
            if e - s == B:
                blocks.append({"id": entry.block_ids[s // B].hex(), "start": s})
            else:
                parent = entry.block_ids[s // B - 1] if s else root
                blocks.append({"id": tail_block_id(parent, entry.tokens[s:e]).hex(), "start": s,
                               "tail": True})
            ranges.append((s, e))
        views, dtype = layer_views(entry.layers), dtype_name(entry.layers)
        job = self.client.next_id()
        entry.write_job = job
        entry.write_pending = False
        head = {"op": "write", "job": job, "tenant": entry.session[0],
                "session_id": entry.session[1], "root": root.hex(), "blocks": blocks,
                "dirty_since": time.time()}
        if give_up_at is not None:
            head["give_up_at"] = give_up_at
        with self._cond:
            self._staged[job] = estimate
            self._unsent.add(job)

        def send() -> None:
            frames = [encode_views(views, dtype, s, e) for s, e in ranges]
            with self._cond:
                self._unsent.discard(job)
                if job in self._staged:  # not cancelled meanwhile
                    self._staged[job] = sum(len(f) for f in frames)
            self.client.send_write(head, frames)

        self._outbox.put(send)
        return job

    def forget_lost_jobs(self, live: set[int]) -> None:
        """Jobs the coldstore no longer holds (it restarted) stop counting as staged."""
        with self._cond:
            for job in [j for j in self._staged if j not in live and j not in self._unsent]:
                self._staged.pop(job)

    def write_out(self, entry, give_up_at: float) -> str:
        """Write the entry now, by `give_up_at` (unix s): written | deadline | refused | error."""
        if entry.write_job is None:
            job = self.write_behind(entry, give_up_at=give_up_at)
            if job is None:
                return "written" if entry.durable else "error"
        else:
            job = entry.write_job
            self._send({"op": "promote", "job": job, "give_up_at": give_up_at})
        with self._cond:
            while True:
                outcome = self._outcome.get(job)
                # Progress of this job, not of the session: an edited history or a branch of
                # the same session must not count as this entry's write.
                if outcome == "written" or (outcome is None and
                                            self._job_durable.get(job, 0) >= entry.n_tokens):
                    entry.durable_tokens = entry.n_tokens
                    self._staged.pop(job, None)  # committed: the coldstore holds it no more
                    return "written"
                if outcome == "superseded" and self._superseded_by.get(job) is not None:
                    job = self._superseded_by[job]  # a newer job took over our blocks
                    continue
                if outcome == "unknown_job":  # the coldstore restarted and lost it: send again
                    break
                if outcome in _FAILED:
                    return outcome if outcome in ("deadline", "refused") else "error"
                left = give_up_at - time.time()  # one hard bound for the whole release
                if left <= 0:
                    return "deadline"
                self._cond.wait(left)
        if time.time() >= give_up_at:
            return "deadline"
        entry.write_job = None
        return self.write_out(entry, give_up_at)

    def _send(self, head: dict) -> None:
        """A message about a job, behind the job itself."""
        self._outbox.put(lambda: self.client.send(head))

    def cancel(self, entry) -> None:
        if entry.write_job is not None:
            self._send({"op": "cancel", "job": entry.write_job})
            with self._cond:
                self._staged.pop(entry.write_job, None)
            entry.write_job = None

    def on_event(self, msg: dict) -> None:
        with self._cond:
            job = msg.get("job")
            if msg.get("op") == "progress":
                self._job_durable[job] = max(self._job_durable.get(job, 0),
                                             msg.get("durable_tokens", 0))
            if msg.get("op") == "done":
                self._staged.pop(job, None)
                self._outcome[job] = msg["outcome"]
                if msg.get("by") is not None:
                    self._superseded_by[job] = msg["by"]
                for d in (self._outcome, self._job_durable, self._superseded_by):
                    while len(d) > 4096:
                        d.pop(next(iter(d)))
            self._cond.notify_all()
