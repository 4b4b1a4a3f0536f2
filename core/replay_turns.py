"""The turns in which durable subscriptions replay: per event loop, the subscriptions with
replay work to do are served in turn (round robin) by one callback per loop turn, together
within `TURN_PUMP_S`, so that many sessions resuming at once never hold up a CONNECT or an
acknowledgement. Knows nothing of what a subscription replays (`core/durable_replay.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .durable import DurableSubscription

log = logging.getLogger("shardgate.core.durable")

TURN_PUMP_S = 0.002
"""Replay of every durable subscription together takes at most about this long per event-loop
turn (then the rest waits for the next turn, after the turn's I/O): with many sessions
resuming at once, a CONNECT or an acknowledgement never waits behind all of their replays.
Under the soak the replay is a third of the loop's time, and a new connection waits through
one or two replay slices (the turn running as it connects, and the slice queued before its
`connection_made`): 2 ms rather than 4 took the soak's CONNECT -> CONNACK from p50 12-14 /
p99 24-34 ms to 9 / 20-24 on a loaded machine, with as many waves completed
(bench/RESULTS.md, 2026-11-24 16:00)."""


class PumpQueue:
    """The durable subscriptions of one event loop with replay work to do, served in turn
    (round robin) by one callback per loop turn within `TURN_PUMP_S`; a subscription whose
    pump leaves work over asks again and goes to the back."""

    __slots__ = ("_loop", "_waiting", "_scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._waiting: deque[DurableSubscription] = deque()
        self._scheduled = False

    def add(self, subscription: DurableSubscription) -> None:
        self._waiting.append(subscription)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._run)

    def _run(self) -> None:
        self._scheduled = False
        waiting = self._waiting
        clock = time.perf_counter
        deadline = clock() + TURN_PUMP_S
        # Those that ask again while this runs wait for the next turn.
        for _ in range(len(waiting)):
            subscription = waiting.popleft()
            try:
                subscription._pump(deadline)
            except Exception:
                log.exception("replay of subscription %s failed", subscription.name)
            if clock() >= deadline:
                break
        if waiting and not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._run)


_pump_queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, PumpQueue] = weakref.WeakKeyDictionary()


def pump_queue(loop: asyncio.AbstractEventLoop) -> PumpQueue:
    queue = _pump_queues.get(loop)
    if queue is None:
        queue = _pump_queues[loop] = PumpQueue(loop)
    return queue
