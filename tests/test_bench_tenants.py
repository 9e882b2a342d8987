"""`kvbank bench tenants` on the tiny model: a full-queue flood from one API key and a probe
from another, through a real stack. The times are the bench's to report; here, that it runs,
the flood is refused past its own share, and the probe is still answered."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_bench_tenants_runs_a_flood_and_answers_the_other_key(tiny_model, tmp_path, cache_dir):
    out = tmp_path / "tenants.json"
    run = subprocess.run(
        [sys.executable, "-m", "kvbank.apps.cli", "bench", "tenants", "--model", str(tiny_model),
         "--scenarios", "full_queue", "--rounds", "1", "--probes", "1", "--probe-tokens", "4",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**__import__("os").environ, "KVBANK_CACHE_DIR": str(cache_dir)})
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    doc = json.loads(out.read_text())
    # and a row per scenario for the person who ran it
    rows = [line.split()[1] for line in run.stdout.splitlines() if line.startswith("│")]
    assert rows == ["idle", "full_queue"] and "longest gap" in run.stdout, run.stdout[-3000:]
    assert doc["errors"] == [], doc["errors"]
    assert doc["rounds"] == 1 and doc["provenance"]["commit"]["sha"], doc
    flood, idle = doc["full_queue"], doc["idle"]
    assert flood["probes"] == 1 and idle["probes"] >= 1, doc
    assert flood["ttft_p50_s"] > 0 and isinstance(flood["ttft_met"], bool), flood
    # the token the longest gap came before (None: an answer of one token has no gap)
    assert flood["gap_max_before_token"] in (None, 2, 3, 4), flood
    # past its share of the queue the flooding key is refused, while the probe was answered
    assert flood["flood_answers"].get("429", 0) > 0, flood
