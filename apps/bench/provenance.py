"""What every bench's JSON says about the run that made it: the command, the code, the machine,
and how busy the machine was.

This machine is shared: a run made while other programs take its cores measures them too. So
each result carries the load average (1, 5 and 15 minutes) when the run began and when it
ended, and `quiet`: whether both 1-minute loads stayed under QUIET_LOAD. A figure for the
record is one measured quiet; a run that was not says so in its own JSON.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

QUIET_LOAD = 1.5  # the 1-minute load average under which a run counts as measured quiet
PACKAGES = ("kvbank", "mlx", "mlx-lm", "lmdb", "numpy", "pyzmq", "grpcio")

_started: dict | None = None


def begin(argv: list[str] | None = None) -> dict:
    """The run starts: its argv, date and load now (the registry calls it before a bench)."""
    global _started
    _started = {"argv": list(sys.argv if argv is None else argv),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds"),
                "commit": commit(),  # the code as the run starts (a commit may land during it)
                "load_at_start": load(), "_t0": time.monotonic()}
    return _started


def load() -> list[float]:
    """The load average over 1, 5 and 15 minutes."""
    return [round(x, 2) for x in os.getloadavg()]


def record() -> dict:
    """The provenance of the run begun last (`begin`; begun now if none was): argv, versions,
    commit, date, machine, the load at its start and now, its duration."""
    start = _started or begin()
    end = load()
    return {"argv": start["argv"], "date": start["date"], "commit": start["commit"],
            "versions": versions(), "machine": machine(),
            "load_at_start": start["load_at_start"], "load_at_end": end,
            "quiet": max(start["load_at_start"][0], end[0]) < QUIET_LOAD,
            "quiet_load": QUIET_LOAD,
            "duration_s": round(time.monotonic() - start["_t0"], 1)}


def stamp(doc: dict) -> dict:
    """`doc` with its `provenance` (kept if it has one)."""
    if "provenance" not in doc:
        doc["provenance"] = record()
    return doc


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def commit(here: Path | None = None) -> dict:
    """The git commit this kvbank runs from (the checkout `here`, this file's by default),
    and whether its tracked code anywhere in it differs from it (`dirty`; docs aside); None
    for an install without a checkout."""
    here = here or Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return {"sha": None, "dirty": None}
        # the whole checkout's code (`:(top)`; a bare `.` would be this folder's alone); docs
        # written while a run goes on do not make it another run's code
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ":(top)", ":(top,exclude)docs", ":(top,exclude)*.md"],
                               cwd=here, capture_output=True, text=True, timeout=30)
        return {"sha": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.TimeoutExpired):
        return {"sha": None, "dirty": None}


def machine() -> dict:
    cpu = ""
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                    if line.startswith("model name")), "")
    except OSError:
        pass
    mem = 0
    try:
        mem = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo")
                   if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        pass
    return {"hostname": platform.node(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "cpu_model": cpu or platform.processor(),
            "memory_bytes": mem}
