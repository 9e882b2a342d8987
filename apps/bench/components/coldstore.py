"""`kvbank bench coldstore`: the SSD tier against raw LMDB, and against recomputing.

In one run, on one disk, each pair measured back to back `repeats` times (medians reported;
this disk's speed drifts between runs):
- write: the same block payloads put into a fresh LMDB environment (one synced commit per
  block, as the coldstore commits) vs handed to a real coldstore process as a write-behind
  job the way the worker sends one (payloads streamed behind the header), timed until its
  acknowledgement; each repeat a new conversation, so nothing is deduped, and both sides
  write to new space;
- read: the same payloads read back from LMDB (page cache dropped first) vs the worker's
  restore (read-only map, decode into MLX arrays, mlx-lm caches) under the worker's allocator
  settings; the restore through the coldstore process is measured once, last (its reads stay
  mapped in that process, so the page cache cannot be dropped for it again);
- write amplification: a 20-turn conversation through a real stack (tiny model, default block
  size and delays), bytes the coldstore wrote / bytes of distinct KV it holds at the end;
- restore vs recompute: an N-token conversation of the model (default 8K, SmolLM2);
- what streaming a restore layer by layer could save at best: the restore against the next
  turn's forward (1,024 tokens) over the same conversation;
- what checking every block's checksum adds to a restore: with and without it, back to back,
  from the disk and from memory (goal: at most 2 % of a restore from the disk).
"""

from __future__ import annotations

import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

TENANT, SESSION = "", "bench-coldstore"
FINGERPRINT = b"bench-coldstore"


def add_arguments(p) -> None:
    """`kvbank bench coldstore`'s flags."""
    from kvbank.apps.flags import model_flag
    from kvbank.config import DEFAULT_BLOCK_TOKENS

    model_flag(p)
    p.add_argument("--tokens", type=int, default=8192,
                   help="conversation length for the read/write and recompute runs")
    p.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS)
    p.add_argument("--turns", type=int, default=20, help="turns of the amplification run")
    p.add_argument("--repeats", type=int, default=5,
                   help="back-to-back raw/coldstore pairs for writes and reads; medians "
                        "are reported (default: %(default)s)")
    p.add_argument("--json", action="store_true")


def _drop_page_cache(path: Path) -> None:
    """Make the next read come from the disk, not from memory (no root needed)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _raw_write(path: Path, ids: list[bytes], payloads: list[bytes]) -> float:
    import lmdb

    env = lmdb.open(str(path), map_size=1 << 34, readahead=True, sync=True, metasync=True)
    t0 = time.perf_counter()
    for bid, p in zip(ids, payloads):
        with env.begin(write=True) as txn:
            txn.put(bid, p)
    dt = time.perf_counter() - t0
    env.close()
    return dt


def _raw_read(path: Path, ids: list[bytes]) -> float:
    """The blocks read back in order, no copy: py-lmdb faults a value's pages in as it is got
    (copying each into a new `bytes` timed the copy and fresh pages, not the disk)."""
    import lmdb

    _drop_page_cache(path / "data.mdb")
    env = lmdb.open(str(path), readonly=True, readahead=True, lock=False)
    t0 = time.perf_counter()
    with env.begin(buffers=True) as txn:
        n = sum(len(txn.get(b)) for b in ids)
    dt = time.perf_counter() - t0
    env.close()
    assert n > 0
    return dt


class _Coldstore:
    """A real coldstore process and the worker's client of it."""

    def __init__(self, data_dir: Path, *extra: str):
        from kvbank.contracts.health import coldstore_up
        from kvbank.config import Layout
        from kvbank.worker.link.client import ColdstoreClient

        self.layout = Layout(data_dir).ensure()
        self.proc = subprocess.Popen([sys.executable, "-m", "kvbank.apps.cli", "coldstore",
                                      "--data-dir", str(data_dir), "--quiet-grace-s", "0",
                                      "--tail-delay-s", "0", *extra])
        while not coldstore_up(self.layout.coldstore_address):
            if self.proc.poll() is not None:
                raise RuntimeError("the coldstore did not start")
        self.done = threading.Event()
        self.outcome = None
        self.client = ColdstoreClient(self.layout, on_event=self._on_event).start()

    def _on_event(self, msg) -> None:
        from kvbank.contracts.coldstore_wire import outcome_of

        if msg.WhichOneof("kind") == "done":
            self.outcome = outcome_of(msg.done)
            self.done.set()

    def write(self, tokens: np.ndarray, root, ids: list, payloads: list[bytes],
              block_tokens: int, session: str = SESSION) -> float:
        from kvbank.contracts.coldstore_wire import pb
        from kvbank.contracts.vocabulary import Outcome

        self.client.put_session(TENANT, session, block_tokens, tokens.tobytes())
        write = pb.Write(job=self.client.next_id(), tenant=TENANT, session_id=session,
                         root=bytes(root), dirty_since=time.time(),
                         blocks=[pb.Block(id=bytes(b), start=i * block_tokens)
                                 for i, b in enumerate(ids)])
        self.done.clear()
        self.outcome = None
        t0 = time.perf_counter()
        self.client.send_write(write, payloads)
        self.done.wait(600)
        dt = time.perf_counter() - t0
        if self.outcome != Outcome.WRITTEN:
            raise RuntimeError(f"the coldstore's write ended {self.outcome}")
        return dt

    def read(self, ids: list) -> list:
        return self.client.get_blocks([bytes(b) for b in ids], timeout_s=600)

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(60)


def _conversation_kv(model_dir: Path, n_tokens: int, seed: int, turn_tokens: int = 1024):
    """The model's KV of an n-token prompt, how long computing it took, and how long the next
    turn's `turn_tokens` took over it (what follows a restore: layer-by-layer streaming could
    at best overlap the two)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from kvbank.worker.kv.kinds import FullKind

    model, _ = load(str(model_dir))
    tokens = np.random.default_rng(seed).integers(1000, 20000, n_tokens, dtype=np.uint32)
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    for s in range(0, n_tokens, 512):
        model(mx.array(tokens[None, s:s + 512]), cache=cache)
        mx.eval([c.state for c in cache])
    recompute_s = time.perf_counter() - t0
    turn = np.random.default_rng(seed + 1).integers(1000, 20000, turn_tokens, dtype=np.uint32)
    t0 = time.perf_counter()
    for s in range(0, turn_tokens, 512):
        model(mx.array(turn[None, s:s + 512]), cache=cache)
        mx.eval([c.state for c in cache])
    turn_s = time.perf_counter() - t0
    return tokens, FullKind().freeze_layers(cache, n_tokens), recompute_s, turn_s


def _restore(read, ids: list, n_tokens: int) -> float:
    """Fetch + decode + build mlx-lm caches, as the worker restores a conversation."""
    import mlx.core as mx

    from kvbank.worker.kv.kinds import FullKind

    t0 = time.perf_counter()
    layers = read(ids)
    cache = FullKind().restore_layers(layers, n_tokens)
    mx.eval([c.state for c in cache])
    return time.perf_counter() - t0


def _write_amplification(tmp: Path, turns: int, seed: int) -> dict:
    """20 agent turns through a real stack with its default block size and delays (the tiny
    model: its context of 2048 tokens holds 20 turns of 40-80 tokens plus 16 answered)."""
    from kvbank.deploy.local import LocalStack
    from kvbank.models import default_cache_dir
    from kvbank.testing.tiny import make_tiny_model

    model = make_tiny_model(tmp / "tiny", seed=0, cache_dir=default_cache_dir())
    rng = np.random.default_rng(seed)
    stack = LocalStack.start(model, tmp / "stack", shim=False)
    try:
        with stack.client() as c:
            for _ in range(turns):
                c.generate(session_id=SESSION, append=True, max_tokens=16,
                           token_ids=rng.integers(1000, 20000, int(rng.integers(40, 80))).tolist())
                time.sleep(0.5)  # the agent runs its tool: a quiet window
            tokens = c.get_session(SESSION).token_count
            stack.wait_durable(SESSION, timeout_s=300)
        from kvbank.contracts.health import coldstore_ping

        reply = coldstore_ping(stack.layout.coldstore_address, timeout_ms=10_000)
    finally:
        stack.stop()
    if reply is None:
        raise RuntimeError("the stack's coldstore did not answer a ping")
    distinct = reply.stats.block_bytes
    return {"amplification_turns": turns, "amplification_tokens": tokens,
            "written_bytes": reply.written_bytes,
            "distinct_kv_bytes": distinct,
            "write_amplification": round(reply.written_bytes / distinct, 3)}


def _ids(conv: np.ndarray, root, block_tokens: int) -> list:
    from kvbank.blocks import chain_block_ids, tail_block_id

    ids = chain_block_ids(conv, root, block_tokens)
    n_full = len(ids) * block_tokens
    if n_full < len(conv):
        ids.append(tail_block_id(ids[-1] if ids else root, conv[n_full:]))
    return ids


def _median_ratio(pairs: list[tuple[float, float]]) -> float:
    """The median of raw / coldstore over pairs measured back to back."""
    return statistics.median(raw / ours for raw, ours in pairs)


def _in_turns(r: int) -> tuple[str, str]:
    """Who goes first alternates: on this disk, space freed by the run before is faster to
    write than space never written, and its speed drifts."""
    return ("raw", "coldstore") if r % 2 == 0 else ("coldstore", "raw")


def _write_pairs(tmp: Path, cs: _Coldstore, conv: np.ndarray, payloads: list[bytes],
                 block_tokens: int, repeats: int) -> list[tuple[float, float]]:
    """(raw, coldstore) write times; each repeat a new conversation, nothing deleted."""
    from kvbank.blocks import chain_root

    pairs = []
    for r in range(repeats):
        root = chain_root(FINGERPRINT + b"%d" % r, TENANT)
        ids = _ids(conv, root, block_tokens)
        timed = {}
        for side in _in_turns(r):
            timed[side] = (_raw_write(tmp / f"raw{r}", ids, payloads) if side == "raw"
                           else cs.write(conv, root, ids, payloads, block_tokens,
                                         session=f"{SESSION}-{r}"))
        pairs.append((timed["raw"], timed["coldstore"]))
    return pairs


def _restore_direct(tmp: Path, ids: list, tokens: int, *, cold: bool = True,
                    verify: bool = True) -> float:
    """The worker's restore from the read-only map (page cache dropped first, `cold`)."""
    from kvbank.coldstore.store import ColdStore
    from kvbank.worker.kv import codec

    if cold:
        _drop_page_cache(tmp / "cs" / "store" / "data.mdb")
    store = ColdStore(tmp / "cs" / "store", readonly=True)
    try:
        return _restore(lambda i: store.get_blocks(i, decode=lambda views, done_with:
                                                   codec.decode_blocks(views, 0, done_with,
                                                                    verify=verify)),
                        ids, tokens)
    finally:
        store.close()


def _read_pairs(tmp: Path, ids: list, tokens: int, repeats: int) -> list[tuple[float, float]]:
    """(raw, restore) read times of the first conversation, page cache dropped each time,
    under the worker's allocator settings (it returns freed memory after each request)."""
    from kvbank.worker.memory.allocator import give_back_freed_memory

    pairs = []
    for r in range(repeats):
        timed = {}
        for side in _in_turns(r):
            give_back_freed_memory()
            timed[side] = (_raw_read(tmp / "raw0", ids) if side == "raw"
                           else _restore_direct(tmp, ids, tokens))
        pairs.append((timed["raw"], timed["coldstore"]))
    return pairs


def _checksum_cost(tmp: Path, ids: list, tokens: int, repeats: int) -> dict:
    """What verifying every block's checksum adds to a restore: restores with and without
    it back to back (who goes first alternates), from the disk (page cache dropped) and
    from memory (the file's pages cached: the copy alone, the check's worst case)."""
    from kvbank.worker.memory.allocator import give_back_freed_memory

    out = {}
    for where, cold in (("cold", True), ("warm", False)):
        pairs = []
        for r in range(repeats):
            timed = {}
            for verify in ((True, False) if r % 2 == 0 else (False, True)):
                give_back_freed_memory()
                timed[verify] = _restore_direct(tmp, ids, tokens, cold=cold, verify=verify)
            pairs.append((timed[True], timed[False]))
        out[f"checksum_cost_{where}"] = round(statistics.median(a / b for a, b in pairs) - 1, 4)
        out[f"checksum_costs_{where}"] = [round(a / b - 1, 4) for a, b in pairs]
    return out


def run(*, model: str | None, tokens: int = 8192, block_tokens: int = 256, turns: int = 20,
        repeats: int = 5, seed: int = 0) -> dict:
    from kvbank.config import preload_openblas

    preload_openblas()  # before the first import of MLX
    import mlx.core as mx

    from kvbank.blocks import chain_root
    from kvbank.models import prepare_model
    from kvbank.worker.kv import codec
    from kvbank.heap import resident_bytes
    from kvbank.worker.memory.pricing import default_memory_budget
    from kvbank.worker.memory.allocator import mlx_cache_limit, serve_buffers_from_the_heap

    serve_buffers_from_the_heap()  # the worker's allocator settings, for both sides
    model_dir = prepare_model(model)
    conv, layers, recompute_s, turn_s = _conversation_kv(model_dir, tokens, seed)
    payloads = [codec.encode_range(layers, s, min(s + block_tokens, tokens))
                for s in range(0, tokens, block_tokens)]
    nbytes = sum(map(len, payloads))
    del layers
    # MLX's cache limit as the worker sets it at its default --memory-budget, with what this
    # process holds now as the fixed part (the worker measures its own after a warm-up).
    mx.set_cache_limit(mlx_cache_limit(default_memory_budget(), resident_bytes()))
    with tempfile.TemporaryDirectory(prefix="kvbank-bench-") as tmp:
        tmp = Path(tmp)
        cs = _Coldstore(tmp / "cs")
        try:
            writes = _write_pairs(tmp, cs, conv, payloads, block_tokens, repeats)
            ids = _ids(conv, chain_root(FINGERPRINT + b"0", TENANT), block_tokens)
            reads = _read_pairs(tmp, ids, tokens, repeats)
            checksum = _checksum_cost(tmp, ids, tokens, repeats)
            _drop_page_cache(tmp / "cs" / "store" / "data.mdb")
            via_s = _restore(lambda i: codec.decode_blocks(cs.read(i)), ids, tokens)
        finally:
            cs.stop()
        amp = _write_amplification(tmp, turns, seed)
    raw_write_s, cs_write_s = (statistics.median(x) for x in zip(*writes))
    raw_read_s, direct_s = (statistics.median(x) for x in zip(*reads))
    mb = nbytes / 1e6
    return {
        "model": str(model_dir), "tokens": tokens, "block_tokens": block_tokens,
        "kv_bytes": nbytes, "repeats": repeats,
        "raw_write_mb_s": round(mb / raw_write_s, 1),
        "coldstore_write_mb_s": round(mb / cs_write_s, 1),
        "write_ratio": round(_median_ratio(writes), 3),
        "write_ratios": [round(a / b, 3) for a, b in writes],
        "raw_read_mb_s": round(mb / raw_read_s, 1),
        "restore_direct_s": round(direct_s, 3),
        "restore_via_coldstore_s": round(via_s, 3),
        "restore_default": "direct" if direct_s <= via_s else "coldstore",
        "restore_ratio": round(_median_ratio(reads), 3),
        "restore_ratios": [round(a / b, 3) for a, b in reads],
        **checksum,
        "recompute_s": round(recompute_s, 2),
        "restore_vs_recompute": round(recompute_s / min(direct_s, via_s), 1),
        # A restore then the next turn's 1,024 tokens, one after the other. Streaming layer by
        # layer (a layer's forward starting once its KV is in) could hide at most the shorter
        # of the two: the share of the turn's start it could save, an upper bound.
        "next_turn_s": round(turn_s, 3),
        "layer_streaming_bound": round(min(direct_s, turn_s) / (direct_s + turn_s), 4),
        **amp,
    }


def run_cli(args) -> int:
    from kvbank.apps.bench.report import print_result

    print_result(args.bench, run(model=args.model, tokens=args.tokens, block_tokens=args.block_tokens,
                     turns=args.turns, repeats=args.repeats), args.json)
    return 0
