"""`kvbank bench cluster` on the tiny model: two stacks, three anonymous agents, both policies.
Checks the document's shape and its bookkeeping, not the timing goals (a CPU and a tiny
model say nothing about those)."""

from __future__ import annotations

import pytest

from kvbank.apps.bench import cluster as bench
from kvbank.deploy import cluster

AGENTS, TURNS, STACKS = 3, 3, 2
PER_POLICY = ("wall_s", "ttft_p50_s", "ttft_p95_s", "recomputed_fraction", "affinity",
              "requests_per_stack", "max_min_requests", "errors")


@pytest.fixture(scope="module")
def doc(tiny_model, cache_dir):
    cluster.find_router_bin()  # the test extra installs it; missing, this fails and says so
    return bench.run(model=tiny_model, stacks=STACKS, agents=AGENTS, turns=TURNS,
                     turn_tokens=40, system_tokens=100, max_tokens=4, think_s=0.1,
                     policies=("kv_aware", "round_robin"), max_wall_s=120,
                     extra=["--block-tokens", "16", "--quiet-grace-s", "0.1",
                            "--tail-delay-s", "0"],
                     env={"KVBANK_CACHE_DIR": str(cache_dir)}, start_timeout_s=240)


def test_every_key_with_sane_values(doc):
    for key in ("ttft_p50_speedup_vs_round_robin", "goals", "stacks", "agents", "turns",
                "turn_tokens", "system_tokens", "think_s", "seed", "policies", "model"):
        assert key in doc, key
    assert doc["stacks"] == STACKS and doc["policies"] == ["kv_aware", "round_robin"]
    assert set(doc["goals"]) == {"affinity", "recomputed_fraction",
                                 "ttft_p50_speedup_vs_round_robin", "max_min_requests"}
    assert all(isinstance(v, bool) for v in doc["goals"].values()), doc["goals"]
    assert doc["ttft_p50_speedup_vs_round_robin"] > 0
    for policy in ("kv_aware", "round_robin"):
        r = doc[policy]
        for key in PER_POLICY:
            assert key in r, (policy, key)
        assert r["errors"] == 0, r["error_reasons"]
        assert r["unattributed_turns"] == 0, r
        assert r["wall_s"] > 0 and 0 < r["ttft_p50_s"] <= r["ttft_p95_s"]
        assert 0 <= r["affinity"] <= 1
        assert 0 <= r["recomputed_fraction"] <= 1
        assert r["returning_turns"] == AGENTS * (TURNS - 1)
        assert len(r["requests_per_stack"]) == STACKS
        assert sum(r["requests_per_stack"]) == AGENTS * TURNS, r["requests_per_stack"]
        assert r["dead"] == []
    rr = doc["round_robin"]
    assert min(rr["requests_per_stack"]) > 0, rr["requests_per_stack"]
    assert rr["max_min_requests"] >= 1
