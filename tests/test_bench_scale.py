"""`kvbank bench scale --quick`: the command runs and its report holds together (its goals
are the benchmark's, at real sizes: docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_scale_quick_reports_writes_restores_and_releases(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvbank.apps.cli", "bench", "scale", "--quick",
                          "--json", "--data-dir", str(tmp_path / "not" / "yet")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["write_behind_mb_s"] > 0 and r["raw_write_mb_s"] > 0 and r["write_vs_raw"] > 0
    # the CPU each side's write took (on a 2-core machine, what bounds the pipeline)
    assert all(set(b["cpu_s_per_gb"]) == {"worker", "coldstore", "raw"} for b in r["builds"])
    assert r["restore_mb_s"] > 0 and r["raw_read_mb_s"] > 0 and r["restore_vs_raw"] > 0
    # every agent came back once, restored from SSD, the others released first
    assert len(r["restores"]) == r["conversations"] * r["turns"] == r["turns_done"]
    assert all(x["bytes"] >= r["conversation_bytes"] for x in r["restores"])
    # a release writes out at most what the last turn added; nothing unwritten is dropped
    assert r["release_unwritten_bytes_max"] <= r["turn_bytes"]
    assert r["unwritten_dropped"] == 0
    assert r["peak_rss_bytes"] >= r["rss_before_bytes"] > 0
    # each write's memory beyond its KV is reported (bounded at real sizes: test_scale.py)
    assert r["write_extra_bytes_max"] == max(b["write_extra_bytes"] for b in r["builds"])
    # the tiny geometry is hybrid, as Qwen3.6-27B: each build and each turn carries its
    # recurrent checkpoints, and each restore from SSD reads the one at its end
    assert r["checkpoint_bytes"] > 0 and "state:2" in r["cache_layout"]
    assert all(b["checkpoints"] >= 2 and b["checkpoint_bytes"] >= 2 * r["checkpoint_bytes"]
               for b in r["builds"])
    assert all(x["checkpoint_bytes"] == r["checkpoint_bytes"] for x in r["restores"])
    assert all(t["source"] == "ssd" and t["checkpoints"] >= 1 for t in r["turn_rows"])
    # prefetch: the hint read the conversation back, and its return found it in RAM
    p = r["prefetch"]
    kinds = {x["kind"]: x["source"] for x in p["returns"]}
    assert kinds == {"unhinted": "ssd", "ram_hit": "ram", "hinted": "ram"}
    assert p["hint_status"] == ["restored"] and len(p["hinted_vs_ram_hit"]) == 1
    assert all(x["cached_tokens"] == x["tokens"] - 256 for x in p["returns"])  # all of it
    est = r["restore_vs_recompute_estimate"]
    assert est["estimate"] is True and est["recompute_s"] > 0 and est["restore_s"] > 0
    assert list((tmp_path / "not" / "yet").iterdir()) == []  # the store it made is gone


def test_bench_scale_picks_the_longest_conversations_this_machine_takes(tmp_path):
    """Without --tokens the bench sizes its conversations to this machine (issue #35): the
    most it will hold (two at their largest and a return's copy, with prefetch) fits the
    memory available, a dense model's 4x larger KV a token gets no longer conversations than
    the hybrid's, and a size below the scenario's 32K tokens says so."""
    from kvbank.apps.bench.components import scale
    from kvbank.apps.bench.components.scale_kv import GEOMETRIES

    args = dict(conversations=3, turns=2, turn_tokens=1536, prefetch=True, data_dir=tmp_path)
    picked = {name: scale.pick_tokens(GEOMETRIES[name], **args)
              for name in ("qwen3.6-27b", "qwen3-32b")}
    for name, (tokens, bound) in picked.items():
        assert tokens in scale.SIZES
        bank = scale.HELD_WITH_PREFETCH * scale.conversation_bytes(GEOMETRIES[name], tokens,
                                                                   2, 1536)
        if tokens > min(scale.SIZES):  # the smallest is taken when nothing fits
            assert bank < bound["mem_available_bytes"]
        assert ("note" in bound) == (tokens < 32768)
    assert picked["qwen3-32b"][0] <= picked["qwen3.6-27b"][0]
