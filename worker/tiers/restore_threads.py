"""Restores from SSD read on a thread of their own, while the engine steps the batch.

A restore of a long conversation from LMDB reads and decodes several GB: seconds. On the
engine thread, every running request's decode waited that long (issue #35). So a read worth
it (`worth_a_thread`: `THREAD_MIN_BYTES` or more beyond what RAM holds) runs on a thread,
and the engine, told by `wake` when it ends, hands its result over on its own thread
(`Engine._join`). The thread reads LMDB (its own read txn, `StoreReader._read_txn`) and
decodes into MLX arrays; everything else stays the engine's: the bank (its hit was taken
before, its entry handed over after), the coldstore link and the events (a corrupt block
found is handed back, `Restorer.corrupt` reports it), the snapshot. The request's memory was
reserved before the read, as for any restore; a request cancelled while it reads, or a
worker stopping, drops what was read when the thread ends. A RAM hit, or a short read, stays
inline: a thread would cost more than it saves. A prefetch hint's read (worker/tiers/prefetch.py)
runs the same way, in a `Restores` of its own: it is no request.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

THREAD_MIN_BYTES = int(os.environ.get("KVBANK_RESTORE_THREAD_MIN_BYTES", 32 << 20))
# Test seam, never set in production: a folder where a restore's thread, before it reads,
# writes `held` and waits until `release` appears (or its request is cancelled, or the worker
# stops), so a test can act while a restore is in flight without guessing at times.
HOLD_ENV = "KVBANK_TEST_HOLD_RESTORE"


@dataclass(kw_only=True)
class Read:
    """A read from SSD on a thread. `ssd`, `error` and `corrupt` are the thread's until
    `done` is set, the engine's after."""

    ssd: Any = None
    error: BaseException | None = None
    corrupt: list = field(default_factory=list)  # (block id, CorruptBlock) found by the read
    done: threading.Event = field(default_factory=threading.Event)

    def gone(self) -> bool:
        """Nobody waits for it any more: a read not begun need not begin."""
        return False


@dataclass(kw_only=True)
class Restoring(Read):
    """An admitted request whose KV is read from SSD on a thread; what `Engine._start` knew
    of it, kept for its hand-over (`Engine._join`)."""

    job: Any  # commands.Generate
    tokens: Any
    ids: list
    session: tuple[str, str]
    history: Any  # its conversation's committed tokens before this turn (None: none)
    decoding: Any
    look: Any  # restore.Look
    t0: float  # when its restore began
    stall_s: float = 0.0  # the engine thread's share of the restore

    def gone(self) -> bool:
        return self.job.cancelled.is_set()


class Restores:
    """The reads in flight (engine thread; each thread sets only its own `Read`): requests'
    restores, and apart from them prefetch hints' (worker/tiers/prefetch.py)."""

    def __init__(self, wake: Callable[[], None], kv_bytes_per_token: int):
        self.wake = wake
        self.kv_bytes_per_token = kv_bytes_per_token
        self.stopping = threading.Event()
        self._inflight: list[Read] = []

    def __len__(self) -> int:
        return len(self._inflight)

    def worth_a_thread(self, more_tokens: int) -> bool:
        """A read from SSD of `more_tokens` beyond what RAM holds, long enough that a thread
        costs less than the others' wait."""
        return more_tokens > 0 and more_tokens * self.kv_bytes_per_token >= THREAD_MIN_BYTES

    def start(self, r: Read, read: Callable[[Callable], Any]) -> None:
        """`read(on_corrupt)` on a thread; the engine hears of its end through `wake`."""
        self._inflight.append(r)
        threading.Thread(target=self._read, args=(r, read), name="restore",
                         daemon=True).start()

    def _read(self, r: Read, read) -> None:
        try:
            _held_for_test(lambda: r.gone() or self.stopping.is_set())
            if not (r.gone() or self.stopping.is_set()):
                r.ssd = read(lambda block, e: r.corrupt.append((block, e)))
        except BaseException as e:  # the engine fails the request (or hint) with it
            r.error = e
        finally:
            r.done.set()
            self.wake()

    def take_done(self) -> list:
        """The restores whose read has ended, out of the in-flight list."""
        done = [r for r in self._inflight if r.done.is_set()]
        self._inflight = [r for r in self._inflight if not r.done.is_set()]
        return done

    def stop(self, timeout_s: float) -> list:
        """The worker stops: reads not begun never begin; those under way end (they are not
        interruptible), for `timeout_s` at most. Returns them all, for their requests' end."""
        self.stopping.set()
        end = time.monotonic() + timeout_s
        for r in self._inflight:
            r.done.wait(max(0.0, end - time.monotonic()))
        gone, self._inflight = self._inflight, []
        return gone


def _held_for_test(let_go: Callable[[], bool]) -> None:
    """The test seam (`HOLD_ENV`): wait here until the test releases it, or `let_go()`."""
    folder = os.environ.get(HOLD_ENV)
    if not folder:
        return
    folder = Path(folder)
    (folder / "held").touch()
    while not (folder / "release").exists() and not let_go():
        time.sleep(0.01)
