"""`kvbank bench scale`: conversations of real models' size, to SSD and back.

KV in the geometry of a real model (bf16, as on a Mac; the numbers from its published
config.json are in scale_kv.GEOMETRIES), and for a hybrid model (Qwen3.6-27B) its recurrent
layers' checkpoints, are synthesized at each turn's new tokens, with no model forward, so the
machine's CPU does not bound the run. Everything else is the worker's own: its KV manager
(bank, records, writer, restorer, the link to a real coldstore process, the engine's commit),
its `CacheKinds` over the model's real cache layout (scale_kv.SynthModel), its restore path
(`KVManager.restore`, `with_room`) and its `Prefetcher`, in this process:

1. Each of `--conversations` conversations of `--tokens` tokens is built, with a checkpoint
   every `--checkpoint-every` tokens and at its end as the worker takes them, committed and
   written behind; the bank holds one, so the next one's admission releases the last
   (`release_sessions(write_out_before_release=True)`, as the seeds' admission does).
2. `--turns` rounds: each agent comes back in turn with `--turn-tokens` more tokens; its
   conversation is restored from SSD (the others released first, written out), extended, and
   committed and written behind again.
3. Prefetch (scale_prefetch.py): in a bank that holds two, returns with and without the
   prefetch hint and RAM hits, each timed from its arrival to its first forward.

Beside each write and each restore, on the same disk (its speed moves from one minute to the
next): as many bytes as the build wrote, in blocks of the same size, written to a new LMDB
environment as fast as it commits (`raw_write_mb_s`; in new file space, as the store grows: see
`Raw`; before the build's write in every other build, after it in the others), and the latest of
them read back with the page cache dropped (`raw_read_mb_s`; single-threaded, where a restore
reads with several lanes). Goals: write-behind >= 0.7 of raw writes, restore >= 0.8 of raw
reads, peak RSS (the kernel's VmHWM, through parts 1 and 2) <= 1.1 x (what the process held
before + the bank's budget), every release's write-out only the last turn's blocks, nothing
unwritten dropped, a hinted return's time to first forward within 1.1x of a RAM hit's.

Last, an estimate, labelled as one: a 100K-token conversation's restore at this run's
restore rate against recomputing its tokens at the default model's measured prefill rate
scaled by parameter count (`estimate`).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from kvbank.apps.bench.components.scale_kv import (GEOMETRIES, checkpoint_bytes, checkpoint_every,
                                                   forward, presize)
from kvbank.apps.bench.components.scale_rig import (AnonPeak, Raw, Rig, cpu_s, drop_caches, status,
                                                    vm_hwm)

logger = logging.getLogger(__name__)

FIRST_CHUNK = 512  # the worker's --prefill-chunk-tokens default: a return's first forward
# The recompute side of the estimate (`estimate`): SmolLM2-135M-Instruct, the default model,
# read a 512-token prompt at 243.0 tok/s on this machine's CPU in float32
# (docs/benchmarks/prefill.json, "single"/"512", 2026-12-02); its parameters, and the real
# model's (Qwen3.6-27B is dense: all 27B active for every token).
PREFILL_TOK_S = {"model": "SmolLM2-135M-Instruct", "tok_s": 243.0, "params": 134_515_008,
                 "source": "docs/benchmarks/prefill.json single 512-token prompt, 2026-12-02"}
MODEL_PARAMS = {"qwen3.6-27b": 27e9, "qwen3-32b": 32.8e9, "tiny": 134_515_008}
ESTIMATE_TOKENS = 100_000


def estimate(geometry: str, g: dict, restore_bytes_per_s: float | None) -> dict | None:
    """Restore of a 100K-token conversation (its KV and one checkpoint, at this run's median
    restore rate) against recomputing it (the default model's prefill rate scaled down by the
    parameter ratio; attention's growth with context left out, so recompute is if anything
    longer). An estimate, not a measurement."""
    if not restore_bytes_per_s:
        return None
    nbytes = ESTIMATE_TOKENS * g["bytes_per_token"] + checkpoint_bytes(g)
    restore_s = nbytes / restore_bytes_per_s
    tok_s = PREFILL_TOK_S["tok_s"] * PREFILL_TOK_S["params"] / MODEL_PARAMS[geometry]
    recompute_s = ESTIMATE_TOKENS / tok_s
    return {"estimate": True, "tokens": ESTIMATE_TOKENS, "bytes": nbytes,
            "restore_s": round(restore_s, 2), "recompute_s": round(recompute_s),
            "recompute_vs_restore": round(recompute_s / restore_s),
            "prefill_tok_s_scaled": round(tok_s, 3), "prefill": PREFILL_TOK_S,
            "model_params": MODEL_PARAMS[geometry],
            "how": "restore: this run's median restore MB/s over 100K tokens' KV and one "
                   "checkpoint; recompute: the default model's measured prefill rate x its "
                   "params / the real model's params (FLOPs per token ~ 2 x params), on "
                   "this machine's CPU"}


SIZES = (131072, 98304, 65536, 49152, 32768, 16384, 8192)  # the issue asks 32K-128K
RAM_SHARE, DISK_SHARE = 0.8, 0.8  # of what is available when the run starts
# What the bench holds at its peak, in conversations at their largest: the prefetch part's
# bank of two and a return's copy into a buffer with room (`with_room`): 2.7 measured at
# 64K tokens (VmHWM 15.06 GB), 2.9 at 96K; else the bank of one and its room.
HELD_WITH_PREFETCH, HELD = 2.9, 1.25
SLACK_BYTES = 2 << 30  # the process before the bank, the raw samples, the allocator


def conversation_bytes(g: dict, tokens: int, turns: int, turn_tokens: int) -> int:
    """One conversation at its largest, as the bank holds it: its KV after every turn, and
    for a hybrid geometry its newest checkpoints."""
    from kvbank.worker.tiers.bank import MAX_CHECKPOINTS

    return ((tokens + turns * turn_tokens) * g["bytes_per_token"]
            + MAX_CHECKPOINTS * checkpoint_bytes(g))


def pick_tokens(g: dict, *, conversations: int, turns: int, turn_tokens: int,
                prefetch: bool, data_dir: Path | None) -> tuple[int, dict]:
    """The longest conversations this machine's RAM and disk take (issue #35: the largest
    that fit): the bank holds one of them (two in the prefetch part) beside the process, and
    the store all of them, each written and rewritten once a turn, within RAM_SHARE of the
    memory available and DISK_SHARE of the disk free now (a failed allocation on a CPU is a
    crash, not an error: the bench must not try). Returns it and why."""
    mem = _mem_available()
    disk = shutil.disk_usage(data_dir or tempfile.gettempdir()).free
    held = HELD_WITH_PREFETCH if prefetch else HELD
    for tokens in SIZES:
        conv = conversation_bytes(g, tokens, turns, turn_tokens)
        ram_ok = held * conv + SLACK_BYTES <= RAM_SHARE * mem
        disk_ok = conversations * conv * 2.5 + SLACK_BYTES <= DISK_SHARE * disk  # raw too
        if ram_ok and disk_ok:
            break
    bound = {"mem_available_bytes": mem, "disk_free_bytes": disk, "ram_share": RAM_SHARE,
             "disk_share": DISK_SHARE, "bank_holds_conversations": held,
             "chosen_by": "the bench (the largest of %s that fit)" % (SIZES,)}
    if tokens < 32768:
        bound["note"] = (f"below the 32K tokens the scenario asks: {tokens} tokens is the "
                         "largest this machine's RAM and disk take for this geometry")
    return tokens, bound


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def run(*, geometry: str = "qwen3.6-27b", tokens: int | None = None, conversations: int = 3,
        turns: int = 2, turn_tokens: int = 1536, block_tokens: int = 256,
        checkpoint_every_tokens: int | None = None, prefetch_rounds: int = 2,
        first_chunk: int = FIRST_CHUNK, data_dir: Path | None = None) -> dict:
    from kvbank.config import preload_openblas

    preload_openblas()
    import mlx.core as mx

    from kvbank.apps.bench.components.scale_kv import kinds_for
    from kvbank.worker.memory.allocator import serve_buffers_from_the_heap
    from kvbank.worker.link.writer import STREAM_WINDOW_BYTES
    from kvbank.worker.tiers.bank import MAX_CHECKPOINTS

    serve_buffers_from_the_heap()  # the worker's allocator: freed KV goes back to the OS
    mx.set_cache_limit(0)
    g = GEOMETRIES[geometry]
    if data_dir is not None:
        Path(data_dir).mkdir(parents=True, exist_ok=True)
    if tokens is None:
        tokens, sized = pick_tokens(g, conversations=conversations, turns=turns,
                                    turn_tokens=turn_tokens,
                                    prefetch=bool(prefetch_rounds and conversations >= 2),
                                    data_dir=data_dir)
    else:
        sized = {"chosen_by": "--tokens"}
    logger.info("%d conversations of %d tokens of %s (%s)", conversations, tokens, geometry,
                sized["chosen_by"])
    kinds = kinds_for(g)
    every = checkpoint_every(g, checkpoint_every_tokens, block_tokens)
    cp_bytes = checkpoint_bytes(g)
    conv_bytes = conversation_bytes(g, tokens, turns, turn_tokens)
    block_bytes = block_tokens * g["bytes_per_token"]
    bank_bytes = int(conv_bytes * 1.25)  # one conversation, room and turn included
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="kvbank-scale-", dir=data_dir) as tmp:
        w = Rig(Path(tmp) / "data", kinds, f"bench-scale:{geometry}".encode(), block_tokens,
                bank_bytes)
        store = w.layout.store_dir / "data.mdb"
        raw = Raw(Path(tmp) / "raw", block_bytes)
        base_rss, anon_base, anon = vm_hwm(), status("RssAnon"), AnonPeak()
        builds, releases, restores, turns_done = [], [], [], []
        try:
            held: dict[str, np.ndarray] = {}
            for i in range(conversations):  # 1. build each, write it behind
                name = f"agent-{i}"
                if i:
                    releases.append(w.release_all_but(name, g["bytes_per_token"]))
                toks = rng.integers(1000, 40000, tokens).astype(np.uint32)
                cache = kinds.new_cache()
                presize(kinds, cache, tokens)
                cps, _ = forward(kinds, cache, 0, tokens, seed=i,
                                 splits=kinds.splits(0, tokens, (), every))
                # what the write will carry: the KV, and a checkpoint at each split and at
                # the end (the commit takes that one), as many as the bank keeps
                ends = min(len(set(cps) | {tokens}), MAX_CHECKPOINTS) if kinds.checkpointed else 0
                raw_bytes = tokens * g["bytes_per_token"] + ends * cp_bytes
                # The raw sample goes first in every other build: on this VM memory gets
                # faster as the page cache fills and is recycled, so the pair's second write
                # meets faster memory than its first (raw, written second in every pair, caught
                # it in the third of each default run: 1.28-1.47 GB/s, the build 0.45-0.87)
                raw_first = i % 2 == 1
                if raw_first:
                    raw_mb_s = raw.write_mb_s(raw_bytes)
                anon.window()  # the write's own window: what it holds beyond the KV
                before_write = status("RssAnon")
                cpu, cs_cpu = cpu_s(), cpu_s(w.proc.pid)
                t0 = time.perf_counter()
                w.h.commit(w.key(name), toks, cache, checkpoints=cps)
                e = w.bank.terminal(w.key(name))
                n_cps, cps_nbytes = len(e.checkpoints), sum(c.nbytes for c in
                                                            e.checkpoints.values())
                del cache, cps, e  # the bank's alone: a release frees it
                w.wait_durable(name)
                write_s = time.perf_counter() - t0
                cpu, cs_cpu = cpu_s() - cpu, cpu_s(w.proc.pid) - cs_cpu
                extra = max(0, anon.window() - before_write)
                nbytes = tokens * g["bytes_per_token"] + cps_nbytes
                mb_s = nbytes / write_s / 1e6
                if not raw_first:
                    raw_bytes, raw_mb_s = nbytes, raw.write_mb_s(nbytes)
                gb = nbytes / 1e9
                builds.append({"tokens": tokens, "bytes": nbytes, "checkpoints": n_cps,
                               "checkpoint_bytes": cps_nbytes, "write_s": round(write_s, 3),
                               "mb_s": round(mb_s, 1), "raw_write_mb_s": round(raw_mb_s, 1),
                               "raw_first": raw_first, "raw_bytes": raw_bytes,
                               "vs_raw": round(mb_s / raw_mb_s, 3),
                               "write_extra_bytes": extra,
                               "write_extra_blocks": round(extra / block_bytes, 2),
                               # CPU seconds a GB took: the worker's side (this process) and
                               # the coldstore's, against the raw writer's on the same cores
                               "cpu_s_per_gb": {"worker": round(cpu / gb, 3),
                                                "coldstore": round(cs_cpu / gb, 3),
                                                "raw": round(raw.write_cpu_s / gb, 3)}})
                held[name] = toks
            for t in range(turns):  # 2. each agent comes back in turn
                for i in range(conversations):
                    name = f"agent-{i}"
                    n = len(held[name])
                    releases.append(w.release_all_but(name, g["bytes_per_token"]))
                    from_ssd = not w.bank.session_entries(w.key(name))
                    if from_ssd:
                        drop_caches(store)
                    prompt = np.concatenate([held[name], rng.integers(1000, 40000, turn_tokens)
                                             .astype(np.uint32)])
                    row = w.come_back(name, prompt, seed=100 * t + i, every=every,
                                      first_chunk=first_chunk)
                    held[name] = prompt
                    e = w.bank.terminal(w.key(name))
                    turns_done.append({"agent": name, "tokens": len(prompt),
                                       "source": row["source"],
                                       "checkpoints": len(e.checkpoints),
                                       "checkpoint_bytes": sum(c.nbytes for c in
                                                               e.checkpoints.values())})
                    del e
                    if from_ssd:
                        # what it read: the blocks up to its restore point, and the checkpoint
                        # stored with the last of them
                        nbytes = row["cached_tokens"] * g["bytes_per_token"] + cp_bytes
                        mb_s = nbytes / row["restore_s"] / 1e6
                        raw_mb_s = raw.read_mb_s()
                        restores.append({"tokens": n, "restored_tokens": row["cached_tokens"],
                                         "bytes": nbytes, "checkpoint_bytes": cp_bytes,
                                         "restore_s": row["restore_s"],
                                         "to_first_forward_s": row["to_first_forward_s"],
                                         "mb_s": round(mb_s, 1),
                                         "raw_read_mb_s": round(raw_mb_s, 1),
                                         "vs_raw": round(mb_s / raw_mb_s, 3)})
            peak, anon_peak = vm_hwm(), anon.stop()
            prefetch = None
            if prefetch_rounds and conversations >= 2:  # 3. the prefetch hint
                from kvbank.apps.bench.components.scale_prefetch import run_prefetch

                prefetch = run_prefetch(w, g, held, rounds=prefetch_rounds,
                                        turn_tokens=turn_tokens, every=every,
                                        first_chunk=first_chunk, bank_bytes=2 * conv_bytes,
                                        rng=rng)
                prefetch["peak_rss_bytes"] = vm_hwm()
                prefetch["peak_rss_vs_budget"] = round(vm_hwm() / (base_rss + 2 * conv_bytes), 3)
        finally:
            w.close()
            raw.close()

    def median(rows, key):
        return round(float(np.median([r[key] for r in rows])), 3) if rows else None
    restore_mb_s = median(restores, "mb_s")
    return {
        "geometry": geometry, "geometry_config": g, "tokens": tokens, "sized": sized,
        "conversation_bytes": tokens * g["bytes_per_token"],
        "conversations": conversations, "turns": turns, "turn_tokens": turn_tokens,
        "block_tokens": block_tokens, "bank_bytes": bank_bytes, "cache_layout": kinds.layout,
        "checkpoint_bytes": cp_bytes, "checkpoint_every": every,
        "max_checkpoints": MAX_CHECKPOINTS,
        # medians over the writes and the restores, each paired with raw LMDB beside it
        "write_behind_mb_s": median(builds, "mb_s"),
        "raw_write_mb_s": median(builds, "raw_write_mb_s"),
        "write_vs_raw": median(builds, "vs_raw"),
        # on 2 cores the write's own threads (encode, ZeroMQ both sides) take the core the
        # raw writer leaves to the kernel's writeback: medians of each build's CPU s per GB
        "write_cpu_s_per_gb": {k: median([b["cpu_s_per_gb"] for b in builds], k)
                               for k in ("worker", "coldstore", "raw")},
        # a write's memory beyond the KV it writes: RssAnon sampled every 20 ms through each
        # build's write-behind; the writer streams a window of STREAM_WINDOW_BYTES at a time
        "block_bytes": block_bytes,
        "write_extra_bytes_max": max((b["write_extra_bytes"] for b in builds), default=0),
        "write_extra_blocks_max": max((b["write_extra_blocks"] for b in builds), default=0),
        "write_window_bytes": STREAM_WINDOW_BYTES,
        "restore_mb_s": restore_mb_s, "raw_read_mb_s": median(restores, "raw_read_mb_s"),
        "restore_vs_raw": median(restores, "vs_raw"),
        "restore_s_median": median(restores, "restore_s"),
        "raw_sample_bytes": "each as many as the build's write it is paired with (written "
                            "before it where `raw_first`, every other build); a restore reads "
                            "the latest",
        "raw_write_space": "new: each sample a new environment, none deleted (see Raw)",
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
        "turn_rows": turns_done,
        "prefetch": prefetch,
        "restore_vs_recompute_estimate": estimate(geometry, g, restore_mb_s and
                                                  restore_mb_s * 1e6),
    }


def add_arguments(p) -> None:
    p.add_argument("--geometry", choices=[g for g in GEOMETRIES if g != "tiny"],
                   default="qwen3.6-27b", help="whose KV: its layers, heads and sizes "
                                               "(default: %(default)s)")
    p.add_argument("--tokens", type=int, default=None,
                   help="each conversation's length (default: the longest of %s that this "
                        "machine's RAM and disk take, printed)" % (SIZES,))
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--turns", type=int, default=2, help="rounds in which each agent returns")
    p.add_argument("--turn-tokens", type=int, default=1536)
    p.add_argument("--checkpoint-every", type=int, default=None,
                   help="tokens between a long prompt's checkpoints, hybrid geometries "
                        "(default: the worker's rule for the geometry)")
    p.add_argument("--prefetch-rounds", type=int, default=2,
                   help="rounds of unhinted, RAM-hit and hinted returns (0: none)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="where the store goes (default: the system's temporary directory; "
                        "the disk measured)")
    p.add_argument("--quick", action="store_true",
                   help="a tiny geometry and 2,048 tokens: seconds, to check it runs")
    p.add_argument("--json", action="store_true")


def _result(args) -> dict:
    if args.quick:
        return run(geometry="tiny", tokens=2048, conversations=3, turns=1, turn_tokens=256,
                   block_tokens=64, checkpoint_every_tokens=512, prefetch_rounds=1,
                   first_chunk=128, data_dir=args.data_dir)
    return run(geometry=args.geometry, tokens=args.tokens, conversations=args.conversations,
               turns=args.turns, turn_tokens=args.turn_tokens,
               checkpoint_every_tokens=args.checkpoint_every,
               prefetch_rounds=args.prefetch_rounds, data_dir=args.data_dir)


def run_cli(args) -> int:
    from kvbank.apps.bench.report import print_result

    print_result(args.bench, _result(args), args.json)
    return 0
