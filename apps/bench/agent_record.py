"""What three real agents send over ten turns, recorded for `kvbank bench agents` to replay.

Claude Code (`claude -p`, then `claude -p --continue`, on /v1/messages), Codex (`codex exec`,
then `codex exec resume --last`, on /v1/responses) and the OpenAI Agents SDK (`Runner.run`
with a function tool, on /v1/responses) each run against a fresh stack of their own on the
agent model (kvbank/testing/agent_model.py), the shim recording every request it answers
(`--record-requests`): body as sent, usage, answer. The recordings are kept gzipped:

    python -m kvbank.apps.bench.agent_record [--out tests/agents/recordings] [--turns 10]

The pinned CLIs come from `make agents` (tests/agents); their telemetry, update checks and
non-essential traffic are off, their homes scratch folders: nothing leaves loopback.
Every client's ten requests are a tool loop. The CLIs choose tools themselves, so their model
(kvbank/testing/agent_model.py: calls_once) calls one of their own tools that takes no arguments
(`CALLS`) and answers "Done" once its output comes back: each prompt makes two requests, the
call and the answer after the tool's output. The Agents SDK's model answers "Done"
(says_done); each run forces one call of a function tool (the worker's grammar writes it),
the SDK runs it and sends its output back, and the answer after it is a structured output
(a JSON schema, which a random model ends).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Literal

REPO = Path(__file__).resolve().parents[2]
BIN = REPO / "tests" / "agents" / "node_modules" / ".bin"
RECORDINGS = REPO / "tests" / "agents" / "recordings"
CLIENTS = ("claude-code", "codex", "agents-sdk")
# The tool each CLI's model calls once a turn (kvbank/testing/agent_model.py: calls_once): one of its
# own that takes no arguments and changes nothing. The Agents SDK's calls are forced instead.
CALLS = {"claude-code": "ListAgents", "codex": "get_goal", "agents-sdk": None}
MAX_TOKENS = 64
# The stack both the recordings and their replays run on; answers are bounded by the clients'
# own max tokens or, where they send none (Codex), by the stack's default.
STACK_FLAGS = ["--block-tokens", "16", "--quiet-grace-s", "0.1", "--tail-delay-s", "0",
               "--default-max-tokens", str(MAX_TOKENS)]
PROMPTS = ["List the files here.", "Now read README.md.", "What does it say?",
           "Add a line to it.", "Show me the diff.", "Undo that.", "Which files changed?",
           "Write a test.", "Run it.", "Summarize what we did."]


def tokens(path: str, usage: dict) -> tuple[int, int, int]:
    """(prompt, cached, answer) tokens from a usage in its API's shape."""
    if path.startswith("/v1/messages"):
        cached = usage.get("cache_read_input_tokens") or 0
        prompt = (usage.get("input_tokens") or 0) + cached + (
            usage.get("cache_creation_input_tokens") or 0)
        return prompt, cached, usage.get("output_tokens") or 0
    if path.startswith("/v1/responses"):
        return (usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"],
                usage["output_tokens"])
    return (usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get(
        "cached_tokens") or 0, usage["completion_tokens"])


def run_client(cmd: list[str], home: Path, env: dict[str, str],
               timeout_s: float = 300) -> subprocess.CompletedProcess:
    """A CLI in a scratch home and work folder, no terminal, nothing to read on stdin (Codex
    waits for stdin to close); raises with its output if it fails."""
    work = home / "work"
    work.mkdir(parents=True, exist_ok=True)
    (work / "README.md").write_text("# demo\n")
    base = {"PATH": f"{BIN}:{os.environ['PATH']}", "HOME": str(home), "LANG": "C.UTF-8",
            "NO_COLOR": "1"}
    out = subprocess.run(cmd, cwd=work, env={**base, **env}, stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
    return out


def claude_code(shim_url: str) -> tuple[list[str], dict[str, str]]:
    """Claude Code's print-mode command and environment, on the shim, nothing else."""
    env = {"ANTHROPIC_BASE_URL": shim_url, "ANTHROPIC_API_KEY": "kvbank",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
           "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(MAX_TOKENS)}
    return [str(BIN / "claude"), "-p", "--output-format", "json"], env


def codex(shim_url: str, home: Path, context: int,
          only_provider: bool = False) -> tuple[list[str], dict[str, str]]:
    """Codex's exec command and environment: a custom provider on the shim's Responses API,
    analytics, feedback, telemetry, update checks, web search and plugins off; or, with
    `only_provider`, the provider and nothing else, as a new user writes it (Codex then sends
    its hosted web_search tool)."""
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    provider = f"""\
model = "kvbank"
model_provider = "kvbank"

[model_providers.kvbank]
name = "kvbank"
base_url = "{shim_url}/v1"
wire_api = "responses"
"""
    if only_provider:
        (home / ".codex" / "config.toml").write_text(provider)
        return ([str(BIN / "codex"), "exec", "--skip-git-repo-check", "--json"],
                {"CODEX_HOME": str(home / ".codex")})
    (home / ".codex" / "config.toml").write_text(f"""\
model_context_window = {context}
check_for_update_on_startup = false
web_search = "disabled"
{provider}
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
    return ([str(BIN / "codex"), "exec", "--skip-git-repo-check", "--json"],
            {"CODEX_HOME": str(home / ".codex")})


def _main_requests(log: Path) -> int:
    lines = log.read_text().splitlines() if log.exists() else []
    return sum(bool(json.loads(line)["body"].get("tools")) for line in lines)


def _record_claude_code(stack, home: Path, turns: int, context: int, log: Path) -> None:
    """Prompts of one conversation until `turns` requests: each a call, then "Done"."""
    cmd, env = claude_code(stack.shim_url)
    for i in range(turns):
        if _main_requests(log) >= turns:
            break
        run_client([*cmd, "--max-turns", "4", *(["--continue"] if i else []),
                    PROMPTS[i % len(PROMPTS)]], home, env)


def _record_codex(stack, home: Path, turns: int, context: int, log: Path) -> None:
    cmd, env = codex(stack.shim_url, home, context)
    for i in range(turns):
        if _main_requests(log) >= turns:
            break
        run_client([*cmd, *(["resume", "--last"] if i else []), PROMPTS[i % len(PROMPTS)]],
                   home, env, timeout_s=120)


def _record_agents_sdk(stack, home: Path, turns: int, context: int, log: Path) -> None:
    """Runs of two requests each (the forced call; the answer after its output), each run on
    the last one's history, until `turns` requests."""
    import asyncio

    import openai
    from agents import Runner

    client = openai.AsyncOpenAI(base_url=stack.shim_url + "/v1", api_key="kvbank",
                                max_retries=0)
    agent, _ = weather_agent(client, MAX_TOKENS)

    async def runs():
        history: list = []
        for i in range(0, turns, 2):
            history.append({"role": "user", "content": f"Weather, {PROMPTS[i // 2]}"})
            result = await Runner.run(agent, history, max_turns=4)
            history = result.to_input_list()
        await client.close()

    asyncio.run(runs())


def weather_agent(client, max_tokens: int, on_call=None):
    """(agent, its output type): an Agents SDK agent on its default Responses model whose one
    function tool, `get_weather`, it is made to call (a random model calls none of its own
    accord); its answer is structured output, so that a random model ends it. `on_call(city)`
    sees each call. Tracing off: its traces go to OpenAI's servers otherwise."""
    from agents import (Agent, ModelSettings, OpenAIResponsesModel, function_tool,
                        set_tracing_disabled)
    from pydantic import BaseModel

    class Done(BaseModel):
        done: bool

    set_tracing_disabled(True)

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo", "Lima"]) -> str:
        """The weather in a city now."""
        if on_call is not None:
            on_call(city)
        return f"12 C and rain in {city}"

    agent = Agent(name="coder", instructions="You are a coding agent.", tools=[get_weather],
                  model=OpenAIResponsesModel("gpt-4.1", client), output_type=Done,
                  model_settings=ModelSettings(tool_choice="get_weather", temperature=0,
                                               max_tokens=max_tokens))
    return agent, Done


RECORDERS = {"claude-code": _record_claude_code, "codex": _record_codex,
             "agents-sdk": _record_agents_sdk}


def write_gzip(src: Path, dest: Path) -> None:
    """`src` gzipped with no name or time in its header: the same lines, the same bytes."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw,
                                                mtime=0, compresslevel=9) as f:
        f.write(src.read_bytes())


def record(clients: list[str], out: Path, turns: int, cache_dir: Path | None = None) -> dict:
    """Each client's recording, made on a fresh stack of its own; {client: requests}."""
    from kvbank.deploy.local import LocalStack
    from kvbank.testing.agent_model import CONTEXT, agent_model

    counts = {}
    with tempfile.TemporaryDirectory(prefix="kvbank-record-") as tmp:
        root = Path(tmp)
        env = {"KVBANK_CACHE_DIR": str(cache_dir)} if cache_dir else {}
        for name in clients:
            model = agent_model(root / f"{name}-model", cache_dir, call=CALLS[name])
            log = root / f"{name}.jsonl"
            stack = LocalStack.start(model, root / f"{name}-data", env=env, timeout_s=120,
                                     extra=[*STACK_FLAGS, "--record-requests", str(log)])
            try:
                RECORDERS[name](stack, root / f"{name}-home", turns, CONTEXT, log)
            finally:
                stack.stop()
            write_gzip(log, out / f"{name}.jsonl.gz")
            counts[name] = len(log.read_text().splitlines())
    return counts


def main(argv: list[str] | None = None) -> int:
    from kvbank.config import preload_openblas

    preload_openblas()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=RECORDINGS)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--clients", default=",".join(CLIENTS),
                    help="comma-separated, of " + ", ".join(CLIENTS))
    args = ap.parse_args(argv)
    clients = [c for c in args.clients.split(",") if c]
    if unknown := set(clients) - set(CLIENTS):
        ap.error(f"unknown clients: {', '.join(sorted(unknown))}")
    if {"claude-code", "codex"} & set(clients):
        for name in ("claude", "codex"):
            if not (BIN / name).exists():
                ap.error(f"{BIN / name} is missing: run `make agents`")
    print(json.dumps(record(clients, args.out, args.turns)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
