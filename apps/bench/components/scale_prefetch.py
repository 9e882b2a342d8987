"""`kvbank bench scale`, its last part: the prefetch hint at a real model's size, as in service.

At this size a restore from SSD takes seconds, so the hint (`/v1/kvbank/prefetch`, sent when
an agent's think time starts) should pay: the worker's own `Prefetcher` (worker/tiers/prefetch.py)
reads the conversation back on its background path (a `Restores` thread, as the engine runs
it), and lands it in the bank on the engine's turn after the read ends. The bank is the run's
(`--memory-budget` less the process): where it has no room for the hinted conversation beside
the others, the hint displaces one back later, or answers `no_room`.

Each round, every return timed from its arrival to its first forward evaluated (the worker's
restore, `with_room`, one prefill chunk):
- unhinted: a conversation on SSD only comes back with no hint (page cache dropped): the full
  restore; its restore's seconds are the round's read time;
- RAM hit: the same conversation back again while in RAM;
- hinted, once per think time: another conversation, on SSD only (page cache dropped), is
  hinted; its return arrives a think time later, swept around the read time (`fractions` of
  it). Meanwhile this thread plays the engine's loop: woken when the read ends, it lands it.
  A return that arrives while the read is still under way waits for it, as a request does in
  the worker (`reading_for`), and that wait is in its time. `landed_first`: the read had
  landed when the return arrived.
Between returns the turn just committed is written behind (untimed).
"""

from __future__ import annotations

import threading
import time

import numpy as np

from kvbank.apps.bench.components.scale_rig import TENANT
from kvbank.apps.bench.disk import drop_caches


def run_prefetch(rig, g: dict, held: dict, *, memory, rounds: int, turn_tokens: int,
                 every: int, first_chunk: int, fractions: tuple[float, ...], rng) -> dict:
    from kvbank.worker.tiers.prefetch import Prefetcher
    from kvbank.worker.tiers.restore_threads import Restores

    woke = threading.Event()
    reads = Restores(woke.set, g["bytes_per_token"])
    pf = Prefetcher(bank=rig.bank, restorer=rig.h.restorer, conversations=rig.h.conversations,
                    hints=rig.h.hints, eviction=rig.h.eviction,  # the worker's: its ranking reads them
                    root_for=rig.h.root_for, block_tokens=rig.block_tokens,
                    kv_bytes_per_token=g["bytes_per_token"],
                    room=lambda: rig.bank.effective_max_bytes - rig.bank.total_nbytes,
                    reads=reads)
    data = rig.layout.store_dir / "data.mdb"
    names = sorted(held)
    rows = []

    def engine_until(deadline: float | None, key) -> None:
        """The engine's loop: reads that end are landed; until `deadline` (None: until the
        read of `key` has landed)."""
        while True:
            left = None if deadline is None else deadline - time.perf_counter()
            if deadline is None and not pf.reading_for(key):
                return
            if left is not None and left <= 0:
                return
            if woke.wait(timeout=left if left is not None else 1.0):
                woke.clear()
                pf.land()

    def back(name: str, how: str, r: int, waited_s: float = 0.0) -> dict:
        pf.started(rig.key(name))  # the engine's admission ends a hint
        prompt = np.concatenate([held[name], rng.integers(1000, 40000, turn_tokens)
                                 .astype(np.uint32)])
        row = rig.come_back(name, prompt, seed=1000 + 10 * r + len(rows), every=every,
                            first_chunk=first_chunk)
        held[name] = prompt
        row.update(agent=name, kind=how, round=r, waited_for_read_s=round(waited_s, 3),
                   arrival_to_first_forward_s=round(waited_s + row["to_first_forward_s"], 3))
        rig.wait_durable(name)  # its think time: the turn written behind
        return row

    def on_ssd_only(name: str) -> None:
        rig.h.eviction.release_sessions(None, only_sessions=[rig.key(name)],
                                        reason="admin_release", write_out_before_release=True)
        rig.wait_all_durable()
        drop_caches(data)

    try:
        for r in range(rounds):
            x, y = names[r % len(names)], names[(r + 1) % len(names)]
            memory.phase("prefetch")
            on_ssd_only(x)
            rows.append(back(x, "unhinted", r))
            read_s = rows[-1]["restore_s_exact"]
            memory.phase("ram_hits")
            rows.append(back(x, "ram_hit", r))
            ram_hit_s = rows[-1]["arrival_to_first_forward_s"]
            memory.phase("prefetch")
            for f in fractions:
                on_ssd_only(y)
                think = f * read_s
                t0 = time.perf_counter()
                report = pf.hint(TENANT, y, np.zeros(0, np.uint32))  # y's think time starts
                engine_until(t0 + think, rig.key(y))
                arrived = time.perf_counter()
                landed = not pf.reading_for(rig.key(y)) and bool(
                    rig.bank.session_entries(rig.key(y)))
                engine_until(None, rig.key(y))  # a request waits for the hint's read
                row = back(y, "hinted", r, waited_s=time.perf_counter() - arrived)
                row.update(think_fraction=f, think_s=round(think, 3), read_time_s=round(read_s, 3),
                           hint_status=report.status, landed_first=landed,
                           vs_ram_hit=round(row["arrival_to_first_forward_s"] / ram_hit_s, 3))
                rows.append(row)
    finally:
        pf.stop(60)

    def times(kind: str) -> list[float]:
        return [x["arrival_to_first_forward_s"] for x in rows if x["kind"] == kind]

    hinted = [x for x in rows if x["kind"] == "hinted"]
    ram, unhinted = times("ram_hit"), times("unhinted")
    by_fraction = {}
    for f in fractions:
        these = [x for x in hinted if x["think_fraction"] == f]
        by_fraction[str(f)] = {
            "think_s": [x["think_s"] for x in these],
            "landed_first": sum(x["landed_first"] for x in these), "returns": len(these),
            "vs_ram_hit": [x["vs_ram_hit"] for x in these],
            "vs_ram_hit_median": round(float(np.median([x["vs_ram_hit"] for x in these])), 3)
            if these else None,
            "waited_for_read_s": [x["waited_for_read_s"] for x in these]}
    return {
        "rounds": rounds, "first_chunk_tokens": first_chunk, "think_fractions": list(fractions),
        "ram_hit_s": ram, "unhinted_s": unhinted,
        "unhinted_vs_ram_hit_median": (round(float(np.median(unhinted) / np.median(ram)), 2)
                                       if ram else None),
        "landed_first_fraction": round(sum(x["landed_first"] for x in hinted)
                                       / len(hinted), 3) if hinted else None,
        "hint_status": [x["hint_status"] for x in hinted],
        "by_think_fraction": by_fraction,
        "returns": rows,
    }
