"""The worker's shared-memory buffers, mapped for LMDB to copy blocks from where the worker
encoded them (worker/link/shared_buffers.py says why).

A buffer is mapped the first time a write names it and stays mapped while the coldstore is
busy: the worker reuses its buffers, and mapping one afresh faults its pages in again. A
buffer the worker lets go of (it unlinks it) is named in its next write (`forget`): its
memory goes with the last mapping. Every mapping goes when the coldstore goes idle
(`close_all`).
"""

from __future__ import annotations

import logging
from multiprocessing import resource_tracker, shared_memory

from kvbank import heap

logger = logging.getLogger(__name__)

MAX_MAPPED = 256  # past this many buffers mapped at once, those not read lately go


class SharedPayloads:
    def __init__(self):
        self._mapped: dict[str, shared_memory.SharedMemory] = {}

    def view(self, name: str, nbytes: int) -> memoryview:
        """The first `nbytes` of the worker's buffer `name`. ValueError when it is not there
        (the worker that named it is gone) or is smaller than `nbytes`."""
        shm = self._mapped.pop(name, None)
        if shm is None:
            try:
                shm = shared_memory.SharedMemory(name=name)
            except (FileNotFoundError, OSError) as e:
                raise ValueError(f"shared-memory payload {name!r}: {e}") from None
            # The worker owns it: without this, Python 3.11's tracker would unlink it when
            # this process ends (3.13 has `track=False`).
            resource_tracker.unregister(shm._name, "shared_memory")
            heap.close_shared_descriptor(shm)
            if len(self._mapped) >= MAX_MAPPED:
                self._close(next(iter(self._mapped)))
        self._mapped[name] = shm  # the newest last
        if shm.size < nbytes:
            raise ValueError(f"shared-memory payload {name!r}: {shm.size} bytes, "
                             f"{nbytes} announced")
        return shm.buf[:nbytes]

    def payloads(self, job, names, frames) -> list[memoryview]:
        """A write job's next blocks' payloads (coldstore/lanes.py `WriteJob`): the frames, or
        where the write names shared memory (Write.shm), the worker's buffers as they lie
        ('': the next frame). ValueError where they do not add up."""
        if not names:
            return [f.buffer for f in frames]
        if len(names) > job.in_transit or sum(not n for n in names) != len(frames):
            raise ValueError(f"job {job.job_id}: {len(names)} payloads ({len(frames)} frames) "
                             f"for {job.in_transit} blocks in transit")
        first, rest = len(job.blocks) - job.in_transit, iter(frames)
        return [self.view(name, job.blocks[first + i].nbytes) if name else next(rest).buffer
                for i, name in enumerate(names)]

    def probe(self, name: str, expect: bytes) -> bool:
        """Whether the buffer `name` can be mapped and starts with `expect`."""
        try:
            ok = bytes(self.view(name, len(expect))) == expect
        except ValueError:
            return False
        self._close(name)
        return ok

    def forget(self, names) -> None:
        """The worker let go of these buffers."""
        for name in names:
            if name in self._mapped:
                self._close(name)

    def close_all(self) -> None:
        for name in list(self._mapped):
            self._close(name)

    def _close(self, name: str) -> None:
        shm = self._mapped.pop(name)
        try:
            shm.close()
        except BufferError:  # a block still holds a view of it: it goes with the next idle
            self._mapped[name] = shm
