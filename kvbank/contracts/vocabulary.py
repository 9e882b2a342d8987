"""The words that cross a process or reach a client: one enum per kind. Each is a StrEnum,
so it prints, logs, labels metrics and serializes to JSON as its plain string."""

from __future__ import annotations

from enum import StrEnum


class Decision(StrEnum):
    """What admission decided for one request."""

    ADMITTED = "admitted"
    WAIT = "wait"  # requests in flight hold the missing memory: first in line, it waits
    REFUSED = "refused"


class Verdict(StrEnum):
    """When a retry of the same request can succeed (the `x-kvbank-verdict` a client reads)."""

    AFTER_IN_FLIGHT = "after_in_flight_requests_finish"
    AFTER_SSD = "after_the_conversation_cache_reaches_ssd"
    NOT_WITHOUT_SHORTER = "not_without_a_shorter_prompt"
    NEVER = "never_at_this_limit"


NO_RETRY_VERDICTS = (Verdict.NEVER, Verdict.NOT_WITHOUT_SHORTER)


class RefusalReason(StrEnum):
    """Why a request was refused (the `x-kvbank-reason` a client reads)."""

    MAX_PROMPT_TOKENS = "max_prompt_tokens"
    MAX_REQUEST_TOKENS = "max_request_tokens"
    OVER_MEMORY_BUDGET = "over_memory_budget"
    MEMORY_HELD = "memory_held"
    IN_FLIGHT = "in_flight"
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"


class TrimReason(StrEnum):
    """Why KV left the RAM bank: which policy, called by whom."""

    BANK_BUDGET = "bank_budget"  # after a commit, over --bank-bytes
    DYNAMIC_CEILING = "dynamic_ceiling"  # the guard's tick: the budget minus everything else
    PRESSURE_WARNING = "pressure_warning"
    PRESSURE_CRITICAL = "pressure_critical"
    ADMISSION_LRU = "admission_lru"  # admission step 3
    ADMISSION_SHED = "admission_shed"  # step 4
    ADMISSION_RELEASE = "admission_release"  # step 5
    ADMIN_TRIM = "admin_trim"
    ADMIN_RELEASE = "admin_release"
    ADMIN_FLUSH = "admin_flush"  # nothing leaves: every conversation is written now
    PREFETCH = "prefetch"  # a hinted conversation, back sooner, took the place of one on SSD
    SESSION_DELETED = "session_deleted"


class Outcome(StrEnum):
    """How a coldstore write job ended."""

    WRITTEN = "written"
    SUPERSEDED = "superseded"  # a newer job of the same conversation took over its blocks
    CANCELLED = "cancelled"
    DEADLINE = "deadline"  # its write-out deadline passed: its blocks were taken back
    REFUSED = "refused"  # a budget said no (coldstore/budgets.py)
    ERROR = "error"
    STALE = "stale"
    UNKNOWN_JOB = "unknown_job"  # the coldstore does not know it (it restarted)


FAILED_OUTCOMES = frozenset({Outcome.DEADLINE, Outcome.ERROR, Outcome.REFUSED, Outcome.STALE,
                             Outcome.UNKNOWN_JOB, Outcome.CANCELLED})
# Sent again by retry_writes while the entry is still in RAM. A deadline too: the coldstore
# took the job's blocks back, so RAM holds the only copy again (a write promoted ahead, or a
# flush, that ran out of time must not leave the entry unprotected).
RETRY_OUTCOMES = frozenset({Outcome.REFUSED, Outcome.ERROR, Outcome.DEADLINE})


class Policy(StrEnum):
    """Which policy a receipt is from (`Receipt.kind`)."""

    SHRINK_TO_BYTES = "shrink_to_bytes"
    SHRINK_FOR_ADMISSION = "shrink_for_admission"
    IDLE_RELEASE = "idle_release"  # release_sessions
    RELEASE_WRITE_OUT = "release_write_out"  # release_sessions(write_out_before_release=True)
    PRESSURE_TRIM = "pressure_trim"
    FLUSH = "flush"
    ADMISSION = "admission"


class PressureSource(StrEnum):
    """What named the pressure level the guard acts on."""

    NONE = "none"  # normal: nothing to act on
    LEDGER = "ledger"  # kvbank's own bytes against its memory budget
    SYSTEM = "system"  # the machine's available memory
    PSI = "psi"  # the kernel's pressure stall information
    INJECTED = "injected"  # the Admin RPC (`kvbank admin pressure`)


class PressureLevel(StrEnum):
    NORMAL = "normal"
    WARNING = "warning"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        return list(PressureLevel).index(self)

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs, kept by the shim, router and worker
