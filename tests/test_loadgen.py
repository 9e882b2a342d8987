"""`kvbank loadgen`: seeded scenarios, the JSON report against a real stack, clean failures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvbank.apps.cli import main
from kvbank.apps.loadgen.run import Row, RunResult
from kvbank.apps.loadgen.report import summarize
from kvbank.apps.loadgen.scenarios import SCENARIOS, Conversation, build, params
from kvbank.apps.loadgen.targets import http_failure

SMALL = ["--turns", "3", "--turn-tokens", "20", "--system-tokens", "40", "--max-tokens", "4",
         "--no-progress"]
ROW_FIELDS = {"agent", "turn", "prompt_tokens", "cached_tokens", "recomputed_tokens",
              "cache_source", "ttft_s", "total_s", "status", "new_tokens"}
SUMMARY_FIELDS = {"wall_s", "prompt_tokens", "new_tokens", "recomputed_tokens", "ttft_p50_s",
                  "ttft_p95_s", "ttft_max_s", "refusals", "errors"}


@pytest.fixture
def stack(module_stack):
    """The module's one stack: each run below has a seed of its own, so no run finds
    another's prompts in its cache."""
    return module_stack


def _loadgen(target: str, out: Path, seed: int, *extra: str) -> dict:
    assert main(["loadgen", target, *SMALL, "--seed", str(seed), "--json", str(out),
                 *extra]) == 0
    return json.loads(out.read_text())


def _check_sums(doc: dict) -> None:
    rows, s = doc["rows"], doc["summary"]
    assert all(ROW_FIELDS <= set(r) for r in rows)
    assert SUMMARY_FIELDS <= set(s)
    assert all(r["status"] == "ok" for r in rows), rows
    for field in ("prompt_tokens", "cached_tokens", "new_tokens", "recomputed_tokens"):
        assert s[field] == sum(r[field] for r in rows), field
    for r in rows:
        assert r["recomputed_tokens"] == max(
            0, r["prompt_tokens"] - r["cached_tokens"] - r["new_tokens"])
        assert 0 <= r["cached_tokens"] <= r["prompt_tokens"]
        assert 0 < r["ttft_s"] <= r["total_s"]
    assert s["ttft_p50_s"] <= s["ttft_p95_s"] <= s["ttft_max_s"] == max(r["ttft_s"] for r in rows)
    assert s["refusals"] == {} and s["errors"] == {}
    assert s["turns"] == s["turns_ok"] == len(rows)
    for agent in {r["agent"] for r in rows}:
        turns = [r for r in rows if r["agent"] == agent]
        assert [r["turn"] for r in turns] == [1, 2, 3]
        # The first turn computes its whole prompt; later turns find the agent's history.
        assert turns[0]["new_tokens"] == turns[0]["prompt_tokens"]
        assert all(r["cached_tokens"] > 0 for r in turns[1:])
        assert all(r["new_tokens"] < r["prompt_tokens"] for r in turns[1:])


def test_grpc_two_agents_report_sums_and_plot(stack, tmp_path):
    png = tmp_path / "ttft.png"
    doc = _loadgen(f"grpc://{stack.address}", tmp_path / "out.json", 1, "--plot", str(png))
    assert doc["params"]["scenario"] == "two-agents"
    assert len(doc["rows"]) == 6
    assert [r["agent"] for r in doc["rows"]] == ["agent0", "agent1"] * 3  # taking turns
    _check_sums(doc)
    rows = doc["rows"]
    assert rows[0]["cache_source"] == "none"
    assert all(r["cache_source"] in ("ram", "ssd") for r in rows[2:])
    assert doc["summary"]["server_recomputed_tokens"] == sum(
        r["server_recomputed_tokens"] for r in rows)
    assert png.stat().st_size > 0


def test_grpc_n_agents_run_at_once_and_finish(stack, tmp_path):
    doc = _loadgen(f"grpc://{stack.address}", tmp_path / "out.json", 2, "--scenario",
                   "n-agents", "--agents", "3", "--think-s", "0")
    assert len(doc["rows"]) == 9
    _check_sums(doc)
    assert doc["summary"]["stopped_by"] == "turns"


@pytest.mark.parametrize("kind", ["grpc", "openai"])
def test_prefetch_hints_before_each_returning_turn(stack, tmp_path, kind):
    """--prefetch: at the start of each think time the agent hints it will be back; the row
    of the turn after it says what the hint did (here RAM holds everything: in_ram)."""
    target = (f"grpc://{stack.address}" if kind == "grpc"
              else stack.shim_url.replace("http://", "openai://"))
    doc = _loadgen(target, tmp_path / "out.json", 3 if kind == "grpc" else 4, "--scenario",
                   "n-agents", "--agents", "2", "--think-s", "0.2", "--prefetch")
    _check_sums(doc)
    rows = doc["rows"]
    assert all(r["hint"] is None for r in rows if r["turn"] == 1)
    assert all(r["hint"] == "in_ram" for r in rows if r["turn"] > 1), [r["hint"] for r in rows]
    assert doc["summary"]["hints"] == {"in_ram": 4}


def _shim_not_answering(stack) -> str:
    """Why kvbank's OpenAI shim does not answer GET /health on this stack ("" when it does)."""
    if not stack.shim_url:
        return "the stack has no OpenAI shim (no shim_url)"
    try:
        r = httpx.get(stack.shim_url + "/health", timeout=10)
    except httpx.HTTPError as e:
        return f"kvbank's OpenAI shim at {stack.shim_url} did not answer GET /health: {e!r}"
    if r.status_code != 200:
        return (f"kvbank's OpenAI shim at {stack.shim_url} answered GET /health with "
                f"HTTP {r.status_code}: {r.text[:200]}")
    return ""


def test_openai_target_sends_session_header_and_reads_usage(stack, tmp_path):
    why = _shim_not_answering(stack)
    assert not why, why
    target = stack.shim_url.replace("http://", "openai://")
    doc = _loadgen(target, tmp_path / "out.json", 5, "--run-id", "lgtest")
    _check_sums(doc)
    assert all(r["session_id"] == f"lgtest-{r['agent']}" for r in doc["rows"])
    with stack.client() as c:  # the x-session-id header named kvbank's sessions
        assert c.get_session("lgtest-agent0").token_count > 0
        assert c.get_session("lgtest-agent1").token_count > 0


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_same_seed_same_prompts_other_seed_other_prompts(scenario):
    a, b = build(params(scenario, seed=7)), build(params(scenario, seed=7))
    assert a.messages() == b.messages()
    assert build(params(scenario, seed=8)).messages() != a.messages()

    def prompts(s):  # whole conversations sent, given the same answers
        out = []
        for agent in s.agents:
            conv = Conversation(agent)
            for t in agent.turns:
                out.append(conv.next_messages(t))
                conv.answered(f"answer {t.turn}")
        return out

    assert prompts(a) == prompts(b)


def test_compaction_turn_starts_a_new_shorter_prefix():
    s = build(params("compaction", turns=5, compact_every=2))
    agent = s.agents[0]
    assert [t.compact_to is not None for t in agent.turns] == [False, False, True, False, True]
    conv = Conversation(agent)
    sent = []
    for t in agent.turns:
        sent.append(conv.next_messages(t))
        conv.answered("ok")
    assert [len(m) for m in sent] == [2, 4, 2, 4, 2]
    assert sent[2][0] == {"role": "system", "content": agent.system}
    assert sent[2][1]["content"].startswith(agent.turns[2].compact_to)


def test_refusals_are_counted_by_reason_with_the_message():
    refused = http_failure(httpx.Response(429, json={"error": {"message": "queue full"}}), 0.1)
    assert (refused.status, refused.reason, refused.message) == ("refused", "HTTP 429",
                                                                 "queue full")
    assert http_failure(httpx.Response(400, json={"error": {"message": "bad"}}),
                        0.1).status == "error"
    rows = [Row("a", "s-a", 1, "ok", 0.0, 1.0, ttft_s=0.5, prompt_tokens=10, cached_tokens=0,
                new_tokens=10, recomputed_tokens=0),
            Row("a", "s-a", 2, "refused", 1.0, 0.1, reason="HTTP 429", message="queue full"),
            Row("b", "s-b", 1, "refused", 1.1, 0.1, reason="HTTP 429", message="queue full")]
    s = summarize(RunResult("openai://x", params("two-agents"), "r", rows, 2.0, "turns", "usage"))
    assert s["refusals"] == {"HTTP 429": {"count": 2, "message": "queue full"}}
    assert (s["refused"], s["errored"], s["turns_ok"], s["prompt_tokens"]) == (2, 0, 1, 10)


def test_max_wall_s_zero_starts_no_turn(stack, tmp_path):
    out = tmp_path / "out.json"
    rc = main(["loadgen", f"grpc://{stack.address}", *SMALL, "--max-wall-s", "0",
               "--json", str(out)])
    assert rc == 1  # it ran, and no turn succeeded
    doc = json.loads(out.read_text())
    assert doc["rows"] == [] and doc["summary"]["stopped_by"] == "max_wall_s"


@pytest.mark.parametrize("target", ["grpc://127.0.0.1:1", "openai://127.0.0.1:1"])
def test_unreachable_target_is_one_line_and_nonzero(target):
    out = subprocess.run([sys.executable, "-m", "kvbank.apps.cli", "loadgen", target,
                          "--connect-timeout-s", "1", "--no-progress"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("kvbank loadgen:")]
    assert len(lines) == 1 and "cannot reach" in lines[0] and target in lines[0], out.stderr

