"""The one way tests wait: for a positive event, bounded, naming what they waited for.

A test never proves that something did not happen by sleeping; it waits for the event that
must come first (a receipt, an acknowledgement, a later request's answer) and then looks."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], what: str, timeout_s: float = 60.0,
               every_s: float = 0.05) -> T:
    """Poll `predicate` until it returns something truthy, and return that; fail the test
    with `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(every_s)
