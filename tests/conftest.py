"""Shared fixtures: the tiny model, and a real kvbank stack (three processes) around it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvbank.config import Layout, preload_openblas

preload_openblas()  # before anything imports mlx in this process
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import grpc  # noqa: E402
import pytest  # noqa: E402

from kvbank.client import Client  # noqa: E402


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    """Where the default model is imported: the user's cache, so runs share one import."""
    from kvbank.models import default_cache_dir

    return default_cache_dir()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, cache_dir) -> Path:
    from kvbank.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0, cache_dir=cache_dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Stack:
    """A running `kvbank up` (supervisor + router + worker + coldstore)."""

    proc: subprocess.Popen
    layout: Layout
    address: str
    log: Path

    def client(self) -> Client:
        return Client(self.address)

    def pid(self, name: str) -> int:
        return int((self.layout.run_dir / f"{name}.pid").read_text())

    def kill9(self, name: str) -> int:
        pid = self.pid(name)
        os.kill(pid, signal.SIGKILL)
        return pid

    def wait_restarted(self, name: str, old_pid: int, timeout_s: float = 60) -> None:
        """Until the supervisor has a new `name` process and the stack answers again."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.pid(name) != old_pid:
                    break
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.1)
        self.wait_ready(deadline - time.monotonic())

    def wait_ready(self, timeout_s: float = 60) -> None:
        from deploy.supervisor import _grpc_healthy

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if _grpc_healthy(self.layout.worker_address) and _grpc_healthy(self.address):
                return
            time.sleep(0.1)
        raise TimeoutError(f"stack not ready; log:\n{self.log.read_text()[-3000:]}")

    def wait_durable(self, session_id: str, timeout_s: float = 30) -> "object":
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


def start_stack(model: Path, data_dir: Path, *, extra: list[str] = (), cache_dir: Path | None = None,
                timeout_s: float = 120) -> Stack:
    port = free_port()
    layout = Layout(data_dir)
    log = data_dir.parent / f"{data_dir.name}-stack.log"
    env = dict(os.environ)
    if cache_dir is not None:
        env["KVBANK_CACHE_DIR"] = str(cache_dir)
    argv = [sys.executable, "-m", "kvbank.cli", "up", "--model", str(model),
            "--data-dir", str(data_dir), "--port", str(port), "--block-tokens", "16",
            "--quiet-grace-s", "0.1", *extra]
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)
    stack = Stack(proc, layout, f"127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout_s
    while not (layout.run_dir / "ready").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stack.stop()
            raise RuntimeError(f"kvbank up failed; log:\n{log.read_text()[-4000:]}")
        time.sleep(0.1)
    return stack


@pytest.fixture
def stack(tiny_model, tmp_path, cache_dir):
    s = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir)
    yield s
    s.stop()


def rpc_error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value
