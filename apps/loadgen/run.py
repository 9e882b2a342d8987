"""The runner: plays a scenario's turns against one target and records one `Row` per turn.

Bounded twice: each agent plays at most `params.turns` turns, and no turn starts after
`max_wall_s` (a turn in flight then gets only the time left as its timeout), so a run ends by
itself. A refused or failed turn is recorded and skipped (its message is dropped from the
agent's history, which stays as it was); there are no retries.

**New tokens** of a turn are the tokens the server had to compute at minimum: those not in
the agent's previous prompt + answer. With a tokenizer (`TokenCounter`, the served model's
folder) they are counted exactly, from the chat template: the new prompt's tokens past its
longest common prefix with the previous prompt's tokens followed by the answer's. Without one
they come from the usage: `prompt - previous prompt - previous completion` for a turn that
extends the history, and the whole prompt for an agent's first turn or a compaction turn
(an upper bound there). **Recomputed tokens** of a turn are then `prompt - cached - new` (at
least 0), when the server reports cached tokens; kvbank's own count (`usage.recomputed_tokens`)
is kept beside it as `server_recomputed_tokens`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvbank.apps.loadgen.scenarios import AgentScript, Conversation, Params, Scenario, TurnScript
from kvbank.apps.loadgen.targets import Reply, Target

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Row:
    agent: str
    session_id: str
    turn: int                                # 1-based, per agent
    status: str                              # ok | refused | error | timeout
    started_s: float                         # since the run started
    total_s: float
    ttft_s: float | None = None              # client-side, first answer text
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    new_tokens: int | None = None
    recomputed_tokens: int | None = None     # prompt - cached - new, >= 0
    server_recomputed_tokens: int | None = None
    cache_source: str | None = None          # ram | ssd | none: the server's; else derived:
    #                                          hit | partial (recomputed > 0) | miss (cached 0)
    server_ttft_s: float | None = None
    compacted: bool = False
    hint: str | None = None                  # --prefetch: what the hint before it did
    reason: str | None = None
    message: str | None = None


@dataclass
class RunResult:
    target: str
    params: Params
    run_id: str
    rows: list[Row]
    wall_s: float
    stopped_by: str                          # turns | max_wall_s
    token_counts: str                        # tokenizer | usage


class TokenCounter:
    """Exact token counts with the served model's tokenizer and chat template."""

    def __init__(self, model_dir: Path | str):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self._lock = threading.Lock()  # the runner's agent threads share it

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        with self._lock:
            return list(self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False))

    def text_ids(self, text: str) -> list[int]:
        with self._lock:
            return list(self.tokenizer.encode(text, add_special_tokens=False))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class _Agent:
    """One agent's conversation and what the runner remembers of its last good turn."""

    def __init__(self, script: AgentScript, session_id: str):
        self.script = script
        self.session_id = session_id
        self.conversation = Conversation(script)
        self.prev_ids: list[int] | None = None       # previous prompt + answer (tokenizer)
        self.hint: str | None = None                 # the prefetch hint before the next turn
        self.prev_total: int | None = None           # previous prompt + completion (usage)


class Runner:
    def __init__(self, scenario: Scenario, target: Target, *, run_id: str, max_wall_s: float,
                 request_timeout_s: float = 600.0, counter: TokenCounter | None = None,
                 on_row: Callable[[Row], None] | None = None, prefetch: bool = False):
        """`prefetch`: at the start of each think time, an agent hints that it will be back
        (kvbank's prefetch), as an agent harness would when a tool call starts."""
        self.scenario = scenario
        self.target = target
        self.run_id = run_id
        self.max_wall_s = max_wall_s
        self.request_timeout_s = request_timeout_s
        self.counter = counter
        self.on_row = on_row
        self.prefetch = prefetch
        self.rows: list[Row] = []
        self._rows_lock = threading.Lock()
        self._stop = threading.Event()
        self._t0 = 0.0

    def run(self) -> RunResult:
        self._t0 = time.monotonic()
        agents = [_Agent(a, f"{self.run_id}-{a.agent_id}") for a in self.scenario.agents]
        turns = self.scenario.params.turns
        if self.scenario.schedule == "alternate":
            for t in range(turns):
                for a in agents:
                    self._turn(a, a.script.turns[t])
        elif self.scenario.schedule == "sequential":
            for a in agents:
                for t in range(turns):
                    self._turn(a, a.script.turns[t])
        else:
            threads = [threading.Thread(target=self._agent_loop, args=(a,), daemon=True,
                                        name=f"loadgen-{a.script.agent_id}") for a in agents]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        wall_s = time.monotonic() - self._t0
        rows = sorted(self.rows, key=lambda r: r.started_s)
        return RunResult(self.target.url, self.scenario.params, self.run_id, rows, wall_s,
                         "max_wall_s" if self._stop.is_set() else "turns",
                         "tokenizer" if self.counter else "usage")

    def _remaining_s(self) -> float:
        return self.max_wall_s - (time.monotonic() - self._t0)

    def _agent_loop(self, a: _Agent) -> None:
        if self._stop.wait(min(a.script.start_s, max(0.0, self._remaining_s()))):
            return
        for t in a.script.turns:
            think_s = t.think_s
            if think_s and self.prefetch and len(a.conversation.history) > 1:
                hinted_at = time.monotonic()
                a.hint = self.target.prefetch(session_id=a.session_id,
                                              messages=list(a.conversation.history),
                                              timeout_s=max(1.0, think_s))
                think_s = max(0.0, think_s - (time.monotonic() - hinted_at))
            if think_s and self._stop.wait(min(think_s, max(0.0, self._remaining_s()))):
                return
            self._turn(a, t)

    def _turn(self, a: _Agent, t: TurnScript) -> None:
        remaining = self._remaining_s()
        if remaining <= 0 or self._stop.is_set():
            self._stop.set()
            return
        messages = a.conversation.next_messages(t)
        started = time.monotonic() - self._t0
        try:
            reply = self.target.send(agent_id=a.script.agent_id, session_id=a.session_id,
                                     messages=messages,
                                     max_tokens=self.scenario.params.max_tokens,
                                     timeout_s=max(1.0, min(self.request_timeout_s, remaining)))
        except Exception as e:  # a target bug must not kill an agent thread silently
            logger.warning("turn %d of %s failed: %s: %s", t.turn, a.script.agent_id,
                           type(e).__name__, e)
            reply = Reply("error", reason=type(e).__name__, message=str(e))
        row = Row(a.script.agent_id, a.session_id, t.turn, reply.status, round(started, 4),
                  round(reply.total_s, 4), compacted=t.compact_to is not None, hint=a.hint,
                  reason=reply.reason, message=reply.message)
        a.hint = None
        if reply.status == "ok":
            self._account(a, t, messages, reply, row)
            a.conversation.answered(reply.text)
        else:
            a.conversation.failed()
        with self._rows_lock:
            self.rows.append(row)
        if self.on_row:
            self.on_row(row)

    def _account(self, a: _Agent, t: TurnScript, messages: list[dict], reply: Reply,
                 row: Row) -> None:
        row.ttft_s = round(reply.ttft_s, 4) if reply.ttft_s is not None else None
        row.prompt_tokens = reply.prompt_tokens
        row.completion_tokens = reply.completion_tokens
        row.cached_tokens = reply.cached_tokens
        row.server_recomputed_tokens = reply.server_recomputed_tokens
        row.server_ttft_s = reply.server_ttft_s
        extends = a.prev_total is not None and t.compact_to is None
        if self.counter is not None:
            ids = self.counter.prompt_ids(messages)
            if row.prompt_tokens is None:
                row.prompt_tokens = len(ids)
            row.new_tokens = len(ids) - _common_prefix(ids, a.prev_ids or [])
            a.prev_ids = ids + self.counter.text_ids(reply.text)
        elif row.prompt_tokens is not None:
            row.new_tokens = row.prompt_tokens
            if extends:
                row.new_tokens = max(0, row.prompt_tokens - a.prev_total)
        if row.prompt_tokens is not None:
            a.prev_total = row.prompt_tokens + (row.completion_tokens or 0)
        if None not in (row.prompt_tokens, row.cached_tokens, row.new_tokens):
            row.recomputed_tokens = max(0, row.prompt_tokens - row.cached_tokens - row.new_tokens)
        if reply.cache_source:
            row.cache_source = reply.cache_source
        elif row.cached_tokens is not None:
            row.cache_source = ("miss" if row.cached_tokens == 0 else
                                "partial" if row.recomputed_tokens else "hit")
