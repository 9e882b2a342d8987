"""`kvbank bench scale`: conversations of real models' size, to SSD and back.

KV in the geometry of a real model (bf16, as on a Mac; the numbers from its published
config.json are in GEOMETRIES) is synthesized at each turn's new tokens, with no model forward,
so the machine's CPU does not bound the run. It goes through the real `SessionBank`, `KVWriter`
and a real coldstore process, the worker's own parts, in this process:

1. Each of `--conversations` conversations of `--tokens` tokens is built and written behind;
   the bank holds one, so the next one's admission releases the last
   (`release_sessions(write_out_before_release=True)`, as the seeds' admission does).
2. `--turns` rounds: each agent comes back in turn with `--turn-tokens` more tokens; its
   conversation is restored from SSD (the others released first, written out), extended, and
   written behind again.

Beside each write and each restore, on the same disk (its speed moves from one minute to the
next): up to 1 GiB of blocks of the same size written to a new LMDB environment as fast as
it commits (`raw_write_mb_s`; in new file space, as the store grows: see `_Raw`), and read back with the page cache dropped (`raw_read_mb_s`;
single-threaded, where a restore reads with several lanes). Goals: write-behind ≥ 0.7 of raw writes, restore ≥ 0.8 of raw
reads, peak RSS (the kernel's VmHWM) ≤ 1.1 × (what the process held before + the bank's
budget), every release's write-out only the last turn's blocks, nothing unwritten dropped.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

TENANT = ""
# From each model's config.json: its full-attention layers, KV heads and head size, in bf16.
GEOMETRIES = {
    # 64 layers, every 4th full attention; 4 KV heads of 256. Its 48 Gated DeltaNet layers'
    # checkpoints (149.6 MiB each) are not in this run: only the attention KV.
    "qwen3.6-27b": {"layers": 16, "kv_heads": 4, "head_dim": 256, "bytes_per_token": 65536},
    # 64 layers, 8 KV heads of 128: 256 KiB a token, 100K tokens = 25 GiB.
    "qwen3-32b": {"layers": 64, "kv_heads": 8, "head_dim": 128, "bytes_per_token": 262144},
    "tiny": {"layers": 2, "kv_heads": 2, "head_dim": 64, "bytes_per_token": 1024},  # --quick
}


def _status(field: str) -> int:
    """A line of /proc/self/status, in bytes: VmHWM (the kernel's high-water mark of this
    process's resident memory, mapped file pages included), RssAnon (what it holds itself)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _vm_hwm() -> int:
    return _status("VmHWM")


class _AnonPeak:
    """RssAnon sampled every 20 ms: the worker's own memory (a restore's reads of the LMDB
    map are file pages, counted in VmHWM, not here; kvbank's budget counts what this counts)."""

    def __init__(self):
        import threading

        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _status("RssAnon"))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _layers(geometry: dict, n: int, seed: int):
    """One turn's synthesized K and V: (1, heads, n, dim) bf16 per layer, distinct per seed."""
    import mlx.core as mx

    shape = (1, geometry["kv_heads"], n, geometry["head_dim"])
    out = []
    for i in range(geometry["layers"]):
        base = mx.full(shape, float(seed % 97 + i), dtype=mx.bfloat16)
        out.append((base, base + 1))
    mx.eval(out)
    return out


class _Worker:
    """The worker's parts that move KV: bank, writer, the link to a real coldstore."""

    def __init__(self, data_dir: Path, block_tokens: int, bank_bytes: int):
        from apps.bench.coldstore import _Coldstore
        from kvbank.blocks import chain_root
        from worker.bank import SessionBank
        from worker.writer import KVWriter

        self.cs = _Coldstore(data_dir)
        self.root = chain_root(b"bench-scale", TENANT)
        self.writer = KVWriter(self.cs.client, block_tokens=block_tokens,
                               root_for=lambda t: self.root, on_message=self._on_message)
        self.cs.client.on_event = self.writer.deliver
        self.bank = SessionBank(block_tokens=block_tokens, root_for=lambda t: self.root,
                                max_bytes=bank_bytes, active_pin_s=0, writer=self.writer)
        self.block_tokens = block_tokens

    def _on_message(self, msg) -> None:
        from kvbank.contracts.coldstore_wire import outcome_of

        kind = msg.WhichOneof("kind")
        if kind == "progress":
            self.bank.mark_durable((msg.progress.tenant, msg.progress.session_id),
                                   msg.progress.durable_tokens)
        elif kind == "done":
            d = msg.done
            key = (d.tenant, d.session_id)
            self.bank.mark_durable(key, d.durable_tokens)
            self.bank.mark_write_done(key, d.job, outcome_of(d))

    def commit(self, name: str, tokens: np.ndarray, layers, durable_tokens: int):
        self.cs.client.put_session(TENANT, name, self.block_tokens, tokens.tobytes())
        e = self.bank.insert((TENANT, name), tokens, layers, durable_tokens=durable_tokens)
        self.writer.write_behind(e)
        return e

    def wait_durable(self, e) -> float:
        t0 = time.perf_counter()
        while e.durable_tokens < e.n_tokens:
            self.writer.pump(timeout_s=0.05)
        return time.perf_counter() - t0

    def release_all_but(self, keep: str, bytes_per_token: int) -> dict:
        """The seeds' admission step for `keep`'s turn: every other conversation leaves RAM,
        written out first. What each release still had to write, and how long it took."""
        others = [e for e in self.bank.entries.values() if e.session != (TENANT, keep)]
        pending = sum((e.n_tokens - min(e.durable_tokens, e.n_tokens)) * bytes_per_token
                      for e in others)
        r = self.bank.release_sessions(None, keep_sessions=[(TENANT, keep)],
                                       reason="admission_release", write_out_before_release=True)
        return {"released_bytes": r.released_bytes, "unwritten_bytes_at_release": pending,
                "written_out_entries": r.written_out_entries,
                "write_out_s": round(r.write_out_s, 3), "unwritten_dropped": r.unwritten_dropped}

    def close(self) -> None:
        self.writer.close()
        self.cs.client.close()
        self.cs.proc.terminate()
        self.cs.proc.wait(30)


def _drop_caches(path: Path) -> str:
    """Make the next read of `path` come from the disk: the kernel's page cache dropped
    whole where this process may (root), else this file's pages (posix_fadvise), which the
    kernel may keep. Says which."""
    from apps.bench.coldstore import _drop_page_cache

    _drop_page_cache(path)
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return "dropped (drop_caches)"
    except OSError:
        return "this file's pages dropped (posix_fadvise): the kernel may keep some"


def _restore(store_dir: Path, name: str, capacity: int):
    """The conversation's KV from LMDB, page cache dropped first: (layers, tokens, bytes, s)."""
    from kvbank.contracts.store_layout import StoreReader
    from worker import kv

    _drop_caches(store_dir / "data.mdb")
    store = StoreReader(store_dir, readonly=True)
    try:
        meta, tokens = store.get_session(TENANT, name)
        t0 = time.perf_counter()
        payloads_bytes = [0]

        def decode(views, done_with):
            payloads_bytes[0] = sum(len(v) for v in views)
            return kv.decode_blocks(views, capacity, done_with)

        layers = store.get_blocks(meta.block_ids(), decode=decode)
        dt = time.perf_counter() - t0
    finally:
        store.close()
    return layers, tokens, payloads_bytes[0], dt


class _Raw:
    """Raw LMDB on the same disk, measured beside each write and each restore (this disk's
    speed moves from one minute to the next): `sample` bytes in blocks of `block_bytes`, put
    with one synced commit each (as the coldstore commits), read back after the page cache is
    dropped. One payload serves every key: LMDB stores each.

    Each sample is a new environment beside the earlier ones, kept until the run ends: new
    file space, as the coldstore's growing store writes. A sample written where the last one
    was just deleted reuses the page-cache pages that freed, and on a VM whose free memory
    goes back to the host that is 3-4x faster than new pages (680-710 MB/s against 190-260 in
    the same minute, 1 GiB, Dec 2026): a rewrite's speed, not the disk's."""

    def __init__(self, scratch: Path, sample: int, block_bytes: int):
        from concurrent.futures import ProcessPoolExecutor
        from multiprocessing import get_context

        self.scratch, self.block_bytes = scratch, block_bytes
        self.ids = [i.to_bytes(16, "big") for i in range(max(1, sample // block_bytes))]
        self.samples = 0
        # In a process of its own: its copies and map pages are not the worker's memory (the
        # bench reads the worker's peak from this process's VmHWM).
        self.child = ProcessPoolExecutor(1, mp_context=get_context("spawn"))

    @property
    def latest(self) -> Path:
        return self.scratch / f"sample-{self.samples - 1}"

    def write_mb_s(self) -> float:
        self.samples += 1
        self.latest.mkdir(parents=True)
        dt = self.child.submit(_raw_write_sample, self.latest, self.ids, self.block_bytes)
        return len(self.ids) * self.block_bytes / dt.result() / 1e6

    def read_mb_s(self) -> float:
        from apps.bench.coldstore import _raw_read

        _drop_caches(self.latest / "data.mdb")
        dt = self.child.submit(_raw_read, self.latest, self.ids).result()
        return len(self.ids) * self.block_bytes / dt / 1e6

    def close(self) -> None:
        self.child.shutdown()


def _raw_write_sample(path: Path, ids: list[bytes], block_bytes: int) -> float:
    """`_raw_write` of one random payload under every key (in the raw child process)."""
    from apps.bench.coldstore import _raw_write

    payload = os.urandom(block_bytes)
    return _raw_write(path, ids, [payload] * len(ids))


def run(*, geometry: str = "qwen3.6-27b", tokens: int = 65536, conversations: int = 3,
        turns: int = 2, turn_tokens: int = 1536, block_tokens: int = 256,
        data_dir: Path | None = None) -> dict:
    from kvbank.config import preload_openblas

    preload_openblas()
    import mlx.core as mx

    from worker import kv
    from worker.admission import serve_buffers_from_the_heap

    serve_buffers_from_the_heap()  # the worker's allocator: freed KV goes back to the OS
    mx.set_cache_limit(0)
    g = GEOMETRIES[geometry]
    conv_bytes = (tokens + turns * turn_tokens) * g["bytes_per_token"]
    bank_bytes = int(conv_bytes * 1.25)  # one conversation, room and turn included
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="kvbank-scale-", dir=data_dir) as tmp:
        w = _Worker(Path(tmp) / "data", block_tokens, bank_bytes)
        raw = _Raw(Path(tmp) / "raw", min(1 << 30, tokens * g["bytes_per_token"]),
                   block_tokens * g["bytes_per_token"])
        base_rss, anon_base, anon = _vm_hwm(), _status("RssAnon"), _AnonPeak()
        builds, releases, restores, turns_done = [], [], [], []
        try:
            held: dict[str, np.ndarray] = {}
            for i in range(conversations):  # 1. build each, write it behind
                name = f"agent-{i}"
                if i:
                    releases.append(w.release_all_but(name, g["bytes_per_token"]))
                toks = rng.integers(1000, 40000, tokens).astype(np.uint32)
                layers = _layers(g, tokens, seed=i)
                t0 = time.perf_counter()
                e = w.commit(name, toks, layers, 0)
                del layers
                w.wait_durable(e)
                write_s = time.perf_counter() - t0
                mb_s = e.nbytes / write_s / 1e6
                raw_mb_s = raw.write_mb_s()
                builds.append({"tokens": tokens, "bytes": e.nbytes, "write_s": round(write_s, 3),
                               "mb_s": round(mb_s, 1), "raw_write_mb_s": round(raw_mb_s, 1),
                               "vs_raw": round(mb_s / raw_mb_s, 3)})
                del e  # the bank's alone: a release frees it
                held[name] = toks
            for t in range(turns):  # 2. each agent comes back in turn
                for i in range(conversations):
                    name = f"agent-{i}"
                    n = len(held[name])
                    releases.append(w.release_all_but(name, g["bytes_per_token"]))
                    if not w.bank.session_entries((TENANT, name)):
                        # restored with room for the turn, which is written in place (the
                        # worker's own path: no second copy of the conversation)
                        layers, _, nbytes, dt = _restore(w.cs.layout.store_dir, name,
                                                         kv.capacity(n + turn_tokens))
                        raw_mb_s = raw.read_mb_s()
                        restores.append({"tokens": n, "bytes": nbytes, "restore_s": round(dt, 3),
                                         "mb_s": round(nbytes / dt / 1e6, 1),
                                         "raw_read_mb_s": round(raw_mb_s, 1),
                                         "vs_raw": round(nbytes / dt / 1e6 / raw_mb_s, 3)})
                    else:  # one conversation only: still in RAM, grown by a copy
                        (e,) = w.bank.session_entries((TENANT, name))
                        pad = [(0, 0), (0, 0), (0, kv.capacity(n + turn_tokens) - n), (0, 0)]
                        layers = [(mx.pad(k[..., :n, :], pad), mx.pad(v[..., :n, :], pad))
                                  for k, v in e.layers]
                    new = _layers(g, turn_tokens, seed=100 * t + i)
                    for (k, v), (nk, nv) in zip(layers, new):  # a layer at a time, as a forward
                        k[..., n:n + turn_tokens, :] = nk
                        v[..., n:n + turn_tokens, :] = nv
                        mx.eval(k, v)
                    held[name] = np.concatenate([held[name],
                                                 rng.integers(1000, 40000, turn_tokens)
                                                 .astype(np.uint32)])
                    w.commit(name, held[name], layers, n)
                    e = layers = new = None  # the bank's alone: a release frees it
                    turns_done.append({"agent": name, "tokens": len(held[name])})
            peak, anon_peak = _vm_hwm(), anon.stop()
        finally:
            w.close()
            raw.close()
    def median(rows, key):
        return round(float(np.median([r[key] for r in rows])), 3) if rows else None
    return {
        "geometry": geometry, "geometry_config": g, "tokens": tokens,
        "conversation_bytes": tokens * g["bytes_per_token"],
        "conversations": conversations, "turns": turns, "turn_tokens": turn_tokens,
        "block_tokens": block_tokens, "bank_bytes": bank_bytes,
        # medians over the writes and the restores, each paired with raw LMDB beside it
        "write_behind_mb_s": median(builds, "mb_s"),
        "raw_write_mb_s": median(builds, "raw_write_mb_s"),
        "write_vs_raw": median(builds, "vs_raw"),
        "restore_mb_s": median(restores, "mb_s"), "raw_read_mb_s": median(restores, "raw_read_mb_s"),
        "restore_vs_raw": median(restores, "vs_raw"),
        "raw_sample_bytes": len(raw.ids) * raw.block_bytes,
        "raw_write_space": "new: each sample a new environment, none deleted (see _Raw)",
        "page_cache": ("dropped before each read (drop_caches)"
                       if os.access("/proc/sys/vm/drop_caches", os.W_OK) else
                       "this file's pages dropped before each read (posix_fadvise): the "
                       "kernel may keep some"),
        "peak_rss_bytes": peak, "rss_before_bytes": base_rss,
        "peak_rss_vs_budget": round(peak / (base_rss + bank_bytes), 3),
        "peak_anon_bytes": anon_peak, "anon_before_bytes": anon_base,
        "peak_anon_vs_budget": round(anon_peak / (anon_base + bank_bytes), 3),
        "releases": releases,
        "release_write_out_s_max": max((r["write_out_s"] for r in releases), default=0.0),
        "release_unwritten_bytes_max": max((r["unwritten_bytes_at_release"] for r in releases),
                                           default=0),
        "turn_bytes": turn_tokens * g["bytes_per_token"],
        "unwritten_dropped": sum(r["unwritten_dropped"] for r in releases),
        "builds": builds, "restores": restores, "turns_done": len(turns_done),
    }




def add_arguments(p) -> None:
    p.add_argument("--geometry", choices=[g for g in GEOMETRIES if g != "tiny"],
                   default="qwen3.6-27b", help="whose KV: its layers, heads and sizes "
                                               "(default: %(default)s)")
    p.add_argument("--tokens", type=int, default=65536, help="each conversation's length")
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--turns", type=int, default=2, help="rounds in which each agent returns")
    p.add_argument("--turn-tokens", type=int, default=1536)
    p.add_argument("--data-dir", type=Path, default=None,
                   help="where the store goes (default: the system's temporary directory; "
                        "the disk measured)")
    p.add_argument("--quick", action="store_true",
                   help="a tiny geometry and 2,048 tokens: seconds, to check it runs")
    p.add_argument("--json", action="store_true")


def run_cli(args) -> dict:
    if args.quick:
        return run(geometry="tiny", tokens=2048, conversations=3, turns=1, turn_tokens=256,
                   block_tokens=64, data_dir=args.data_dir)
    return run(geometry=args.geometry, tokens=args.tokens, conversations=args.conversations,
               turns=args.turns, turn_tokens=args.turn_tokens, data_dir=args.data_dir)
