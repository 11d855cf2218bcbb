"""Waiting in tests for what another process does: a check polled until it holds, or a failure naming the wait."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], object], timeout_s: float, every_s: float = 0.02) -> bool:
    """Whether `condition()` holds within `timeout_s` (asked every `every_s`, and once more at the end)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every_s)
    return bool(condition())


def wait_for(check: Callable[[], object], timeout_s: float, what: str = "condition") -> None:
    """Return once `check()` is true; fail the test if it is not within `timeout_s`."""
    if not wait_until(check, timeout_s, every_s=0.1):
        raise AssertionError(f"{what} not reached in {timeout_s:.0f} s")
