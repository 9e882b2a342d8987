"""The coding agents people run, unchanged, against the real stack: Claude Code (Anthropic's
Messages API) and Codex (OpenAI's Responses API), the pinned CLIs `make agents` installs into
tests/agents. Each runs two turns of one conversation in print mode, its telemetry and update
checks off and its home a scratch folder; the shim records what it sent
(`--record-requests`), and every later turn reads the earlier ones from cache.

The model is the tiny tool model with a 64K-token context (Claude Code's system prompt and
tools are about 21K tokens), its head made to answer "Done" and end, at any temperature: a
random model that never stops makes Claude Code give up on a turn ("response exceeded the
output token maximum"), and both CLIs sample at their own temperature
(kvbank/testing/agent_model.py). How the CLIs are run is apps/bench/agent_record.py's, which records
them for `kvbank bench agents`.
"""

from __future__ import annotations

import json

import pytest

from kvbank.apps.bench.agent_record import BIN, MAX_TOKENS, claude_code, codex, run_client
from kvbank.testing.agent_model import CONTEXT, says_done
from tests.conftest import start_stack


@pytest.fixture(scope="module")
def agents(tool_model, tmp_path_factory, cache_dir):
    for name in ("claude", "codex"):
        assert (BIN / name).exists(), f"{BIN / name} is missing: run `make agents`"
    root = tmp_path_factory.mktemp("agent-clients")
    model = says_done(tool_model, root / "model")
    record = root / "requests.jsonl"
    s = start_stack(model, root / "data", cache_dir=cache_dir,
                    extra=["--default-max-tokens", str(MAX_TOKENS),
                           "--record-requests", str(record)])
    s.record = record
    yield s
    s.stop()


def _records(stack, path: str) -> list[dict]:
    if not stack.record.exists():
        return []
    lines = stack.record.read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["path"] == path]


def test_claude_code_runs_on_kvbank_and_its_next_turn_reads_the_last_from_cache(agents,
                                                                                tmp_path):
    """`claude -p`, then `claude -p --continue`: Claude Code's own requests (its default model
    name, its mid-conversation system message, thinking and context_management, a new
    attribution nonce each request) go through, and the second turn's first request reads
    from cache the whole prompt and answer of the first turn's last request."""
    claude, env = claude_code(agents.shim_url)
    run_client([*claude, "List the files here."], tmp_path, env)
    first = _records(agents, "/v1/messages")
    run_client([*claude, "--continue", "Now read README.md."], tmp_path, env)
    second = _records(agents, "/v1/messages")[len(first):]
    assert first and second
    last, nxt = first[-1]["usage"], second[0]["usage"]
    whole = last["input_tokens"] + last["cache_read_input_tokens"] + last["output_tokens"]
    assert nxt["cache_read_input_tokens"] >= whole, (last, nxt)
    assert nxt["kvbank"]["recomputed_tokens"] == 0, nxt


def test_codex_runs_on_kvbank_and_its_next_turn_reads_the_last_from_cache(agents, tmp_path):
    """`codex exec` configured with only its provider (the shim), as a new user writes it,
    then `codex exec resume --last`: every field Codex sends is taken (its hosted web_search
    tool is left out of the prompt, with a warning), and the second turn reads the first
    turn's prompt and answer from cache."""
    cmd, env = codex(agents.shim_url, tmp_path, CONTEXT, only_provider=True)
    run_client([*cmd, "List the files here."], tmp_path, env)
    first = _records(agents, "/v1/responses")
    assert any(t.get("type", "").startswith("web_search")
               for r in first for t in r["body"].get("tools", [])), \
        "Codex's defaults send its web_search tool"
    run_client([*cmd, "resume", "--last", "Now read README.md."], tmp_path, env)
    second = _records(agents, "/v1/responses")[len(first):]
    assert first and second
    last, nxt = first[-1]["usage"], second[0]["usage"]
    assert nxt["input_tokens_details"]["cached_tokens"] >= \
        last["input_tokens"] + last["output_tokens"], (last, nxt)
    assert nxt["kvbank"]["recomputed_tokens"] == 0, nxt
    assert all(r["body"].get("store") is False for r in first + second)
