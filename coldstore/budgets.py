"""What the coldstore may write: the hourly write budget, the free-disk floor, the per-entry cap.

Each check returns a `WriteRefusal` (a stable reason code and a sentence with the numbers) or
None: a value, not an exception (kvbank.contracts.failures holds those). A refused job leaves
nothing new restorable; the worker keeps serving the entry from RAM and its release drops it
as if there were no SSD tier. The store size cap is not a refusal: the
store makes room by retiring the least recently used sessions' KV (`ColdStore.retire_lru`).
A block LMDB's map has no room for at its ceiling is refused too (`map_full`, from the
commit itself: coldstore/server.py), so the cap defaults to half that ceiling.
"""

from __future__ import annotations

import shutil
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
HOUR_S = 3600.0


@dataclass(frozen=True)
class Limits:
    write_bytes_per_hour: int = 128 * GIB
    free_disk_floor_bytes: int | None = None  # None: 10 GiB or 5 % of the disk, the smaller
    store_max_bytes: int | None = None  # None: no cap (the disk floor still holds)
    entry_max_bytes: int | None = None  # None: no cap
    store_map_bytes: int | None = None  # LMDB's map ceiling; None: it grows with the store

    @property
    def store_cap_bytes(self) -> int | None:
        """The cap on stored KV and responses: `store_max_bytes`, else half the map's ceiling
        (pages carry headers and round up, freed pages wait two commits to be reused)."""
        if self.store_max_bytes is not None or self.store_map_bytes is None:
            return self.store_max_bytes
        return self.store_map_bytes // 2


@dataclass(frozen=True)
class WriteRefusal:
    """Why a block may not be written now (the job ends `refused`)."""

    reason: str  # write_budget | disk_floor | entry_too_large | store_cap | map_full
    message: str


class Budgets:
    def __init__(self, limits: Limits, store_dir: Path):
        self.limits = limits
        self.store_dir = store_dir
        self._written: deque[tuple[float, int]] = deque()
        self._written_bytes = 0
        total = shutil.disk_usage(store_dir).total
        self.free_disk_floor_bytes = (limits.free_disk_floor_bytes
                                      if limits.free_disk_floor_bytes is not None
                                      else min(10 * GIB, total // 20))

    def written_last_hour(self, now: float | None = None) -> int:
        now = time.time() if now is None else now
        while self._written and self._written[0][0] <= now - HOUR_S:
            self._written_bytes -= self._written.popleft()[1]
        return self._written_bytes

    def record(self, nbytes: int, now: float | None = None) -> None:
        self._written.append((time.time() if now is None else now, nbytes))
        self._written_bytes += nbytes

    def check_entry(self, entry_bytes: int) -> WriteRefusal | None:
        cap = self.limits.entry_max_bytes
        if cap is not None and entry_bytes > cap:
            return WriteRefusal("entry_too_large",
                                f"this conversation's KV is {entry_bytes} bytes, over the "
                                f"per-entry cap of {cap} bytes (--entry-max-bytes)")
        return None

    def check_write(self, nbytes: int, now: float | None = None) -> WriteRefusal | None:
        budget = self.limits.write_bytes_per_hour
        used = self.written_last_hour(now)
        if used + nbytes > budget:
            wait = (self._written[0][0] + HOUR_S - (time.time() if now is None else now)
                    if self._written else 0.0)
            return WriteRefusal("write_budget",
                                f"the hourly write budget of {budget} bytes is spent ({used} "
                                f"written in the last hour); room returns in "
                                f"{max(0.0, wait):.0f} s (--write-budget-bytes-per-hour)")
        free = shutil.disk_usage(self.store_dir).free
        if free - nbytes < self.free_disk_floor_bytes:
            return WriteRefusal("disk_floor",
                                f"the disk has {free} bytes free; writing {nbytes} more would go "
                                f"below the floor of {self.free_disk_floor_bytes} bytes "
                                f"(--free-disk-floor-bytes)")
        return None
