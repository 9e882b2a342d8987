"""Shared-memory buffers the kv-encode thread encodes blocks into, for the coldstore to commit
from where they lie.

Sent as ZeroMQ frames, a block is copied three more times on its way to LMDB: into the
socket, out of it into a buffer the coldstore's I/O thread allocates, and into LMDB's pages.
On this 2-core VM (Dec 2026) the socket alone moved 16.8 MB blocks at 1.6-2.6 GB/s for
0.5-0.8 CPU-seconds a GB, as much as the matched raw LMDB writer spends in all; a pipeline of
the same copies through named shared memory kept up with the raw writer (0.73-1.07 of it,
against 0.52-1.34 through the socket, three rounds alternated). The block's bytes now go into
a POSIX shared-memory buffer (`multiprocessing.shared_memory`: /dev/shm on Linux, the kernel's
shared memory on macOS) and only its name travels; the coldstore maps it
(coldstore/shared.py) and LMDB copies from there.

A buffer is lent to a job until the coldstore says it is done with the block (a `progress`
for it, in the job's order, or the job's `done`), then reused. Free ones are kept up to
`keep_bytes` and all go back after a quiet second (`clear`), as the frames' buffers did.

On Linux a buffer's pages are allocated when it is made (`posix_fallocate`): a tmpfs that is
full (a container's 64 MB /dev/shm) then refuses it at once, where a write into it would
have killed the worker with SIGBUS. A buffer that cannot be made is no error: that block
goes as a frame.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import threading
from collections import deque
from multiprocessing import shared_memory
from typing import Callable

from kvbank import heap

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"  # Linux's POSIX shared memory (a tmpfs); macOS has none to check
PAGE = 64 << 10  # buffers are made in whole 64 KiB, so blocks of nearby sizes share them
# Smaller blocks go as frames: their copies cost little, and a window of them would be
# hundreds of buffers (a file and a mapping each, in both processes). A real model's block is
# several MB (SmolLM2-135M's 256 tokens: 5.9 MB in bfloat16; Qwen3.6-27B's: 16.8 MB).
MIN_BYTES = 1 << 20


def make_buffer(name: str, nbytes: int) -> shared_memory.SharedMemory | None:
    """A new named buffer of `nbytes`, its pages allocated; None where the system cannot
    give them."""
    if os.path.isdir(SHM_DIR):
        fs = os.statvfs(SHM_DIR)
        if fs.f_bavail * fs.f_frsize < nbytes:
            return None
    try:
        shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
    except OSError as e:
        logger.warning("no shared memory for a block's payload (%s): it goes as a frame", e)
        return None
    fd = getattr(shm, "_fd", -1)  # CPython keeps the descriptor; posix_fallocate is Linux's
    if fd >= 0 and hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            logger.warning("shared memory full (%s): a block's payload goes as a frame", e)
            shm.close()
            shm.unlink()
            return None
    heap.close_shared_descriptor(shm)
    return shm


class SharedBuffers:
    """The kv-encode thread takes buffers (`take`); the owner thread gives them back as the
    coldstore answers (`committed`, `ended`). One lock keeps the two apart."""

    def __init__(self, keep_bytes: int):
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._free: list[shared_memory.SharedMemory] = []
        self._lent: dict[int, deque] = {}  # job -> its buffers (None: a frame) in send order
        self._ended: set[int] = set()  # jobs done before all their sends went
        self._released: list[str] = []  # names let go of, for the coldstore to unmap
        self._prefix = f"kvb{os.getpid()}{secrets.token_hex(3)}"  # macOS: names <= 31 chars
        self._names = itertools.count()

    # -- the kv-encode thread ------------------------------------------------------------

    def take(self, job: int, nbytes: int, fill: Callable[[memoryview], object]) -> str | None:
        """A buffer lent to `job` with the block `fill` writes into its first `nbytes`: its
        name; None when none could be had (the block goes as a frame, and its place in the
        job's order is kept)."""
        with self._lock:
            fits = [b for b in self._free if b.size >= nbytes]
            buf = min(fits, key=lambda b: b.size) if fits else None
            if buf is not None:
                self._free.remove(buf)
        if buf is None:
            size = -(-nbytes // PAGE) * PAGE
            buf = make_buffer(f"{self._prefix}{next(self._names)}", size)
        with self._lock:
            self._lent.setdefault(job, deque()).append(buf)
        if buf is None:
            return None
        fill(buf.buf[:nbytes])
        return buf.name

    def gone(self, job: int) -> bool:
        """The job ended before this send: its blocks are not sent (the coldstore would drop
        them unread) and what it was lent is back."""
        with self._lock:
            if job not in self._ended:
                return False
            self._give_back(self._lent.pop(job, ()))
            return True

    def clear(self) -> None:
        """No send for a while: the free buffers go back to the system."""
        with self._lock:
            free, self._free = self._free, []
            self._released += [buf.name for buf in free]
        for buf in free:
            release(buf)

    def released(self) -> list[str]:
        """The names let go of since the last call: the next write tells the coldstore, which
        would otherwise keep their memory mapped until it goes idle."""
        with self._lock:
            names, self._released = self._released, []
        return names

    # -- the owner thread ------------------------------------------------------------------

    def committed(self, job: int) -> None:
        """The coldstore committed the job's next block: its buffer is free."""
        with self._lock:
            lent = self._lent.get(job)
            if lent:
                self._give_back([lent.popleft()])

    def ended(self, job: int) -> None:
        """The job is over at the coldstore (done, or lost with it): every buffer it holds is
        free, and what it sends from now on is not sent."""
        with self._lock:
            self._give_back(self._lent.pop(job, ()))
            self._ended.add(job)
            if len(self._ended) > 4096:  # jobs whose last send went long ago
                self._ended = set(sorted(self._ended)[-2048:])

    def lent_bytes(self) -> int:
        with self._lock:
            return sum(b.size for lent in self._lent.values() for b in lent if b is not None)

    def close(self) -> None:
        with self._lock:
            bufs = self._free + [b for lent in self._lent.values() for b in lent if b]
            self._free, self._lent = [], {}
        for buf in bufs:
            release(buf)

    def _give_back(self, bufs) -> None:
        """Under the lock: free buffers kept up to `keep_bytes`, the smallest first, and the
        largest (a hybrid model's checkpoint block, 171 MB for Qwen3.6-27B, comes back every
        few blocks: made afresh, its pages are faulted in again)."""
        self._free += [buf for buf in bufs if buf is not None]
        self._free.sort(key=lambda b: b.size)
        kept, keep = 0, []
        for buf in self._free[:-1]:
            kept += buf.size
            if kept <= self.keep_bytes:
                keep.append(buf)
            else:
                self._released.append(buf.name)
                release(buf)
        self._free = keep + self._free[-1:]


def release(buf: shared_memory.SharedMemory) -> None:
    """Unmapped and unlinked: its memory goes once the coldstore has unmapped it too."""
    try:
        buf.close()
    except BufferError:  # a view of it still lives (a send in ZeroMQ's hands): unlink only
        pass
    try:
        buf.unlink()
    except FileNotFoundError:
        pass
