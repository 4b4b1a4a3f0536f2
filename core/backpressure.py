"""Back-pressure between publishers and whatever their messages fill: one object per broker.

A publisher is anything that can stop being read for a while (`Publisher`: an MQTT
connection, a cluster peer's link whose pushes are being dispatched). While its messages are
dispatched it is the `current` one (`publishing`). A queue that fills up (an MQTT session
behind its client, a cluster link whose peer is behind reading) declares itself congested:
the current publisher is held, and every held publisher is released once no queue is
congested any more. QoS ≥ 1 messages then wait in the publisher's socket (or its peer's link)
instead of overflowing the queue.

This module decides nothing about when a queue counts as congested or gives up: its owners do.
It must not import protocols or the cluster.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol


class Publisher(Protocol):
    """Something whose input can be paused: `hold()` stops reading it after what is in hand,
    `release()` reads it again; `held` says which."""

    @property
    def held(self) -> bool: ...

    def hold(self) -> None: ...

    def release(self) -> None: ...


class BackPressure:
    """The current publisher, the congested queues and the publishers they hold."""

    __slots__ = ("current", "_congested", "_held")

    def __init__(self) -> None:
        # the publisher whose messages are being dispatched now (None: none is)
        self.current: Publisher | None = None
        self._congested: set[object] = set()
        self._held: list[Publisher] = []

    @contextmanager
    def publishing(self, publisher: Publisher) -> Iterator[None]:
        """While the body runs, `publisher` is the current one (nested: restored after)."""
        outer, self.current = self.current, publisher
        try:
            yield
        finally:
            self.current = outer

    @property
    def congested_count(self) -> int:
        return len(self._congested)

    def is_congested(self, queue: object) -> bool:
        return queue in self._congested

    def congested(self, queue: object, *, own: object = None) -> None:
        """`queue` is filling up: hold the current publisher (unless it is `own`, the queue's
        own client, or held already) until no queue is congested."""
        self._congested.add(queue)
        publisher = self.current
        if publisher is not None and publisher is not own and not publisher.held:
            publisher.hold()
            self._held.append(publisher)

    def relieved(self, queue: object) -> None:
        """`queue` caught up (or went away, or gave up holding): once no queue is congested,
        every held publisher is read again."""
        self._congested.discard(queue)
        if not self._congested and self._held:
            held, self._held = self._held, []
            for publisher in held:
                publisher.release()
