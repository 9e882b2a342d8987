"""`--record-requests FILE`: what agents send, kept to look at and to replay.

Each generation request the shim answered becomes one JSON line: the time, the path, the
request's body as the client sent it, and the usage the client got back (in its API's shape,
with kvbank's facts under `kvbank`). Bodies hold whole conversations, so this is off unless
asked for; the file only grows.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


class Recorder:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def record(self, path: str, body: object, usage: dict | None) -> None:
        line = json.dumps({"at": round(time.time(), 3), "path": path, "body": body,
                           "usage": usage}, ensure_ascii=False)
        with self.path.open("a", encoding="utf-8") as f:  # the event loop's alone
            f.write(line + "\n")
