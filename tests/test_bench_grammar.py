"""`kvbank bench grammar` on the tiny model: the JSON's shape, and that the constrained runs
really were constrained (no timing goals here: those are the benchmark's, on the real model)."""

from __future__ import annotations

import json

import llguidance as llg

from kvbank.apps.bench.components.grammar import SCHEMA
from kvbank.apps.cli import main

# The schema's keys are fixed and free whitespace is off, so a constrained answer must open so.
OPENING = '{"people": [{"name": "'


def _valid_prefix(tokenizer, text: str) -> bool:
    """Whether `text` begins a JSON document of SCHEMA, by a matcher of llguidance's own (not
    the GrammarProcessor under test)."""
    from kvbank.worker.compute.grammar import JSON_STYLE

    matcher = llg.LLMatcher(llg.LLTokenizer(tokenizer._tokenizer.backend_tokenizer.to_str()),
                            llg.LLMatcher.grammar_from_json_schema(SCHEMA, overrides=JSON_STYLE),
                            log_level=0)
    ids = tokenizer._tokenizer.encode(text, add_special_tokens=False)
    return matcher.consume_tokens(ids) and not matcher.is_error()


def test_bench_grammar_json_and_constrained_output(tiny_model, tmp_path, monkeypatch, cache_dir):
    monkeypatch.setenv("KVBANK_CACHE_DIR", str(cache_dir))
    out = tmp_path / "grammar.json"
    assert main(["bench", "grammar", "--model", str(tiny_model), "--tokens", "16",
                 "--pairs", "2", "--batch", "1,2", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert (doc["tokens"], doc["pairs"], doc["overhead_goal"]) == (16, 2, 0.10)
    assert set(doc["batches"]) == {"1", "2"}
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(tiny_model)
    for b in doc["batches"].values():
        assert len(b["ratios"]) == 2
        assert b["u_ms_per_token"] > 0 and b["c_ms_per_token"] > 0
        assert min(b["ratios"]) <= b["c_over_u"] <= max(b["ratios"])
        assert b["grammar_ms_per_step"] > 0
        c, u = b["sample_constrained"], b["sample_unconstrained"]
        # the random model left alone writes no JSON; under the grammar it must
        assert c.startswith(OPENING) and len(c) > len(OPENING), c
        assert _valid_prefix(tokenizer, c), c
        assert not u.startswith(OPENING) and not _valid_prefix(tokenizer, u), u
    assert doc["within_goal"] == all(b["c_over_u"] <= 1.10 for b in doc["batches"].values())


def test_bench_grammar_refuses_bad_flags(capsys):
    assert main(["bench", "grammar", "--batch", "0"]) == 2
    assert "--batch" in capsys.readouterr().err
