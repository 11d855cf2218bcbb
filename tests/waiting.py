"""Waiting in tests for what another process does: a check polled until it holds, or a failure naming the wait."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(check: Callable[[], object], timeout_s: float, what: str = "condition") -> None:
    """Return once `check()` is true; fail the test if it is not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    if not check():
        raise AssertionError(f"{what} not reached in {timeout_s:.0f} s")
