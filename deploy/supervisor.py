"""`kvbank up`: start coldstore, worker, router and shim, keep them running, stop them in order.

Start order is the coldstore, then (once it is healthy) the worker, the router and the shim at
once: the router asks the worker for its Info only when a request comes; stop order is the
reverse: shim and router first (no new requests), then the worker
(finishes and hands its last writes over), then the coldstore (bounded flush).
A process that dies is restarted and the restart is logged: at once (RESTART_S) if it had
served (a kill -9, an OOM kill: its clients are waiting), else after a backoff that doubles
while it keeps dying before it serves (a crash loop), up to MAX_BACKOFF_S.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvbank.config import OPENBLAS_PATHS, Layout
from kvbank.contracts.health import coldstore_up, grpc_healthy

logger = logging.getLogger(__name__)

STOP_GRACE_S = {"shim": 5.0, "router": 5.0, "worker": 15.0, "coldstore": 20.0}
# The longest an orderly stop takes: the front doors together, then the worker, then the
# coldstore, each given its grace before a kill. A caller waits longer than this before it kills
# the supervisor itself (which would leave its children's pid files behind).
STOP_BOUND_S = STOP_GRACE_S["router"] + STOP_GRACE_S["worker"] + STOP_GRACE_S["coldstore"]
RESTART_S = 0.1  # a process that had served and died is restarted after this
MIN_BACKOFF_S, MAX_BACKOFF_S = 0.5, 10.0  # one that died before serving (a crash loop)


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    served: bool = False  # healthy since its last spawn
    backoff_s: float = MIN_BACKOFF_S
    respawn_at: float | None = None  # it died: spawned again at this time (monotonic)


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc() if sys.platform == "linux" else None
_PR_SET_PDEATHSIG = 1


def _sigterm_when_parent_dies() -> None:  # runs in the child between fork and exec
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def die_with_parent() -> dict:
    """`subprocess.Popen` arguments that, on Linux, send the child SIGTERM when the thread
    that started it ends: a supervisor killed by SIGKILL leaves no process of its own behind
    (each stops in order on SIGTERM). Elsewhere: none."""
    return {"preexec_fn": _sigterm_when_parent_dies} if _LIBC is not None else {}


def _kvbank(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvbank.apps.cli", *args]


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    blas = next((p for p in OPENBLAS_PATHS if os.path.exists(p)), None)
    if blas:
        env["LD_PRELOAD"] = ":".join(x for x in (blas, env.get("LD_PRELOAD")) if x)
    else:
        logger.warning("OpenBLAS not found (%s): MLX on CPU will be very slow. "
                       "Install it with: apt-get install libopenblas0-pthread", OPENBLAS_PATHS[0])
    return env


class Supervisor:
    def __init__(self, *, model: Path, layout: Layout, host: str, port: int, shim_port: int,
                 metrics_port: int, args: dict[str, list[str]]):
        """`args` holds each process's own flags, as `kvbank up` was given them."""
        self.layout = layout.ensure()
        common = ["--data-dir", str(layout.data_dir)]

        def metrics(offset: int) -> list[str]:
            return ["--metrics-port", str(metrics_port + offset if metrics_port > 0
                                          else metrics_port)]

        self.children = [
            Child("coldstore", _kvbank("coldstore", *common, *metrics(2), *args["coldstore"]),
                  dict(os.environ)),
            Child("worker", _kvbank("worker", *common, "--model", str(model), *metrics(1),
                                    *args["worker"]), _worker_env()),
            Child("router", _kvbank("router", *common, "--model", str(model), "--host", host,
                                    "--port", str(port), *metrics(0), *args["router"]),
                  dict(os.environ)),
        ]
        if shim_port:
            self.children.append(
                Child("shim", _kvbank("shim", "--router", f"{host}:{port}", *args["shim"]),
                      dict(os.environ)))
        self.host, self.port = host, port
        self.shim_address = _shim_address(args["shim"]) if shim_port else None
        self.stopping = False

    def _spawn(self, c: Child) -> None:
        c.proc = subprocess.Popen(c.argv, env=c.env, **die_with_parent())
        c.started_at, c.served, c.respawn_at = time.monotonic(), False, None
        (self.layout.run_dir / f"{c.name}.pid").write_text(str(c.proc.pid))
        logger.info("%s started (pid %d)", c.name, c.proc.pid)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: self._request_stop())
        signal.signal(signal.SIGINT, lambda *_: self._request_stop())
        try:
            # The coldstore first (the worker's store and link need it), then the others at
            # once: the router and the shim load no model, and start while the worker does.
            first, rest = self.children[:1], self.children[1:]
            for group in (first, rest):
                for c in group:
                    self._spawn(c)
                for c in group:
                    if not self._wait_healthy(c, timeout_s=300):
                        if self.stopping:
                            return 0
                        logger.error("%s did not become healthy; stopping", c.name)
                        return 1
            logger.info("kvbank is up: router on %s:%d, OpenAI API on %s, worker on %s, "
                        "coldstore on %s, store %s", self.host, self.port,
                        f"http://{self.shim_address}/v1" if self.shim_address else "(off)",
                        self.layout.worker_address, self.layout.coldstore_address,
                        self.layout.store_dir)
            (self.layout.run_dir / "ready").write_text(str(os.getpid()))
            while not self.stopping:
                self._check_children()
                # A plain sleep: the signal handler only sets a flag. An Event set from the
                # handler deadlocks when the signal lands while this thread holds the Event's
                # own lock (a stack once ignored SIGTERM and SIGINT until it was killed).
                time.sleep(self._next_check_s())
            return 0
        finally:
            (self.layout.run_dir / "ready").unlink(missing_ok=True)
            self._stop_all()

    def _request_stop(self) -> None:
        self.stopping = True

    def _check_children(self) -> None:
        """Each child: spawned again when its restart is due; marked served once healthy (a
        health check every loop until then); on exit, its restart scheduled. Never sleeps:
        one child's backoff does not hold another's restart."""
        now = time.monotonic()
        for c in self.children:
            if c.respawn_at is not None:
                if now >= c.respawn_at and not self.stopping:
                    self._spawn(c)
                continue
            if c.proc is None:
                continue
            if c.proc.poll() is None:
                if not c.served and self._healthy(c.name):
                    c.served, c.backoff_s = True, MIN_BACKOFF_S
                    logger.info("%s is healthy", c.name)
                continue
            delay = RESTART_S if c.served else c.backoff_s
            if not c.served:
                c.backoff_s = min(c.backoff_s * 2, MAX_BACKOFF_S)
            logger.error("%s exited with %s; restarting in %.1fs", c.name, c.proc.returncode,
                         delay)
            c.respawn_at = now + delay
            c.restarts += 1

    def _next_check_s(self) -> float:
        """Until the loop looks again: 0.2 s, or sooner where a restart is due."""
        due = [c.respawn_at for c in self.children if c.respawn_at is not None]
        return max(0.0, min([0.2, *(t - time.monotonic() for t in due)]))

    def _wait_healthy(self, c: Child, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.stopping:
            if c.proc.poll() is not None:
                return False
            if self._healthy(c.name):
                logger.info("%s is healthy", c.name)
                c.served = True
                return True
            time.sleep(0.05)
        return False

    def _healthy(self, name: str) -> bool:
        if name == "coldstore":
            return coldstore_up(self.layout.coldstore_address)
        if name == "shim":
            return _http_healthy(f"http://{self.shim_address}/health")
        address = self.layout.worker_address if name == "worker" else f"{self.host}:{self.port}"
        return grpc_healthy(address)

    def _stop_all(self) -> None:
        """The front doors (shim, router) together, then the worker, then the coldstore."""
        doors = [c for c in self.children if c.name in ("shim", "router")]
        rest = [c for c in reversed(self.children) if c not in doors]
        for group in (doors, *([c] for c in rest)):
            running = [c for c in group if c.proc is not None and c.proc.poll() is None]
            for c in running:
                c.proc.send_signal(signal.SIGTERM)
            for c in running:
                try:
                    c.proc.wait(timeout=STOP_GRACE_S[c.name])
                    logger.info("%s stopped", c.name)
                except subprocess.TimeoutExpired:
                    logger.warning("%s did not stop in %.0fs; killing it", c.name,
                                   STOP_GRACE_S[c.name])
                    c.proc.kill()
                    c.proc.wait()
        for c in self.children:
            (self.layout.run_dir / f"{c.name}.pid").unlink(missing_ok=True)


def _shim_address(shim_args: list[str]) -> str:
    flags = dict(zip(shim_args[::2], shim_args[1::2]))
    return f"{flags.get('--shim-host', '127.0.0.1')}:{flags['--shim-port']}"


def _http_healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
