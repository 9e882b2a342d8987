"""`kvbank bench agents --quick` end to end: the Agents SDK's recorded tool loop
(tests/agents/recordings) replayed on a fresh stack, the JSON the docs' table is made of, and
what a user would notice: the cache serves the agent's history. And the model the CLIs'
recordings ran on, which makes their turns tool loops."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvbank.apps.bench.agents import answer_of, reuse

TURN_KEYS = {"turn", "prompt_tokens", "answer_tokens", "cached_tokens", "history_tokens",
             "reuse", "recomputed_tokens", "answer_matches"}


def test_bench_agents_quick_replays_a_recording_and_reuses_its_history(tmp_path, cache_dir):
    out = tmp_path / "agents.json"
    subprocess.run([sys.executable, "-m", "kvbank.apps.cli", "bench", "agents", "--quick", "--json",
                    str(out)], check=True, timeout=300,
                   env={**os.environ, "KVBANK_CACHE_DIR": str(cache_dir)})
    result = json.loads(out.read_text())
    assert {"definition", "goal", "clients", "min_history_reuse", "meets_goal"} <= set(result)
    [(name, client)] = result["clients"].items()
    assert name == "agents-sdk" and client["api"] == "/v1/responses"
    assert client["turns"] == 3 and len(client["per_turn"]) == 3
    assert all(set(t) == TURN_KEYS for t in client["per_turn"])
    assert 0.0 <= client["history_reuse"] <= 1.0
    # the tool loop's history (the call, its output, the answer) comes from cache
    assert client["answers_match"], client["per_turn"]
    assert client["history_reuse"] >= result["goal"] == 0.98, client["per_turn"]
    assert client["recomputed_tokens"] == 0
    assert result["meets_goal"]


def test_reuse_clips_each_turn_and_answers_compare_without_ids():
    """The definition on made-up turns: cache beyond the previous turn counts for nothing, a
    turn that read less counts what it read; ids are not what an answer said."""
    turns = [{"history_tokens": 0, "cached_tokens": 0},
             {"history_tokens": 100, "cached_tokens": 150},
             {"history_tokens": 200, "cached_tokens": 100}]
    assert reuse(turns) == round(200 / 300, 4)
    assert reuse(turns[:1]) is None
    a = [{"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f",
          "arguments": '{"x": 1}'}, {"type": "message", "content": [{"text": "Done"}]}]
    b = [{"type": "function_call", "id": "fc_2", "call_id": "c2", "name": "f",
          "arguments": '{"x":1}'}, {"type": "message", "content": [{"text": "Done"}]}]
    assert answer_of(a) == answer_of(b) == [["call", "f", {"x": 1}], ["text", "Done"]]
    assert answer_of([{"type": "text", "text": "Done"}]) != answer_of([{"type": "text",
                                                                        "text": "No"}])


@pytest.mark.parametrize("call", ["ListAgents", "get_goal"])
def test_the_clis_model_calls_its_tool_then_answers_done_at_any_temperature(tool_model,
                                                                           tmp_path, call):
    """kvbank/testing/agent_model.py's calls_once, the model Claude Code's and Codex's recordings ran
    on: a user's message gets the call, the tool's output gets "Done", sampled hot."""
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    from kvbank.testing.agent_model import calls_once

    model, tok = load(str(calls_once(tool_model, tmp_path / "model", call)))
    tools = [{"type": "function", "function": {"name": call, "description": "x",
                                               "parameters": {"type": "object"}}}]
    asked = [{"role": "system", "content": "You are an agent. " * 50},
             {"role": "user", "content": "List the files here."}]
    answered = asked + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": call, "arguments": {}}}]},
        {"role": "tool", "content": "nothing yet"}]
    for messages, want in [(asked, '<tool_call>{"name":"%s","arguments":{}}</tool_call>' % call),
                           (answered, "Done")]:
        prompt = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                         tokenize=False)
        assert generate(model, tok, prompt, max_tokens=40,
                        sampler=make_sampler(temp=1.0)) == want


def test_bench_agents_template_names_each_loss_and_its_cause(tmp_path, cache_dir):
    """`--template`: Nemotron's scripted model in the tool loop; its template renders neither
    the reasoning nor the generation prompt's <think> back, so every later request loses
    the previous answer, and the JSON says so and why, with the run's provenance."""
    out = tmp_path / "templates.json"
    subprocess.run([sys.executable, "-m", "kvbank.apps.cli", "bench", "agents", "--template",
                    "nemotron_nano_v2", "--turns", "3", "--json", str(out)], check=True,
                   timeout=300, env={**os.environ, "KVBANK_CACHE_DIR": str(cache_dir)})
    result = json.loads(out.read_text())
    assert {"definition", "goal", "families", "meets_goal", "provenance"} <= set(result)
    assert "--template" in result["provenance"]["argv"] and result["provenance"]["commit"]
    a = result["families"]["nemotron_nano_v2"]["apis"]["chat"]
    assert a["requests"] == a["calls_structured"] == 3
    assert all(s["recomputed_tokens"] == 0 for s in a["per_request"])
    later = a["per_request"][1:]
    assert [s["request"] for s in a["losses"]] == [2, 3], a["losses"]
    for s in later:
        assert 0 <= s["reuse"] < result["goal"] and s["template_loss_tokens"] > 0, s
        assert s["added_tokens"] < s["history_tokens"]  # the system part is not counted
        assert "drops the reasoning" in s["cause"], s
    assert a["min_reuse_rendered_back"] is None  # no request where the template kept it all


@pytest.mark.matrix  # make test-all: two stacks for one more view of what test_family_loops checks
def test_bench_prerender_restores_the_new_query_with_the_prerender_and_not_without(
        tmp_path, cache_dir):
    """`kvbank bench prerender` on a one-call tool loop, one round: with `--prerender on` the
    new query (its history re-rendered without the loop's reasoning) restores all but the
    user's text; with it off, only what stood before the first dropped reasoning. What the
    template drops here is less than a block of tokens, and is still worth pre-rendering."""
    out = tmp_path / "prerender.json"
    subprocess.run([sys.executable, "-m", "kvbank.apps.cli", "bench", "prerender", "--rounds",
                    "1", "--steps", "1", "--listing", "20", "--json", str(out)], check=True,
                   timeout=300, env={**os.environ, "KVBANK_CACHE_DIR": str(cache_dir)})
    doc = json.loads(out.read_text())
    [on], [off] = doc["rows"]["on"], doc["rows"]["off"]
    assert doc["prerendered_rounds"] == 1, on
    assert on["cached_tokens"] == on["prerender_tokens"] >= on["prompt_tokens"] - 32, on
    assert off["cached_tokens"] < on["cached_tokens"] - 100, (on, off)
    assert doc["goal_met"] in (True, False) and doc["provenance"]["commit"]["sha"]
    assert doc["on_new_query_ttft_s"] > 0 and doc["off_new_query_ttft_s"] > 0
