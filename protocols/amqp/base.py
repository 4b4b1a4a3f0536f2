"""The state every part of an AMQP connection shares: its fields, its output (frames appended
to a list the service flushes to the `Link` once per event-loop turn, publisher confirms merged
into one multiple ack per channel and flush), closing the connection or one channel, and the
queues to wake once the current read is handled.

`AmqpConnection` (connection.py) is this plus the handler mixins: `handshake`, `topology`,
`consuming`, `publishing`, `transactions`. Each mixin subclasses `ConnectionBase` so that the
type checker sees the shared fields.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pamqp import commands
from pamqp import frame as pframe

from ...core.edge import Principal
from ...core.message import Message
from .channel import AmqpChannel, Delivery
from .errors import ChannelException, ConnectionException, ReplyCode
from .frames import (
    CONTENT_HEADER_FRAME,
    FRAME_END,
    FRAME_HEADER,
    HEARTBEAT_FRAME,
    Link,
    State,
    frame_bytes,
)
from .hotpath import encode_ack
from .properties import encoded_properties
from .queues import Queue

if TYPE_CHECKING:
    from .remote import RemoteQueue
    from .service import AmqpService
    from .vhost import VirtualHost

log = logging.getLogger(__name__)


def settled_confirms(channel: AmqpChannel) -> None:
    """Move `channel.confirm_ready` up to the highest tag below which every publish is
    settled, and forget those tags (`unconfirmed` holds tags in publish order)."""
    unconfirmed = channel.unconfirmed
    settled: list[int] = []
    for tag, done in unconfirmed.items():
        if not done:
            break
        settled.append(tag)
    if settled:
        for tag in settled:
            del unconfirmed[tag]
        if settled[-1] > channel.confirm_ready:
            channel.confirm_ready = settled[-1]


class ConnectionBase:
    """One client connection's protocol state (sans-IO): the shared part."""

    _numbers = itertools.count(1)

    def __init__(self, service: AmqpService, link: Link, remote: str, loopback: bool) -> None:
        self.service = service
        # Monotonic seconds from the service's scheduler (the adapter's loop, or a test clock).
        self._clock = service.scheduler.time
        self.settings = service.settings
        self.link = link
        self.remote = remote
        self.loopback = loopback
        self.id = f"amqp-{next(self._numbers)}"
        # Why the connection ended, for the log line of its departure (None while it is open).
        self.close_reason: str | None = None
        self.state = State.AWAIT_HEADER
        self.buffer = bytearray()
        self.out: list[bytes] = []
        self.out_bytes = 0
        self.flush_requested = False
        self.close_after_flush = False
        self.transport_writable = True
        self.stalled = False
        self.channels: dict[int, AmqpChannel] = {}
        self.closing_channels: set[int] = set()
        self.frame_max = self.settings.frame_max
        self.channel_max = self.settings.channel_max
        self.heartbeat = 0
        self.username = ""
        self.principal = Principal("amqp", None, "", remote)
        self.vhost: VirtualHost | None = None
        self.client_properties: dict[str, Any] = {}
        self.capabilities: dict[str, Any] = {}
        self.opened_at = self._clock()
        self.last_received = self.opened_at
        self.last_sent = self.opened_at
        self.closing_since = 0.0
        self._publishes_in_flight = 0
        self.messages_in = 0
        self.messages_out = 0
        self._landing: dict[asyncio.Future[None], list[tuple[AmqpChannel, int, Message]]] = {}
        # Publishes of this read not yet handed to the core (channel, confirm seq, message):
        # handed over together (`_flush_publishes`), one journal append per shard.
        self._publish_batch: list[tuple[AmqpChannel, int, Message]] = []
        self._confirm_channels: set[AmqpChannel] = set()
        self._paused = False
        self._held_by_alarm = False
        # connection.blocked was sent and connection.unblocked not yet
        self._told_blocked = False
        # Replies waiting on something outside this connection (a bind-ok until the cluster's
        # other nodes know the route, a queue operation on the node that holds the queue):
        # no further frame is read until they are sent, so replies keep the client's order.
        self._holds = 0
        # Shared queues of other nodes this connection uses, by name (`remote.RemoteQueue`).
        self._remote_queues: dict[str, RemoteQueue] = {}
        self._wake_queues: set[Queue] = set()
        # (exchange, exchange type, routing key) -> (core topic, encoded route), for repeated
        # publishes.
        self._topics: dict[tuple[str, str, str], tuple[str, bytes]] = {}
        self._ctag = itertools.count(1)
        self._ctag_prefix = os.urandom(6).hex()

    if TYPE_CHECKING:
        # Provided by the mixins and AmqpConnection; declared for the type checker.
        def data_received(self, data: bytes) -> None: ...

        def _queue_name(
            self, channel: AmqpChannel, name: str, method: type[commands.base.Frame]
        ) -> str: ...

        def _at_home(
            self, channel: AmqpChannel, name: str, here: Callable[[], None],
            there: Callable[[str], None],
        ) -> None: ...

        def _remote_queue(self, name: str, node: str) -> RemoteQueue: ...

        def _ask_home(
            self, channel: AmqpChannel, node: str, name: str, method: type[commands.base.Frame],
            request: dict[str, Any],
            reply_for: Callable[[dict[str, Any]], commands.base.Frame] | None,
            after: Callable[[dict[str, Any]], None] | None = None,
        ) -> None: ...

        def _deliver_publish(
            self, channel: AmqpChannel, frame: commands.Basic.Publish, message: Message, seq: int
        ) -> None: ...

        def _flush_publishes(self) -> None: ...

        def _settle_negative(
            self, channel: AmqpChannel, deliveries: list[Delivery], requeue: bool
        ) -> None: ...

        def _commit_ok(self, channel: AmqpChannel) -> None: ...

        def block(self, reason: str) -> None: ...

        def unblock(self) -> None: ...

        def queue_deleted(self, queue: Queue) -> None: ...

        def reauthorize_consumers(self) -> int: ...

    # ================================================================== output
    @property
    def writable(self) -> bool:
        return self.transport_writable and self.out_bytes < self.settings.max_outbound_buffer

    def _write(self, data: bytes) -> None:
        self.out.append(data)
        self.out_bytes += len(data)
        if not self.flush_requested:
            self.flush_requested = True
            self.service.request_flush(self)

    def send_method(self, channel: int, method: commands.base.Frame) -> None:
        self._write(pframe.marshal(method, channel))

    def send_content(self, channel: int, method: commands.base.Frame | bytes, message: Message) -> None:
        """A method with content (deliver, get-ok, return): method, header and body frames."""
        payload = message.payload
        size = len(payload)
        properties = encoded_properties(message)
        head = method if isinstance(method, bytes) else pframe.marshal(method, channel)
        # Content header frame (§4.2.6.1): class 60, weight 0, body size, properties.
        header = CONTENT_HEADER_FRAME.pack(2, channel, 12 + len(properties), 60, 0, size)
        chunk = self.frame_max - 8
        if size <= chunk:
            if size:
                self._write(b"".join((
                    head, header, properties, FRAME_END, FRAME_HEADER.pack(3, channel, size),
                    payload, FRAME_END,
                )))
            else:
                self._write(b"".join((head, header, properties, FRAME_END)))
            return
        parts = [head, header, properties, FRAME_END]
        for start in range(0, size, chunk):
            parts.append(frame_bytes(3, channel, payload[start:start + chunk]))
        self._write(b"".join(parts))

    def flush(self) -> None:
        self.flush_requested = False
        if self._confirm_channels:
            for channel in self._confirm_channels:
                settled_confirms(channel)
                if channel.confirm_ready and not channel.closing:
                    self.out.append(encode_ack(channel.number, channel.confirm_ready, True))
                channel.confirm_ready = 0
            self._confirm_channels.clear()
        if self.out:
            data = b"".join(self.out) if len(self.out) > 1 else self.out[0]
            self.out.clear()
            self.out_bytes = 0
            self.last_sent = self._clock()
            self.link.write(data)
            if self.stalled and self.writable:
                # Consumers stopped for a full output buffer: there is room again.
                self.stalled = False
                self._resume_consumers()
                self._run_wakeups()
        if self.close_after_flush:
            self.state = State.CLOSED
            self.link.close()

    def sent(self, message: Message) -> None:
        """Count one message delivered to this client (basic.deliver or basic.get-ok)."""
        self.messages_out += 1
        self.service.edge.stats.sent("amqp", message)

    def set_writable(self, writable: bool) -> None:
        """The transport paused or resumed writing."""
        self.transport_writable = writable
        if writable and self.stalled:
            self.stalled = False
            self._resume_consumers()
            self._run_wakeups()

    def _resume_consumers(self) -> None:
        for channel in self.channels.values():
            for consumer in channel.consumers.values():
                self._wake_queues.add(consumer.queue)

    def close(self, exc: ConnectionException) -> None:
        """Close the connection with a connection exception (connection.close)."""
        if self.state in (State.CLOSING, State.CLOSED):
            return
        log.info("closing AMQP connection %s: %s", self.remote, exc.reply_text)
        if self.close_reason is None:
            self.close_reason = f"closed by the broker: {exc.code} {exc.reply_text}"
        self._release_all()
        if self.state is State.AWAIT_HEADER:
            self.state = State.CLOSED
            self.link.close()
            return
        self.send_method(0, commands.Connection.Close(exc.code, exc.reply_text, exc.class_id, exc.method_id))
        self.state = State.CLOSING
        self.closing_since = self._clock()
        if exc.code == ReplyCode.ACCESS_REFUSED and self.vhost is None:
            self.close_after_flush = True

    def _request_flush(self) -> None:
        if not self.flush_requested:
            self.flush_requested = True
            self.service.request_flush(self)

    def _release_all(self) -> None:
        touched: list[Queue] = []
        for channel in self.channels.values():
            touched.extend(channel.release())
        self.channels.clear()
        self.service.connection_closed(self, touched)

    def shutdown(self, text: str = "broker shutting down") -> None:
        self.close(ConnectionException(ReplyCode.CONNECTION_FORCED, text))
        self.close_after_flush = True
        self._request_flush()

    def connection_lost(self) -> None:
        if self.close_reason is None:
            self.close_reason = "connection lost"
        self.state = State.CLOSED
        self._release_all()
        self.out.clear()

    def tick(self, now: float) -> None:
        """Heartbeats and timeouts, called about once a second by the service."""
        state = self.state
        if state is State.CLOSED:
            return
        if state is State.CLOSING:
            if self.closing_since and now - self.closing_since > 5:
                self.state = State.CLOSED
                self.link.close()
            return
        if state is not State.OPEN:
            # From accept to connection.open-ok, whatever the client sent meanwhile: a
            # handshake that stalls anywhere (after tune-ok too) ends here.
            if now - self.opened_at > self.settings.handshake_timeout:
                log.info("AMQP handshake timeout for %s", self.remote)
                self.state = State.CLOSED
                self.link.close()
            return
        heartbeat = self.heartbeat
        if heartbeat:
            if now - self.last_received > 2 * heartbeat:
                log.info("missed heartbeats from %s, closing", self.remote)
                self.state = State.CLOSED
                self._release_all()
                self.link.close()
                return
            if now - self.last_sent >= heartbeat / 2 and not self.out:
                self._write(HEARTBEAT_FRAME)


    # ================================================================== channels
    def _close_channel(self, channel: AmqpChannel, exc: ChannelException) -> None:
        log.debug("channel %d of %s closed: %s", channel.number, self.remote, exc.reply_text)
        self._drop_channel(channel)
        self.closing_channels.add(channel.number)
        self.send_method(
            channel.number,
            commands.Channel.Close(exc.code, exc.reply_text, exc.class_id, exc.method_id),
        )

    def _drop_channel(self, channel: AmqpChannel) -> None:
        self.channels.pop(channel.number, None)
        touched = channel.release()
        self.service.queues_released(self, touched)

    # ================================================================== held replies
    def hold_until(
        self, channel: AmqpChannel, future: asyncio.Future[Any],
        then: Callable[[asyncio.Future[Any]], None],
    ) -> None:
        """Read no more frames until `future` is done, then run `then(future)` (which sends
        the reply, or raises the channel's or connection's exception) and read on."""
        self.hold()
        future.add_done_callback(lambda done: self.release_hold(channel, lambda: then(done)))

    def hold(self) -> None:
        self._holds += 1
        self._paused = True

    def release_hold(self, channel: AmqpChannel, then: Callable[[], None],
                     orphaned: Callable[[], None] | None = None) -> None:
        """End one `hold`: `then()` if the channel is still open, else `orphaned()`."""
        self._holds -= 1
        if self.state is State.OPEN and self.channels.get(channel.number) is channel:
            try:
                then()
            except ChannelException as exc:
                self._close_channel(channel, exc)
            except ConnectionException as exc:
                self.close(exc)
        elif orphaned is not None:
            orphaned()
        self._flush_publishes()  # a publish `then` routed
        self._run_wakeups()
        self._request_flush()
        self.resume_reading()

    def resume_reading(self) -> None:
        """Read the frames held back once nothing holds this connection any more."""
        if (self._paused and not self._holds and self._publishes_in_flight == 0
                and not self._held_by_alarm):
            self._paused = False
            if self.state is not State.CLOSED:
                self.data_received(b"")

    # ================================================================== wake-ups
    def wake(self, queue: Queue) -> None:
        self._wake_queues.add(queue)

    def wake_channel(self, channel: AmqpChannel) -> None:
        for consumer in channel.consumers.values():
            self._wake_queues.add(consumer.queue)

    def _run_wakeups(self) -> None:
        if self._wake_queues:
            queues = self._wake_queues
            self._wake_queues = set()
            for queue in queues:
                queue.dispatch()

