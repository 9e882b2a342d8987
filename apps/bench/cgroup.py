"""A memory cgroup for one side of a comparison: the same limit for each server's whole process
tree, page cache included, and what each side used under it.

Made by the bench, as root, below the cgroup the bench runs in (so whatever bounds the bench
bounds it too): cgroup v1's memory controller (`memory.limit_in_bytes`, which counts the page
cache a side's processes bring in, as v2's `memory.max` does) or v2 where the bench's own
cgroup delegates the memory controller. A side's process enters it before it execs
(`preexec`), so every process it starts is in it from its first page. What comes back
(`usage`): the peak (`max_usage_in_bytes`; v2 `memory.peak`), how often the limit was hit
(`failcnt`; v2 `max` events: the kernel reclaimed or throttled to stay under it) and how many
processes it OOM-killed.

Where no such cgroup can be made (not root, no memory controller, v2 without delegation),
`MemoryCgroup.create` raises `CgroupUnavailable` saying why: a comparison at "the same
memory" that cannot enforce it is not run.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOT = Path("/sys/fs/cgroup")


class CgroupUnavailable(RuntimeError):
    """No memory cgroup can be made here; the message says why and what would do."""


def _own(controller: str | None) -> str:
    """This process's cgroup path for `controller` (v1), or its v2 path (None)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if (controller is None and names == "") or (controller and controller in
                                                    names.split(",")):
            return path
    raise CgroupUnavailable(f"this process is in no {controller or 'v2'} cgroup "
                            f"(/proc/self/cgroup)")


def parse_bytes(spec: str | int) -> int:
    """`1500000000`, `1.5GB`, `1500MB`, `2GiB`: bytes."""
    if isinstance(spec, int):
        return spec
    s = spec.strip().upper().replace(" ", "")
    for suffix, mult in (("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10), ("GB", 10**9),
                         ("MB", 10**6), ("KB", 10**3), ("G", 10**9), ("M", 10**6),
                         ("B", 1)):
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * mult)
    return int(float(s))


class MemoryCgroup:
    """One side's cgroup: `preexec` puts a child in it, `usage` reads it, `remove` ends it."""

    def __init__(self, path: Path, version: int, limit_bytes: int | None):
        self.path, self.version, self.limit_bytes = path, version, limit_bytes
        self._procs = str(path / "cgroup.procs").encode()
        self.peak_anon_bytes = 0  # sampled (`sample`): the tree's own memory, no page cache
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    @classmethod
    def create(cls, name: str, limit_bytes: int | None) -> "MemoryCgroup":
        """A new cgroup `name` below this process's, limited to `limit_bytes` (None: no limit,
        for a side measured unbounded: its peak is still read)."""
        if os.geteuid() != 0:
            raise CgroupUnavailable("making a memory cgroup needs root (the limit would be "
                                    "the same for both sides only if the kernel enforces it)")
        if (V1_ROOT / "memory.limit_in_bytes").exists():
            parent = V1_ROOT / _own("memory").lstrip("/")
            version = 1
        elif (V2_ROOT / "cgroup.controllers").exists():
            parent = V2_ROOT / _own(None).lstrip("/")
            if "memory" not in (parent / "cgroup.subtree_control").read_text().split():
                try:
                    (parent / "cgroup.subtree_control").write_text("+memory")
                except OSError as e:
                    raise CgroupUnavailable(
                        f"cgroup v2: {parent} does not delegate the memory controller to "
                        f"its children and cannot be made to ({e}); run the bench in a "
                        f"cgroup that does (e.g. systemd-run --scope -p Delegate=yes)") from e
            version = 2
        else:
            raise CgroupUnavailable("no memory cgroup controller is mounted (neither "
                                    f"{V1_ROOT} nor cgroup v2 at {V2_ROOT})")
        path = parent / name
        try:
            if path.exists():
                cls(path, version, None).remove()
            path.mkdir()
        except OSError as e:
            raise CgroupUnavailable(f"cannot make {path}: {e}") from e
        group = cls(path, version, limit_bytes)
        try:
            if version == 1:
                group._write("memory.limit_in_bytes", str(limit_bytes or -1))
                got = int(group._read("memory.limit_in_bytes"))
                if limit_bytes and abs(got - limit_bytes) > 4096:
                    raise CgroupUnavailable(f"{path}: asked a limit of {limit_bytes} bytes, "
                                            f"the kernel set {got}")
                group.limit_bytes = limit_bytes and got
            else:
                group._write("memory.max", str(limit_bytes) if limit_bytes else "max")
                group._write("memory.swap.max", "0") if (path / "memory.swap.max").exists() \
                    else None
        except OSError as e:
            group.remove()
            raise CgroupUnavailable(f"cannot set {path}'s limit: {e}") from e
        return group

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def _write(self, name: str, value: str) -> None:
        (self.path / name).write_text(value)

    def preexec(self) -> None:
        """In a child between fork and exec (`subprocess.Popen(preexec_fn=...)`): it joins this
        cgroup, and so does every process it starts. Plain syscalls only (after a fork)."""
        fd = os.open(self._procs, os.O_WRONLY)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in self._read("cgroup.procs").split()]
        except OSError:
            return []

    def stat(self) -> dict[str, int]:
        try:
            return {k: int(v) for k, v in (line.split() for line in
                                           self._read("memory.stat").splitlines())}
        except OSError:
            return {}

    def anon_bytes(self) -> int:
        """The tree's own memory now (anonymous and shared: what it holds, not page cache)."""
        s = self.stat()
        if self.version == 1:
            return s.get("total_rss", 0) + s.get("total_shmem", 0)
        return s.get("anon", 0) + s.get("shmem", 0)

    def start_sampling(self, every_s: float = 0.2) -> None:
        """`peak_anon_bytes` sampled from now until `usage` (the kernel keeps the peak of the
        total, page cache included, itself)."""
        def run() -> None:
            while not self._stop.wait(every_s):
                self.peak_anon_bytes = max(self.peak_anon_bytes, self.anon_bytes())

        self._sampler = threading.Thread(target=run, name="cgroup-sample", daemon=True)
        self._sampler.start()

    def usage(self) -> dict:
        """What the side used: its peak (page cache included, as the limit counts it), the
        sampled peak of its own memory, how often it met the limit, OOM kills."""
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join(timeout=5)
        self.peak_anon_bytes = max(self.peak_anon_bytes, self.anon_bytes())
        if self.version == 1:
            oom = dict(line.split() for line in self._read("memory.oom_control").splitlines())
            peak, hits = int(self._read("memory.max_usage_in_bytes")), \
                int(self._read("memory.failcnt"))
            kills = int(oom.get("oom_kill", 0))
        else:
            events = dict(line.split() for line in self._read("memory.events").splitlines())
            peak = int(self._read("memory.peak")) if (self.path / "memory.peak").exists() \
                else int(self._read("memory.current"))
            hits, kills = int(events.get("max", 0)), int(events.get("oom_kill", 0))
        return {"cgroup": str(self.path), "cgroup_version": self.version,
                "limit_bytes": self.limit_bytes, "peak_bytes": peak,
                "peak_anon_bytes": self.peak_anon_bytes,
                "peak_vs_limit": round(peak / self.limit_bytes, 3) if self.limit_bytes
                else None,
                "limit_hits": hits, "oom_kills": kills,
                "throttled": hits > 0, "killed": kills > 0}

    def remove(self, timeout_s: float = 30) -> None:
        """Once its processes are gone (they are the bench's own: any left are killed): its
        page cache is reclaimed (v1 force_empty), so the next side does not find this one's
        files in memory charged to no one, and the cgroup goes."""
        deadline = time.monotonic() + timeout_s
        while (left := self.pids()) and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        if self.version == 1 and (self.path / "memory.force_empty").exists():
            try:
                self._write("memory.force_empty", "0")
            except OSError:
                pass
        try:
            self.path.rmdir()
        except OSError:
            pass
