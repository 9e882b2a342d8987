"""`--record-requests FILE`: what agents send, kept to look at and to replay.

Each generation request the shim answered becomes one JSON line: the time, the path, the
request's body as the client sent it, the usage the client got back (in its API's shape,
with kvbank's facts under `kvbank`), and the answer (`answer`: the body's `choices`, `content`
or `output`), so that a replay (`kvbank bench agents`) can tell whether it still gets the
same. Bodies hold whole conversations, so this is off unless asked for; the file only grows.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


class Recorder:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def record(self, path: str, body: object, usage: dict | None,
               answer: dict | None = None) -> None:
        content = next((answer[k] for k in ("choices", "content", "output") if k in answer),
                       None) if answer else None
        line = json.dumps({"at": round(time.time(), 3), "path": path, "body": body,
                           "usage": usage, "answer": content}, ensure_ascii=False)
        with self.path.open("a", encoding="utf-8") as f:  # the event loop's alone
            f.write(line + "\n")
