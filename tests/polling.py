"""Waiting, with a bound, for what the server does after it answers (drains, stats)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    """Poll ``condition`` until it is true; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.25)


async def until(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    """``wait_for`` in a coroutine: the event loop runs on while it polls."""
    import asyncio

    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.01)
