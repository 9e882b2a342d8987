"""Settings every process shares: where things live, how they find each other.

One place computes the paths and addresses so that the supervisor, the processes and the tests
agree on them without passing a dozen flags around.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ROUTER_PORT = 50051
DEFAULT_SHIM_PORT = 8000
DEFAULT_METRICS_PORT = 9400  # router; worker +1, coldstore +2
DEFAULT_BLOCK_TOKENS = 256
# While prompts are read, answers pause at most this long between tokens (worker/compute/scheduler.py).
DEFAULT_DECODE_WAIT_S = 10.0
DEFAULT_SHARED_FORWARD_S = 0.15  # see worker/compute/scheduler.py `_step_tokens`
# A tenant shares the server while another tenant runs a request or sent one within this long
# (its next may come any moment): the worker's prompt forwards shorten, and the shim holds
# back a tenant's refused requests (apps/shim/pacing.py).
SHARED_WINDOW_S = 60.0
# The share of the front end's time one tenant's refused requests may take while it shares.
DEFAULT_REFUSAL_SHARE = 0.1
# A gRPC channel to a peer that may be restarting (router -> worker, shim -> router, a
# client -> router). gRPC's default backoff is 1 s x 1.6^n up to 120 s, so a peer back after
# 20 s went unnoticed for up to 20 s more; capped at half a second, the channel is connected
# again within that of its peer serving.
RECONNECT_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 100),
                     ("grpc.max_reconnect_backoff_ms", 500))
# How long a request waits for a (re)starting peer to connect before it is answered
# UNAVAILABLE (HTTP 503) with a retry-after of RETRY_AFTER_UNAVAILABLE_S.
PEER_READY_WAIT_S = 2.0
RETRY_AFTER_UNAVAILABLE_S = 1
OPENBLAS_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
)


def default_data_dir() -> Path:
    env = os.environ.get("KVBANK_DATA_DIR")
    if env:
        return Path(env)
    return Path.home() / ".local" / "share" / "kvbank"


MAX_SOCKET_PATH = 100  # sockaddr_un holds 107 bytes; some room for what follows


@dataclass(frozen=True)
class Layout:
    """Where one kvbank deployment keeps its store and its sockets."""

    data_dir: Path

    @property
    def store_dir(self) -> Path:
        """The LMDB environment (KV blocks and session records)."""
        return self.data_dir / "store"

    @property
    def run_dir(self) -> Path:
        """Sockets and pid files of the running processes."""
        return self.data_dir / "run"

    @property
    def events_path(self) -> Path:
        """The structured event log (JSON lines, rotated)."""
        return self.data_dir / "log" / "events.jsonl"

    @property
    def sockets_dir(self) -> Path:
        """`run_dir`, unless a socket's path there would pass what a Unix socket address holds
        (107 bytes): then a directory in the system's temporary one, named by the data dir,
        the same for every process of this deployment."""
        if len(str(self.run_dir / "worker-state.sock")) <= MAX_SOCKET_PATH:
            return self.run_dir
        import hashlib
        import tempfile

        digest = hashlib.sha1(str(self.data_dir.resolve()).encode()).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / f"kvbank-{digest}"

    @property
    def worker_address(self) -> str:
        """gRPC address of the worker (internal: router only)."""
        return f"unix://{self.sockets_dir / 'worker.sock'}"

    @property
    def coldstore_address(self) -> str:
        """ZeroMQ ROUTER of the coldstore: write jobs, session records, acknowledgements."""
        return f"ipc://{self.sockets_dir / 'coldstore.sock'}"

    @property
    def worker_state_address(self) -> str:
        """ZeroMQ PUB of the worker: busy/quiet, read by the coldstore's idle lane."""
        return f"ipc://{self.sockets_dir / 'worker-state.sock'}"

    def ensure(self) -> "Layout":
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.sockets_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        return self


def preload_openblas() -> str | None:
    """Load Debian's OpenBLAS before MLX so that MLX's CPU matmuls use it.

    The mlx-cpu wheel bundles a reference BLAS that is ~40x slower; loading OpenBLAS after the
    first `import mlx` has no effect. Returns the path loaded, or None.
    """
    import ctypes

    for path in OPENBLAS_PATHS:
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                return path
            except OSError:
                continue
    return None
