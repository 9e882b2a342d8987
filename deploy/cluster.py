"""`kvbank cluster up`: several kvbank stacks behind vLLM's router, on one machine.

Each stack is a whole `kvbank up` (coldstore, worker, router, shim) with its own data dir, its
own ports and its own KV-event endpoints; `vllm-router --policy kv_aware` sits in front of
their OpenAI shims, subscribes to their KV events and sends each conversation to the stack
that holds its KV. Clients use one URL: the router's.

Start: the model is prepared once (`prepare_model`) and every stack gets the folder; the stacks
start together, each is waited for (its `run/ready`, then its shim's /health); then the
router starts and is waited for (/health: every stack healthy). Stop (Ctrl-C, SIGTERM): the
router first (no new requests), then every stack at once (each `kvbank up` stops its own
processes in order), and they are waited for. The children run in their own process groups,
so a terminal's Ctrl-C reaches only this process, which stops them in that order; on Linux
they also get SIGTERM if this process dies.

`ClusterStack` is the same thing for tests and benchmarks (a prepared model, free ports).
The argv builders (`plan_cluster`, `router_argv`, `stack_flags`) start nothing.

KV events carry no tenant: the event endpoints here bind on loopback only.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvbank.config import DEFAULT_SHIM_PORT, default_data_dir
from kvbank.deploy.supervisor import die_with_parent

if TYPE_CHECKING:  # imported when used: `kvbank --help` reads this module's defaults
    from kvbank.deploy.local import LocalStack

logger = logging.getLogger(__name__)

DEFAULT_STACKS = 2
DEFAULT_PORT = DEFAULT_SHIM_PORT  # clients keep the URL a single stack gives them
DEFAULT_POLICY = "kv_aware"
POLICIES = ("kv_aware", "round_robin", "random", "power_of_two", "cache_aware")
DEFAULT_BLOCK_SIZE = 16  # vllm-router's --kv-event-block-size default
DEFAULT_MODEL_NAME = "kvbank"  # the id a shim serves unless told otherwise
LOOPBACK = "127.0.0.1"
ROUTER_STOP_S = 15.0
ROUTER_HEALTH_INTERVAL_S = 10  # vllm-router's default (60 s) notices a dead stack late
ROUTER_INSTALL_HINT = ("pip install vllm-router (Linux x86_64), or pip install 'kvbank[cluster]'; "
                       "or pass --router-bin")


class ClusterError(RuntimeError):
    """A cluster that could not start; the message says which part and ends with its log."""


def default_cluster_dir() -> Path:
    """`kvbank up`'s default data dir with `-cluster`: stack I lives in its `stack-I`."""
    base = default_data_dir()
    return base.with_name(base.name + "-cluster")


def find_router_bin(explicit: str | None = None) -> str:
    """The `vllm-router` program: `explicit`, else the one next to this Python (a venv's
    bin/), else on PATH. Raises ClusterError naming the install command when there is none."""
    if explicit:
        found = shutil.which(explicit)
        if found is None:
            raise ClusterError(f"--router-bin {explicit}: no such program. {ROUTER_INSTALL_HINT}")
        return found
    beside = Path(sys.executable).parent / "vllm-router"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("vllm-router")
    if found is None:
        raise ClusterError(f"vllm-router is not installed. {ROUTER_INSTALL_HINT}")
    return found


def free_ports(n: int, host: str = LOOPBACK) -> list[int]:
    """`n` distinct free ports, outside the kernel's ephemeral range (see deploy/local.py)."""
    from kvbank.deploy.local import free_ports as pick

    return pick(n, host)


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


# -- the plan: every port and flag, decided before anything starts ----------------------------


@dataclass(frozen=True)
class StackPlan:
    index: int  # 1-based, as printed
    data_dir: Path
    port: int  # the stack's gRPC router (loopback)
    shim_port: int  # its OpenAI API: the URL vllm-router routes to
    events_port: int  # its worker's KV-event PUB
    replay_port: int  # its worker's replay ROUTER
    metrics_port: int = 0  # `kvbank up --metrics-port`: 0 free ports, -1 off, N its own base

    @property
    def shim_url(self) -> str:
        """The bare http origin: vllm-router's --worker-urls entry and its event sources' key."""
        return f"http://{LOOPBACK}:{self.shim_port}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://{LOOPBACK}:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://{LOOPBACK}:{self.replay_port}"


@dataclass
class ClusterPlan:
    stacks: list[StackPlan]
    host: str  # vllm-router's address
    port: int
    prometheus_port: int
    policy: str = DEFAULT_POLICY
    block_size: int = DEFAULT_BLOCK_SIZE
    model_name: str = DEFAULT_MODEL_NAME
    router_extra: list[str] = field(default_factory=list)  # more vllm-router flags, last

    @property
    def url(self) -> str:
        host = LOOPBACK if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """What OpenAI clients are given."""
        return f"{self.url}/v1"


def plan_cluster(n: int, base_dir: Path, *, host: str = LOOPBACK, port: int | None = None,
                 metrics_port: int = 0, block_size: int = DEFAULT_BLOCK_SIZE,
                 policy: str = DEFAULT_POLICY, model_name: str = DEFAULT_MODEL_NAME,
                 router_extra: list[str] = (), ports: list[int] | None = None) -> ClusterPlan:
    """Ports for `n` stacks (four each) and the router. `ports`: use these instead of free
    ones (a test's fixed plan): 4*n for the stacks, then the router's metrics port.
    `metrics_port` N > 0 gives stack I the base N + 3*(I-1) (router, worker +1, coldstore +2)."""
    if n < 1:
        raise ClusterError(f"--stacks {n}: need at least one")
    if policy not in POLICIES:
        raise ClusterError(f"--policy {policy}: one of {', '.join(POLICIES)}")
    if block_size < 1:
        raise ClusterError(f"--kv-events-block-size {block_size}: must be >= 1")
    need = 4 * n + 1 + (port is None)
    ports = list(ports) if ports is not None else free_ports(need)
    if len(ports) < need:
        raise ClusterError(f"{len(ports)} ports given, {need} needed")
    stacks = [StackPlan(i + 1, Path(base_dir) / f"stack-{i + 1}", *ports[4 * i:4 * i + 4],
                        metrics_port=(metrics_port + 3 * i if metrics_port > 0
                                      else metrics_port))
              for i in range(n)]
    prometheus_port = ports[4 * n]
    return ClusterPlan(stacks, host, port if port is not None else ports[4 * n + 1],
                       prometheus_port, policy, block_size, model_name, list(router_extra))


def stack_flags(stack: StackPlan, block_size: int) -> list[str]:
    """The `kvbank up` flags a stack gets from the cluster, besides --model, --data-dir,
    --port and --shim-port (LocalStack passes those)."""
    return ["--metrics-port", str(stack.metrics_port),
            "--kv-events-endpoint", stack.events_endpoint,
            "--kv-events-replay-endpoint", stack.replay_endpoint,
            "--kv-events-block-size", str(block_size)]


def stack_argv(stack: StackPlan, model: str | Path, block_size: int,
               extra: list[str] = ()) -> list[str]:
    """The whole `kvbank up` command of one stack (as printed by --dry-run)."""
    return ["kvbank", "up", "--model", str(model), "--data-dir", str(stack.data_dir),
            "--port", str(stack.port), "--shim-port", str(stack.shim_port),
            *stack_flags(stack, block_size), *extra]


def router_argv(router_bin: str, plan: ClusterPlan) -> list[str]:
    """vllm-router's command: every stack's shim a worker; with kv_aware, each one's event and
    replay source under the same URL, the block size the stacks announce, the model they serve."""
    urls = [s.shim_url for s in plan.stacks]
    argv = [router_bin, "--host", plan.host, "--port", str(plan.port), "--policy", plan.policy,
            "--worker-urls", *urls,
            "--prometheus-host", LOOPBACK, "--prometheus-port", str(plan.prometheus_port),
            "--health-check-interval-secs", str(ROUTER_HEALTH_INTERVAL_S)]
    if plan.policy == "kv_aware":
        for s in plan.stacks:
            argv += ["--kv-event-source", f"{s.shim_url}={s.events_endpoint}"]
        for s in plan.stacks:
            argv += ["--kv-event-replay-source", f"{s.shim_url}={s.replay_endpoint}"]
        argv += ["--kv-event-block-size", str(plan.block_size),
                 "--kv-event-model", plan.model_name]
    return [*argv, *plan.router_extra]


# -- running it ---------------------------------------------------------------------------


def popen_kwargs() -> dict:
    """Own process group (a terminal's Ctrl-C reaches only the cluster, which stops the
    children in order); on Linux, SIGTERM when the cluster process dies."""
    return {"process_group": 0, **die_with_parent()}


def blas_threads(stacks: int, cores: int | None = None) -> dict[str, str]:
    """The environment that gives each of `stacks` workers on one machine its share of the
    cores for OpenBLAS (at least one thread). Each OpenBLAS starts a thread per core: three
    workers on two cores each ran two, and a turn's prefill waited on the others' threads
    (`bench cluster` TTFT p50 0.96x round robin's with that, 1.56x with one each). An
    operator's own OPENBLAS_NUM_THREADS stands."""
    if "OPENBLAS_NUM_THREADS" in os.environ:
        return {}
    cores = cores or len(os.sched_getaffinity(0)) or 1
    return {"OPENBLAS_NUM_THREADS": str(max(1, cores // max(1, stacks)))}


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def _served_model(shim_url: str) -> str:
    """The model id a shim serves (its /v1/models); the shim's default when it will not say
    (API keys)."""
    import httpx

    try:
        r = httpx.get(f"{shim_url}/v1/models", timeout=5)
        if r.status_code == 200:
            return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        pass
    return DEFAULT_MODEL_NAME


def _clear_stale_ready(stack: StackPlan) -> None:
    """A `run/ready` left by a stack that was killed would pass for a started one."""
    ready = stack.data_dir / "run" / "ready"
    try:
        pid = int(ready.read_text())
    except (FileNotFoundError, ValueError):
        ready.unlink(missing_ok=True)
        return
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        ready.unlink(missing_ok=True)
        return
    except PermissionError:
        pass
    raise ClusterError(f"stack {stack.index}: a kvbank already runs on {stack.data_dir} "
                       f"(pid {pid}); stop it or pass another --data-dir")


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except FileNotFoundError:
        return "(no log)"


@dataclass
class ClusterStack:
    """N stacks and vllm-router, on loopback (tests, benchmarks, `kvbank cluster up`).
    Start it from a thread that outlives it: on Linux the children get SIGTERM when the thread
    that started them ends (so that a killed caller leaves nothing running)."""

    plan: ClusterPlan
    base_dir: Path
    stacks: list[LocalStack] = field(default_factory=list)
    router: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return self.plan.url

    @property
    def base_url(self) -> str:
        return self.plan.base_url

    @property
    def router_log(self) -> Path:
        return self.base_dir / "router.log"

    @classmethod
    def start(cls, model: Path, base_dir: Path, *, stacks: int = DEFAULT_STACKS,
              policy: str = DEFAULT_POLICY, host: str = LOOPBACK, port: int | None = None,
              extra: list[str] = (), block_size: int = DEFAULT_BLOCK_SIZE,
              metrics_port: int = 0, router_bin: str | None = None,
              router_extra: list[str] = (), env: dict | None = None,
              timeout_s: float = 300, plan: ClusterPlan | None = None) -> "ClusterStack":
        """Start `stacks` stacks on the prepared `model` folder, then the router; return once
        the router answers /health. `extra`: more `kvbank up` flags for every stack. On any
        failure (or Ctrl-C) what started is stopped and ClusterError says which part failed,
        with the end of its log."""
        router_bin = find_router_bin(router_bin)
        base_dir = Path(base_dir)
        if plan is None:
            plan = plan_cluster(stacks, base_dir, host=host, port=port,
                                metrics_port=metrics_port, block_size=block_size,
                                policy=policy, router_extra=list(router_extra))
        if port_in_use(plan.host, plan.port):
            raise ClusterError(f"{plan.host}:{plan.port} is in use; pass another --port")
        base_dir.mkdir(parents=True, exist_ok=True)
        for s in plan.stacks:
            _clear_stale_ready(s)
        cluster = cls(plan, base_dir)
        env = {**blas_threads(len(plan.stacks)), **(env or {})}
        try:
            cluster._start_stacks(model, list(extra), env, timeout_s)
            cluster._start_router(router_bin, timeout_s)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start_stacks(self, model: Path, extra: list[str], env: dict | None,
                      timeout_s: float) -> None:
        from kvbank.deploy.local import LocalStack

        deadline = time.monotonic() + timeout_s
        for s in self.plan.stacks:  # all at once; each imports MLX and loads the model
            self.stacks.append(LocalStack.start(
                Path(model), s.data_dir, extra=[*stack_flags(s, self.plan.block_size), *extra],
                env=env, port=s.port, shim_port=s.shim_port, wait=False,
                popen=popen_kwargs()))
        for s, stack in zip(self.plan.stacks, self.stacks):
            try:
                stack.wait_started(max(1.0, deadline - time.monotonic()))
            except RuntimeError:
                raise ClusterError(f"stack {s.index} did not start; the end of {stack.log}:\n"
                                   f"{stack.log_tail()}") from None
            while not http_ok(f"{s.shim_url}/health"):
                if stack.proc.poll() is not None or time.monotonic() > deadline:
                    raise ClusterError(f"stack {s.index}'s OpenAI API {s.shim_url} is not "
                                       f"healthy; the end of {stack.log}:\n{stack.log_tail()}")
                time.sleep(0.2)
            logger.info("stack %d is up: %s", s.index, s.shim_url)
        if self.plan.policy == "kv_aware":
            self.plan.model_name = _served_model(self.plan.stacks[0].shim_url)

    def _start_router(self, router_bin: str, timeout_s: float) -> None:
        argv = router_argv(router_bin, self.plan)
        logger.info("starting %s", shlex.join(argv))
        with open(self.router_log, "wb") as f:
            self.router = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, **popen_kwargs())
        deadline = time.monotonic() + timeout_s
        while not http_ok(f"{self.url}/health"):
            if self.router.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"vllm-router did not become healthy on {self.url}; the end "
                                   f"of {self.router_log}:\n{_tail(self.router_log)}")
            time.sleep(0.2)
        logger.info("vllm-router is up: %s (%s)", self.url, self.plan.policy)

    def dead(self) -> list[tuple[str, Path]]:
        """The parts that exited on their own, with their logs: ('router', log), ('stack 2',
        log), ..."""
        out = ([("router", self.router_log)]
               if self.router is not None and self.router.poll() is not None else [])
        return out + [(f"stack {s.index}", st.log) for s, st in zip(self.plan.stacks, self.stacks)
                      if st.proc.poll() is not None]

    def stop(self) -> None:
        """The router first, then every stack at once (each stops its processes in order);
        waits for all of them."""
        if self.router is not None and self.router.poll() is None:
            self.router.terminate()
            try:
                self.router.wait(timeout=ROUTER_STOP_S)
            except subprocess.TimeoutExpired:
                logger.warning("vllm-router did not stop in %.0fs; killing it", ROUTER_STOP_S)
                self.router.kill()
                self.router.wait()
        for stack in self.stacks:
            if stack.proc.poll() is None:
                stack.proc.send_signal(signal.SIGTERM)
        for stack in self.stacks:
            stack.stop()  # waits (SIGINT again is harmless; kills after 60 s)

    def table(self) -> str:
        """The short table `kvbank cluster up` prints."""
        rows = [("stack", "OpenAI API (shim)", "gRPC", "KV events", "replay", "log")]
        for s, st in zip(self.plan.stacks, self.stacks):
            rows.append((str(s.index), s.shim_url, f"{LOOPBACK}:{s.port}", s.events_endpoint,
                         s.replay_endpoint, str(st.log)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]
        lines.append(f"router  vllm-router --policy {self.plan.policy} on {self.url}"
                     + (f", model {self.plan.model_name!r}, block size {self.plan.block_size}"
                        if self.plan.policy == "kv_aware" else "")
                     + f"; metrics http://{LOOPBACK}:{self.plan.prometheus_port}/metrics;"
                     f" log {self.router_log}")
        return "\n".join(lines)


def run_cluster(*, stacks: int = DEFAULT_STACKS, model: str | None = None,
                base_dir: Path | None = None, host: str = LOOPBACK, port: int = DEFAULT_PORT,
                policy: str = DEFAULT_POLICY, block_size: int = DEFAULT_BLOCK_SIZE,
                metrics_port: int = 0, router_bin: str | None = None,
                router_extra: list[str] = (), stack_extra: list[str] = (),
                timeout_s: float = 600, dry_run: bool = False) -> int:
    """`kvbank cluster up`: start, print the URL, run until Ctrl-C or SIGTERM, stop in order."""
    base_dir = Path(base_dir) if base_dir is not None else default_cluster_dir()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per health poll
    try:
        plan = plan_cluster(stacks, base_dir, host=host, port=port, metrics_port=metrics_port,
                            block_size=block_size, policy=policy,
                            router_extra=list(router_extra))
        if dry_run:
            try:
                bin_ = find_router_bin(router_bin)
            except ClusterError:
                bin_ = router_bin or "vllm-router"
            for s in plan.stacks:
                print(shlex.join(stack_argv(s, model or "(default model)", block_size,
                                            list(stack_extra))))
            print(shlex.join(router_argv(bin_, plan)))
            return 0
        router_bin = find_router_bin(router_bin)  # before minutes of model loading
    except ClusterError as e:
        print(f"kvbank cluster: {e}", file=sys.stderr)
        return 2

    def _terminate(signum, frame):
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, h) for sig, h in
                ((signal.SIGTERM, _terminate), (signal.SIGINT, signal.default_int_handler))}
    cluster = None
    try:
        from kvbank.models import prepare_model

        model_dir = prepare_model(model)
        logger.info("model %s; starting %d stacks under %s", model_dir, stacks, base_dir)
        cluster = ClusterStack.start(model_dir, base_dir, router_bin=router_bin,
                                     extra=list(stack_extra), timeout_s=timeout_s, plan=plan)
        print(cluster.table())
        print(f"Ctrl-C stops the router, then the stacks. OpenAI clients use "
              f"(OPENAI_BASE_URL):\n{cluster.base_url}", flush=True)
        while not (dead := cluster.dead()):
            time.sleep(0.5)
        for part, log in dead:
            print(f"kvbank cluster: {part} exited; the end of {log}:\n{_tail(log)}",
                  file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvbank cluster: stopping the router, then the stacks", file=sys.stderr)
        return 0
    except ClusterError as e:
        print(f"kvbank cluster: {e}", file=sys.stderr)
        return 1
    finally:
        for sig in previous:  # the ordered stop runs to its end
            signal.signal(sig, signal.SIG_IGN)
        if cluster is not None:
            cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
