"""`kvbank bench agents --template FAMILY`: an agent's tool loop on each model family's
published chat template, and how much of what each turn added the next one reads from cache.

    kvbank bench agents --template qwen3_5,gpt_oss|all [--api chat|responses|anthropic|all]
                        [--turns N] [--json FILE]

Per family (kvbank/testing/family_models.py: Qwen3.5, Qwen3-Coder, GLM-4.5, GLM-4.6, gpt-oss,
Gemma 4, Nemotron Nano v2), its scripted tiny model (the family's architecture, SmolLM2's
tokenizer plus the family's tokens, weights set to write a line of reasoning and a call of
`run` in the family's own format) behind a fresh stack. The loop is the one tests/families.py
drives through the client SDKs, here as raw JSON over HTTP: a system prompt, two tools, a
query; each later request sends the whole history back exactly as the API returned it (the
answer, its reasoning and call, the tool's result), a new user query at the seventh.

For request t >= 2 (1-based), with H_t = the tokens of request t's prompt and answer (the
session's, read back from the worker) and C_t what it read from cache:

    K_t      = the tokens request t's prompt shares with H_{t-1} (all of it where the template
               writes back exactly the model's tokens; K_1 = the system prompt and tools, which
               every conversation shares and which are never counted)
    added_t  = |H_{t-1}| - K_{t-1}     (what the previous request added: the tool result or
                                        query before its answer, the history the template
                                        wrote anew, and the answer)
    reuse_t  = clip(min(C_t, |H_{t-1}|) - K_{t-1}, 0, added_t) / added_t

Where the template writes back exactly the model's tokens, the goal is reuse_t >= GOAL. Where
it does not, the step names the loss: `template_loss_tokens` (|H_{t-1}| - K_t: the previous
history's tokens from the first one the new prompt writes otherwise), what the template
wrote there against what the model did, and its cause; `restore_loss_tokens` is what the
server read from cache short of K_t (a model with recurrent or window layers restores at a
checkpoint).
"""

from __future__ import annotations

import tempfile
import time
import uuid
from pathlib import Path

GOAL = 0.99
APIS = ("chat", "responses", "anthropic")
REQUESTS = 9          # the query, then eight more
NEW_QUERY_AT = 7      # 1-based: the seventh request carries a new user query
MAX_TOKENS = 120      # the longest script is about 60 tokens
SYSTEM = "You are a coding agent."
STACK_FLAGS = ["--block-tokens", "16", "--quiet-grace-s", "0.1", "--tail-delay-s", "0"]
DEFINITION = ("reuse_t = clip(min(cached_t, |H_{t-1}|) - K_{t-1}, 0, added_t) / added_t, "
              "added_t = |H_{t-1}| - K_{t-1}, H_t = request t's prompt and answer tokens, "
              "K_t = the tokens request t's prompt shares with H_{t-1} (K_1: the system "
              "prompt and tools, shared by every conversation)")


def _tools(api: str) -> list[dict]:
    from kvbank.testing.family_models import TOOLS

    if api == "chat":
        return TOOLS
    if api == "responses":
        return [{"type": "function", **t["function"]} for t in TOOLS]
    return [{"name": t["function"]["name"], "description": t["function"]["description"],
             "input_schema": t["function"]["parameters"]} for t in TOOLS]


class Loop:
    """One conversation on one API, as a client keeps it: `body()` the next request,
    `answered(reply, i)` adds the answer, the tool's result and (before the new query's
    request) the user's next message; `usage(reply)` in the API's own shape."""

    def __init__(self, api: str, query: str):
        self.api, self.query = api, query
        self.history: list = [{"role": "user", "content": query}]

    @property
    def path(self) -> str:
        return {"chat": "/v1/chat/completions", "responses": "/v1/responses",
                "anthropic": "/v1/messages"}[self.api]

    def body(self) -> dict:
        common = {"model": "kvbank", "tools": _tools(self.api), "temperature": 0}
        if self.api == "chat":
            return {**common, "messages": [{"role": "system", "content": SYSTEM},
                                           *self.history], "max_tokens": MAX_TOKENS}
        if self.api == "responses":
            return {**common, "instructions": SYSTEM, "input": list(self.history),
                    "store": False, "max_output_tokens": MAX_TOKENS}
        return {**common, "system": SYSTEM, "messages": list(self.history),
                "max_tokens": MAX_TOKENS}

    def answered(self, reply: dict, i: int) -> list:
        """Adds the answer and what follows it; returns its calls as (name, arguments)."""
        import json

        result = f"a.py\nb{i}.py"
        new_query = i + 2 == NEW_QUERY_AT
        if self.api == "chat":
            m = {k: v for k, v in reply["choices"][0]["message"].items() if v is not None}
            calls = m.get("tool_calls") or []
            self.history += [m] + [{"role": "tool", "tool_call_id": c["id"], "content": result}
                                   for c in calls]
            if new_query:
                self.history.append({"role": "user", "content": "Now the tests folder."})
            return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                    for c in calls]
        if self.api == "responses":
            calls = [o for o in reply["output"] if o["type"] == "function_call"]
            self.history += reply["output"] + [
                {"type": "function_call_output", "call_id": o["call_id"], "output": result}
                for o in calls]
            if new_query:
                self.history.append({"role": "user", "content": "Now the tests folder."})
            return [(o["name"], json.loads(o["arguments"])) for o in calls]
        uses = [b for b in reply["content"] if b["type"] == "tool_use"]
        self.history.append({"role": "assistant", "content": reply["content"]})
        follow = [{"type": "tool_result", "tool_use_id": b["id"], "content": result}
                  for b in uses]
        if new_query:
            follow.append({"type": "text", "text": "Now the tests folder."})
        self.history.append({"role": "user", "content": follow or "Go on."})
        return [(b["name"], b["input"]) for b in uses]


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _clip(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[:n] + "…"


def cause(tok, before: list[int], prompt: list[int], at: int, new_query: bool) -> str:
    """Why the new prompt parts from the previous history at `at`: what the template wrote
    there against what the model generated, and whether it left out reasoning the model
    wrote (counted by the script's reasoning line)."""
    from kvbank.testing.family_models import REASONING

    model, template = tok.decode(before[at:]), tok.decode(prompt[at:])
    why = []
    dropped = model.count(REASONING) - template.count(REASONING)
    if dropped > 0:
        why.append(f"the template drops the reasoning of {dropped} earlier "
                   f"answer{'s' if dropped > 1 else ''}"
                   + (" at a new user query" if new_query else ""))
    why.append(f"it writes {_clip(template)!r} where the model's tokens read "
               f"{_clip(model)!r}")
    return "; ".join(why)


def system_part(tok, prompt: list[int]) -> int:
    """The tokens of `prompt` (a first request) that any other query would share: the
    system prompt and tools as the template renders them (two queries' renders compared,
    so no template has to render the system part alone)."""
    from kvbank.testing.family_models import TOOLS

    a, b = (tok.encode(tok.render([{"role": "system", "content": SYSTEM},
                                   {"role": "user", "content": q}], TOOLS))
            for q in ("List the files here.", "Which tests fail?"))
    return min(_common(a, b), _common(a, prompt))


def run_loop(stack, tok, api: str, requests: int) -> dict:
    """One tool loop on `api`; per request its tokens, cache and reuse (module doc)."""
    import httpx

    from kvbank.apps.bench.agent_record import tokens
    from kvbank.testing.family_models import CALL

    loop = Loop(api, f"[{uuid.uuid4().hex[:8]}] List the files here.")
    steps, calls_ok, kept_before = [], 0, 0
    with httpx.Client(timeout=600) as http, stack.client() as c:
        for i in range(requests):
            r = http.post(stack.shim_url + loop.path, json=loop.body())
            r.raise_for_status()
            reply = r.json()
            prompt_n, cached, answer_n = tokens(loop.path, reply["usage"])
            session = reply["usage"]["kvbank"]["session_id"]
            ids = list(c.get_session(session).token_ids)
            if i == 0:  # the system part every conversation shares: never counted
                kept_before = system_part(tok, ids[:prompt_n])
            calls_ok += loop.answered(reply, i) == [CALL]
            step = {"request": i + 1, "prompt_tokens": prompt_n, "cached_tokens": cached,
                    "answer_tokens": answer_n,
                    "recomputed_tokens": reply["usage"]["kvbank"]["recomputed_tokens"],
                    "new_query": i + 1 == NEW_QUERY_AT}
            if i:
                before, base = steps[-1]["_ids"], kept_before
                prompt = ids[:prompt_n]
                kept = _common(prompt, before)
                added = len(before) - base
                step |= {"history_tokens": len(before), "added_tokens": added,
                         "reuse": round(max(0, min(min(cached, len(before)) - base, added))
                                        / added, 4) + 0.0,
                         "template_loss_tokens": len(before) - kept,
                         "restore_loss_tokens": max(0, kept - cached)}
                why = [cause(tok, before, prompt, kept, step["new_query"])] \
                    if kept < len(before) else []
                if step["restore_loss_tokens"]:
                    why.append(f"restored {step['restore_loss_tokens']} tokens before that, at "
                               f"a checkpoint (a model with recurrent or window layers "
                               f"restores where it kept its state)")
                if why or step["reuse"] < GOAL:
                    step["cause"] = "; ".join(why) or "read less than the previous history"
                kept_before = kept
            step["_ids"] = ids
            steps.append(step)
    for s in steps:
        del s["_ids"]
    later = [s for s in steps if "reuse" in s]
    exact = [s["reuse"] for s in later if not s["template_loss_tokens"]]
    losses = [{k: s[k] for k in ("request", "reuse", "template_loss_tokens",
                                 "restore_loss_tokens", "cause") if k in s}
              for s in later if s["reuse"] < GOAL]
    added = sum(s["added_tokens"] for s in later)
    return {"api": loop.path, "requests": len(steps), "calls_structured": calls_ok,
            "history_reuse": round(sum(s["reuse"] * s["added_tokens"] for s in later)
                                   / added, 4) if added else None,
            "min_reuse_rendered_back": min(exact) if exact else None,
            "meets_goal": all(r >= GOAL for r in exact),
            "losses": losses, "per_request": steps}


def run(families: list[str], apis: list[str], requests: int = REQUESTS,
        cache_dir: Path | None = None) -> dict:
    """Each family on a fresh stack of its own; each API's loop there."""
    from kvbank.deploy.local import LocalStack
    from kvbank.router.tokenizer import PromptTokenizer
    from kvbank.testing.family_models import FAMILIES, scripted_model

    started = time.time()
    result = {"bench": "agents", "template": True, "definition": DEFINITION, "goal": GOAL,
              "requests": requests, "new_query_at": NEW_QUERY_AT, "stack_flags": STACK_FLAGS,
              "families": {}}
    env = {"KVBANK_CACHE_DIR": str(cache_dir)} if cache_dir else {}
    with tempfile.TemporaryDirectory(prefix="kvbank-bench-templates-") as tmp:
        for name in families:
            model = scripted_model(name, cache_dir=cache_dir)
            tok = PromptTokenizer(model)
            stack = LocalStack.start(model, Path(tmp) / name, env=env, timeout_s=300,
                                     extra=STACK_FLAGS)
            try:
                result["families"][name] = {
                    "title": FAMILIES[name].title, "template": FAMILIES[name].template,
                    "apis": {api: run_loop(stack, tok, api, requests) for api in apis}}
            finally:
                stack.stop()
    loops = [a for f in result["families"].values() for a in f["apis"].values()]
    result["meets_goal"] = bool(loops) and all(a["meets_goal"] for a in loops)
    result["seconds"] = round(time.time() - started, 1)
    return result


def summary(result: dict) -> dict:
    """The table's rows: per family and API, the reuse and each loss's cause."""
    return {f"{name} {api}": {"history_reuse": a["history_reuse"],
                              "min_reuse_rendered_back": a["min_reuse_rendered_back"],
                              "losses": {s["request"]: s.get("cause") for s in a["losses"]}}
            for name, f in result["families"].items() for api, a in f["apis"].items()}


def families_of(arg: str) -> list[str]:
    from kvbank.testing.family_models import FAMILIES

    names = list(FAMILIES) if arg == "all" else [n for n in arg.split(",") if n]
    if unknown := [n for n in names if n not in FAMILIES]:
        raise SystemExit(f"kvbank bench agents: unknown --template {', '.join(unknown)}; "
                         f"one of {', '.join(FAMILIES)}, or all")
    return names
