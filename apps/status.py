"""`kvbank status`: where every conversation's KV is, and the tiers, budgets and pressure.

One table of sessions (state, tokens, bytes in RAM, durable up to, dirty age, last use) and
one of the worker's memory; `--evictions` shows the bank's eviction log instead; `--watch`
redraws every `--every` seconds; `--json` prints the same as JSON. On a server with API keys,
the operator's key (`--admin-key`) shows every tenant and the whole server; an API key
(`--api-key`), that tenant's own conversations and figures.
"""

from __future__ import annotations

import json
import signal
import sys
from types import SimpleNamespace
import time

import grpc
from google.protobuf.json_format import MessageToDict
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from kvbank.client import Client


def key_hint(e: grpc.RpcError) -> str:
    """What to pass when the server wants a key."""
    if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return (" (pass the operator's key with --admin-key or $KVBANK_ADMIN_KEY, or an API "
                "key with --api-key or $KVBANK_API_KEY)")
    return ""


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _ago(t: float, now: float) -> str:
    if not t:
        return "-"
    s = max(0.0, now - t)
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.0f}h"


def snapshot(c: Client) -> dict:
    return {"sessions": [MessageToDict(s, always_print_fields_with_no_presence=True)
                         for s in c.list_sessions()],
            "worker": MessageToDict(c.status(), always_print_fields_with_no_presence=True)}


def evictions(c: Client) -> list[dict]:
    return [json.loads(x) for x in c.status().recent_evictions_json]


def render_evictions(c: Client) -> Table:
    """The bank's eviction log: who left RAM, why, and what a release's write did."""
    now = time.time()
    t = Table(title="evictions (newest last)", title_justify="left")
    for col in ("ago", "session", "reason", "tokens", "RAM", "on SSD", "write-out", "write s"):
        t.add_column(col, justify="left" if col in ("session", "reason", "write-out")
                     else "right")
    for e in evictions(c):
        t.add_row(_ago(e["at"], now), e["session_id"], e["reason"], str(e["prefix_tokens"]),
                  _mb(e["nbytes"]), "yes" if e["durable"] else "no",
                  e["release_write_out"] or "-",
                  "-" if e["write_out_s"] is None else f"{e['write_out_s']:.2f}")
    return t


def render(c: Client):
    now = time.time()
    st = c.status()
    sessions = Table(title="sessions", title_justify="left")
    for col in ("tenant", "session", "state", "tokens", "RAM", "durable up to", "dirty for",
                "last use"):
        sessions.add_column(col, justify="left" if col in ("tenant", "session", "state")
                            else "right")
    for s in sorted(c.list_sessions(), key=lambda s: -s.updated_at):
        dirty = s.durable_tokens < s.token_count
        sessions.add_row(s.tenant or "-", s.session_id, s.state, str(s.token_count),
                         _mb(s.ram_bytes),
                         str(s.durable_tokens), _ago(s.updated_at, now) if dirty else "-",
                         _ago(s.updated_at, now))
    rest = f"{st.kv_bits} bits" if st.kv_bits else "full precision"  # --kv-bits
    mtp = f"; MTP {st.mtp}" if st.mtp else ""
    if st.scope == "tenant":
        return Group(sessions, _tenant_memory(st, rest))
    memory = Table(title=f"worker memory (KV at rest: {rest}{mtp})", title_justify="left")
    for col in ("budget", "held", "model", "bank", "running", "staged", "bank cap",
                "pressure", "scheduler", "running / waiting"):
        memory.add_column(col, justify="right")
    memory.add_row(_mb(st.memory_budget_bytes), _mb(st.held_bytes), _mb(st.fixed_bytes),
                   f"{_mb(st.bank_bytes)} ({st.bank_entries})", _mb(st.running_bytes),
                   _mb(st.staged_bytes),
                   _mb(min(st.bank_max_bytes, st.bank_ceiling_bytes or st.bank_max_bytes)),
                   f"{st.pressure_level} ({st.pressure_source})", st.scheduler,
                   f"{st.running_requests} / {st.waiting_requests}")
    tiers = Table(title="SSD tier (coldstore)", title_justify="left")
    tier = json.loads(st.coldstore_json) if st.coldstore_json else {}
    if not tier:
        tiers.add_column("state")
        tiers.add_row("the coldstore is not answering")
    else:
        for col in ("stored KV", "sessions", "blocks", "queued jobs", "staged", "written",
                    "write budget left", "free disk"):
            tiers.add_column(col, justify="right")
        tiers.add_row(_mb(tier["store_bytes"]), str(tier["sessions"]), str(tier["blocks"]),
                      str(tier["queued_jobs"]), _mb(tier["staged_bytes"]),
                      _mb(tier["written_bytes"]), _mb(tier["write_budget_left_bytes"]),
                      _mb(tier["free_disk_bytes"]))
    return Group(sessions, memory, tiers)


def _tenant_memory(st, rest: str) -> Table:
    """An API key's own view: its conversations in RAM and its requests; the server's figures
    are the operator's (`--admin-key`)."""
    t = Table(title=f"this API key's conversations (KV at rest: {rest}; the whole server: "
                    f"--admin-key)", title_justify="left")
    for col in ("in RAM", "budget", "bank cap", "pressure", "scheduler", "running / waiting"):
        t.add_column(col, justify="right")
    t.add_row(f"{_mb(st.bank_bytes)} ({st.bank_entries})", _mb(st.memory_budget_bytes),
              _mb(st.bank_max_bytes), st.pressure_level, st.scheduler,
              f"{st.running_requests} / {st.waiting_requests}")
    return t


def run_status(address: str, *, watch: bool, every_s: float, as_json: bool,
               show_evictions: bool = False, api_key: str | None = None,
               admin_key: str | None = None) -> int:
    draw = render_evictions if show_evictions else render
    try:
        with Client(address, api_key, admin_key) as c:
            if as_json:
                print(json.dumps(evictions(c) if show_evictions else snapshot(c)))
                return 0
            if not watch:
                console = Console()
                if not console.is_terminal:  # a pipe or a file: do not squeeze to 80 columns
                    console = Console(width=160)
                console.print(draw(c))
                return 0
            return _watch(c, draw, every_s)
    except grpc.RpcError as e:
        print(f"kvbank status: {address}: {e.code().name}: {e.details()}{key_hint(e)}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def _watch(c: Client, draw, every_s: float) -> int:
    """Redraw until Ctrl-C. Ctrl-C only sets a flag: raised as KeyboardInterrupt in the middle
    of a gRPC call, it can leave the channel's close waiting on that call for good (the
    process never exits; grpc/grpc#19973), so the loop stops between calls instead. The flag
    is a plain attribute: an Event set from the handler deadlocks when Ctrl-C lands while this
    thread holds the Event's own lock (the watch then never exits)."""
    pressed = SimpleNamespace(yes=False)
    before = signal.signal(signal.SIGINT, lambda *_: setattr(pressed, "yes", True))
    try:
        with Live(draw(c), refresh_per_second=4) as live:
            while not pressed.yes:
                next_at = time.monotonic() + every_s
                while not pressed.yes and time.monotonic() < next_at:
                    time.sleep(min(0.05, every_s))
                if not pressed.yes:
                    live.update(draw(c))
    finally:
        signal.signal(signal.SIGINT, before)
    return 0
