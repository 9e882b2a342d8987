"""The benchmark records docs/benchmarks.md reports (docs/benchmarks/*.json; earlier ones are in
docs/benchmarks/superseded/): each says what ran, on which code and machine, how busy the
machine was, and that each comparison in it was fair. A record of an unfair comparison (sides
under other memory limits or settings, reads of other blocks, a page cache not dropped) fails
here, before anyone quotes it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit  # make test-fast

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "benchmarks"
REMEASURED = ("compare-", "scale-", "turn-", "kvbits")  # the benches issue #46 made fair
CITING = ("docs/benchmarks.md", "README.md")


def _records() -> list[Path]:
    return sorted(p for p in RECORDS.glob("*.json") if p.name.startswith(REMEASURED))


def test_the_docs_quote_a_remeasured_bench_only_from_a_record_checked_here():
    """Every record of these benches that docs/benchmarks.md or the README links is either
    one this file checks (docs/benchmarks/, present), or marked superseded (measured before
    these rules) or withheld (a run whose ratios the bench now withholds, kept as evidence of
    what failed) by its folder, so a figure from an unfair run cannot be quoted as current."""
    for doc in CITING:
        text = (ROOT / doc).read_text()
        for path in re.findall(r"benchmarks/((?:[\w.-]+/)*[\w.-]+\.json)", text):
            name = path.rsplit("/", 1)[-1]
            if not name.startswith(REMEASURED) or path.startswith(("superseded/", "withheld/")):
                continue
            assert "/" not in path and (RECORDS / path).exists(), (
                f"{doc} quotes {path}: neither a record checked here nor superseded")


@pytest.mark.parametrize("path", _records(), ids=lambda p: p.name)
def test_a_record_says_what_ran_where_and_how_busy_the_machine_was(path):
    doc = json.loads(path.read_text())
    p = doc["provenance"]
    assert p["argv"][:2] == ["kvbank", "bench"] and len(p["commit"]["sha"]) == 40
    assert p["commit"]["dirty"] is False, "measured on code that is not the commit's"
    assert p["date"] and p["machine"]["cpus"] and p["versions"]["mlx-lm"]
    assert len(p["load_at_start"]) == len(p["load_at_end"]) == 3
    assert p["quiet"] == (max(p["load_at_start"][0], p["load_at_end"][0]) < p["quiet_load"])


@pytest.mark.parametrize("path", [p for p in _records() if p.name.startswith("compare-")],
                         ids=lambda p: p.name)
def test_a_compare_record_held_both_servers_to_one_limit_and_one_set_of_settings(path):
    doc = json.loads(path.read_text())
    assert doc["fairness"]["ok"], doc["fairness"]["problems"]
    # every side served every turn: a side that refused some did less work (its ratios would
    # compare unlike runs)
    assert doc["complete"] and not doc["fairness"].get("incomplete"), doc["fairness"]
    sides = doc["sides"]
    limited = [s for s in sides.values() if s["limit_bytes"][0] is not None]
    # every limited side at the one limit; a record of the unlimited sides alone (what bounds
    # the ratio) holds none to any
    assert {tuple(s["limit_bytes"]) for s in limited} == (
        {(doc["memory_limit_bytes"],) * doc["rounds"]} if limited else set())
    assert limited or set(sides) == {"kvbank_unbounded", "mlx_lm_unlimited"}, set(sides)
    assert len({json.dumps(s["settings"], sort_keys=True) for s in sides.values()}) == 1
    for s in limited:  # the kernel held each to it; what it used is on record
        assert all(m["peak_bytes"] <= m["limit_bytes"] for m in s["memory_by_round"])
        assert s["argv"] and isinstance(s["killed"], bool)
    if "kvbank" in sides:
        assert "--memory-budget" in sides["kvbank"]["argv"]
    if "mlx_lm" in sides:  # a record of kvbank against itself unbounded has no mlx-lm side
        assert "--prompt-cache-bytes" in sides["mlx_lm"]["argv"]


@pytest.mark.parametrize("path", [p for p in _records() if p.name.startswith("scale-")],
                         ids=lambda p: p.name)
def test_a_scale_record_read_and_wrote_the_same_bytes_as_its_yardsticks(path):
    doc = json.loads(path.read_text())
    f = doc["fairness"]
    assert f["ok"] and f["same_blocks"] and f["same_bytes_written"] and f["page_cache_dropped"]
    assert len(doc["write_pairs_rows"]) >= 5  # ABBA pairs
    assert all(x["bytes_read"] == x["raw_bytes"] for x in doc["restores"])


@pytest.mark.parametrize("path", [p for p in _records() if p.name.startswith("turn-")],
                         ids=lambda p: p.name)
def test_a_turn_record_dropped_the_page_cache_for_its_cold_turns(path):
    doc = json.loads(path.read_text())
    assert "drop_caches" in doc["page_cache"]
    assert doc["cache_source_cold_ssd"] == "ssd"
    assert all(io["read_bytes"] > 0 for io in doc["cold_turn_worker_io"])


@pytest.mark.parametrize("path", [p for p in _records() if p.name.startswith("kvbits")],
                         ids=lambda p: p.name)
def test_a_kvbits_record_scored_many_conversations_past_their_first_turn(path):
    a = json.loads(path.read_text())["agreement"]
    assert a["conversations"] >= 8 and a["scored_turns"] == a["conversations"] * (a["turns"] - 1)
    assert set(a["scope"]) == {"kvbank", "mlx_lm"}
    assert all(len(s["kl_per_token_ci95"]) == 2 for s in a["sides"].values())
