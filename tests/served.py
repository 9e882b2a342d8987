"""Which stack served a turn, from the stacks' own event logs (tests of several stacks)."""

from __future__ import annotations

import json


def served_by(stacks) -> dict[tuple[str, int], set[int]]:
    """(conversation, its length after the turn) -> the stacks (by index) that committed
    that turn."""
    out: dict[tuple[str, int], set[int]] = {}
    for i, stack in enumerate(stacks):
        path = stack.layout.events_path
        for line in (path.read_text().splitlines() if path.exists() else ()):
            e = json.loads(line)
            if e["kind"] == "kv_resident":
                out.setdefault((e["session_id"], e["tokens"]), set()).add(i)
    return out
