"""`kvbank bench prefill` on the tiny model: the JSON's shape, and what the runs must have done
whatever the timing (every request read its whole prompt and got a first token, the same one on
every path; the decoding request kept decoding during the other's prefill). No timing goals
here: those are the benchmark's, on the real model."""

from __future__ import annotations

import json

from kvbank.apps.cli import main

TOKENS, CHUNKS, BATCH, REPEATS = 96, (16, 32), 2, 2


def test_bench_prefill_json_and_facts(tiny_model, tmp_path, monkeypatch, cache_dir):
    monkeypatch.setenv("KVBANK_CACHE_DIR", str(cache_dir))
    out = tmp_path / "prefill.json"
    assert main(["bench", "prefill", "--model", str(tiny_model), "--tokens", str(TOKENS),
                 "--chunks", ",".join(map(str, CHUNKS)), "--batch", str(BATCH),
                 "--repeats", str(REPEATS), "--history", "0", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    a = doc["args"]
    assert (a["tokens"], a["chunks"], a["batch"], a["repeats"]) == (TOKENS, list(CHUNKS), BATCH,
                                                                    REPEATS)
    assert a["batch_chunk"] == 512  # the worker's chunk
    assert set(doc["single"]) == set(doc["interleave"]) == {str(c) for c in CHUNKS}
    for c in CHUNKS:
        s, i = doc["single"][str(c)], doc["interleave"][str(c)]
        assert len(s["runs_tok_s"]) == REPEATS and s["tok_s"] > 0 and s["ttft_s"] > 0
        assert i["alone_ttft_s"] == s["ttft_s"] and i["ttft_s"] > 0
        # the decoder got a token every step of the other's prefill: one per chunk at least
        assert all(n >= (TOKENS - 1) // c for n in i["decoder_tokens"]), i
        assert 0 < i["decode_ms_median"] <= i["decode_ms_max"]
    assert doc["fastest_chunk"] in CHUNKS
    b = doc["batched"]
    assert (b["chunk"], b["requests"], b["prompt_tokens"]) == (512, BATCH, BATCH * TOKENS)
    assert set(b["modes"]) == {"single", "batched", "in_batch"}
    firsts = {tuple(m["first_tokens"]) for m in b["modes"].values()}
    assert len(firsts) == 1 and len(firsts.pop()) == BATCH  # greedy: the same first tokens
    for m in b["modes"].values():
        assert len(m["runs_tok_s"]) == REPEATS and m["tok_s"] > 0 and m["wall_s"] > 0
        # each cache holds its whole prompt and its first token
        assert m["cache_tokens"] == [TOKENS + 1] * BATCH
        assert 0 < m["mean_ttft_s"] <= m["wall_s"] + 1e-9
    # the worker reads one prompt at a time: the first has its first token before the last
    assert b["modes"]["batched"]["mean_ttft_s"] < b["modes"]["batched"]["wall_s"]
    assert len(b["ratios"]) == REPEATS
    assert min(b["ratios"]) <= b["batched_over_single"] <= max(b["ratios"])
    assert doc["same_first_tokens"] and doc["cache_tokens_ok"]
    assert doc["within_goal"] == (b["batched_over_single"] >= doc["goal"] == 1.0)


def test_bench_prefill_refuses_bad_flags(capsys):
    assert main(["bench", "prefill", "--chunks", "0"]) == 2
    assert "--chunks" in capsys.readouterr().err
    assert main(["bench", "prefill", "--batch", "0"]) == 2


def test_bench_prefill_with_history(tiny_model, tmp_path, monkeypatch, cache_dir):
    """Prompts that continue conversations (returning agents): every mode ends with history +
    prompt + first token in each cache, and gives the same first tokens."""
    monkeypatch.setenv("KVBANK_CACHE_DIR", str(cache_dir))
    out = tmp_path / "prefill.json"
    assert main(["bench", "prefill", "--model", str(tiny_model), "--tokens", "24",
                 "--chunks", "16", "--batch", "2", "--history", "40", "--repeats", "1",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["args"]["history"] == 40
    for m in doc["batched"]["modes"].values():
        assert m["cache_tokens"] == [40 + 24 + 1] * 2
    assert doc["same_first_tokens"] and doc["cache_tokens_ok"]
