"""A `Scheduler` whose time moves only when a test says so, for driving sans-IO connections
without an event loop."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class ManualTimer:
    def __init__(self, when: float, callback: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.when = when
        self.callback = callback
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """`time()`, `call_soon` and `call_later` on a clock that `advance` moves."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self._soon: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self._timers: list[tuple[float, int, ManualTimer]] = []
        self._order = itertools.count()

    def time(self) -> float:
        return self.now

    def call_soon(self, callback: Callable[..., Any], *args: Any) -> None:
        self._soon.append((callback, args))

    def call_later(self, delay: float, callback: Callable[..., Any], *args: Any) -> ManualTimer:
        timer = ManualTimer(self.now + delay, callback, args)
        heapq.heappush(self._timers, (timer.when, next(self._order), timer))
        return timer

    def run_soon(self) -> None:
        """Run what was deferred to the next turn (and what those calls defer in turn)."""
        while self._soon:
            batch, self._soon = self._soon, []
            for callback, args in batch:
                callback(*args)

    def advance(self, seconds: float) -> None:
        """Move time forward, running every timer that falls due, in order."""
        end = self.now + seconds
        self.run_soon()
        while self._timers and self._timers[0][0] <= end:
            when, _, timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self.now = max(self.now, when)
            timer.callback(*timer.args)
            self.run_soon()
        self.now = end
