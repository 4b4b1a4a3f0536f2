"""Logging refused publishes without a line per message: a publisher sending thousands of
payloads that do not fit a stream's schema must not flood the log.

The first refusal of each kind (the exception's class) is logged at once as a WARNING with its
client and reason; later ones at most once per `interval_s`, with how many there were since.
Every refusal is counted by the broker (`BrokerStats.rejected_by_reason`, the metric
`shardgate_messages_rejected_total`), and the client gets its own error each time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class RefusalLog:
    __slots__ = ("log", "interval_s", "clock", "_last")

    def __init__(self, log: logging.Logger, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.interval_s = interval_s
        self.clock = clock
        # kind -> (when its last line was written, refusals since that line)
        self._last: dict[str, tuple[float, int]] = {}

    def refused(self, who: str, topic: str, error: BaseException) -> None:
        kind = type(error).__name__
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last[0] < self.interval_s:
            self._last[kind] = (last[0], last[1] + 1)
            return
        self._last[kind] = (now, 0)
        more = f" ({last[1]} more refused like it since the last report)" if last and last[1] else ""
        self.log.warning("%s: publish to %r rejected: %s%s", who, topic, error, more)
