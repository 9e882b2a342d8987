"""`kvbank bench agents`: how much of an agent's history the cache serves, on the requests real
agents send.

    kvbank bench agents [--json FILE] [--quick] [--clients claude-code,codex,agents-sdk]
                        [--recordings DIR] [--turns N]
    kvbank bench agents --template FAMILY[,FAMILY...]|all [--api chat|responses|anthropic|all]

With --template, no recording: each model family's published chat template and scripted
model in a tool loop (apps/bench/agent_families.py, where its measure is defined).

Each client's recorded requests (tests/agents/recordings: Claude Code, Codex and the OpenAI
Agents SDK, ten turns each, recorded against a stack with `--record-requests` by

    python -m kvbank.apps.bench.agent_record [--out tests/agents/recordings] [--turns 10]

which needs the pinned CLIs of `make agents`; see its docstring) are replayed in order, same
path and same body, against a fresh stack on the model they were recorded on
(kvbank/testing/agent_model.py, built in-process from its seed). A turn is a request of the main
conversation (one that carries tools; side requests, such as Claude Code's titles, are
replayed but not counted). For turn t >= 2:

    history_t = prompt_{t-1} + answer_{t-1}     (tokens of the previous turn's prompt and answer)
    reuse_t   = min(cached_t, history_t) / history_t
    history_reuse = sum_t min(cached_t, history_t) / sum_t history_t

`cached_t` is what the API reports read from cache (`cache_read_input_tokens`,
`cached_tokens`). New tokens (the user's next message, a tool's output) can never come from
cache, so they are not counted against it; cache beyond the previous turn (a shared system
prompt) is not counted for it. The goal is history_reuse >= 0.98 per client. Each replayed
answer is compared with the recorded one (text and tool calls, not ids): where they differ, the
history the next request carries is not what this server generated, and the turn says so.
"""

from __future__ import annotations

import argparse
import gzip
import json
import tempfile
import time
from pathlib import Path

from kvbank.apps.bench.agent_record import (CALLS, CLIENTS, RECORDINGS, REPO, STACK_FLAGS,
                                           tokens)

GOAL = 0.98
QUICK = {"clients": ["agents-sdk"], "turns": 3}
MODEL = ("kvbank.agent_model.agent_model: the tiny llama of seed 0, the Qwen tools template, "
         "a 64K context, a head that calls the client's tool (CALLS) once a user turn and "
         "then answers 'Done' (calls_once), or answers 'Done' at once (says_done)")
DEFINITION = ("history_reuse = sum over turns t>=2 of min(cached_t, history_t) / sum of "
              "history_t, where history_t = prompt_{t-1} + answer_{t-1} tokens of the main "
              "conversation's previous request and cached_t = tokens turn t read from cache")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", default=",".join(CLIENTS),
                   help="comma-separated, of " + ", ".join(CLIENTS) + " (default: all)")
    p.add_argument("--recordings", type=Path, default=RECORDINGS,
                   help="folder of CLIENT.jsonl.gz recordings (default: %(default)s)")
    p.add_argument("--turns", type=int, default=None,
                   help="replay only up to this many main turns per client (default: all)")
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK['clients'][0]} alone, {QUICK['turns']} turns")
    p.add_argument("--vary-attribution", action="store_true",
                   help="give Claude Code's attribution line a new value each request, as it "
                        "sends it to Anthropic's API (it never changes on other base URLs)")
    p.add_argument("--template", default=None, metavar="FAMILY",
                   help="instead of the recordings: the tool loop on these model families' "
                        "published templates (comma-separated, or all)")
    p.add_argument("--api", default="chat",
                   help="with --template: chat, responses, anthropic, or all "
                        "(default: %(default)s)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="print the result as JSON (to FILE if given)")


def load(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def is_main(record: dict) -> bool:
    """A request of the main conversation: agents send their tools with every one of it."""
    return bool((record.get("body") or {}).get("tools"))


def _args(text: object) -> object:
    try:
        return json.loads(text) if isinstance(text, str) else text
    except ValueError:
        return text


def answer_of(answer: object) -> list:
    """What an answer said, without its ids: text, reasoning, tool calls (name, arguments),
    whichever API's shape (`content`, `output` or `choices`) it came in."""
    out = []
    for item in answer or []:
        kind = item.get("type")
        if kind == "text":
            out.append(["text", item["text"]])
        elif kind == "thinking":
            out.append(["reasoning", item["thinking"]])
        elif kind == "tool_use":
            out.append(["call", item["name"], item["input"]])
        elif kind == "message":
            out.append(["text", "".join(p.get("text", "") for p in item["content"])])
        elif kind == "reasoning":
            out.append(["reasoning", "".join(p.get("text", "") for p in
                                             item.get("content") or [])])
        elif kind == "function_call":
            out.append(["call", item["name"], _args(item["arguments"])])
        elif kind == "custom_tool_call":
            out.append(["call", item["name"], item["input"]])
        elif "message" in item:  # a chat completion's choice
            m = item["message"]
            out += [["text", m.get("content") or ""]] + [
                ["call", c["function"]["name"], _args(c["function"]["arguments"])]
                for c in m.get("tool_calls") or []]
    return [a for a in out if a[1:] != [""]]


def _events(response) -> list[dict]:
    """A server-sent event stream's JSON data, in order."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
            out.append(json.loads(line[5:]))
    return out


def _streamed(path: str, events: list[dict]) -> tuple[dict, list]:
    """(usage, answer) of a streamed answer, as its non-streamed body would hold them."""
    if path.startswith("/v1/responses"):
        [done] = [e for e in events if e.get("type") in ("response.completed",
                                                           "response.incomplete")]
        return done["response"]["usage"], done["response"]["output"]
    if path.startswith("/v1/messages"):
        usage, blocks = {}, {}
        for e in events:
            if e["type"] == "message_delta":
                usage = e["usage"]
            elif e["type"] == "content_block_start":
                blocks[e["index"]] = dict(e["content_block"])
            elif e["type"] == "content_block_delta":
                b, d = blocks[e["index"]], e["delta"]
                if d["type"] == "text_delta":
                    b["text"] = b.get("text", "") + d["text"]
                elif d["type"] == "thinking_delta":
                    b["thinking"] = b.get("thinking", "") + d["thinking"]
                elif d["type"] == "input_json_delta":
                    b["partial"] = b.get("partial", "") + d["partial_json"]
        for b in blocks.values():
            if "partial" in b:
                b["input"] = json.loads(b.pop("partial") or "{}")
        return usage, [blocks[i] for i in sorted(blocks)]
    raise ValueError(f"{path}: a streamed replay reads /v1/messages or /v1/responses")


def replay(http, base: str, record: dict) -> tuple[dict, list]:
    """One recorded request sent again: (usage, answer) as the client would get them."""
    body = record["body"]
    if body.get("stream"):
        with http.stream("POST", base + record["path"], json=body) as r:
            r.raise_for_status()
            return _streamed(record["path"], _events(r))
    r = http.post(base + record["path"], json=body)
    r.raise_for_status()
    got = r.json()
    return got["usage"], next((got[k] for k in ("content", "output", "choices") if k in got), [])


def reuse(turns: list[dict]) -> float | None:
    """history_reuse over turns 2.. (each turn with its `history_tokens` and `cached_tokens`)."""
    later = turns[1:]
    history = sum(t["history_tokens"] for t in later)
    if not history:
        return None
    return round(sum(min(t["cached_tokens"], t["history_tokens"]) for t in later) / history, 4)


def _turns(records: list[dict], usages: list[dict], answers: list | None) -> list[dict]:
    """The main conversation's turns, with the cache's share of each one's history."""
    out, prev = [], 0
    for i, (rec, usage) in enumerate(zip(records, usages)):
        prompt, cached, answer = tokens(rec["path"], usage)
        turn = {"turn": len(out) + 1, "prompt_tokens": prompt, "answer_tokens": answer,
                "cached_tokens": cached, "history_tokens": prev,
                "reuse": round(min(cached, prev) / prev, 4) if prev else None,
                "recomputed_tokens": (usage.get("kvbank") or {}).get("recomputed_tokens", 0)}
        if answers is not None:
            turn["answer_matches"] = answer_of(answers[i]) == answer_of(rec.get("answer"))
        out.append(turn)
        prev = prompt + answer
    return out


def _attribution_lines(records: list[dict]) -> int:
    """How many different Claude Code attribution lines (the system prompt's first block,
    which the shim leaves out of the prompt) the main requests carried."""
    lines = set()
    for r in records:
        system = r["body"].get("system")
        if isinstance(system, list) and system and "billing-header" in str(system[0]):
            lines.add(system[0].get("text"))
    return len(lines)


def vary_attribution(record: dict, n: int) -> dict:
    """`record` with Claude Code's attribution line made its `n`th request's own, as Claude
    Code writes it for Anthropic's API (cc_prompt_index, cc_prev_msg: new on every request);
    on any other base URL, the one the recordings were made on, the line never changes."""
    system = record["body"].get("system")
    if not (isinstance(system, list) and system and "billing-header" in str(system[0])):
        return record
    line = f"{system[0]['text']} cc_prompt_index={n}; cc_turn_index=1; cc_prev_msg=msg_{n:08x};"
    return {**record, "body": {**record["body"],
                               "system": [{**system[0], "text": line}, *system[1:]]}}


def run_client(http, base: str, records: list[dict], turns: int | None,
               vary: bool = False) -> dict:
    """Replays one client's recording in order (side requests too), up to `turns` main
    turns, and scores the main turns; with `vary`, each request's attribution line is its
    own (`vary_attribution`)."""
    sent, usages, answers, main = 0, [], [], []
    for rec in records:
        if turns is not None and is_main(rec) and len(main) == turns:
            break
        if vary:
            rec = vary_attribution(rec, sent)
        usage, answer = replay(http, base, rec)
        sent += 1
        if is_main(rec):
            main.append(rec)
            usages.append(usage)
            answers.append(answer)
    replayed = _turns(main, usages, answers)
    recorded = _turns(main, [r["usage"] for r in main], None)
    out = {"api": main[0]["path"] if main else None, "requests": sent, "turns": len(main),
           "history_reuse": reuse(replayed), "recorded_history_reuse": reuse(recorded),
           "recomputed_tokens": sum(t["recomputed_tokens"] for t in replayed),
           "answers_match": all(t["answer_matches"] for t in replayed),
           "mismatched_turns": [t["turn"] for t in replayed if not t["answer_matches"]],
           "per_turn": replayed}
    if main and main[0]["path"].startswith("/v1/messages"):
        out["attribution_lines"] = _attribution_lines(main)
    return out


def _shown(path: Path) -> str:
    """`path` as the JSON shows it: inside the repository, relative to it."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def run(clients: list[str], recordings: Path, turns: int | None = None,
        cache_dir: Path | None = None, vary: bool = False) -> dict:
    """Each client's recording replayed on a fresh stack of its own."""
    import httpx

    from kvbank.deploy.local import LocalStack
    from kvbank.testing.agent_model import agent_model

    for name in clients:
        if not (recordings / f"{name}.jsonl.gz").exists():
            raise FileNotFoundError(f"{recordings / name}.jsonl.gz: record it with "
                                    "`python -m kvbank.apps.bench.agent_record`")
    started = time.time()
    result = {"bench": "agents", "definition": DEFINITION, "goal": GOAL,
              "recordings": _shown(recordings), "model": MODEL, "calls": CALLS,
              "stack_flags": STACK_FLAGS,
              "vary_attribution": vary,
              "clients": {}}
    with tempfile.TemporaryDirectory(prefix="kvbank-bench-agents-") as tmp:
        root = Path(tmp)
        env = {"KVBANK_CACHE_DIR": str(cache_dir)} if cache_dir else {}
        for name in clients:
            model = agent_model(root / f"{name}-model", cache_dir, call=CALLS[name])
            records = load(recordings / f"{name}.jsonl.gz")
            stack = LocalStack.start(model, root / f"{name}-data", env=env, timeout_s=120,
                                     extra=STACK_FLAGS)
            try:
                with httpx.Client(timeout=600) as http:
                    result["clients"][name] = run_client(http, stack.shim_url, records, turns,
                                                          vary)
            finally:
                stack.stop()
    scores = [c["history_reuse"] for c in result["clients"].values()
              if c["history_reuse"] is not None]
    result["min_history_reuse"] = min(scores) if scores else None
    result["meets_goal"] = bool(scores) and min(scores) >= GOAL
    result["seconds"] = round(time.time() - started, 1)
    return result


def summary(result: dict) -> dict:
    """The table's rows: per client, what the docs show."""
    return {name: {k: c[k] for k in ("history_reuse", "turns", "recomputed_tokens",
                                     "answers_match", "recorded_history_reuse")}
            for name, c in result["clients"].items()}


def run_cli(args: argparse.Namespace) -> int:
    from kvbank.apps.bench.report import print_result, write_json

    if args.template:
        return _run_templates(args)
    clients = QUICK["clients"] if args.quick else [c for c in args.clients.split(",") if c]
    turns = QUICK["turns"] if args.quick and args.turns is None else args.turns
    if unknown := set(clients) - set(CLIENTS):
        raise SystemExit(f"kvbank bench agents: unknown clients: {', '.join(sorted(unknown))}")
    result = run(clients, args.recordings, turns, vary=args.vary_attribution)
    if args.json:
        write_json(result, args.json)
    if args.json != "-":
        print_result("agents", {**summary(result), "meets_goal": result["meets_goal"]}, False)
    return 0


def _run_templates(args: argparse.Namespace) -> int:
    from kvbank.apps.bench import agent_families as fam
    from kvbank.apps.bench.report import print_result, write_json

    apis = list(fam.APIS) if args.api == "all" else [a for a in args.api.split(",") if a]
    if unknown := set(apis) - set(fam.APIS):
        raise SystemExit(f"kvbank bench agents: unknown --api {', '.join(sorted(unknown))}; "
                         f"one of {', '.join(fam.APIS)}, or all")
    requests = args.turns or (QUICK["turns"] if args.quick else fam.REQUESTS)
    result = fam.run(fam.families_of(args.template), apis, requests)
    if args.json:
        write_json(result, args.json)
    if args.json != "-":
        print_result("agents --template", {**fam.summary(result),
                                           "meets_goal": result["meets_goal"]}, False)
    return 0
