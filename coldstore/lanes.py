"""Which block the coldstore writes next, and when.

Three rules, in this order:
1. A write-out job (it has `give_up_at`) goes first and ignores the worker's busy signal: a
   release is waiting on it. Past its deadline it stops, takes back the blocks it committed
   (all or nothing: the entry is on SSD whole, or not at all) and reports `deadline`.
2. The idle lane writes only in quiet windows: the worker said "quiet" at least
   `quiet_grace_s` ago (or has said nothing for a while: no worker, nothing to disturb).
3. Bounded staleness: a conversation dirty for longer than `max_dirty_s` is written even while
   the worker is busy, one block per `stale_block_interval_s`, so durability never waits for
   a quiet window that two agents taking turns never leave.

The partial tail block of a conversation is rewritten whole by its next turn, so the idle lane
holds it back for `tail_delay_s`: an agent's quick turns then write each token's KV about once
(write amplification near 1), and the tail is still on SSD within `tail_delay_s` of its turn,
at once for a write-out.

A job's payloads stream in behind its header, so its first block is committed while the rest
are still in transit; a job is picked only when its next block's payload is here. The worker
sends the next payloads as blocks commit (a few blocks ahead, never the whole entry), so a job
waits for its sender only once everything it received is committed; one that has waited
`payload_stall_s` since then (its sender died) is ended, not kept forever.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class PendingBlock:
    block_id: bytes
    start: int
    nbytes: int
    payload: memoryview | None = None  # None: still in transit
    tail: bool = False  # the partial last block: its next turn will rewrite it
    anchor: bool = False  # a partial block carrying a shared checkpoint (coldstore/store.py)


@dataclass
class WriteJob:
    job_id: int
    peer: bytes
    tenant: str
    session_id: str
    root: bytes
    blocks: deque[PendingBlock]
    dirty_since: float
    give_up_at: float | None = None
    first_start: int = 0  # where its first block begins: a deadline rolls back to here
    written_blocks: int = 0
    durable_tokens: int = 0
    in_transit: int = 0  # the last blocks, whose payloads have not arrived yet
    payload_at: float = 0.0  # when payloads last arrived, or a block last committed
    taken_back: bool = False  # a write-out that failed: the blocks it committed were undone

    @property
    def staged_bytes(self) -> int:
        """Payload bytes held in memory until committed."""
        return sum(len(b.payload) for b in self.blocks if b.payload is not None)

    @property
    def entry_bytes(self) -> int:
        """Every block of the job, arrived or not (for the per-entry size cap)."""
        return sum(b.nbytes for b in self.blocks)

    def receive(self, payloads: list[memoryview], now: float) -> None:
        """The next blocks' payloads, in order; each must be the size its header said."""
        if len(payloads) > self.in_transit:
            raise ValueError(f"job {self.job_id}: {len(payloads)} payloads for "
                             f"{self.in_transit} blocks in transit")
        first = len(self.blocks) - self.in_transit
        for i, payload in enumerate(payloads):
            if len(payload) != self.blocks[first + i].nbytes:
                raise ValueError(f"job {self.job_id}: a payload of {len(payload)} bytes for a "
                                 f"block announced as {self.blocks[first + i].nbytes}")
        for i, payload in enumerate(payloads):
            self.blocks[first + i].payload = payload
        self.in_transit -= len(payloads)
        self.payload_at = now


@dataclass
class Lanes:
    quiet_grace_s: float = 0.25
    max_dirty_s: float = 30.0
    tail_delay_s: float = 30.0
    stale_block_interval_s: float = 0.05
    silent_worker_s: float = 2.0
    payload_stall_s: float = 30.0
    jobs: dict[int, WriteJob] = field(default_factory=dict)
    worker_busy: bool = False
    write_now: bool = False  # the worker needs the memory the queued writes hold
    state_changed_at: float = 0.0
    state_heard_at: float = 0.0
    last_stale_write_at: float = 0.0

    def on_worker_state(self, busy: bool, now: float, write_now: bool = False) -> None:
        """The first report starts the quiet grace too: the worker's first "busy" may never
        arrive (a PUB socket drops what it sends before its subscriber connects), and a
        "quiet" then must not count as quiet since the epoch. `write_now`: the worker needs
        the memory the queued writes hold (a join into its batch waits for it): every job is
        written at once, a young tail too."""
        if busy != self.worker_busy or not self.state_heard_at:
            self.state_changed_at = now
        self.worker_busy = busy
        self.write_now = write_now
        self.state_heard_at = now

    def quiet(self, now: float) -> bool:
        if self.write_now:
            return True
        if now - self.state_heard_at > self.silent_worker_s:
            return True
        return not self.worker_busy and now - self.state_changed_at >= self.quiet_grace_s

    def submit(self, job: WriteJob) -> WriteJob | None:
        """Queue a job; returns the job it supersedes (same session), which is dropped.

        The newer job covers everything past the record's durable extent, so the older one has
        nothing left to add; the conversation stays dirty since the older job's time.
        """
        old = next(
            (j for j in self.jobs.values()
             if j.session_id == job.session_id and j.tenant == job.tenant),
            None,
        )
        if old is not None:
            del self.jobs[old.job_id]
            job.dirty_since = min(job.dirty_since, old.dirty_since)
            if old.give_up_at is not None:
                job.give_up_at = (old.give_up_at if job.give_up_at is None
                                  else min(job.give_up_at, old.give_up_at))
        self.jobs[job.job_id] = job
        return old

    def cancel(self, job_id: int) -> WriteJob | None:
        return self.jobs.pop(job_id, None)

    def held(self, job: WriteJob, now: float) -> bool:
        """Only a young partial tail is left: wait, its next turn would rewrite it."""
        return (job.give_up_at is None and len(job.blocks) == 1 and job.blocks[0].tail
                and now - job.dirty_since < self.tail_delay_s and not self.write_now)

    def stalled(self, job: WriteJob, now: float) -> bool:
        """Its next block's payload is missing, and nothing arrived or was committed for
        `payload_stall_s`."""
        return (bool(job.in_transit) and bool(job.blocks) and job.blocks[0].payload is None
                and now - job.payload_at >= self.payload_stall_s)

    def _actionable(self, job: WriteJob, now: float) -> bool:
        """Its next block is here, or it is finished, past its deadline, or stalled."""
        if not job.blocks or self.stalled(job, now):
            return True
        if job.give_up_at is not None and now >= job.give_up_at:
            return True
        return job.blocks[0].payload is not None

    def next_job(self, now: float, *, flushing: bool = False) -> WriteJob | None:
        """The job to write a block of now, if any. `flushing` (a clean stop): any job that
        has a block here, quiet window or not, tail or not."""
        if not self.jobs:
            return None
        actionable = [j for j in self.jobs.values() if self._actionable(j, now)]
        deadline = [j for j in actionable if j.give_up_at is not None]
        if deadline:
            return min(deadline, key=lambda j: j.give_up_at)
        if flushing:
            return actionable[0] if actionable else None
        ready = [j for j in actionable if not self.held(j, now)]
        if not ready:
            return None
        oldest = min(ready, key=lambda j: j.dirty_since)
        if self.quiet(now):
            return oldest
        if (now - oldest.dirty_since >= self.max_dirty_s
                and now - self.last_stale_write_at >= self.stale_block_interval_s):
            return oldest
        return None

    def staged_bytes(self) -> int:
        return sum(j.staged_bytes for j in self.jobs.values())
