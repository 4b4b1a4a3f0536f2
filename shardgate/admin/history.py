"""A short server-side history of the broker's traffic counters, for the dashboard's chart.

Every `interval_s` seconds the cumulative counters (messages and bytes in and out,
connections) are sampled into a ring of `span_s` worth of points; `/api/history` returns them
so a page load draws the last minutes at once instead of starting an empty chart. One sample
every few seconds: nothing here runs per message.
"""

from __future__ import annotations

import asyncio
import collections
import time
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
        self.samples: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=int(span_s / interval_s) + 1)
        self._task: asyncio.Task[None] | None = None

    def sample(self) -> None:
        point = {"t": time.time(), **self.read()}
        self.samples.append(point)

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

    def view(self) -> dict[str, Any]:
        return {"interval_s": self.interval_s, "span_s": self.span_s, "samples": list(self.samples)}
