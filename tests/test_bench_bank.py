"""`kvbank bench bank` on a small bank: the JSON is whole and known sessions are found."""

from __future__ import annotations

import json

import pytest

from kvbank.apps.bench.components.bank import run

pytestmark = pytest.mark.unit  # make test-fast


def test_bench_bank_small():
    out = run(entries=200, prompt_tokens=1024, block_tokens=64, group_size=20, lookups=300,
              warmup=20)
    json.dumps(out)  # the CLI prints it
    for key in ("entries", "prompt_tokens", "block_tokens", "lookups", "hit_rate",
                "insert_s", "lookup_p50_ms", "lookup_p99_ms", "goal_p99_ms"):
        assert key in out, key
    assert out["entries"] == 200 and out["evicted"] == 0
    assert out["lookups"] == 300
    assert out["hit_rate"] > 0 and out["hit_rate_known"] == 1.0
    assert out["as_expected_rate"] == 1.0  # every lookup found what the bench knows is there
    assert 0 < out["lookup_p50_ms"] <= out["lookup_p99_ms"]
    assert out["insert_s"] > 0 and out["goal_p99_ms"] == 2.0
