"""Scenarios: what each agent says, turn by turn, generated from a seed.

Every user and tool message (and the shared system prompt, and each compaction summary) is
drawn from `random.Random(seed)` over a fixed word list, before anything is sent. So two runs
with the same seed and parameters send the same messages, token for token, to any server.
A conversation's history is those messages plus the answers the server actually gave, so the
*prompts* are identical across servers given identical answers; at temperature 0 with the same
model (and the same chat template) they are.

Sizes are in tokens "about": every word of `WORDS` is one token with its leading space in
byte-level BPE vocabularies like SmolLM2's, and each newline, period and comma counts as one.

Scenarios (`SCENARIOS` holds each one's defaults):

- `two-agents`: two coding agents taking turns on one server (A1 B1 A2 B2 ...). One shared
  system prompt; each turn appends a tool result or a user message and asks for an answer, so
  both contexts grow every turn.
- `n-agents`: N agents at once (one thread each), each pausing a seeded think time around
  `think_s` between its turns, started staggered.
- `compaction`: one agent that every `compact_every` turns replaces its history with a summary:
  system prompt + one message holding the summary and the new message (a new, shorter prefix).
- `shared-prefix`: many short sessions, one after another, over one long system prompt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = tuple("""
the a an and or but if then else when while for with without from into onto over under about
file line code test build run error value list map key item node tree graph queue stack cache
bank block page read write open close send fetch parse check update delete create return call
start stop wait retry function class method module package import export config option flag
path name type field record user agent server client request response session token model
prompt answer turn budget memory disk small large fast slow new old first last next previous
empty full valid invalid true false null none count size length index offset limit total time
second minute hour day data text string number should must can will may would could need want
make take give keep find show use add remove this that these those here there now again also
only still just very more less most least fix bug patch change diff commit branch merge review
issue plan step task goal result output input loop thread lock event signal handler worker
router store table row column query schema
""".split())
TOOLS = ("read_file", "run_tests", "grep", "list_dir", "git_diff", "build")
DIRS = ("src", "lib", "tests", "core", "api", "util")

# Each scenario's defaults; `Params` fields not named here keep their class default.
SCENARIOS: dict[str, dict] = {
    "two-agents": dict(agents=2, turns=12, turn_tokens=150, system_tokens=300, max_tokens=32),
    "n-agents": dict(agents=4, turns=4, turn_tokens=100, system_tokens=300, max_tokens=32,
                     think_s=2.0),
    "compaction": dict(agents=1, turns=12, turn_tokens=150, system_tokens=300, max_tokens=32,
                       compact_every=4, summary_tokens=200),
    "shared-prefix": dict(agents=8, turns=2, turn_tokens=40, system_tokens=1200, max_tokens=16),
}
# How each scenario orders its turns: round-robin, one thread per agent, or agent after agent.
SCHEDULES = {"two-agents": "alternate", "n-agents": "concurrent", "compaction": "alternate",
             "shared-prefix": "sequential"}


@dataclass(frozen=True)
class Params:
    scenario: str = "two-agents"
    seed: int = 0
    agents: int = 2
    turns: int = 12              # per agent
    turn_tokens: int = 150       # about this many tokens per user/tool message
    system_tokens: int = 300     # the shared system prompt
    max_tokens: int = 32         # asked of the server per turn
    think_s: float = 0.0         # n-agents: mean pause between an agent's turns
    compact_every: int = 4       # compaction: turns between summaries
    summary_tokens: int = 200    # compaction: about this many tokens per summary

    def validate(self) -> "Params":
        if self.scenario not in SCENARIOS:
            raise ValueError(f"scenario must be one of {sorted(SCENARIOS)}; given: "
                             f"{self.scenario!r}")
        for name in ("agents", "turns", "turn_tokens", "max_tokens", "compact_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; given: {getattr(self, name)}")
        for name in ("system_tokens", "summary_tokens", "think_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0; given: {getattr(self, name)}")
        if self.scenario == "two-agents" and self.agents != 2:
            raise ValueError(f"two-agents has 2 agents; given: agents={self.agents}")
        return self


def params(scenario: str, **overrides) -> Params:
    """`Params` for a scenario: its defaults, then every override that is not None."""
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario must be one of {sorted(SCENARIOS)}; given: {scenario!r}")
    values = {**SCENARIOS[scenario], **{k: v for k, v in overrides.items() if v is not None}}
    return Params(scenario=scenario, **values).validate()


@dataclass(frozen=True)
class TurnScript:
    turn: int                        # 1-based, per agent
    content: str                     # the user or tool message of this turn
    compact_to: str | None = None    # this turn first replaces the history with this summary
    think_s: float = 0.0             # pause before this turn (concurrent schedule only)


@dataclass(frozen=True)
class AgentScript:
    agent_id: str
    system: str
    turns: tuple[TurnScript, ...]
    start_s: float = 0.0             # offset of the first turn (concurrent schedule only)


@dataclass(frozen=True)
class Scenario:
    params: Params
    schedule: str                    # alternate | concurrent | sequential
    agents: tuple[AgentScript, ...]

    def messages(self) -> list[str]:
        """Every seeded text of the scenario, in order (what determinism is checked on)."""
        out = []
        for a in self.agents:
            out.append(a.system)
            for t in a.turns:
                out += [t.compact_to or "", t.content, repr(t.think_s)]
        return out


class _Text:
    """Seeded text of about n tokens: words (1 token each), newlines, periods, commas."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def words(self, n: int) -> list[str]:
        return [self.rng.choice(WORDS) for _ in range(max(0, n))]

    def prose(self, n: int) -> str:
        """Sentences of 6-14 words; each sentence costs its words + 1 (the period)."""
        sentences, left = [], n
        while left > 1:
            k = min(left - 1, self.rng.randint(6, 14))
            w = self.words(k)
            sentences.append(" ".join([w[0].capitalize(), *w[1:]]) + ".")
            left -= k + 1
        return " ".join(sentences)

    def lines(self, n: int) -> str:
        """Code-ish lines `a_b = c d ...` of about 6-11 tokens, newline included."""
        out, left = [], n
        while left > 1:
            k = min(left - 1, self.rng.randint(6, 11))
            out.append("_".join(self.words(2)) + " = " + " ".join(self.words(k - 4)))
            left -= k + 1
        return "\n".join(out)

    def path(self) -> str:
        return f"{self.rng.choice(DIRS)}/{'_'.join(self.words(2))}.py"


def _system(text: _Text, n: int) -> str:
    head = "You are a coding agent working in a repository. Follow the rules below.\n"
    return head + text.prose(max(0, n - 16))


def _user_message(text: _Text, n: int, turn: int) -> str:
    if turn % 2 == 1:
        return "Task: " + text.prose(n - 2)
    tool = text.rng.choice(TOOLS)
    return f"Tool result ({tool} {text.path()}):\n" + text.lines(n - 12)


def build(p: Params) -> Scenario:
    """The scenario's scripts, all drawn from one `random.Random(p.seed)` in a fixed order."""
    p.validate()
    text = _Text(random.Random(f"kvbank-loadgen/{p.scenario}/{p.seed}"))
    system = _system(text, p.system_tokens)
    agents = []
    for i in range(p.agents):
        name = f"session{i:02d}" if p.scenario == "shared-prefix" else f"agent{i}"
        turns = []
        for t in range(1, p.turns + 1):
            compact_to = None
            if p.scenario == "compaction" and t > 1 and (t - 1) % p.compact_every == 0:
                compact_to = "Summary of the work so far: " + text.prose(p.summary_tokens - 6)
            think_s = 0.0
            if p.scenario == "n-agents" and t > 1:
                think_s = round(p.think_s * text.rng.uniform(0.5, 1.5), 3)
            turns.append(TurnScript(t, _user_message(text, p.turn_tokens, t), compact_to,
                                    think_s))
        start_s = round(i * p.think_s * text.rng.uniform(0.25, 0.75), 3) \
            if p.scenario == "n-agents" else 0.0
        agents.append(AgentScript(name, system, tuple(turns), start_s))
    return Scenario(p, SCHEDULES[p.scenario], tuple(agents))


class Conversation:
    """One agent's history as the OpenAI API sees it: the seeded messages plus the answers.

    `next_messages(turn)` is the whole conversation to send for that turn; `answered(text)`
    keeps the turn (its message and the server's answer), `failed()` drops its message, so a
    refused turn leaves the history as it was. A compaction turn replaces the history before
    its message is added.
    """

    def __init__(self, agent: AgentScript):
        self.agent = agent
        self.history: list[dict] = [{"role": "system", "content": agent.system}]
        self._pending: list[dict] | None = None

    def next_messages(self, turn: TurnScript) -> list[dict]:
        base = self.history
        content = turn.content
        if turn.compact_to is not None:
            base = base[:1]
            content = f"{turn.compact_to}\n\n{turn.content}"
        self._pending = [*base, {"role": "user", "content": content}]
        return list(self._pending)

    def answered(self, text: str) -> None:
        assert self._pending is not None, "answered() without next_messages(): a bug"
        self.history = [*self._pending, {"role": "assistant", "content": text}]
        self._pending = None

    def failed(self) -> None:
        self._pending = None
