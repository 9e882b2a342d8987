"""The router's admission queue shares the worker between tenants (router/admission.py): a
line per API key, served by turns, a cap on each key's running and waiting requests. Pure
policy on asyncio futures: which request gets the next slot, who is refused and why.

One FIFO line once made a tenant's 8-token request wait 222 s behind another's 20 long ones;
the times are `kvbank bench tenants`' to measure, the order is these tests'."""

from __future__ import annotations

import asyncio

import pytest

from kvbank.contracts.failures import Refused
from kvbank.router.admission import AdmissionQueue

pytestmark = pytest.mark.unit  # make test-fast


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def _queue(**kw) -> AdmissionQueue:
    return AdmissionQueue(**{"max_active": 4, "max_queue": 64, "max_wait_s": 60,
                             "max_active_per_tenant": 3, "max_queue_per_tenant": 32, **kw})


def test_a_flood_leaves_a_slot_and_the_next_slot_goes_to_the_other_tenant():
    async def run():
        q = _queue()
        for _ in range(3):  # A takes its share at once...
            assert await q.acquire("A") == 0.0
        a_waits = [asyncio.ensure_future(q.acquire("A")) for _ in range(5)]
        await _settle()
        assert q.running("A") == 3 and q.waiting("A") == 5  # ...and no more, the 4th slot free
        assert await q.acquire("B") == 0.0  # B gets it at once, behind none of A's
        b_wait = asyncio.ensure_future(q.acquire("B"))
        await _settle()
        q.release("A", 1.0)  # a slot frees: B waited later than all of A's, but it is B's turn
        await _settle()
        assert b_wait.done() and not any(f.done() for f in a_waits)
        q.release("B", 1.0)  # B has nothing waiting: A's oldest
        await _settle()
        assert a_waits[0].done() and not any(f.done() for f in a_waits[1:])
        assert q.running("A") == 3 and q.running("B") == 1
        for f in a_waits[1:]:
            f.cancel()
        await _settle()
        assert q.depth == 0

    asyncio.run(run())


def test_tenants_take_turns_and_each_keeps_its_own_order():
    async def run():
        q = _queue(max_active=1, max_active_per_tenant=1)
        await q.acquire("A")
        order = []

        async def wait(t: str, n: int) -> None:
            await q.acquire(t)
            order.append(f"{t}{n}")

        waiters = [asyncio.ensure_future(wait(t, n)) for t, n in
                   (("A", 1), ("A", 2), ("A", 3), ("B", 1), ("C", 1), ("B", 2))]
        await _settle()
        for _ in waiters:
            q.release(order[-1][0] if order else "A", 1.0)
            await _settle()
        # A had the slot already: B and C come first, then by turns
        assert order == ["B1", "C1", "A1", "B2", "A2", "A3"]

    asyncio.run(run())


def test_a_tenants_share_of_the_queue_refuses_it_and_not_the_others():
    async def run():
        q = _queue(max_active=1, max_active_per_tenant=1, max_queue=4, max_queue_per_tenant=2)
        await q.acquire("A")
        a = [asyncio.ensure_future(q.acquire("A")) for _ in range(2)]
        await _settle()
        with pytest.raises(Refused) as refused:
            await q.acquire("A")
        assert "--max-queue-per-tenant 2" in str(refused.value)
        assert refused.value.retry_after_s >= 1
        b = [asyncio.ensure_future(q.acquire("B")) for _ in range(2)]  # B's share is its own
        await _settle()
        assert q.depth == 4 and not any(f.done() for f in a + b)
        with pytest.raises(Refused) as full:  # the whole queue is full now
            await q.acquire("C")
        assert "--max-queue 4" in str(full.value)
        for f in a + b:
            f.cancel()

    asyncio.run(run())


def test_without_shares_it_is_one_line_as_before():
    """No API keys: one tenant; its cap is the worker's slots, its share the whole queue."""
    async def run():
        q = AdmissionQueue(2, 1, 60)
        await q.acquire()
        await q.acquire()
        waiting = asyncio.ensure_future(q.acquire())
        await _settle()
        with pytest.raises(Refused):
            await q.acquire()
        q.release("", 0.5)
        await _settle()
        assert waiting.done() and q.active == 2

    asyncio.run(run())
