"""One read budget per event-loop turn, shared by every client listener (MQTT over TCP, TLS and
WebSocket, AMQP and AMQPS).

libuv reads a readable socket up to 32 times per callback (256 KiB each with uvloop), and one
poll can return every busy socket at once, so a turn that handled every read it was given would
last hundreds of milliseconds under a flood of publishes: new connections would wait in the
listen queue and CONNACKs / connection.open-ok go unsent for as long, turn after turn. Once
the reads of a turn have taken `budget_s` (`listeners.read_budget_s`, all protocols together),
a connection that reads does not handle what it read now: it stops reading its socket (TCP
back-pressure meanwhile) and hands the budget a callback that handles it at a later turn.

A turn begins at its first read (or with the handling of what earlier turns left). The reads
left for later are handled at the start of the next turn, oldest first, within one budget;
what does not fit waits for the turn after, and the reads of the coming poll share whatever
that turn has left. Between turns the listener accepts. A connection still in its opening
handshake (MQTT CONNECT, AMQP up to connection.open) does not ask the budget: those reads are
small and a client waiting for its answer is what the budget is there for.

`budget_s` 0 means no limit; a negative budget leaves every read after a turn's first for a
later turn (tests use it to force that path). The budget is sans-IO: it is handed the loop's
`call_soon` and a clock. The composition root makes one per broker and hands it to every
listener's service; a service made without one (tests) makes its own.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

# The default of `listeners.read_budget_s`: seconds of reads one event-loop turn handles. A new
# connection's CONNECT waits, at the poll that reports it, behind the rest of that turn's reads
# (the listener's readiness comes early in a poll's batch), so the budget is most of the wait:
# under the soak, 5 ms gave a CONNECT -> CONNACK p99 of 26-30 ms and 2 ms 19-21 ms, at the
# same throughput (bench/RESULTS.md, 2026-11-24 13:00).
DEFAULT_READ_BUDGET_S = 0.002


class ReadBudget:
    """The reads of one event loop's turns: how long this turn's have taken, and what waits."""

    __slots__ = ("budget_s", "_call_soon", "_clock", "_turn_start", "_turn_scheduled", "_waiting")

    def __init__(self, budget_s: float = DEFAULT_READ_BUDGET_S,
                 *, call_soon: Callable[[Callable[[], None]], Any],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.budget_s = budget_s
        self._call_soon = call_soon  # the event loop's (or a test clock's)
        self._clock = clock
        self._turn_start = 0.0  # when this turn's first read began; 0: no read yet this turn
        self._turn_scheduled = False
        self._waiting: deque[Callable[[], None]] = deque()

    @property
    def waiting(self) -> int:
        """Reads left for later turns, not handled yet."""
        return len(self._waiting)

    def spent(self) -> bool:
        """Asked before a read is handled: whether this turn's reads have used the budget.
        The turn's first read starts its clock (and is always handled)."""
        budget = self.budget_s
        if not budget:
            return False
        start = self._turn_start
        if not start:
            self._turn_start = self._clock()
            self._schedule_turn()
            return False
        return self._clock() - start > budget

    def defer(self, handle: Callable[[], None]) -> None:
        """Call `handle` at a later turn, after the reads deferred before it. The caller has
        stopped reading its socket and keeps what it read; `handle` handles it and reads on."""
        self._waiting.append(handle)
        self._schedule_turn()

    def _schedule_turn(self) -> None:
        if not self._turn_scheduled:
            self._turn_scheduled = True
            self._call_soon(self._next_turn)

    def _next_turn(self) -> None:
        """A new turn: handle the reads left for later, oldest first, within one budget; what
        remains waits for the turn after, and this turn's poll reads share what is left."""
        self._turn_scheduled = False
        waiting = self._waiting
        if not waiting:
            self._turn_start = 0.0
            return
        clock = self._clock
        start = self._turn_start = clock()
        budget = self.budget_s
        try:
            while waiting:
                waiting.popleft()()
                if clock() - start > budget:
                    break
        finally:
            self._schedule_turn()  # ends this turn, whether or not reads are still waiting
