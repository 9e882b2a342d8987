"""glibc's allocator settings, for the processes that move KV through their own memory.

The worker and the coldstore copy KV in buffers of 16 MB (a block) to hundreds of MB (a
recurrent-state checkpoint). glibc maps a buffer above its mmap threshold on its own and
unmaps it when freed, so the next one is faulted in page by page, and on a VM a page fault
costs more CPU than the copy into the page. Each process says here what it keeps of what it
frees (worker/memory/allocator.py, coldstore/server.py). Without glibc (macOS, musl) these do
nothing.
"""

from __future__ import annotations

import os

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
M_ARENA_MAX = -8

_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
            _LIBC.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC


def glibc() -> bool:
    return bool(_libc())


def mallopt(param: int, value: int) -> bool:
    """glibc's `mallopt`: False where it refused (or there is no glibc)."""
    return bool(_libc() and _LIBC.mallopt(param, value))


def resident_bytes(pid: int | str = "self") -> int:
    """Memory a process holds itself: anonymous + shared resident pages (Linux RssAnon +
    RssShmem). File-backed pages (libraries, the LMDB map a restore reads) are the kernel's
    page cache and can be dropped any time, so they do not count. Elsewhere: RSS."""
    return _status_bytes(pid, ("RssAnon", "RssShmem"))


def anonymous_bytes(pid: int | str = "self") -> int:
    """A process's anonymous resident pages (Linux RssAnon): its heap, without the shared
    memory it maps. Elsewhere: RSS."""
    return _status_bytes(pid, ("RssAnon",))


def _status_bytes(pid: int | str, fields: tuple[str, ...]) -> int:
    """The sum of /proc/PID/status's `fields` (kB there), in bytes; RSS where there is none."""
    try:
        status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
        return sum(int(status[k].split()[0]) * 1024 for k in fields)
    except (OSError, KeyError, ValueError):
        import psutil

        return psutil.Process(None if pid == "self" else int(pid)).memory_info().rss


def give_back_freed_pages() -> None:
    """Return every free page of the heap to the OS (glibc keeps them otherwise)."""
    if _libc():
        _LIBC.malloc_trim(0)


def close_shared_descriptor(shm) -> None:
    """A `multiprocessing.shared_memory` mapping stands without its file descriptor: closed
    once mapped, so a process holding many buffers does not hold a descriptor for each
    (CPython keeps it until `close`, which skips it once it is -1)."""
    fd = getattr(shm, "_fd", -1)
    if fd >= 0:
        os.close(fd)
        shm._fd = -1
