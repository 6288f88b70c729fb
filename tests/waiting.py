"""Waiting in tests for something the bus does in its own time (a server back, a leader elected,
a record written)."""

from __future__ import annotations

import asyncio
import time


async def wait_for(what: str, ok, timeout: float = 30.0):
    """``await ok()`` again every 0.2 s until it returns something true (returned) or ``timeout``
    passes (AssertionError naming ``what`` and the last error): a server's loss moves leaders, and
    a read may fail for a moment."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = await ok()
            if result:
                return result
        except Exception as e:  # noqa: BLE001 - tried again until the deadline
            last = e
        else:
            last = None
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s (last error: {last!r})")
        await asyncio.sleep(0.2)
