"""Waiting for the cluster view to change instead of polling it.

A retry that waits for something only a change of the view can bring (a shard's owner back,
this node's lease granted at join) reads `count` before its attempt and, when the attempt
fails, awaits `since(count, timeout_s)`: it returns at the view's next change (at once if it
changed meanwhile), or after `timeout_s` at the latest (the backstop for what the view does
not announce, such as etcd answering again).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Protocol

from .waits import wait_within


class ChangingView(Protocol):
    def on_change(self, callback: Callable[[], None]) -> None: ...


class ViewChanges:
    """Counts the view's changes and wakes the waiters of the next one."""

    def __init__(self, view: ChangingView) -> None:
        self.count = 0
        self._waiters: list[asyncio.Future[None]] = []
        view.on_change(self._changed)

    def _changed(self) -> None:
        self.count += 1
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def since(self, seen: int, timeout_s: float) -> None:
        """Return once the view changed after `seen` (a `count` read earlier), or after
        `timeout_s`."""
        if self.count != seen:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        with contextlib.suppress(TimeoutError):
            await wait_within(waiter, timeout_s)
