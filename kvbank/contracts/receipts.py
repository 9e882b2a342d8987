"""Receipts: one type per policy, on one base. A policy returns its receipt, the bank keeps
the last ones (the Status RPC and `kvbank status` read them) and the event log gets each as
one line, so an operator can always answer "what did the worker do, and why"."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvbank.contracts.vocabulary import (Decision, Outcome, Policy, PressureLevel, PressureSource,
                                         RefusalReason, TrimReason, Verdict)


@dataclass(kw_only=True)
class Receipt:
    """`kind` names the policy, `reason` who called it and why (empty: an admitted request),
    `at` when (unix s)."""

    kind: Policy
    reason: TrimReason | RefusalReason | str = ""
    at: float = field(default_factory=time.time)


@dataclass(kw_only=True)
class TrimReceipt(Receipt):
    """A policy that trims the bank toward `target_bytes`."""

    target_bytes: int
    evicted_bytes: int = 0
    bytes_after: int = 0


@dataclass(kw_only=True)
class ShrinkReceipt(TrimReceipt):
    """`shrink_to_bytes`: what the LRU trim took and kept."""

    kind: Policy = Policy.SHRINK_TO_BYTES
    evicted_entries: int = 0
    unwritten_kept: int = 0
    unwritten_dropped: int = 0


@dataclass(kw_only=True)
class ShedReceipt(TrimReceipt):
    """`shrink_for_admission`: abandoned branches first, then whole idle turns."""

    kind: Policy = Policy.SHRINK_FOR_ADMISSION
    non_terminal_evicted: int = 0
    terminal_evicted: int = 0


@dataclass(kw_only=True)
class ReleaseRow:
    """One conversation `release_sessions` let go of."""

    session_id: str
    tenant: str = ""
    entries: int = 0
    held_bytes: int = 0
    on_ssd_entries: int = 0
    dropped_entries: int = 0
    written_out_entries: int = 0


@dataclass(kw_only=True)
class ReleaseReceipt(Receipt):
    """`release_sessions`: one row per conversation released; `write_out_s` is the time spent
    writing, summed over the writes."""

    kind: Policy = Policy.IDLE_RELEASE  # RELEASE_WRITE_OUT with write_out_before_release
    rows: list[ReleaseRow] = field(default_factory=list)
    released_entries: int = 0
    released_bytes: int = 0
    written_out_entries: int = 0
    unwritten_dropped: int = 0
    write_out_s: float = 0.0
    skipped_busy_sessions: int = 0

    def add(self, row: ReleaseRow) -> None:
        self.rows.append(row)
        self.released_entries += row.entries
        self.released_bytes += row.held_bytes
        self.written_out_entries += row.written_out_entries
        self.unwritten_dropped += row.dropped_entries


@dataclass(kw_only=True)
class PressureReceipt(Receipt):
    """`pressure_trim`: one guard action at a memory-pressure level."""

    kind: Policy = Policy.PRESSURE_TRIM
    level: PressureLevel
    source: PressureSource
    bank_entries_evicted: int = 0
    bank_unwritten_kept: int = 0
    bank_unwritten_dropped: int = 0
    bytes_after: int = 0
    deferred_s: float = 0.0


@dataclass(kw_only=True)
class FlushReceipt(Receipt):
    """`flush`: every conversation not on SSD yet, written now (they stay in RAM)."""

    kind: Policy = Policy.FLUSH
    written_entries: int = 0
    failed_entries: int = 0
    seconds: float = 0.0


@dataclass(kw_only=True)
class AdmissionReceipt(Receipt):
    """`make_room`: one per admitted or refused request, what it needed and what each step
    did. `reason` and `verdict` are set when it waits or is refused."""

    kind: Policy = Policy.ADMISSION
    need_bytes: int
    free_before: int  # taken_over_bytes counted as free (the request's own cache to be)
    free_after: int = 0
    taken_over_bytes: int = 0
    lru_evicted: int = 0
    shed_non_terminal: int = 0
    shed_terminal: int = 0
    released_sessions: int = 0
    shed_target_bytes: int | None = None  # the bank size step 4 shed to (chain shed: lower)
    written_out: int = 0
    write_out_s: float = 0.0  # its release step's writes
    decision: Decision = Decision.ADMITTED
    verdict: Verdict | str = ""  # empty while admitted
    holders: dict = field(default_factory=dict)
    tenant: str = ""
    session_id: str = ""


@dataclass(kw_only=True)
class Eviction:
    """One row of the bank's eviction log (`kvbank status --evictions`)."""

    at: float
    reason: TrimReason
    session_id: str
    prefix_tokens: int
    nbytes: int
    durable: bool
    release_write_out: Outcome | None = None  # when a write-out ran first
    write_out_s: float | None = None
    tenant: str = ""
