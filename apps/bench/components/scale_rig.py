"""`kvbank bench scale`'s rig: the worker's own KV manager (worker/tiers/manager.py: bank, records,
writer, restorer, the coldstore link and its message handling, the commit) over a real
coldstore process, and what the bench needs beside it: the process's memory and the page
cache (the disk's yardsticks are scale_io.py's)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

TENANT = ""


class Rig:
    """A coldstore process on `data_dir` and the worker's KV manager over it, driven from this
    thread as the engine drives them from its own."""

    def __init__(self, data_dir: Path, kinds, fingerprint: bytes, block_tokens: int,
                 bank_bytes: int):
        from kvbank.config import Layout
        from kvbank.contracts.health import coldstore_up
        from kvbank.worker.tiers.manager import KVManager

        self.layout = Layout(data_dir).ensure()
        self.proc = subprocess.Popen([sys.executable, "-m", "kvbank.apps.cli", "coldstore",
                                      "--data-dir", str(data_dir), "--quiet-grace-s", "0",
                                      "--tail-delay-s", "0"])
        while not coldstore_up(self.layout.coldstore_address):
            if self.proc.poll() is not None:
                raise RuntimeError("the coldstore did not start")
            time.sleep(0.05)
        self.h = KVManager(self.layout, kinds=kinds, fingerprint=fingerprint,
                           block_tokens=block_tokens, bank_bytes=bank_bytes, active_pin_s=0)
        self.kinds, self.bank, self.block_tokens = kinds, self.h.bank, block_tokens

    def admit_under(self, memory_budget: int, held_before: int, *, bytes_per_token: int,
                    checkpoint_bytes: int, first_chunk: int) -> None:
        """The worker's memory budget from here on: what the processes held before the bank
        is the fixed part of the worker's price list (kvbank/contracts/pricing.py), the
        synthesized forwards hold no transients, and each return is admitted as the engine
        admits a request (`KVManager.make_room`); prefetch hints take what it leaves."""
        from kvbank.contracts.pricing import Pricing

        self.h.pricing = Pricing(kv_bytes_per_token=bytes_per_token, fixed_bytes=held_before,
                                 chunk_tokens=first_chunk, state_bytes=2 * checkpoint_bytes)
        self.h.budget = lambda: memory_budget

    def key(self, name: str) -> tuple[str, str]:
        return (TENANT, name)

    def wait_durable(self, name: str) -> float:
        """Until the conversation's bank entry is all on SSD (the writer pumped, as the
        engine's loop pumps it): seconds waited."""
        t0 = time.perf_counter()
        e = self.bank.terminal(self.key(name))
        while e is not None and e.durable_tokens < e.n_tokens:
            self.h.writer.pump(timeout_s=0.05)
        return time.perf_counter() - t0

    def wait_all_durable(self) -> float:
        """Until every conversation in the bank is all on SSD: nothing writes while the
        next read is timed."""
        t0 = time.perf_counter()
        for e in list(self.bank.entries.values()):
            self.wait_durable(e.session[1])
        return time.perf_counter() - t0

    def stored_chain(self, prompt) -> list[bytes]:
        """The ids of the prompt's chain blocks the store holds from its start: what a restore
        of it reads (before any tail block or anchor)."""
        from kvbank.blocks import chain_block_ids

        store = self.h.restorer.store()
        ids = chain_block_ids(prompt, self.h.root_for(TENANT), self.block_tokens)
        n = 0
        while store is not None and n < len(ids) and store.has_block(ids[n]):
            n += 1
        return [bytes(b) for b in ids[:n]]

    def release_all_but(self, keep: str, bytes_per_token: int) -> dict:
        """The seeds' admission step for `keep`'s turn: every other conversation leaves RAM,
        written out first. What each release still had to write, and how long it took."""
        others = [e for e in self.bank.entries.values() if e.session != self.key(keep)]
        pending = sum((e.n_tokens - min(e.durable_tokens, e.n_tokens)) * bytes_per_token
                      for e in others)
        r = self.h.eviction.release_sessions(None, keep_sessions=[self.key(keep)],
                                             reason="admission_release",
                                             write_out_before_release=True)
        return {"released_bytes": r.released_bytes, "unwritten_bytes_at_release": pending,
                "written_out_entries": r.written_out_entries,
                "write_out_s": round(r.write_out_s, 3), "unwritten_dropped": r.unwritten_dropped}

    def come_back(self, name: str, prompt, *, seed: int, every: int, first_chunk: int
                  ) -> dict:
        """A conversation's next turn, as the engine runs it: admitted under the budget
        (`admit_under`: room made, its cache reserved), its cache from the worker's restorer
        (RAM, or SSD when RAM has it not), the history copied where its buffer has no room for
        the prompt (`copies_history`, `with_room`: the engine's, the scheduler's), the forwards
        (synthesized: scale_kv.forward) with the checkpoints the worker takes every `every`
        tokens and at the turn's end, then the engine's commit. Times: the restore, and
        restore to the first forward evaluated (`first_chunk` tokens, the worker's
        --prefill-chunk-tokens)."""
        from kvbank.blocks import chain_block_ids
        from kvbank.v1 import api_pb2
        from kvbank.contracts.vocabulary import Decision

        from kvbank.apps.bench.components.scale_kv import forward

        key = self.key(name)
        own = 0
        if self.h.pricing is not None:
            own = self.h.pricing.own_bytes(len(prompt), 0)
            ids = chain_block_ids(prompt, self.h.root_for(TENANT), self.block_tokens)
            while self.h.make_room(prompt, ids, TENANT, key, need=own, solo_need=own,
                                   running=0).decision == Decision.WAIT:
                self.h.writer.pump(timeout_s=0.05)  # writes in flight hold the room
        self.bank.begin_request(key)
        self.bank.reserve_active(key, own)
        t0 = time.perf_counter()
        taken = self.h.restore(prompt, TENANT, key)
        cache, cached, source, handed = taken.cache, taken.cached, taken.source, taken.handed
        restore_s = time.perf_counter() - t0
        self.h.copies_history(key, handed, len(prompt))
        self.kinds.with_room(cache, len(prompt))
        room_s = time.perf_counter() - t0
        splits = self.kinds.splits(cached, len(prompt), (), every)
        checkpoints, first_s = forward(self.kinds, cache, cached, len(prompt), seed=seed,
                                       splits=splits, first_chunk=first_chunk)
        self.h.commit(key, prompt, cache, handed=handed, checkpoints=checkpoints)
        self.bank.end_request(key)
        return {"source": api_pb2.CacheSource.Name(source).removeprefix("CACHE_SOURCE_").lower(),
                "cached_tokens": cached, "tokens": len(prompt),
                "restore_s": round(restore_s, 3), "restore_s_exact": restore_s,
                "with_room_s": round(room_s - restore_s, 3),
                "first_forward_s": round(first_s, 3),
                "to_first_forward_s": round(room_s + first_s, 3)}

    def close(self) -> None:
        self.h.close()
        self.proc.terminate()
        self.proc.wait(30)


def status(field: str) -> int:
    """A line of /proc/self/status, in bytes: VmHWM (the kernel's high-water mark of this
    process's resident memory, mapped file pages included), RssAnon (what it holds itself)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def vm_hwm() -> int:
    return status("VmHWM")


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user and system, every thread) a process has used: this one, or `pid`."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


class AnonPeak:
    """RssAnon sampled every 20 ms: the worker's own memory (a restore's reads of the LMDB
    map are file pages, counted in VmHWM, not here; kvbank's budget counts what this counts)."""

    def __init__(self):
        import threading

        self.peak, self._stop = 0, threading.Event()
        self.window_peak = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            now = status("RssAnon")
            self.peak, self.window_peak = max(self.peak, now), max(self.window_peak, now)

    def window(self) -> int:
        """The peak since the last call, and a new window from now (a write's own peak)."""
        got, self.window_peak = self.window_peak, status("RssAnon")
        return got

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak
