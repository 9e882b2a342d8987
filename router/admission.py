"""The router's two admission steps: per-request ceilings, then a bounded queue.

They run before the worker is asked for anything, so a request that can never fit, or one
that would wait forever, is answered at once. Every refusal is a `Refused` (kvbank/contracts/failures.py):
a reason code, a retry verdict and, when waiting can help, a retry-after in seconds. The
worker's own steps (bank shrink, admission shed, release) follow in worker/tiers/eviction.py (`make_room`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Awaitable, Callable

from kvbank.contracts.failures import Refused
from kvbank.contracts.pricing import Pricing
from kvbank.contracts.vocabulary import RefusalReason, Verdict

def worker_pricing(info) -> Pricing:
    """The worker's own price list, from its Info."""
    return Pricing(info.kv_bytes_per_token, info.fixed_bytes, info.prefill_chunk_tokens,
                   info.transient_base_bytes, info.transient_per_context_token)


@dataclass(frozen=True)
class Ceilings:
    max_prompt_tokens: int | None = None
    max_request_tokens: int | None = None  # prompt + max_tokens


def check_ceilings(c: Ceilings, *, prompt_tokens: int, max_tokens: int, info) -> None:
    """Step 1: refuse at once what can never run at this configuration."""
    if c.max_prompt_tokens is not None and prompt_tokens > c.max_prompt_tokens:
        raise Refused(RefusalReason.MAX_PROMPT_TOKENS, Verdict.NOT_WITHOUT_SHORTER,
                      f"the prompt is {prompt_tokens} tokens; this server takes at most "
                      f"{c.max_prompt_tokens} (--max-prompt-tokens): shorten it or compact the "
                      f"conversation")
    total = prompt_tokens + max_tokens
    if c.max_request_tokens is not None and total > c.max_request_tokens:
        raise Refused(RefusalReason.MAX_REQUEST_TOKENS, Verdict.NOT_WITHOUT_SHORTER,
                      f"prompt ({prompt_tokens}) + max_tokens ({max_tokens}) = {total} tokens; "
                      f"this server takes at most {c.max_request_tokens} "
                      f"(--max-request-tokens): lower max_tokens or shorten the prompt")
    if not info.memory_budget_bytes:
        return
    pricing = worker_pricing(info)
    if pricing.request_bytes(prompt_tokens, max_tokens) > info.memory_budget_bytes - info.fixed_bytes:
        fits = pricing.max_fit_tokens(info.memory_budget_bytes, prompt_tokens)
        raise Refused(RefusalReason.OVER_MEMORY_BUDGET, Verdict.NEVER,
                      f"prompt ({prompt_tokens}) + max_tokens ({max_tokens}) = {total} tokens, "
                      f"but the worker's memory budget ({info.memory_budget_bytes / 1e6:.0f} MB, "
                      f"--memory-budget) fits at most {fits} tokens with this prompt, even "
                      f"with every other conversation moved to SSD: shorten it, lower "
                      f"max_tokens or raise the budget")


class AdmissionQueue:
    """Step 2: at most `max_active` requests at the worker, at most `max_queue` waiting; each
    tenant (API key) at most `max_active_per_tenant` running and `max_queue_per_tenant`
    waiting, and the tenants served by turns.

    One tenant's flood once made another's 8-token request wait 222 s in one FIFO line. Now a
    slot that frees goes to a tenant with a request waiting and under its running cap: the
    one with the fewest running, and of those the one served longest ago (round robin); the
    oldest of that tenant's requests first. A tenant at its cap leaves the slot to others (by
    default the cap is one slot short: a flood never takes them all). A full
    queue, or a tenant's full share of it, refuses at once with a retry-after estimated from
    recent turn times, except a request whose conversation this machine holds (`holds`):
    behind a gateway a refusal sends it to another machine, which would recompute all of it,
    so it waits here (bounded by `max_wait_s` as any other) unless its tenant's share is full.
    """

    def __init__(self, max_active: int, max_queue: int, max_wait_s: float,
                 max_active_per_tenant: int | None = None,
                 max_queue_per_tenant: int | None = None):
        self.max_active = max(1, max_active)
        self.max_queue = max(0, max_queue)
        self.max_wait_s = max_wait_s
        self.per_tenant_active = max(1, min(self.max_active, max_active_per_tenant
                                            or self.max_active))
        self.per_tenant_queue = (None if max_queue_per_tenant is None  # no share: one line
                                 else max(0, max_queue_per_tenant))
        self.active = 0
        self._running: dict[str, int] = {}  # tenant -> its requests at the worker
        self._waiting: dict[str, deque[asyncio.Future]] = {}  # tenant -> waiters, oldest first
        self._granted = 0  # slots granted so far
        self._last: dict[str, int] = {}  # tenant -> when it was last granted one (`_granted`)
        self._recent_s: deque[float] = deque(maxlen=32)

    @property
    def depth(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def waiting(self, tenant: str) -> int:
        return len(self._waiting.get(tenant, ()))

    def running(self, tenant: str) -> int:
        return self._running.get(tenant, 0)

    def retry_after_s(self) -> int:
        turn = sorted(self._recent_s)[len(self._recent_s) // 2] if self._recent_s else 1.0
        return max(1, math.ceil(turn * (self.depth + 1) / self.max_active))

    async def acquire(self, tenant: str = "",
                      holds: Callable[[], Awaitable[bool]] | None = None) -> float:
        """Wait for a slot; returns the seconds waited. Raises Refused."""
        if (self.active < self.max_active and self.running(tenant) < self.per_tenant_active
                and not self.waiting(tenant)):
            self._grant(tenant)
            return 0.0
        if self.per_tenant_queue is not None and self.waiting(tenant) >= self.per_tenant_queue:
            raise self._full(f"this API key has {self.running(tenant)} requests running and "
                             f"{self.waiting(tenant)} waiting (--max-queue-per-tenant "
                             f"{self.per_tenant_queue})")
        if self.depth >= self.max_queue and not (holds is not None and await holds()):
            raise self._full(f"{self.active} requests are running and {self.depth} waiting "
                             f"(--max-queue {self.max_queue})")
        t0 = time.monotonic()
        fut = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, deque()).append(fut)
        granted = False
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.max_wait_s)
            granted = True
        except asyncio.TimeoutError:
            raise Refused(RefusalReason.QUEUE_TIMEOUT, Verdict.AFTER_IN_FLIGHT,
                          f"waited {self.max_wait_s:.0f} s (--max-queue-wait-s) without a free "
                          f"slot: retry in {self.retry_after_s()} s",
                          retry_after_s=self.retry_after_s())
        finally:
            if not granted:  # timed out or the client went away
                if not fut.done():
                    self._forget(tenant, fut)
                    fut.cancel()
                elif not fut.cancelled():  # granted as we gave up: pass it on
                    self.release(tenant, 0.0, count=False)
        return time.monotonic() - t0

    def release(self, tenant: str = "", held_s: float = 0.0, count: bool = True) -> None:
        """A request of `tenant` left the worker: its slot goes to the next tenant in turn."""
        if count:
            self._recent_s.append(held_s)
        self.active -= 1
        self._running[tenant] -= 1
        if not self._running[tenant]:
            del self._running[tenant]
        self._hand_on()

    def _grant(self, tenant: str) -> None:
        self.active += 1
        self._running[tenant] = self._running.get(tenant, 0) + 1
        self._granted += 1
        self._last[tenant] = self._granted

    def _hand_on(self) -> None:
        """Free slots to waiters: each to the tenant with a request waiting, under its cap,
        that has the fewest running, and of those the one served longest ago (by turns)."""
        while self.active < self.max_active:
            ready = [t for t, q in self._waiting.items()
                     if q and self.running(t) < self.per_tenant_active]
            if not ready:
                return
            tenant = min(ready, key=lambda t: (self.running(t), self._last.get(t, 0)))
            q = self._waiting[tenant]
            fut = q.popleft()
            if not q:
                del self._waiting[tenant]
            self._grant(tenant)
            fut.set_result(None)

    def _forget(self, tenant: str, fut: asyncio.Future) -> None:
        """A waiter that gave up leaves its tenant's line (and the line, if it was the last)."""
        q = self._waiting.get(tenant)
        if q is not None and fut in q:
            q.remove(fut)
            if not q:
                del self._waiting[tenant]

    def _full(self, what: str) -> Refused:
        return Refused(RefusalReason.QUEUE_FULL, Verdict.AFTER_IN_FLIGHT,
                       f"{what}: retry in {self.retry_after_s()} s",
                       retry_after_s=self.retry_after_s())
