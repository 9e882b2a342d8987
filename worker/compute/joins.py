"""What answers joining and leaving mlx-lm's batch hold in the worker's ledger.

An answer reads its prompt on its own cache and then joins mlx-lm's `BatchGenerator`, which
copies its cache into the batch's (worker/compute/scheduler.py). The copy is priced when the
join is asked, and held until the scheduler says it is made; members leaving the batch are
copied out a layer at a time, and the ledger holds that layer for the batch (Pricing). Where
the budget has no room for a join's copy the answers decode beside the batch, and are asked
again once the ledger falls below what it held at the refusal.
"""

from __future__ import annotations

from typing import Callable

from kvbank import metrics
from kvbank.contracts.pricing import Pricing
from kvbank.worker.compute.scheduler import Running
from kvbank.worker.memory.pricing import held_bytes


def length(r: Running) -> int:
    """The tokens a request's cache may reach: its prompt and max_tokens."""
    return len(r.tokens) + r.job.request.max_tokens


class BatchJoins:
    """The engine's answer to `BatchScheduler.may_join`, and what joins hold meanwhile (the
    engine thread's state; the ledger is the KV manager's)."""

    def __init__(self, pricing: Pricing, kv, batch, budget: Callable[[], int]):
        self.pricing = pricing
        self.kv = kv  # worker/tiers/manager.py KVManager
        self.batch = batch  # worker/compute/scheduler.py BatchScheduler
        self.budget = budget
        self.refused_at: int | None = None  # the ledger when a join was last refused

    def lens(self) -> list[int]:
        """The batch's members, by the tokens each may reach (`length`)."""
        return [length(r) for r in self.batch.running.values() if r.uid >= 0]

    def may_join(self, joining: list[Running]) -> bool:
        """Whether answers on their own caches may join mlx-lm's batch: the join copies each
        cache into the batch's, padded to the longest there (`Pricing.join_bytes`), and the
        batch's rows may grow longer (`hold_leave`). Each is charged its copy now, when the
        budget has room for all of it, until the copy is made (`settle`); else they decode on
        their own caches beside the batch (a forward each, no copy), and are asked again once
        the ledger falls below what it held then (`ask_again`)."""
        lens = self.lens()
        leave_was = self.pricing.leave_bytes(lens)
        extra = []
        for r in joining:
            extra.append(self.pricing.join_bytes(length(r), batch_len=max(lens, default=0),
                                                 batch_size=len(lens)))
            r.join_copy = extra[-1] - self.pricing.padding_bytes(
                length(r), batch_len=max(lens, default=0), batch_size=len(lens))
            lens.append(length(r))
        leave = self.pricing.leave_bytes(lens)
        held = held_bytes(self.pricing, self.kv)
        if sum(extra) + leave - leave_was > self.budget() - held:
            metrics.BATCH_JOINS.labels("no_memory").inc(len(joining))
            self.refused_at = held
            for r in joining:
                r.join_copy = 0
            return False
        self.refused_at = None
        for r, nbytes in zip(joining, extra):
            self.kv.reserve(r.bank_key, nbytes)
        self.kv.hold_leave(leave)
        metrics.BATCH_JOINS.labels("joined").inc(len(joining))
        return True

    def settle(self) -> None:
        """Answers whose join's copy is made (mlx-lm's merge, then its extend, a step each):
        their own caches are gone, and they hold their rows' padding from now on."""
        for r in self.batch.take_joined():
            self.kv.unreserve(r.bank_key, r.join_copy)
            r.join_copy = 0

    def hold_leave(self) -> None:
        """What members ending in the next step take as they leave the batch, held before it:
        a layer of every row, copied out or gathered (`Pricing.leave_bytes`)."""
        self.kv.hold_leave(self.pricing.leave_bytes(self.lens()))

    def ask_again(self) -> bool:
        """Whether answers beside the batch should be asked to join now: none was refused
        since the last join, or the ledger fell below what it held at the refusal (a prompt
        read, writes landed, an answer ended). Asked once: a refusal sets it again."""
        if self.refused_at is None or held_bytes(self.pricing, self.kv) < self.refused_at:
            self.refused_at = None
            return True
        return False

    def wants_writes(self) -> bool:
        """Whether the coldstore should write its queued jobs at once, tails too: a join was
        refused, and writes it holds in memory for us (`staged_bytes`) are part of what held
        the room (bench compare n-agents at 1.3 GB: 31-65 MB of young tails at every turn's
        start, kept for `--tail-delay-s`; a join of two 8 MB short)."""
        return self.refused_at is not None and self.kv.ledger()["staged_bytes"] > 0
