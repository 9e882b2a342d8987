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
    """Step 2: at most `max_active` requests at the worker, at most `max_queue` waiting.

    FIFO; a full queue refuses at once with a retry-after estimated from recent turn times,
    except a request whose conversation this machine holds (`holds`): behind a gateway a
    refusal sends it to another machine, which would recompute all of it, so it waits here
    (bounded by `max_wait_s` as any other).
    """

    def __init__(self, max_active: int, max_queue: int, max_wait_s: float):
        self.max_active = max(1, max_active)
        self.max_queue = max(0, max_queue)
        self.max_wait_s = max_wait_s
        self.active = 0
        self._waiters: deque[asyncio.Future] = deque()
        self._recent_s: deque[float] = deque(maxlen=32)

    @property
    def depth(self) -> int:
        return len(self._waiters)

    def retry_after_s(self) -> int:
        turn = sorted(self._recent_s)[len(self._recent_s) // 2] if self._recent_s else 1.0
        return max(1, math.ceil(turn * (self.depth + 1) / self.max_active))

    async def acquire(self, holds: Callable[[], Awaitable[bool]] | None = None) -> float:
        """Wait for a slot; returns the seconds waited. Raises Refused."""
        if self.active < self.max_active and not self._waiters:
            self.active += 1
            return 0.0
        if len(self._waiters) >= self.max_queue and not (holds is not None and await holds()):
            raise Refused(RefusalReason.QUEUE_FULL, Verdict.AFTER_IN_FLIGHT,
                          f"{self.active} requests are running and {self.depth} waiting "
                          f"(--max-queue {self.max_queue}): retry in {self.retry_after_s()} s",
                          retry_after_s=self.retry_after_s())
        t0 = time.monotonic()
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
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
                if fut in self._waiters:
                    self._waiters.remove(fut)
                    fut.cancel()
                elif fut.done() and not fut.cancelled():  # granted as we gave up: pass it on
                    self.release(0.0, count=False)
        return time.monotonic() - t0

    def release(self, held_s: float, count: bool = True) -> None:
        """A request left the worker: hand its slot to the next waiter."""
        if count:
            self._recent_s.append(held_s)
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes on; `active` is unchanged
                return
        self.active -= 1
