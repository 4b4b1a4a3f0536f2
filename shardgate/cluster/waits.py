"""Waiting for something with a timeout, without ever losing a cancellation.

Python 3.11's `asyncio.wait_for` returns the awaited future's outcome (its result, or its
exception) when a cancellation of the waiting task comes in the loop turn that future
completed: the cancellation is swallowed. A loop stopped by cancelling it then runs on (a
follower kept following a dead leader, and the role change waiting for its end never ended).
`wait_within` is the cluster's `wait_for`: the same contract (TimeoutError when the time is
up, the awaited task cancelled and ended first; the awaited task cancelled and ended when
the waiter is cancelled), built on `asyncio.wait`, which lets a cancellation through.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_within(awaitable: Awaitable[T], timeout_s: float | None) -> T:
    """The outcome of `awaitable` (a coroutine is run as a task), or TimeoutError after
    `timeout_s` seconds (None: no limit), when it is cancelled and has ended. A cancellation
    of the caller cancels it too, waits for it to end, and is always raised."""
    future = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait((future,), timeout=timeout_s)
    except asyncio.CancelledError:
        future.cancel()
        if not future.done():
            await asyncio.wait((future,))
        raise
    if not done:
        future.cancel()
        if not future.done():
            await asyncio.wait((future,))
        if future.cancelled():
            raise TimeoutError
    # (a task that ended otherwise as it was being cancelled at the timeout: its outcome)
    return future.result()
