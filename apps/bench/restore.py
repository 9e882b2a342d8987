"""`kvbank bench restore`: what a long restore from SSD costs the requests that keep decoding.

On a real stack (default model), one agent streams an answer while another returns to a
long conversation whose KV is on SSD only (released with its write-out; the data file's page
cache dropped, best effort). The streaming agent's inter-token gaps, as its client receives
them, are split in three: before the return is sent, during it (from its send until its
answer ends: the read from SSD, its prompt's last tokens, its join to the decode batch, its
few tokens), and after. Also: the returning turn's TTFT and restored tokens, and the engine
thread's stall per restore (`kvbank_worker_restore_stall_seconds`: none before issue #35).
`--stack-dir` runs the stack from another checkout, so that one machine measures a before
and an after with the same script.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

SKIP_GAPS = 5  # the streaming answer's first gaps (its hand-off, warming up): left out


def add_arguments(p) -> None:
    """`kvbank bench restore`'s flags."""
    from kvbank.apps.flags import model_flag

    model_flag(p)
    p.add_argument("--tokens", type=int, default=8000,
                   help="the returning conversation's length (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="returns, each from SSD")
    p.add_argument("--around", type=int, default=40,
                   help="streamed tokens before the return is sent, and after it ends")
    p.add_argument("--stream-tokens", type=int, default=4000,
                   help="the streaming answer's max_tokens: more than the return lasts")
    p.add_argument("--stack-dir", type=Path, default=None,
                   help="run the stack from the code in this checkout (a before/after)")
    p.add_argument("--json", action="store_true")


def run_cli(args: argparse.Namespace) -> int:
    from kvbank.apps.bench.report import print_result

    print_result("restore", run(model=args.model, tokens=args.tokens, repeats=args.repeats,
                                around=args.around, stream_tokens=args.stream_tokens,
                                stack_dir=args.stack_dir), args.json)
    return 0


class Stream:
    """A generation streamed on a thread: its tokens, and when each of its token events
    arrived (tests/test_background_restore.py reads the tokens)."""

    def __init__(self, client, *, session_id: str, token_ids: list[int], max_tokens: int):
        from kvbank.v1 import api_pb2

        req = api_pb2.GenerateRequest(session_id=session_id, max_tokens=max_tokens)
        req.tokens.ids.extend(token_ids)  # greedy: temperature 0 by default
        self.call = client.generation.Generate(req)
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.usage = None
        self.ended = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for ev in self.call:
                if ev.token_ids:
                    self.times.append(time.monotonic())
                    self.tokens.extend(ev.token_ids)
                if ev.HasField("usage"):
                    self.usage = ev.usage
        except Exception:  # cancelled
            pass
        finally:
            self.ended.set()

    def wait_tokens(self, n: int, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.times) < n:
            if self.ended.is_set() or time.monotonic() > deadline:
                raise RuntimeError(f"the streaming answer ended at {len(self.times)} tokens")
            time.sleep(0.005)


def _gaps(times: list[float], start: float, end: float) -> dict[str, list[float]]:
    """Gaps between consecutive tokens: before `start`, overlapping [start, end], after."""
    out: dict[str, list[float]] = {"before": [], "during": [], "after": []}
    for a, b in zip(times[SKIP_GAPS:], times[SKIP_GAPS + 1:]):
        where = "before" if b <= start else "after" if a >= end else "during"
        out[where].append(b - a)
    return out


def _stall(metrics_url: str) -> dict[str, list[float]]:
    """The worker's restore stall histogram: label -> [sum, count] (absent before #35)."""
    text = httpx.get(metrics_url, timeout=10).text
    got: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for m in family.samples:
            if m.name.startswith("kvbank_worker_restore_stall_seconds_"):
                entry = got.setdefault(m.labels["where"], [0.0, 0.0])
                if m.name.endswith("_sum"):
                    entry[0] = m.value
                elif m.name.endswith("_count"):
                    entry[1] = m.value
    return got


def _drop_page_cache(data_file: Path) -> None:
    with open(data_file, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _ms(xs: list[float], q: str) -> float:
    if not xs:
        return 0.0
    return round(1000 * (max(xs) if q == "max" else statistics.median(xs)), 1)


def run(model: Path | None = None, tokens: int = 8000, repeats: int = 3, around: int = 40,
        stream_tokens: int = 4000, stack_dir: Path | None = None) -> dict:
    from kvbank.deploy.local import LocalStack
    from kvbank.models import prepare_model
    from kvbank.v1 import api_pb2

    model = prepare_model(model)
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvbank-bench-restore-") as tmp:
        data = Path(tmp) / "data"
        stack = LocalStack.start(model, data, shim=False, timeout_s=600,
                                 popen={"cwd": str(stack_dir)} if stack_dir else None)
        try:
            with stack.client() as c:
                history = rng.integers(1000, 20000, tokens).tolist()
                c.generate(session_id="long", token_ids=history, max_tokens=4, timeout_s=900)
                for i in range(repeats):
                    # written out first (its tail too, which write-behind keeps back for
                    # --tail-delay-s), then gone from RAM
                    if c.release("long").dropped_unwritten_entries:
                        raise RuntimeError("the conversation was not written out in time")
                    _drop_page_cache(stack.layout.store_dir / "data.mdb")
                    stall0 = _stall(stack.metrics_url("worker"))
                    history = list(c.get_session("long").token_ids)
                    streaming = Stream(c, session_id=f"stream-{i}",
                                       token_ids=rng.integers(1000, 20000, 128).tolist(),
                                       max_tokens=stream_tokens)
                    streaming.wait_tokens(SKIP_GAPS + around)
                    start = time.monotonic()
                    returning = Stream(c, session_id="long", max_tokens=8,
                                       token_ids=history + rng.integers(1000, 20000,
                                                                        16).tolist())
                    returning.ended.wait(600)
                    end = time.monotonic()
                    streaming.wait_tokens(len(streaming.times) + around)
                    streaming.call.cancel()
                    u = returning.usage
                    if u is None or u.cache_source != api_pb2.CACHE_SOURCE_SSD:
                        raise RuntimeError(f"the return was not restored from SSD: {u}")
                    stall1 = _stall(stack.metrics_url("worker"))
                    gaps = _gaps(streaming.times, start, end)
                    rows.append({
                        "restored_tokens": u.cached_tokens,
                        "returning_ttft_s": round(u.ttft_s, 3),
                        "return_s": round(end - start, 3),
                        **{f"gap_{w}_{q}_ms": _ms(gaps[w], q)
                           for w in ("before", "during", "after") for q in ("p50", "max")},
                        "gaps_during": len(gaps["during"]),
                        "engine_stall_s": {k: round(v[0] - stall0.get(k, [0, 0])[0], 4)
                                           for k, v in stall1.items()
                                           if v[1] > stall0.get(k, [0, 0])[1]},
                    })
                kv_per_token = c.status().kv_bytes_per_token
        finally:
            stack.stop()
    med = {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]
           if isinstance(rows[0][k], (int, float))}
    return {
        "model": Path(model).name, "tokens": tokens, "repeats": repeats,
        "restored_mb": round(med["restored_tokens"] * kv_per_token / 2**20, 1),
        "stack_dir": str(stack_dir or "."),
        **{k: v for k, v in med.items() if k != "restored_tokens"},
        "restored_tokens": int(med["restored_tokens"]),
        "gap_during_max_ms_worst": max(r["gap_during_max_ms"] for r in rows),
        "runs": rows,
    }
