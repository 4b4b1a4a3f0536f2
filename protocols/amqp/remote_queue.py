"""The client's node side of a queue that lives on another node (its *home*): `RemoteQueue`
stands for it in a channel's consumers and unacknowledged deliveries, `ConsumerProxy` is this
node's end of one consumer link (deliveries in, settlements out), `GetOrigin` settles what
basic.get took there. An ack or a requeue goes back to where the message came from.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, cast

from ...core.message import Message
from ...core.subscriptions import Subscription
from .queues import Queue, QueueConsumer, QueueEntry
from .remote_frames import (
    ACK,
    CANCEL,
    CONSUMING,
    DELIVERY,
    HANDED,
    REFUSED,
    REJECT,
    REQUEUE,
    decode_delivery,
    pack_ids,
)

if TYPE_CHECKING:
    from .remote import ConsumerLink, QueueDirectory

# The remote queues' logger, as before this part had a module of its own.
log = logging.getLogger("shardgate.protocols.amqp.remote")


class RemoteOrigin(Protocol):
    """Where a delivery of a remote queue came from: settles it there."""

    def settle(self, action: bytes, ids: list[int]) -> None: ...


class RemoteEntry(QueueEntry):
    """A message of a queue on another node, as this node hands it to a client."""

    __slots__ = ("origin", "remote_id")

    def __init__(self, message: Message, redelivered: bool, origin: RemoteOrigin | None,
                 remote_id: int) -> None:
        super().__init__(message, None, redelivered)
        self.origin = origin  # None: nothing to settle (no-ack)
        self.remote_id = remote_id


class RemoteQueue(Queue):
    """A queue of another node as this connection's channels see it: consumers and deliveries
    refer to it; settling a delivery goes to the home node (module docstring)."""

    def __init__(self, name: str, node: str) -> None:
        super().__init__(
            name, cast(Subscription, None), durable=True, exclusive_owner=None,
            auto_delete=False, arguments={}, dead_letter=lambda queue, entry, reason: None,
        )
        self.node = node
        self.proxies: dict[QueueConsumer, ConsumerProxy] = {}

    def __repr__(self) -> str:
        return f"RemoteQueue({self.name!r} on {self.node})"

    @property
    def available(self) -> bool:
        return False

    def settle(self, entry: QueueEntry) -> None:
        if isinstance(entry, RemoteEntry) and entry.origin is not None:
            entry.origin.settle(ACK, [entry.remote_id])

    def requeue(self, entries: Any) -> None:
        self._send_back(REQUEUE, entries)

    def reject(self, entry: QueueEntry) -> None:
        self._send_back(REJECT, [entry])

    def _send_back(self, action: bytes, entries: Any) -> None:
        by_origin: dict[int, tuple[RemoteOrigin, list[int]]] = {}
        for entry in entries:
            if isinstance(entry, RemoteEntry) and entry.origin is not None:
                by_origin.setdefault(id(entry.origin), (entry.origin, []))[1].append(entry.remote_id)
        for origin, ids in by_origin.values():
            origin.settle(action, ids)

    def add_remote_consumer(self, consumer: QueueConsumer, proxy: ConsumerProxy) -> None:
        self.consumers.append(consumer)
        self.proxies[consumer] = proxy

    def remove_consumer(self, consumer: QueueConsumer) -> None:
        super().remove_consumer(consumer)
        proxy = self.proxies.pop(consumer, None)
        if proxy is not None:
            proxy.cancel()

    def dispatch(self) -> None:
        """Deliveries come from the home node as its consumers have room; a client that can
        take more lets its no-ack consumers' home nodes know."""
        for proxy in list(self.proxies.values()):
            if proxy.handed:
                proxy.report()

    def expire(self, at_ms: int | None = None) -> None:
        """The home node expires messages."""


class ConsumerProxy:
    """This node's end of one consumer link: hands the home node's deliveries to the client's
    channel and sends its settlements back."""

    def __init__(self, queue: RemoteQueue, consumer: QueueConsumer,
                 on_answer: Callable[[dict[str, Any]], None],
                 on_gone: Callable[[RemoteQueue], None]) -> None:
        self.queue = queue
        self.consumer = consumer
        self.link: ConsumerLink | None = None
        self.on_answer: Callable[[dict[str, Any]], None] | None = on_answer
        self.on_gone = on_gone
        self.outstanding = 0  # delivered here, not settled yet
        # no-ack deliveries handed to the client since the home node was last told (its window
        # for a no-ack consumer moves only while the client's connection takes them)
        self.handed = 0
        self._reporting = False
        self.cancelled = False
        self.closed = False

    def receive(self, frame: bytes) -> None:
        kind = frame[:1]
        if kind == DELIVERY:
            delivery_id, redelivered, message = decode_delivery(frame)
            consumer = self.consumer
            if self.cancelled or self.closed:
                if not consumer.no_ack and self.link is not None and not self.closed:
                    self.link.send(pack_ids(REQUEUE, [delivery_id]))
                return
            origin = None if consumer.no_ack else self
            if origin is not None:
                self.outstanding += 1
            channel: Any = consumer.channel
            channel.deliver(consumer, self.queue, RemoteEntry(message, redelivered, origin, delivery_id))
            if consumer.no_ack:
                self.handed += 1
                if not self._reporting:
                    self._reporting = True
                    channel.connection.service.scheduler.call_soon(self.report)
            return
        if kind in (CONSUMING, REFUSED):
            answer, self.on_answer = self.on_answer, None
            reply = json.loads(frame[1:]) if kind == CONSUMING else {"error": json.loads(frame[1:])}
            if answer is not None:
                answer(reply)
            return
        # the queue was deleted there, or the link broke (b""): the consumer is gone
        if self.closed and self.on_answer is None:
            return
        self.closed = True
        answer, self.on_answer = self.on_answer, None
        if answer is not None:
            answer({"gone": True})
        else:
            self.on_gone(self.queue)

    def report(self) -> None:
        """Tell the home node how many no-ack deliveries the client's connection took, once
        it can take more (else `RemoteQueue.dispatch` reports when it drains)."""
        self._reporting = False
        if not self.handed or self.closed or self.link is None:
            return
        channel: Any = self.consumer.channel
        if not channel.connection.writable:
            channel.connection.stalled = True  # woken (dispatch) when the client reads again
            return
        self.link.send(HANDED + struct.pack(">Q", self.handed))
        self.handed = 0

    def settle(self, action: bytes, ids: list[int]) -> None:
        if self.closed or self.link is None:
            return
        self.outstanding -= len(ids)
        self.link.send(pack_ids(action, ids))
        self._close_when_done()

    def cancel(self) -> None:
        """basic.cancel, or the channel closed: no more deliveries; the link stays until the
        client has settled (or given back) what it holds."""
        if self.cancelled or self.closed:
            return
        self.cancelled = True
        if self.link is not None:
            self.link.send(CANCEL)
        self._close_when_done()

    def close(self) -> None:
        self.closed = True
        if self.link is not None:
            self.link.close()

    def _close_when_done(self) -> None:
        if self.cancelled and self.outstanding <= 0 and not self.closed:
            self.close()


class GetOrigin:
    """Messages taken with basic.get from a queue on another node: settled by a call."""

    def __init__(self, directory: QueueDirectory, node: str, vhost: str, queue: str) -> None:
        self.directory = directory
        self.node = node
        self.vhost = vhost
        self.queue = queue

    def settle(self, action: bytes, ids: list[int]) -> None:
        future = self.directory.call(self.node, {
            "op": "settle", "vhost": self.vhost, "queue": self.queue, "action": action.decode(),
            "ids": ids,
        })
        future.add_done_callback(_log_failure)


def _log_failure(future: asyncio.Future[dict[str, Any]]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("AMQP: settling a basic.get on another node failed: %s", future.exception())


