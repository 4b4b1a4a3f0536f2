"""A short server-side history of the broker's traffic counters, for the dashboard's chart.

Every `interval_s` seconds the cumulative counters (messages and bytes in and out,
connections) are sampled into a ring of `span_s` worth of points; `/api/history` returns them
so a page load draws the last minutes at once instead of starting an empty chart. One sample
every few seconds: nothing here runs per message.

The ring is columns of machine numbers (`array`), one per counter, sized for the whole span
when the first sample comes (at start): a sample writes numbers into them and makes no object
that outlives it. A dict per sample, kept for 15 minutes, would be a few long-lived objects
made every few seconds under load, each pinning an arena of Python's small-object heap that
the load's garbage shares, so an idle broker could not give that memory back.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections.abc import Callable
from typing import Any

INTERVAL_S = 5.0
SPAN_S = 900.0  # 15 minutes


class TrafficHistory:
    def __init__(self, read: Callable[[], dict[str, Any]], interval_s: float = INTERVAL_S,
                 span_s: float = SPAN_S) -> None:
        self.read = read
        self.interval_s = interval_s
        self.span_s = span_s
        self.capacity = int(span_s / interval_s) + 1
        self._columns: dict[str, array[Any]] = {}
        self._count = 0  # samples taken; the newest is at (count - 1) % capacity
        self._task: asyncio.Task[None] | None = None

    def sample(self) -> None:
        point = {"t": time.time(), **self.read()}
        slot = self._count % self.capacity
        for name, value in point.items():
            column = self._columns.get(name)
            if column is None:
                code = "d" if isinstance(value, float) else "q"
                column = self._columns[name] = array(code, bytes(8 * self.capacity))
            column[slot] = value
        self._count += 1

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="traffic-history")

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    @property
    def samples(self) -> list[dict[str, Any]]:
        """The points held, oldest first."""
        count = min(self._count, self.capacity)
        first = self._count - count
        slots = [(first + index) % self.capacity for index in range(count)]
        return [{name: column[slot] for name, column in self._columns.items()} for slot in slots]

    def view(self) -> dict[str, Any]:
        return {"interval_s": self.interval_s, "span_s": self.span_s, "samples": self.samples}
