"""Start a whole kvbank stack (`kvbank up`) as a child process and wait until it serves.

Used by the benchmarks and the end-to-end tests, which need the real processes.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvbank.client import Client
from kvbank.config import Layout


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default; elsewhere a guess is as good as asking for 0


def port_range() -> tuple[int, int]:
    """Where `free_ports` picks: KVBANK_PORT_RANGE ("low-high", high excluded), so that
    several test processes on one machine never plan the same port; else the 12,000 ports
    below the kernel's ephemeral range."""
    given = os.environ.get("KVBANK_PORT_RANGE")
    if given:
        low, high = map(int, given.split("-"))
        return low, high
    low, _ = _ephemeral_range()
    return max(1024, low - 12000), low


_handed_out: set[int] = set()  # every port this process's free_ports returned


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct free ports, all held open together while they are picked.

    Picked below the kernel's ephemeral range: a port planned now and bound seconds later
    (a stack starts after the one before it) must not be handed meanwhile to someone's
    outgoing connection or `bind(0)`. CI lost a cluster test to exactly that. Nor is a port
    handed out twice by one process while others remain: a caller that picks its ports and
    then starts a stack (which picks its own) got the same port twice, as it was not yet
    bound (CI lost a kv-events test to that)."""
    candidates = list(range(*port_range()))
    random.shuffle(candidates)
    fresh = [p for p in candidates if p not in _handed_out]
    if len(fresh) >= n:
        candidates = fresh
    socks: list[socket.socket] = []
    try:
        for port in candidates:
            if len(socks) == n:
                break
            s = socket.socket()
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            socks.append(s)
        if len(socks) < n:  # the range below is crowded: take what the kernel gives
            for _ in range(n - len(socks)):
                s = socket.socket()
                s.bind((host, 0))
                socks.append(s)
        ports = [s.getsockname()[1] for s in socks]
        _handed_out.update(ports)
        return ports
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


@dataclass
class LocalStack:
    proc: subprocess.Popen
    layout: Layout
    address: str
    log: Path
    shim_url: str | None = None  # http://127.0.0.1:PORT, the OpenAI API (None: started without)

    @classmethod
    def start(cls, model: Path, data_dir: Path, *, extra: list[str] = (),
              env: dict | None = None, timeout_s: float = 300, shim: bool = True,
              launcher: tuple[str, ...] = ("-m", "kvbank.apps.cli"), port: int | None = None,
              shim_port: int | None = None, wait: bool = True,
              popen: dict | None = None) -> "LocalStack":
        """`launcher`: the module that runs `up` (a test may stand a slow disk in).
        `port`, `shim_port`: fixed ports (default: free ones); `wait=False` returns as soon as
        the process runs (then `wait_started`); `popen`: more `subprocess.Popen` arguments."""
        picked = free_ports(2)
        port = port or picked[0]
        shim_port = (shim_port or picked[1]) if shim else 0
        layout = Layout(data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        log = data_dir.parent / f"{data_dir.name}-stack.log"
        argv = [sys.executable, *launcher, "up", "--model", str(model),
                "--data-dir", str(data_dir), "--port", str(port),
                "--shim-port", str(shim_port), "--metrics-port", "0", *extra]
        with open(log, "wb") as f:
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT,
                                    env={**os.environ, **(env or {})}, **(popen or {}))
        stack = cls(proc, layout, f"127.0.0.1:{port}", log,
                    f"http://127.0.0.1:{shim_port}" if shim_port else None)
        if wait:
            stack.wait_started(timeout_s)
        return stack

    def wait_started(self, timeout_s: float = 300) -> None:
        """Until `kvbank up` writes run/ready; if it exits first or the time runs out, stops
        it and raises with its log's tail."""
        deadline = time.monotonic() + timeout_s
        while not (self.layout.run_dir / "ready").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvbank up failed; log:\n{self.log_tail()}")
            time.sleep(0.05)

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def metrics_url(self, name: str) -> str:
        return (self.layout.run_dir / f"{name}.metrics").read_text()

    def client(self) -> Client:
        return Client(self.address)

    def pid(self, name: str) -> int:
        return int((self.layout.run_dir / f"{name}.pid").read_text())

    def kill9(self, name: str) -> int:
        pid = self.pid(name)
        os.kill(pid, signal.SIGKILL)
        return pid

    def wait_ready(self, timeout_s: float = 60) -> None:
        from kvbank.contracts.health import grpc_healthy

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if grpc_healthy(self.layout.worker_address) and grpc_healthy(self.address):
                return
            time.sleep(0.1)
        raise TimeoutError(f"stack not ready; log:\n{self.log_tail()}")

    def wait_restarted(self, name: str, old_pid: int, timeout_s: float = 60) -> None:
        """Until the supervisor runs a new `name` process and the stack answers again."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.pid(name) != old_pid:
                    break
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.1)
        self.wait_ready(max(1.0, deadline - time.monotonic()))

    def wait_durable(self, session_id: str, timeout_s: float = 60):
        """Until every committed token of the session has its KV in LMDB."""
        deadline = time.monotonic() + timeout_s
        with self.client() as c:
            while time.monotonic() < deadline:
                s = c.get_session(session_id)
                if s.durable_tokens == s.token_count:
                    return s
                time.sleep(0.1)
        raise TimeoutError(f"session {session_id} never became durable")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
