"""The coding agents people run, unchanged, against the real stack: Claude Code (Anthropic's
Messages API) and Codex (OpenAI's Responses API), the pinned CLIs `make agents` installs into
tests/agents. Each runs two turns of one conversation in print mode, its telemetry and update
checks off and its home a scratch folder; the shim records what it sent
(`--record-requests`), and every later turn reads the earlier ones from cache.

The model is the tiny tool model with a 64K-token context (Claude Code's system prompt and
tools are about 21K tokens), its head made to answer "Done" and end, at any temperature: a
random model that never stops makes Claude Code give up on a turn ("response exceeded the
output token maximum"), and both CLIs sample at their own temperature.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import start_stack

BIN = Path(__file__).parent / "agents" / "node_modules" / ".bin"
CONTEXT = 65536
MAX_TOKENS = 64


def _says_done(src: Path, out: Path) -> Path:
    """`src` with a 64K context and a head that answers "Done" and ends, whatever the
    temperature: one direction of every embedding is constant and the head's "Done" row reads
    it; a second is set in "Done"'s embedding alone, and the end-of-turn row reads it twice
    as hard. After any token the model writes "Done"; after "Done", the end."""
    import mlx.core as mx
    import numpy as np

    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    config.update(max_position_embeddings=CONTEXT, tie_word_embeddings=False)
    (out / "config.json").write_text(json.dumps(config))
    tok = json.loads((out / "tokenizer_config.json").read_text())
    tok["model_max_length"] = CONTEXT
    (out / "tokenizer_config.json").write_text(json.dumps(tok))
    done = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]["Done"]
    w = {k: np.array(v) for k, v in mx.load(str(out / "model.safetensors")).items()}
    embed = w["model.embed_tokens.weight"]
    embed[:, :2] = 0.0
    embed[:, 0] = 1.0
    embed[done, 1] = 1.0
    head = np.zeros_like(embed)
    scale = np.sqrt(embed.shape[1])  # what RMSNorm leaves of a unit direction
    head[done, 0] = 40.0 * scale
    head[config["eos_token_id"], 1] = 80.0 * scale
    w["lm_head.weight"] = head
    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in w.items()},
                        metadata={"format": "mlx"})
    return out


@pytest.fixture(scope="module")
def agents(tool_model, tmp_path_factory, cache_dir):
    for name in ("claude", "codex"):
        assert (BIN / name).exists(), f"{BIN / name} is missing: run `make agents`"
    root = tmp_path_factory.mktemp("agent-clients")
    model = _says_done(tool_model, root / "model")
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


def _run(cmd: list[str], home: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """A CLI in a scratch home and work folder, no terminal, nothing to read on stdin (Codex
    waits for stdin to close)."""
    work = home / "work"
    work.mkdir(parents=True, exist_ok=True)
    (work / "README.md").write_text("# demo\n")
    base = {"PATH": f"{BIN}:{os.environ['PATH']}", "HOME": str(home), "LANG": "C.UTF-8",
            "NO_COLOR": "1"}
    out = subprocess.run(cmd, cwd=work, env={**base, **env}, stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{cmd[0]} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    return out


def test_claude_code_runs_on_kvbank_and_its_next_turn_reads_the_last_from_cache(agents,
                                                                                tmp_path):
    """`claude -p`, then `claude -p --continue`: Claude Code's own requests (its default model
    name, its mid-conversation system message, thinking and context_management, a new
    attribution nonce each request) go through, and the second turn's first request reads
    from cache the whole prompt and answer of the first turn's last request."""
    env = {"ANTHROPIC_BASE_URL": agents.shim_url, "ANTHROPIC_API_KEY": "kvbank",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
           "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(MAX_TOKENS)}
    claude = [str(BIN / "claude"), "-p", "--output-format", "json"]
    _run([*claude, "List the files here."], tmp_path, env)
    first = _records(agents, "/v1/messages")
    _run([*claude, "--continue", "Now read README.md."], tmp_path, env)
    second = _records(agents, "/v1/messages")[len(first):]
    assert first and second
    last, nxt = first[-1]["usage"], second[0]["usage"]
    whole = last["input_tokens"] + last["cache_read_input_tokens"] + last["output_tokens"]
    assert nxt["cache_read_input_tokens"] >= whole, (last, nxt)
    assert nxt["kvbank"]["recomputed_tokens"] == 0, nxt


def test_codex_runs_on_kvbank_and_its_next_turn_reads_the_last_from_cache(agents, tmp_path):
    """`codex exec` with a custom provider pointing at the shim, then `codex exec resume
    --last`: every field Codex sends is taken, and the second turn reads the first turn's
    prompt and answer from cache."""
    home = tmp_path
    (home / ".codex").mkdir(parents=True)
    (home / ".codex" / "config.toml").write_text(f"""\
model = "kvbank"
model_provider = "kvbank"
model_context_window = {CONTEXT}
check_for_update_on_startup = false
web_search = "disabled"

[model_providers.kvbank]
name = "kvbank"
base_url = "{agents.shim_url}/v1"
wire_api = "responses"

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"

[features]
plugins = false
remote_plugin = false
apps = false
""")
    codex = [str(BIN / "codex"), "exec", "--skip-git-repo-check", "--json"]
    env = {"CODEX_HOME": str(home / ".codex")}
    _run([*codex, "List the files here."], home, env)
    first = _records(agents, "/v1/responses")
    _run([*codex, "resume", "--last", "Now read README.md."], home, env)
    second = _records(agents, "/v1/responses")[len(first):]
    assert first and second
    last, nxt = first[-1]["usage"], second[0]["usage"]
    assert nxt["input_tokens_details"]["cached_tokens"] >= \
        last["input_tokens"] + last["output_tokens"], (last, nxt)
    assert nxt["kvbank"]["recomputed_tokens"] == 0, nxt
    assert all(r["body"].get("store") is False for r in first + second)
