"""Output batching shared by the MQTT and AMQP services: what a loop turn writes to a connection
leaves in one write, after the turn.

A connection with output pending asks its service's `OutputBatcher` for a flush
(`request(connection)`); the first request of a turn schedules one `flush` on the service's
scheduler, which first runs `before_flush` (MQTT: commit the session state the
acknowledgements depend on) and then flushes every connection that asked, including those that
ask while it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class Flushable(Protocol):
    def flush(self) -> None: ...


ConnectionT = TypeVar("ConnectionT", bound=Flushable)


class OutputBatcher(Generic[ConnectionT]):
    """Connections with output pending, flushed together once per loop turn."""

    __slots__ = ("_dirty", "_scheduled", "_call_soon", "_before_flush")

    def __init__(self, call_soon: Callable[[Callable[[], None]], object],
                 before_flush: Callable[[], None] | None = None) -> None:
        self._dirty: list[ConnectionT] = []
        self._scheduled = False
        # The service's scheduler's call_soon (looked up when called: it may be set late).
        self._call_soon = call_soon
        self._before_flush = before_flush

    def request(self, connection: ConnectionT) -> None:
        self._dirty.append(connection)
        if not self._scheduled:
            self._scheduled = True
            self._call_soon(self.flush)

    def add(self, connection: ConnectionT) -> None:
        """Record `connection` without scheduling: the caller runs `flush` itself."""
        self._dirty.append(connection)

    def schedule(self) -> None:
        """Flush soon even if no connection asked (e.g. for `before_flush` alone)."""
        if not self._scheduled:
            self._scheduled = True
            self._call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if self._before_flush is not None:
            self._before_flush()
        while self._dirty:
            dirty, self._dirty = self._dirty, []
            for connection in dirty:
                connection.flush()
