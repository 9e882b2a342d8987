"""The structured event log: one JSON line per KV state transition and per policy receipt.

Kinds: `kv_resident` (a turn's KV entered the bank), `kv_durable` (its blocks are on SSD),
`kv_evicted` (it left RAM, with the reason and where it can come back from), `kv_restored`
(a request reused it, from ram or ssd), `conversation_retired` (the coldstore dropped a
conversation's KV: `anonymous_ttl`, `store_cap`), and the receipts `admission`,
`shrink_to_bytes`, `shrink_for_admission`, `idle_release`, `release_write_out`,
`pressure_trim`. Written to `<data>/log/events.jsonl` by the worker and the coldstore (each
line is one append), rotated by size.
"""

from __future__ import annotations

import json
import logging
import time
from logging.handlers import RotatingFileHandler
from pathlib import Path

_log = logging.getLogger("kvbank.events")
_log.propagate = False


def open_log(path: Path, max_bytes: int = 64 << 20, backups: int = 5) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = RotatingFileHandler(path, maxBytes=max_bytes, backupCount=backups)
    handler.setFormatter(logging.Formatter("%(message)s"))
    _log.handlers[:] = [handler]
    _log.setLevel(logging.INFO)


def emit(kind: str, **fields) -> None:
    if _log.handlers:
        _log.info(json.dumps({"at": round(time.time(), 6), "kind": kind, **fields},
                             default=str))
