"""`kvbank bench scale`, its last part: the prefetch hint at a real model's size.

At this size a restore from SSD takes seconds, so the hint (`/v1/kvbank/prefetch`, sent when
an agent's think time starts) should pay: the worker's own `Prefetcher` (worker/tiers/prefetch.py)
reads the conversation back while the agent thinks, and its return finds it in RAM. The bank
holds two conversations here (twice one at its largest: its KV after every turn and
MAX_CHECKPOINTS checkpoints; three never fit), so that a hinted one has room to land: the
prefetcher displaces an idle one, on SSD already, as it does in the worker.

Each round, three returns, each timed from its arrival to its first forward evaluated (the
worker's restore, `with_room`, one prefill chunk):
- unhinted: a conversation on SSD only comes back with no hint (page cache dropped): the full
  restore;
- RAM hit: the same conversation back again while in RAM;
- hinted: another conversation, on SSD only, hinted when its think time starts (page cache
  dropped first); its return comes after the hint's read.
Between returns the turn just committed is written behind (the think time).
"""

from __future__ import annotations

import time

import numpy as np

from kvbank.apps.bench.components.scale_rig import TENANT, drop_caches


def run_prefetch(rig, g: dict, held: dict, *, rounds: int, turn_tokens: int, every: int,
                 first_chunk: int, bank_bytes: int, rng) -> dict:
    from kvbank.worker.tiers.prefetch import Prefetcher

    rig.bank.max_bytes = bank_bytes  # this part's own bank: two conversations
    pf = Prefetcher(bank=rig.bank, restorer=rig.h.restorer, conversations=rig.h.conversations,
                    hints=rig.h.hints, eviction=rig.h.eviction,  # the worker's: its ranking reads them
                    root_for=rig.h.root_for, block_tokens=rig.block_tokens,
                    kv_bytes_per_token=g["bytes_per_token"],
                    room=lambda: rig.bank.effective_max_bytes - rig.bank.total_nbytes)
    data = rig.layout.store_dir / "data.mdb"
    names = sorted(held)
    rows = []

    def back(name: str, how: str, r: int) -> dict:
        pf.started(rig.key(name))  # the engine's admission ends a hint
        prompt = np.concatenate([held[name], rng.integers(1000, 40000, turn_tokens)
                                 .astype(np.uint32)])
        row = rig.come_back(name, prompt, seed=1000 + 10 * r + len(rows), every=every,
                            first_chunk=first_chunk)
        held[name] = prompt
        row.update(agent=name, kind=how, round=r)
        rig.wait_durable(name)  # its think time: the turn written behind
        return row

    def on_ssd_only(name: str) -> None:
        rig.h.eviction.release_sessions(None, only_sessions=[rig.key(name)],
                                        reason="admin_release", write_out_before_release=True)
        drop_caches(data)

    for r in range(rounds):
        x, y = names[r % len(names)], names[(r + 1) % len(names)]
        on_ssd_only(x)
        rows.append(back(x, "unhinted", r))
        rows.append(back(x, "ram_hit", r))
        on_ssd_only(y)
        t0 = time.perf_counter()
        report = pf.hint(TENANT, y, np.zeros(0, np.uint32))  # y's think time starts
        hint_s = time.perf_counter() - t0
        in_bank = sorted(s for _, s in rig.bank.sessions())  # y, and whom it displaced not
        row = back(y, "hinted", r)
        row.update(hint_status=report.status, hint_restored_tokens=report.restored_tokens,
                   hint_s=round(hint_s, 3), in_bank_after_hint=in_bank)
        rows.append(row)

    def times(kind: str) -> list[float]:
        return [x["to_first_forward_s"] for x in rows if x["kind"] == kind]

    ram, hinted, unhinted = times("ram_hit"), times("hinted"), times("unhinted")
    ratios = [round(h / m, 3) for h, m in zip(hinted, ram)]
    return {
        "bank_bytes": bank_bytes, "rounds": rounds, "first_chunk_tokens": first_chunk,
        "ram_hit_s": ram, "hinted_s": hinted, "unhinted_s": unhinted,
        "hint_s": [x["hint_s"] for x in rows if x["kind"] == "hinted"],
        "hint_status": [x["hint_status"] for x in rows if x["kind"] == "hinted"],
        "hinted_vs_ram_hit": ratios,
        "hinted_vs_ram_hit_median": round(float(np.median(ratios)), 3) if ratios else None,
        "goal_hinted_vs_ram_hit": 1.1,
        "unhinted_vs_ram_hit_median": (round(float(np.median(unhinted) / np.median(ram)), 2)
                                       if ram else None),
        "returns": rows,
    }
