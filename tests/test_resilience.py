"""The short subset of `make resilience`: real SIGKILLs of each process under load."""

from __future__ import annotations

from kvbank.deploy.local import LocalStack
from kvbank.apps.resilience import Run
from tests.conftest import start_stack


def test_kills_under_load_lose_no_acknowledged_turn(tiny_model, tmp_path, cache_dir):
    stack: LocalStack = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir,
                                    shim=False, extra=["--tail-delay-s", "1", "--max-dirty-s", "2"])
    try:
        run = Run(stack, agents=2, turns=8, kills=3, seed=1, check_every=2)
        run.rng.choice = lambda names: {0: "coldstore", 1: "router"}.get(  # one of each
            sum(run.report.kills.values()), "worker")
        report = run.run().summary()
    finally:
        stack.stop()
    assert report["agent_errors"] == [], report
    assert sum(report["kills"].values()) == 3, report
    assert report["turns_acknowledged"] >= 16, report
    assert report["turns_lost"] == 0, report
    assert report["wrong_restores"] == 0 and report["restores_checked"] > 0, report
    assert report["kills"] == {"worker": 1, "coldstore": 1, "router": 1}, report
    assert report["ssd_restores_missed"] == 0 and report["ssd_restores_expected"] > 0, \
        report["findings"]
    assert report["store_bad_blocks"] == 0 and report["store_blocks_checked"] > 0, report
