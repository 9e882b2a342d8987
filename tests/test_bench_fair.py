"""The benches' fairness: a comparison's sides under the same cgroup limit and settings, the
limit enforced by the kernel, the ratios and goals as named, and every result carrying its
provenance. No stack: `bench compare`'s arithmetic on made-up sides, and one real cgroup."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvbank.apps.loadgen.run import Row, RunResult
from kvbank.apps.loadgen.scenarios import params

pytestmark = pytest.mark.unit  # make test-fast

SETTINGS = {"prefill_chunk_tokens": 512, "concurrency": 8, "temperature": 0.0,
            "max_tokens": 32}


def test_bench_compare_rounds_alternate_the_order_and_take_the_median_ratio():
    """`bench compare --rounds`: no side always runs first, one slow minute on one side moves
    the reported ratio no more than the middle round does, and the spread says how far the
    rounds stood apart. The ideal is kvbank unbounded: the same engine, nothing evicted."""
    from kvbank.apps.bench.compare import goals, median_ratios, round_ratios, side_order, spread

    sides = ("kvbank", "mlx_lm", "kvbank_unbounded", "mlx_lm_unlimited")
    assert side_order(sides, 0) == list(sides)
    assert side_order(sides, 1) == list(sides)[::-1]

    def side(wall, recomputed=0, prompt=1000):
        return {"wall_s": wall, "ttft_p50_s": wall / 10, "recomputed_tokens": recomputed,
                "prompt_tokens": prompt}

    rounds = [round_ratios({"kvbank": side(kv), "mlx_lm": side(240.0, 300),
                            "kvbank_unbounded": side(100.0), "mlx_lm_unlimited": side(110.0)})
              for kv in (104.0, 140.0, 98.0)]
    assert [r["vs_ideal"] for r in rounds] == [1.04, 1.4, 0.98]
    m = median_ratios(rounds)
    assert m["vs_ideal"] == 1.04 and m["mlx_lm_vs_unlimited"] == round(240 / 110, 3)
    assert m["wall_speedup"] == round(240 / 104, 3) and m["recomputed_fraction"] == 0.0
    assert m["mlx_lm_recomputed_fraction"] == 0.3
    assert spread(rounds)["vs_ideal"] == [0.98, 1.4]
    g = goals(m)
    assert g["vs_ideal"]["met"] and g["wall_speedup"]["met"] and g["recomputed_fraction"]["met"]
    assert goals({**m, "vs_ideal": 1.2})["vs_ideal"]["met"] is False
    # a side not run: its ratios are null, not an error, and its goal unmeasured
    only = median_ratios([round_ratios({"kvbank": side(100.0)})])
    assert only["vs_ideal"] is None and goals(only)["vs_ideal"]["met"] is None


def test_bench_compare_names_a_pair_that_ran_under_other_limits_or_settings():
    """Every ratio compares a pair under the same cgroup limit (the unbounded pair: none) and
    the same settings, in every round; a pair that was not is named, and the run fails."""
    from kvbank.apps.bench.compare import fairness

    fair = {"kvbank": {"limit_bytes": [10**9, 10**9], "settings": SETTINGS},
            "mlx_lm": {"limit_bytes": [10**9, 10**9], "settings": SETTINGS},
            "kvbank_unbounded": {"limit_bytes": [None, None], "settings": SETTINGS},
            "mlx_lm_unlimited": {"limit_bytes": [None, None], "settings": SETTINGS}}
    assert fairness(fair) == {"ok": True, "problems": [], "same_limit": True,
                              "same_settings": True}
    other_limit = {**fair, "mlx_lm": {**fair["mlx_lm"], "limit_bytes": [10**9, 2 * 10**9]}}
    f = fairness(other_limit)
    assert not f["ok"] and not f["same_limit"] and f["same_settings"]
    assert any(p.startswith("wall_speedup") for p in f["problems"])
    other_chunk = {**fair, "mlx_lm": {**fair["mlx_lm"],
                                      "settings": {**SETTINGS, "prefill_chunk_tokens": 2048}}}
    f = fairness(other_chunk)
    assert not f["ok"] and f["same_limit"] and not f["same_settings"]
    unlimited = {**fair, "kvbank": {**fair["kvbank"], "limit_bytes": [None, None]}}
    assert not fairness(unlimited)["ok"]


def test_mlx_lms_prompt_cache_is_the_rules_unless_given_and_the_json_says_which():
    """mlx-lm's server bounds only its prompt cache: on a wide-KV model it was killed at the
    rule's size, so `--mlx-lm-prompt-cache-bytes` gives a smaller one. The JSON keeps both,
    and says it was given; kvbank's budget is the rule's either way."""
    from kvbank.apps.bench.compare_servers import (Settings, Side, memory_flags,
                                                   mlx_lm_argv_flags)
    from kvbank.contracts.pricing import WRITE_KEEP_MARGIN_BYTES

    idle = {"kvbank": {"tree_anon_bytes": 1200 * 10**6, "worker_bytes": 950 * 10**6,
                       "others_bytes": 250 * 10**6, "transient_base_bytes": 45 * 10**6,
                       "transient_per_context_token": 30_000},
            "mlx_lm": {"tree_anon_bytes": 980 * 10**6}}
    limit, settings = 2_800 * 10**6, Settings()
    transient = 45 * 10**6 + 30_000 * 4 * settings.prefill_chunk_tokens
    by_rule = memory_flags(limit, idle, settings)
    assert by_rule["mlx_lm"]["prompt_cache_bytes"] == limit - 980 * 10**6 - transient
    assert not by_rule["mlx_lm"]["given"]
    given = memory_flags(limit, idle, settings, mlx_lm_cache_bytes=700 * 10**6)
    assert given["mlx_lm"]["given"] and given["mlx_lm"]["prompt_cache_bytes"] == 700 * 10**6
    assert given["mlx_lm"]["by_rule_bytes"] == by_rule["mlx_lm"]["prompt_cache_bytes"]
    assert "given by --mlx-lm-prompt-cache-bytes" in given["mlx_lm"]["rule"]
    assert given["kvbank"] == by_rule["kvbank"]
    assert given["kvbank"]["memory_budget_bytes"] == limit - 250 * 10**6 \
        - WRITE_KEEP_MARGIN_BYTES
    argv = mlx_lm_argv_flags(Side("mlx_lm", "", "mlx_lm", True), settings, given)
    assert argv[argv.index("--prompt-cache-bytes") + 1] == str(700 * 10**6)


def test_bench_compare_reports_no_ratio_of_a_pair_that_ran_unfairly():
    """A ratio whose pair ran under other limits is withheld (null, its key named), the
    others stand; other settings withhold every ratio. `vs_ideal` below 1 is a finding, not a
    result: noise where the rounds straddle 1, a measurement to look into where none reached
    it."""
    from kvbank.apps.bench.compare import fairness, findings, withhold

    ratios = {"wall_speedup": 2.4, "vs_ideal": 1.05, "mlx_lm_vs_unlimited": 2.2,
              "unbounded_kvbank_vs_mlx_lm": 0.9, "recomputed_fraction": 0.0,
              "mlx_lm_recomputed_fraction": 0.3, "ttft_p50_speedup": 3.0}
    same = {"limit_bytes": [10**9], "settings": SETTINGS}
    none = {"limit_bytes": [None], "settings": SETTINGS}
    fair = {"kvbank": same, "mlx_lm": same, "kvbank_unbounded": none, "mlx_lm_unlimited": none}
    assert withhold(ratios, fairness(fair)) == (ratios, [])
    other = fairness({**fair, "mlx_lm": {**same, "limit_bytes": [2 * 10**9]}})
    got, keys = withhold(ratios, other)
    assert got["wall_speedup"] is None and got["mlx_lm_recomputed_fraction"] is None
    assert got["vs_ideal"] == 1.05 and got["recomputed_fraction"] == 0.0
    assert "wall_speedup" in keys and "vs_ideal" not in keys
    chunk = fairness({**fair, "mlx_lm": {**same, "settings": {**SETTINGS,
                                                              "prefill_chunk_tokens": 2048}}})
    got, _ = withhold(ratios, chunk)
    assert got["wall_speedup"] is got["vs_ideal"] is got["mlx_lm_vs_unlimited"] is None
    assert findings({"vs_ideal": 1.02}, {"vs_ideal": [0.99, 1.1]}) == []
    # a side that refused turns did less work: it is faster, and no ratio of it is reported
    from kvbank.apps.bench.compare import round_ratios, served_all

    def summary(wall, ok):
        return {"wall_s": wall, "ttft_p50_s": 1.0, "recomputed_tokens": 0,
                "prompt_tokens": 1000, "turns_ok": ok}

    got = round_ratios(served_all({"kvbank": summary(150.0, 13), "mlx_lm": summary(650.0, 24),
                                   "kvbank_unbounded": summary(370.0, 24)}, 24))
    assert got["wall_speedup"] is got["vs_ideal"] is got["recomputed_fraction"] is None
    assert "noise" in findings({"vs_ideal": 0.98}, {"vs_ideal": [0.97, 1.01]})[0]
    assert "look into" in findings({"vs_ideal": 0.93}, {"vs_ideal": [0.9, 0.95]})[0]


def test_bench_compare_prefetch_summary_counts_returning_turns_only():
    """`bench compare --prefetch`: SSD turns counted among returning turns (an agent's first
    turn has no hint and no history), and hinted turns' TTFT p50 over the p50 of the RAM hits
    of the run without hints (not of the hinted run's own, a subset of the same turns)."""
    from kvbank.apps.bench.compare import prefetch_summary

    def run(rows):
        return RunResult("openai://x", params("n-agents"), "r", rows, 9.0, "turns", "usage")

    def row(turn, source, ttft, hint=None, status="ok"):
        return Row("a", "s-a", turn, status, 0.0, ttft + 1, ttft_s=ttft, cache_source=source,
                   hint=hint)

    without = run([row(1, "none", 5.0), row(2, "ssd", 3.0), row(3, "ssd", 4.0),
                   row(4, "ram", 2.0)])
    hinted = run([row(1, "none", 5.0), row(2, "ram", 2.0, "in_ram"),
                  row(3, "ram", 2.2, "in_ram"), row(4, "ssd", 3.0, "no_room"),
                  row(5, "ram", 9.0, "in_ram", status="error")])
    s = prefetch_summary(without, hinted)
    assert (s["returning_turns"], s["ssd_turns_without_hints"], s["ssd_turns_with_hints"]) \
        == (3, 2, 1)
    assert s["hints"] == {"in_ram": 2, "no_room": 1}
    assert (s["hinted_ttft_p50_s"], s["ram_hit_ttft_p50_s"]) == (2.2, 2.0)
    assert s["hinted_vs_ram_hits"] == round(2.2 / 2.0, 3)
    assert s["without_hints_ttft_p50_by_source_s"] == {"ram": 2.0, "ssd": 3.5}


def test_a_sides_cgroup_holds_its_whole_tree_to_the_limit_and_says_so():
    """The limit is the kernel's: a process tree that outgrows it is OOM-killed and the side
    says so; under a larger one the same tree runs and its peak is what it held."""
    from kvbank.apps.bench.cgroup import CgroupUnavailable, MemoryCgroup

    grow = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
            "'b = bytearray(96 << 20); b[::4096] = bytes(len(b) // 4096)'], check=True)")
    seen = {}
    for name, limit in (("tight", 64 << 20), ("roomy", 512 << 20)):
        try:
            group = MemoryCgroup.create(f"kvbank-test-{name}", limit)
        except CgroupUnavailable as e:
            pytest.skip(f"no memory cgroup here: {e}")
        try:
            rc = subprocess.run([sys.executable, "-c", grow], preexec_fn=group.preexec,
                                capture_output=True).returncode
            seen[name] = (rc, group.usage())
        finally:
            group.remove()
    rc, tight = seen["tight"]
    assert rc != 0 and tight["killed"] and tight["throttled"]  # the grandchild, killed
    assert tight["peak_bytes"] <= tight["limit_bytes"] == 64 << 20
    rc, roomy = seen["roomy"]
    assert rc == 0 and not roomy["killed"] and roomy["peak_bytes"] >= 96 << 20


def test_every_result_carries_its_provenance(capsys):
    """argv, versions, the commit, the date, the machine, and the load at its start and end
    (the machine is shared: `quiet` says whether the run had it to itself)."""
    import json

    from kvbank.apps.bench import provenance
    from kvbank.apps.bench.report import print_result

    provenance.begin(["kvbank", "bench", "x"])
    print_result("x", {"figure": 1.0}, True)
    got = json.loads(capsys.readouterr().out)["provenance"]
    assert got["argv"] == ["kvbank", "bench", "x"]
    assert set(got) >= {"date", "commit", "versions", "machine", "load_at_start", "load_at_end",
                        "quiet"}
    assert len(got["commit"]["sha"]) == 40 and got["versions"]["mlx-lm"]
    assert got["quiet"] == (max(got["load_at_start"][0], got["load_at_end"][0])
                            < provenance.QUIET_LOAD)


def test_a_runs_commit_is_dirty_when_any_code_in_the_checkout_differs(tmp_path):
    """A change anywhere in the checkout's code (not only the bench's own folder) makes the
    run another code's; a doc written during the run does not."""
    from kvbank.apps.bench.provenance import commit

    def git(*a):
        subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *a], cwd=tmp_path,
                       check=True, capture_output=True)

    (tmp_path / "apps" / "bench").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    for f in ("apps/bench/b.py", "worker.py", "docs/d.md", "README.md"):
        (tmp_path / f).write_text("x\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "c")
    here = tmp_path / "apps" / "bench"
    assert commit(here)["dirty"] is False and len(commit(here)["sha"]) == 40
    (tmp_path / "docs" / "d.md").write_text("y\n")
    (tmp_path / "README.md").write_text("y\n")
    assert commit(here)["dirty"] is False
    (tmp_path / "worker.py").write_text("y\n")
    assert commit(here)["dirty"] is True


def test_a_kvbank_round_says_what_left_ram_and_what_a_trim_dropped(tmp_path):
    """The kvbank side's record reads the worker's own event log: evictions by reason and
    where they went, the guard's trims by level and source, and the unwritten entries they
    dropped (what a round that recomputed needs to explain itself)."""
    from dataclasses import asdict

    from kvbank import events
    from kvbank.apps.bench.compare_servers import left_ram
    from kvbank.contracts.receipts import PressureReceipt
    from kvbank.contracts.vocabulary import PressureLevel, PressureSource, TrimReason

    path = tmp_path / "log" / "events.jsonl"
    events.open_log(path)
    try:
        events.emit("kv_evicted", tenant="", session_id="~a", reason=TrimReason.ADMISSION_LRU,
                    tokens=900, bytes=1, durable_tokens=900, now="cold", write_out="written")
        events.emit("kv_evicted", tenant="", session_id="~b",
                    reason=TrimReason.PRESSURE_CRITICAL, tokens=800, bytes=1,
                    durable_tokens=310, now="gone", write_out=None)
        events.emit(**asdict(PressureReceipt(level=PressureLevel.CRITICAL,
                                             source=PressureSource.PSI,
                                             bank_unwritten_dropped=1)))
        events.emit("kv_restored", tenant="", session_id="~a", source="ssd")
    finally:
        for h in events._log.handlers:
            h.close()
        events._log.handlers[:] = []
    assert left_ram(path) == {
        "evicted": {"admission_lru: cold": 1, "pressure_critical: gone": 1},
        "pressure_trims": {"critical: psi": 1}, "unwritten_dropped_by_trims": 1}
    assert left_ram(tmp_path / "none.jsonl")["evicted"] == {}
