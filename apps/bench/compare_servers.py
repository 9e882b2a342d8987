"""`kvbank bench compare`'s servers: each side started in a memory cgroup of its own
(apps/bench/cgroup.py), with the settings both servers share set the same, its memory flags set
from the limit by one rule, and what it ran as (argv) and used (its cgroup's peak) recorded.

The sides: kvbank and mlx-lm's server under the same limit (`--memory-limit`), and each
unbounded (no limit; kvbank's bank and mlx-lm's prompt cache without a byte cap): the ideal is
kvbank unbounded, the same engine with nothing evicted; mlx-lm unlimited stands beside it.

The memory flags, from the limit L, as a user sizing a server to a container would: start it,
see what it holds idle, give the rest to KV (`size`, once a run, each engine in a cgroup with
no limit, after one warm-up request):
- kvbank: `--memory-budget` = L - what its other processes hold idle (router, shim,
  coldstore, supervisor) - the coldstore's write margin (`WRITE_KEEP_MARGIN_BYTES`: what it
  may keep while it writes past what the worker counts for its writes). The budget covers the
  worker's resident memory (its model, bank, running requests and their prefill transients,
  which it prices itself, and a slack for what it does not itemize) and the coldstore's
  writes: the blocks handed to it, and LMDB's copy and the pages it keeps for the next.
- mlx-lm: `--prompt-cache-bytes` = L - what its process holds idle - one prefill chunk's
  transient bytes (kvbank's calibration of the same model at the same chunk: mlx-lm counts
  running requests' KV in its prompt cache bytes, not their transients).
Neither is tuned per run; `sizing` in the JSON has every number. Where mlx-lm's server is
killed at the rule's size (it bounds only its prompt cache: MLX's buffer cache and the copies
it makes of a cache entry are outside it), `--mlx-lm-prompt-cache-bytes` gives it a smaller
one, as its user would, and `sizing.mlx_lm.given` says so.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

from kvbank.apps.bench.cgroup import MemoryCgroup

logger = logging.getLogger(__name__)

UNLIMITED_BYTES = 1 << 40
MLX_CACHE_ENTRIES = 100_000  # mlx-lm evicts by bytes alone, never by count
OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
TRANSIENT_CONTEXT_CHUNKS = 4  # the transient reserved for mlx-lm: a chunk at 4 chunks' context


@dataclass(frozen=True)
class Settings:
    """What both servers are given the same, where both have the knob: the prompt tokens a
    prefill step reads (kvbank --prefill-chunk-tokens, mlx-lm --prefill-step-size), the
    requests run at once (kvbank --max-active-requests; mlx-lm --decode-concurrency and
    --prompt-concurrency), greedy sampling (each request's temperature 0, and mlx-lm's --temp)
    and each answer's max tokens (in every request's body). kvbank's --decode-wait-s has no
    mlx-lm counterpart: it keeps its default, recorded."""

    prefill_chunk_tokens: int = 512
    concurrency: int = 8
    temperature: float = 0.0
    max_tokens: int = 32

    def kvbank_flags(self) -> list[str]:
        return ["--prefill-chunk-tokens", str(self.prefill_chunk_tokens),
                "--max-active-requests", str(self.concurrency)]

    def mlx_lm_flags(self) -> list[str]:
        return ["--prefill-step-size", str(self.prefill_chunk_tokens),
                "--decode-concurrency", str(self.concurrency),
                "--prompt-concurrency", str(self.concurrency),
                "--temp", str(self.temperature), "--max-tokens", str(self.max_tokens)]

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Side:
    name: str
    label: str
    engine: str  # kvbank | mlx_lm
    limited: bool  # under --memory-limit (else no limit, nothing evicted)
    hints: bool = False


SIDES = (Side("kvbank", "kvbank (limit)", "kvbank", True),
         Side("mlx_lm", "mlx-lm (limit)", "mlx_lm", True),
         Side("kvbank_unbounded", "kvbank (unbounded, the ideal)", "kvbank", False),
         Side("mlx_lm_unlimited", "mlx-lm (unlimited)", "mlx_lm", False),
         Side("kvbank_prefetch", "kvbank (limit), hints", "kvbank", True, hints=True))
BY_NAME = {s.name: s for s in SIDES}


def wait_health(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    raise RuntimeError(f"{url} did not become healthy in {timeout_s:.0f} s; log:\n{tail}")


def warm_up(url: str, model_name: str | None) -> None:
    """One anonymous 1-token request, so loading the model is not in the timed run."""
    import httpx

    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
            "temperature": 0.0, "model": model_name or "default_model"}
    httpx.post(url + "/v1/chat/completions", json=body, timeout=600).raise_for_status()


def versions() -> dict:
    from importlib.metadata import version

    return {"kvbank": version("kvbank"), "mlx_lm": version("mlx-lm"), "mlx": version("mlx")}


def kvbank_argv_flags(side: Side, settings: Settings, sizing: dict) -> list[str]:
    if side.limited:
        return [*settings.kvbank_flags(), "--memory-budget",
                str(sizing["kvbank"]["memory_budget_bytes"])]
    return [*settings.kvbank_flags(), "--bank-bytes", str(UNLIMITED_BYTES)]


def mlx_lm_argv_flags(side: Side, settings: Settings, sizing: dict) -> list[str]:
    cache = sizing["mlx_lm"]["prompt_cache_bytes"] if side.limited else UNLIMITED_BYTES
    return [*settings.mlx_lm_flags(), "--prompt-cache-bytes", str(cache),
            "--prompt-cache-size", str(MLX_CACHE_ENTRIES)]


@contextmanager
def serve(side: Side, model_dir: Path, tmp: Path, settings: Settings, sizing: dict | None,
          limit_bytes: int | None, record: dict) -> Iterator[str]:
    """`side` served in a cgroup of its own, limited to `limit_bytes` if the side is limited;
    yields its OpenAI base URL. `record` gets its argv, and once it stopped, its cgroup's
    usage (`memory`) and, for kvbank, its sessions and peaks (`kvbank`)."""
    group = MemoryCgroup.create(f"kvbank-bench-{side.name}-{os.getpid()}",
                                limit_bytes if side.limited else None)
    record["group"] = group  # while it runs: its memory now (`size`)
    try:
        group.start_sampling()
        if side.engine == "kvbank":
            flags = kvbank_argv_flags(side, settings, sizing) if sizing else \
                settings.kvbank_flags()
            with _kvbank(model_dir, tmp / f"{side.name}-data", flags, group, record) as url:
                yield url
        else:
            flags = mlx_lm_argv_flags(side, settings, sizing) if sizing else \
                settings.mlx_lm_flags()
            with _mlx_lm(model_dir, tmp, flags, side.name, group, record) as url:
                yield url
    finally:
        record.pop("group", None)
        record["memory"] = group.usage()
        group.remove()


@contextmanager
def _kvbank(model_dir: Path, data_dir: Path, flags: list[str], group: MemoryCgroup,
            record: dict) -> Iterator[str]:
    from kvbank.deploy.local import LocalStack

    stack = LocalStack.start(model_dir, data_dir, extra=flags, timeout_s=900,
                             popen={"preexec_fn": group.preexec})
    record["argv"] = [str(a) for a in stack.proc.args]
    try:
        if not stack.shim_url:
            raise RuntimeError("the kvbank stack was started without its OpenAI shim")
        wait_health(stack.shim_url, stack.proc, 300, stack.log)
        record["stack"] = stack
        with Peaks(stack) as peaks:
            yield stack.shim_url
        record["kvbank"] = {**sessions(stack), "peak_bank_bytes": peaks.bank_bytes,
                            "peak_worker_bytes": peaks.worker_bytes,
                            **left_ram(stack.layout.events_path)}
    finally:
        record.pop("stack", None)
        stack.stop()


@contextmanager
def _mlx_lm(model_dir: Path, tmp: Path, flags: list[str], name: str, group: MemoryCgroup,
            record: dict) -> Iterator[str]:
    from kvbank.deploy.local import free_port

    port = free_port()
    log = tmp / f"{name}.log"
    argv = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir),
            "--port", str(port), *flags]
    record["argv"] = argv
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if os.path.exists(OPENBLAS):
        env["LD_PRELOAD"] = OPENBLAS
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=group.preexec)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_health(url, proc, 600, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        record["returncode"] = proc.returncode


def own_bytes(pid: int) -> int:
    """What a process holds itself: RssAnon + RssShmem (no file pages), from /proc."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return sum(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssShmem") if k in fields)


def sessions(stack) -> dict:
    """Where kvbank's conversations are after the run: the bank's bytes, each one's state."""
    from kvbank.v1 import api_pb2

    with stack.client() as c:
        got = c.sessions.List(api_pb2.ListSessionsRequest(), timeout=30).sessions
    return {"ram_bytes": sum(s.ram_bytes for s in got),
            "sessions": {s.session_id: {"state": s.state, "ram_bytes": s.ram_bytes,
                                        "token_count": s.token_count,
                                        "durable_tokens": s.durable_tokens}
                         for s in got}}


def left_ram(events_path: Path) -> dict:
    """What left kvbank's RAM in a run and why, from its event log: `kv_evicted` by reason
    and where it went (`cold`: on SSD; `gone`: dropped before its SSD write), and the guard's
    trims by level and source, with the unwritten entries they dropped. A round that
    recomputed says here whether KV was dropped (the stack's own files go with the run)."""
    evicted, trims = collections.Counter(), collections.Counter()
    dropped = 0
    lines = events_path.read_text().splitlines() if events_path.exists() else []
    for line in lines:
        e = json.loads(line)
        if e.get("kind") == "kv_evicted":
            evicted[f"{e.get('reason')}: {e.get('now')}"] += 1
        elif e.get("kind") == "pressure_trim":
            trims[f"{e.get('level')}: {e.get('source')}"] += 1
            dropped += e.get("bank_unwritten_dropped", 0)
    return {"evicted": dict(evicted), "pressure_trims": dict(trims),
            "unwritten_dropped_by_trims": dropped}


class Peaks:
    """The worker's peaks through a run: its RAM bank (the worker's own
    `kvbank_bank_peak_bytes`, read once at the end: polling /metrics would cost the worker
    the CPU the run measures) and its resident memory (anonymous + shared pages, as the
    worker's own ledger counts them), read from /proc every `every_s`."""

    def __init__(self, stack, every_s: float = 0.2):
        import threading

        self.stack, self.every_s = stack, every_s
        self.bank_bytes = self.worker_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peaks", daemon=True)

    def __enter__(self) -> "Peaks":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        import httpx

        self._stop.set()
        self._thread.join(timeout=5)
        try:
            text = httpx.get(self.stack.metrics_url("worker"), timeout=10).text
            self.bank_bytes = int(next(float(line.split()[-1]) for line in text.splitlines()
                                       if line.startswith("kvbank_bank_peak_bytes ")))
        except Exception:  # the worker is gone: the run's own error, if any, is the story
            logger.warning("could not read the worker's peak bank bytes")

    def _run(self) -> None:
        pid = self.stack.pid("worker")
        while not self._stop.wait(self.every_s):
            try:
                self.worker_bytes = max(self.worker_bytes, own_bytes(pid))
            except Exception:  # the worker is gone: the run's own rows say so
                return


def size(model_dir: Path, tmp: Path, settings: Settings, limit_bytes: int,
         mlx_lm_cache_bytes: int | None = None) -> dict:
    """Each engine started once with no limit and warmed up, and what it holds idle gives
    each side its memory flags (`memory_flags`)."""
    idle: dict = {}
    side = Side("sizing_kvbank", "", "kvbank", False)
    rec: dict = {}
    with serve(side, model_dir, tmp, settings, None, None, rec) as url:
        warm_up(url, None)
        stack = rec["stack"]
        with stack.client() as c:
            st = c.status()
        group_anon = _group_anon(rec)
        worker = own_bytes(stack.pid("worker"))
        idle["kvbank"] = {"tree_anon_bytes": group_anon, "worker_bytes": worker,
                          "others_bytes": max(0, group_anon - worker),
                          "transient_base_bytes": st.transient_base_bytes,
                          "transient_per_context_token": st.transient_per_context_token}
    rec = {}
    side = Side("sizing_mlx_lm", "", "mlx_lm", False)
    with serve(side, model_dir, tmp, settings, None, None, rec) as url:
        warm_up(url, "default_model")
        idle["mlx_lm"] = {"tree_anon_bytes": _group_anon(rec)}
    return memory_flags(limit_bytes, idle, settings, mlx_lm_cache_bytes)


def memory_flags(limit_bytes: int, idle: dict, settings: Settings,
                 mlx_lm_cache_bytes: int | None = None) -> dict:
    """The memory flags the limit gives each side, from what each holds idle (module
    docstring). `mlx_lm_cache_bytes`: mlx-lm's prompt cache given instead of the rule's,
    recorded as given (for a limit at which the rule's size is killed: mlx-lm bounds no other
    memory of its own, MLX's buffer cache included, so its user lowers its one flag until it
    lives). Raises ValueError where the limit leaves a side no room."""
    from kvbank.contracts.pricing import WRITE_KEEP_MARGIN_BYTES

    k = idle["kvbank"]
    transient = int(k["transient_base_bytes"] + k["transient_per_context_token"]
                    * TRANSIENT_CONTEXT_CHUNKS * settings.prefill_chunk_tokens)
    budget = limit_bytes - k["others_bytes"] - WRITE_KEEP_MARGIN_BYTES
    by_rule = limit_bytes - idle["mlx_lm"]["tree_anon_bytes"] - transient
    cache = by_rule if mlx_lm_cache_bytes is None else mlx_lm_cache_bytes
    if budget <= k["worker_bytes"] + k["transient_base_bytes"] or cache <= 0:
        raise ValueError(
            f"--memory-limit {limit_bytes}: too small for these servers: kvbank's processes "
            f"hold {idle['kvbank']['tree_anon_bytes'] / 1e6:.0f} MB idle, mlx-lm's "
            f"{idle['mlx_lm']['tree_anon_bytes'] / 1e6:.0f} MB, before any KV; kvbank's "
            f"worker needs {(k['worker_bytes'] + k['transient_base_bytes']) / 1e6:.0f} MB "
            f"of its budget ({budget / 1e6:.0f} MB) before any KV, and a prefill chunk's "
            f"transient ({transient / 1e6:.0f} MB) leaves mlx-lm's cache {cache / 1e6:.0f} MB")
    return {"limit_bytes": limit_bytes, "idle": idle, "transient_bytes": transient,
            "kvbank": {"memory_budget_bytes": budget,
                       "rule": "limit - its other processes' idle memory - the "
                               f"coldstore's write margin ({WRITE_KEEP_MARGIN_BYTES} bytes: "
                               "what it may keep past what the worker's ledger counts for "
                               "its writes; the worker's budget covers its model, bank, "
                               "requests, transients and the coldstore's writes)"},
            "mlx_lm": {"prompt_cache_bytes": cache, "by_rule_bytes": by_rule,
                       "given": mlx_lm_cache_bytes is not None,
                       "rule": "limit - its idle memory - one prefill chunk's transient at "
                               f"{TRANSIENT_CONTEXT_CHUNKS} chunks of context"
                               + (" (not applied: given by --mlx-lm-prompt-cache-bytes)"
                                  if mlx_lm_cache_bytes is not None else "")}}


def _group_anon(rec: dict) -> int:
    """The side's tree's own memory now (anonymous: no page cache), from its cgroup."""
    return rec["group"].anon_bytes()
