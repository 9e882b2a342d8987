"""The memory-pressure guard: measure a level every tick, trim the bank when it rises.

Level = the worst of four sources:
  ledger   what the worker holds against --memory-budget (90 % warning, 98 % critical);
  system   memory the OS still has available (under 10 % warning, under 5 % critical);
  psi      Linux pressure stall information, /proc/pressure/memory, where the kernel has it
           (some avg10 >= 10 % warning, full avg10 >= 10 % critical);
  injected a level an operator or a test set with `kvbank admin pressure` (until `auto`).

Actions (each a function with its receipt, `pressure_trim`), on a rising edge and then at most
every `act_every_s` while the level stays up:
  warning  wait up to `warning_wait_s` for an idle engine, then shrink the bank to half of what
           it holds, never an active conversation nor one whose KV is not on SSD yet;
  critical no wait: every idle entry goes, unwritten ones too (and counted).
Every tick also sets the bank's dynamic ceiling: the budget minus everything else held, so the
bank gives back what running requests need, never taking an active conversation.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from kvbank import events, metrics

logger = logging.getLogger(__name__)

LEVELS = ("normal", "warning", "critical")
PSI_PATH = Path("/proc/pressure/memory")


@dataclass
class PressureTrim:
    """Receipt of one guard action."""

    level: str
    source: str
    bank_entries_evicted: int = 0
    bank_unwritten_kept: int = 0
    bank_unwritten_dropped: int = 0
    bytes_after: int = 0
    deferred_s: float = 0.0
    at: float = field(default_factory=time.time)
    kind: str = "pressure_trim"


def _rank(level: str) -> int:
    return LEVELS.index(level)


def ledger_level(held: int, budget: int) -> str:
    frac = held / max(1, budget)
    return "critical" if frac >= 0.98 else "warning" if frac >= 0.90 else "normal"


def system_level() -> str:
    vm = psutil.virtual_memory()
    frac = vm.available / max(1, vm.total)
    return "critical" if frac < 0.05 else "warning" if frac < 0.10 else "normal"


def psi_level(path: Path = PSI_PATH) -> str:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return "normal"
    avg10 = {}
    for line in lines:
        kind, *fields = line.split()
        avg10[kind] = float(dict(f.split("=") for f in fields).get("avg10", 0))
    if avg10.get("full", 0) >= 10:
        return "critical"
    return "warning" if avg10.get("some", 0) >= 10 else "normal"


class Guard:
    """Runs on its own thread; every bank action goes through `engine.call`."""

    def __init__(self, engine, *, tick_s: float = 1.0, act_every_s: float = 120.0,
                 warning_wait_s: float = 60.0):
        self.engine = engine
        self.tick_s = tick_s
        self.act_every_s = act_every_s
        self.warning_wait_s = warning_wait_s
        self.injected: str | None = None
        self.level, self.source = "normal", "none"
        self.receipts: list[PressureTrim] = []
        self._acted_level = "normal"
        self._acted_at = 0.0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="guard", daemon=True)

    def start(self) -> "Guard":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._wake.set()

    def inject(self, level: str) -> tuple[str, str]:
        """`auto` goes back to measuring. Returns the level and source now."""
        if level not in (*LEVELS, "auto"):
            raise ValueError(f"pressure level {level!r}: use one of {', '.join(LEVELS)} or auto")
        self.injected = None if level == "auto" else level
        self.level, self.source = self.measure()
        self._wake.set()
        return self.level, self.source

    def measure(self) -> tuple[str, str]:
        if self.injected is not None:
            return self.injected, "injected"
        e = self.engine
        found = [(ledger_level(e.held_bytes(), e.memory_budget), "ledger"),
                 (system_level(), "system"), (psi_level(), "psi")]
        level, source = max(found, key=lambda f: _rank(f[0]))
        return level, source if level != "normal" else "none"

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.level, self.source = self.measure()
                metrics.PRESSURE_LEVEL.set(_rank(self.level))
                self.engine.update_gauges()
                self.engine.call(self.engine.apply_dynamic_ceiling)
                self.engine.call(self.engine.retry_writes)
                self._maybe_act(time.monotonic())
            except Exception:
                logger.exception("pressure guard tick failed")
            self._wake.wait(self.tick_s)
            self._wake.clear()

    def _maybe_act(self, now: float) -> None:
        level, source = self.level, self.source
        if level == "normal":
            self._acted_level = "normal"
            return
        rising = _rank(level) > _rank(self._acted_level)
        if not rising and now - self._acted_at < self.act_every_s:
            return
        self._acted_level, self._acted_at = level, now
        deferred = 0.0
        if level == "warning":
            t0 = time.monotonic()
            while not self.engine.idle() and time.monotonic() - t0 < self.warning_wait_s:
                if self._stop.wait(0.1):
                    return
            deferred = time.monotonic() - t0
        receipt = self.engine.call(
            lambda: self.engine.pressure_trim(level, source, deferred)).result()
        self.receipts.append(receipt)
        del self.receipts[:-256]
        metrics.PRESSURE_TRIMS.labels(level).inc()
        events.emit(**asdict(receipt))
        logger.warning("pressure %s (%s): %s", level, source, asdict(receipt))
