"""The scheduler's settings (`--scheduler-mode`, `--max-active-requests`, `--decode-wait-s`,
`--shared-forward-s`), checked at start. Apart from worker/compute/scheduler.py so that `kvbank up` checks them
without loading MLX.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbank.config import DEFAULT_DECODE_WAIT_S, DEFAULT_SHARED_FORWARD_S

SCHEDULERS = ("batch", "serial", "hyper")
DEFAULT_BATCH_ACTIVE = 4


@dataclass(frozen=True)
class SchedulerConfig:
    mode: str = "batch"
    max_active: int = DEFAULT_BATCH_ACTIVE
    decode_wait_s: float = DEFAULT_DECODE_WAIT_S  # see worker/compute/scheduler.py
    shared_forward_s: float = DEFAULT_SHARED_FORWARD_S  # likewise

    @classmethod
    def from_flags(cls, mode: str, max_active: int | None,
                   decode_wait_s: float = DEFAULT_DECODE_WAIT_S,
                   shared_forward_s: float = DEFAULT_SHARED_FORWARD_S) -> "SchedulerConfig":
        """Checked at start: a flag that contradicts the mode stops the process, naming it."""
        if mode not in SCHEDULERS:
            raise SystemExit(f"--scheduler-mode {mode}: choose one of {', '.join(SCHEDULERS)}")
        if max_active is not None and max_active < 1:
            raise SystemExit(f"--max-active-requests {max_active}: must be at least 1")
        if not decode_wait_s >= 0:
            raise SystemExit(f"--decode-wait-s {decode_wait_s}: must be 0 (answers take a token "
                             f"every step) or more")
        if not shared_forward_s > 0:
            raise SystemExit(f"--shared-forward-s {shared_forward_s}: must be more than 0")
        mode = "hyper" if mode == "serial" else mode  # its alias (docs/decisions.md)
        if mode == "hyper" and max_active not in (None, 1):
            raise SystemExit(f"--scheduler-mode hyper runs exactly one request at a time; "
                             f"--max-active-requests {max_active} would allow more: drop it "
                             f"or use --scheduler-mode batch")
        if max_active is None:
            max_active = DEFAULT_BATCH_ACTIVE if mode == "batch" else 1
        return cls(mode, max_active, decode_wait_s, shared_forward_s)
