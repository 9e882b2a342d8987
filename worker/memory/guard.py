"""The memory-pressure guard: measure a level every tick, trim the bank when it rises.

Level = the worst of four sources:
  ledger   what the worker holds against --memory-budget (90 % warning, 98 % critical);
  system   memory the OS still has available (under 10 % warning, under 5 % critical);
  psi      Linux pressure stall information, /proc/pressure/memory, where the kernel has it
           (some avg10 >= 10 % warning, full avg10 >= 10 % critical);
  injected a level an operator or a test set with `kvbank admin pressure` (until `auto`).

Actions (`pressure_trim` in worker/tiers/eviction.py, with its receipt), posted to the engine on a
rising edge and then at most every `act_every_s` while the level stays up:
  warning  wait up to `warning_wait_s` for an idle engine, then shrink the bank to half of what
           it holds, never an active conversation nor one whose KV is not on SSD yet;
  critical no wait: every idle entry goes; unwritten ones are dropped (and counted) when the
           machine is short (system, psi, injected), written out first when the source is
           kvbank's own ledger.
Every tick also sets the bank's dynamic ceiling: the budget minus everything else held, so the
bank gives back what running requests need, never taking an active conversation.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import asdict
from pathlib import Path

import psutil

from kvbank import metrics
from kvbank.contracts.vocabulary import PressureLevel, PressureSource
from kvbank.heap import resident_bytes
from kvbank.worker.commands import PressureTrim, Tick

logger = logging.getLogger(__name__)

LEVELS = tuple(PressureLevel)
PSI_PATH = Path("/proc/pressure/memory")


def _rank(level: str) -> int:
    return LEVELS.index(level)


def ledger_level(held: int, budget: int) -> str:
    frac = held / max(1, budget)
    return (PressureLevel.CRITICAL if frac >= 0.98 else PressureLevel.WARNING if frac >= 0.90
            else PressureLevel.NORMAL)


def system_level() -> str:
    vm = psutil.virtual_memory()
    frac = vm.available / max(1, vm.total)
    return (PressureLevel.CRITICAL if frac < 0.05 else PressureLevel.WARNING if frac < 0.10
            else PressureLevel.NORMAL)


def psi_level(path: Path = PSI_PATH) -> str:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return PressureLevel.NORMAL
    avg10 = {}
    for line in lines:
        kind, *fields = line.split()
        avg10[kind] = float(dict(f.split("=") for f in fields).get("avg10", 0))
    if avg10.get("full", 0) >= 10:
        return PressureLevel.CRITICAL
    return PressureLevel.WARNING if avg10.get("some", 0) >= 10 else PressureLevel.NORMAL


class Guard:
    """Runs on its own thread. It reads the engine's published snapshot and posts commands
    (worker/commands.py): a `Tick` every tick, a `PressureTrim` when it acts. It owns only
    its level and its timing."""

    def __init__(self, engine, *, tick_s: float = 1.0, act_every_s: float = 120.0,
                 warning_wait_s: float = 60.0):
        self.engine = engine
        self.tick_s = tick_s
        self.act_every_s = act_every_s
        self.warning_wait_s = warning_wait_s
        self.injected: str | None = None  # the guard thread's: others post to `_injections`
        self._injections: queue.SimpleQueue = queue.SimpleQueue()
        self.level, self.source = PressureLevel.NORMAL, PressureSource.NONE
        self._acted_level = PressureLevel.NORMAL
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

    def inject(self, level: str) -> tuple[PressureLevel, PressureSource]:
        """Any thread (the Admin RPC): the guard takes it at its next tick. `auto` goes back to
        measuring. Returns the level and source that tick will find."""
        if level not in (*LEVELS, "auto"):
            raise ValueError(f"pressure level {level!r}: use one of {', '.join(LEVELS)} or auto")
        self._injections.put(None if level == "auto" else PressureLevel(level))
        self._wake.set()
        return ((PressureLevel(level), PressureSource.INJECTED) if level != "auto"
                else self._machine_level())

    def measure(self) -> tuple[PressureLevel, PressureSource]:
        while not self._injections.empty():  # the guard thread's own, applied in order
            self.injected = self._injections.get()
        if self.injected is not None:
            return self.injected, PressureSource.INJECTED
        return self._machine_level()

    def _machine_level(self) -> tuple[PressureLevel, PressureSource]:
        """The worst of the ledger, the system's free memory and PSI (reads published state
        only: safe on any thread)."""
        snap = self.engine.snapshot
        found = [(ledger_level(snap.held_bytes, self.engine.memory_budget), PressureSource.LEDGER),
                 (system_level(), PressureSource.SYSTEM), (psi_level(), PressureSource.PSI)]
        # On a tie the machine's own reading names the source: it decides what a trim drops.
        level, source = max(found, key=lambda f: (_rank(f[0]), f[1] != PressureSource.LEDGER))
        return level, source if level != PressureLevel.NORMAL else PressureSource.NONE

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                rss = resident_bytes()
                self.engine.post(Tick(rss_bytes=rss))
                self.level, self.source = self.measure()
                metrics.PRESSURE_LEVEL.set(_rank(self.level))
                metrics.WORKER_RSS.set(rss)
                self._maybe_act(time.monotonic())
            except Exception:
                logger.exception("pressure guard tick failed")
            self._wake.wait(self.tick_s)
            self._wake.clear()

    def _maybe_act(self, now: float) -> None:
        level, source = self.level, self.source
        if level == PressureLevel.NORMAL:
            self._acted_level = PressureLevel.NORMAL
            return
        rising = _rank(level) > _rank(self._acted_level)
        if not rising and now - self._acted_at < self.act_every_s:
            return
        self._acted_level, self._acted_at = level, now
        deferred = 0.0
        if level == PressureLevel.WARNING:
            t0 = time.monotonic()
            while not self.engine.snapshot.idle and time.monotonic() - t0 < self.warning_wait_s:
                if self._stop.wait(0.1):
                    return
            deferred = time.monotonic() - t0
        receipt = self.engine.ask(PressureTrim(level=level, source=source, deferred_s=deferred))
        metrics.PRESSURE_TRIMS.labels(level).inc()
        logger.warning("pressure %s (%s): %s", level, source, asdict(receipt))
