"""`kvbank bench turn` on the tiny model: every key, sane values (no timing goals here: those
are the benchmark's, on the real model)."""

from __future__ import annotations

from kvbank.apps.bench.turn import run


def _rounding(ratios: list[float], floors: list[float]) -> float:
    """How far a ratio of the JSON's rounded seconds (4 decimals) may stand from the one the
    bench computed from unrounded ones, itself rounded to 2: a 4 ms floor moves it 1 %."""
    return 0.005 + 1e-4 / min(floors) * ratios[-1]


def test_bench_turn_reports_the_floor_and_the_ratios_to_it(tiny_model, monkeypatch, cache_dir):
    monkeypatch.setenv("KVBANK_CACHE_DIR", str(cache_dir))
    out = run(model=str(tiny_model), tokens=300, block_tokens=16, repeats=2)
    assert out["cache_source_ssd"] == "ssd"
    assert out["cached_tokens_ram"] >= 300 and out["cached_tokens_ssd"] >= 300
    assert out["ttft_floor_s"] > 0
    # Each returning turn is compared with the floor timed just after it.
    assert out["repeats"] == 2 and len(out["ttft_ram_all_s"]) == len(out["ttft_ssd_all_s"]) == 2
    floors = out["ttft_floor_all_s"]
    assert len(floors) == 4 and min(floors) <= out["ttft_floor_s"] <= max(floors)
    for key, turns, paired in (("ram_vs_floor", out["ttft_ram_all_s"], floors[:2]),
                               ("ssd_vs_floor", out["ttft_ssd_all_s"], floors[2:])):
        ratios = sorted(t / f for t, f in zip(turns, paired))
        slack = _rounding(ratios, paired)
        assert ratios[0] - slack <= out[key] <= ratios[-1] + slack
    warm = out["ttft_floor_warm_all_s"]  # the same floors timed again at once, RAM's first
    assert len(warm) == 4 and min(warm) <= out["ttft_floor_warm_s"] <= max(warm)
    for key, turns, paired in (("ram_vs_warm_floor", out["ttft_ram_all_s"], warm[::2]),
                               ("ssd_vs_warm_floor", out["ttft_ssd_all_s"], warm[1::2])):
        ratios = sorted(t / f for t, f in zip(turns, paired))
        slack = _rounding(ratios, paired)
        assert ratios[0] - slack <= out[key] <= ratios[-1] + slack
    assert min(out["ttft_ram_all_s"]) <= out["ttft_ram_s"] <= max(out["ttft_ram_all_s"])
    # Each turn's TTFT split by where it went: the worker's stages and what lies outside.
    for turns, stages in ((out["ttft_ram_all_s"], out["stages_ram_all_s"]),
                          (out["ttft_ssd_all_s"], out["stages_ssd_all_s"])):
        assert len(stages) == 2
        for ttft, split in zip(turns, stages):
            assert set(split) == {"waiting", "restore", "first_token", "outside"}
            assert all(v >= -0.001 for v in split.values())
            assert 0 < split["first_token"] <= ttft
            assert abs(sum(split.values()) - ttft) < 0.002
    assert out["ram_forward_vs_floor"] > 0
    # Cold: restored from SSD with the page cache dropped, against the floor plus a cold raw
    # read of the same blocks (alternating which goes first), both of which read the disk.
    assert out["cache_source_cold_ssd"] == "ssd" and out["cached_tokens_cold_ssd"] >= 300
    floors, computes = out["ttft_floor_cold_all_s"], out["ttft_floor_cold_compute_all_s"]
    assert all(f >= c > 0 for f, c in zip(floors, computes)) and len(floors) == 2
    assert all(b > 0 for b in out["cold_read_bytes"])
    if "drop_caches" in out["page_cache"]:  # the turn and the raw read before it: the disk's
        # (a raw read after the turn may find pages the worker still maps: tiny blocks share
        # their pages with their neighbours, and the worker lets go only of whole pages)
        assert all(io["read_bytes"] > 0 for io in out["cold_turn_worker_io"])
        assert out["cold_read_io"][1]["read_bytes"] > 0
        assert out["cold_withheld"] == []
        ratios = sorted(t / f for t, f in zip(out["ttft_cold_ssd_all_s"], floors))
        slack = _rounding(ratios, floors)
        assert ratios[0] - slack <= out["cold_ssd_vs_floor"] <= ratios[-1] + slack
    else:  # not cold for sure: no cold ratio is reported
        assert out["cold_ssd_vs_floor"] is out["cold_restore_vs_read"] is None
    assert out["checkpoints"] == {}  # full attention: a restore stands anywhere


def test_a_hybrid_models_checkpoints_are_reported_from_the_banks_ledger(
        tmp_path, monkeypatch, cache_dir):
    """qwen3_5 (recurrent state + full attention): the conversation holds checkpoints in the
    bank (its end's at least, at most --max-checkpoints) and its first returning turn adds
    some (where its prompt and its answer end)."""
    from kvbank.testing.tiny import make_arch_model

    monkeypatch.setenv("KVBANK_CACHE_DIR", str(cache_dir))
    model = make_arch_model(tmp_path / "qwen3_5", "qwen3_5", seed=2, context=2048,
                            cache_dir=cache_dir)
    out = run(model=str(model), tokens=300, block_tokens=16, repeats=1, cold_turns=False)
    ck = out["checkpoints"]
    assert out["cached_tokens_ram"] >= 300 and out["cache_source_ssd"] == "ssd"
    assert ck["checkpoint_bytes"] > 0 and ck["kv_bytes_per_token"] > 0
    assert ck["per_conversation"] in range(1, 9)  # whole checkpoints, at most --max-checkpoints
    assert ck["per_conversation"] == round(ck["per_conversation_bytes"] / ck["checkpoint_bytes"], 2)
    assert ck["first_turn_added"] >= 1
    big = ck["qwen36_27b"]
    assert big["per_conversation_bytes"] == round(ck["per_conversation_bytes"]
                                                  / ck["checkpoint_bytes"] * big["checkpoint_bytes"])


def test_a_conversation_longer_than_the_context_is_refused_before_anything_starts(
        tiny_model, monkeypatch, cache_dir, capsys):
    """The worker would refuse the conversation's first turn; the bench says which --tokens
    fits instead, with no traceback."""
    import json

    from kvbank.apps.cli import main

    monkeypatch.setenv("KVBANK_CACHE_DIR", str(cache_dir))
    context = json.loads((tiny_model / "config.json").read_text())["max_position_embeddings"]
    assert main(["bench", "turn", "--model", str(tiny_model), "--tokens", str(context),
                 "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert f"use --tokens {context - 1 - 3 * 17} or less" in err and "Traceback" not in err
