"""The sans-IO AMQP 0-9-1 connection: bytes in → core calls and frames out.

`AmqpConnection.data_received(bytes)` parses frames (pamqp does the method and content header
encoding), runs the connection state machine (protocol header → start/start-ok → tune/tune-ok →
open → open; close/close-ok at any point) and its channels, and appends the frames it answers
with to an output list that the service flushes to the `Link` once per event-loop turn. It never
touches a socket or awaits.

Errors follow the spec's model (AMQP 0-9-1 §1.2 constants, §2.3.7 channel vs connection
exceptions): a `ChannelException` sends channel.close and ignores that channel's frames until
channel.close-ok; a `ConnectionException` (frame errors 501/502/503/504/505, 530, 540) sends
connection.close and ignores everything but close/close-ok until the peer confirms.

Where RabbitMQ and the AMQP text differ, this follows RabbitMQ (its reply codes and texts,
checked against a real node in tests/e2e/test_amqp_*.py): transactions (tx.select/commit/
rollback, commit-ok once the publishes are journaled), mandatory returns before the confirm,
channel-max as a limit on open channels, direct reply-to (`amq.rabbitmq.reply-to`), alternate
exchanges, 540 for prefetch-size, recover requeue=false and channel.flow active=false.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import struct
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from pamqp import commands, constants, decode, exceptions
from pamqp import frame as pframe
from pamqp import header as pheader

from ... import __version__
from ...core.edge import Action, Principal
from ...core.errors import PublishRejected
from ...core.message import Message
from .errors import ChannelException, ConnectionException, ReplyCode
from .hotpath import (
    ACK_INDEX,
    PUBLISH_INDEX,
    BasicProperties,
    decode_ack,
    decode_content_header,
    decode_publish,
    encode_ack,
    encode_deliver,
    encode_deliver_route,
    shortstr,
)
from .properties import encoded_properties, message_from_properties
from .queues import Queue, QueueConsumer, QueueEntry
from .routing import exchange_and_key, publish_topic

if TYPE_CHECKING:
    from .service import AmqpService
    from .vhost import Exchange, VirtualHost

log = logging.getLogger(__name__)

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"  # AMQP 0-9-1 §4.2.2
FRAME_MIN_SIZE = constants.FRAME_MIN_SIZE  # 4096, §4.2.3
_FRAME_HEADER = struct.Struct(">BHI")
_CONTENT_HEADER_FRAME = struct.Struct(">BHIHHQ")  # frame header + class, weight, body size
_FRAME_END = b"\xce"
_INDEX = struct.Struct(">I")
_HEARTBEAT = pframe.marshal(pframe.heartbeat.Heartbeat(), 0)
# Direct reply-to (https://www.rabbitmq.com/docs/direct-reply-to): a pseudo-queue consumed in
# no-ack mode; a publish whose reply-to is this name gets it rewritten to REPLY_TO + "." + a
# token, and a publish to the default exchange with that routing key goes straight to the
# consumer.
REPLY_TO = "amq.rabbitmq.reply-to"
REPLY_PREFIX = REPLY_TO + "."


class Link(Protocol):
    """Where a connection's bytes go (the socket adapter)."""

    def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...


class State(Enum):
    AWAIT_HEADER = "await-header"
    AWAIT_START_OK = "await-start-ok"
    AWAIT_TUNE_OK = "await-tune-ok"
    AWAIT_OPEN = "await-open"
    OPEN = "open"
    CLOSING = "closing"  # we sent connection.close, waiting for close-ok
    CLOSED = "closed"


# Methods that read a queue's contents; they wait for this connection's publishes to land.
_READS_QUEUE = frozenset(
    m.index for m in (
        commands.Basic.Get, commands.Queue.Declare, commands.Queue.Purge, commands.Queue.Delete,
    )
)


def frame_bytes(frame_type: int, channel: int, payload: bytes) -> bytes:
    return _FRAME_HEADER.pack(frame_type, channel, len(payload)) + payload + _FRAME_END


def _ids(method: type[commands.base.Frame] | commands.base.Frame | None) -> tuple[int, int]:
    if method is None:
        return 0, 0
    return method.index >> 16, method.index & 0xFFFF


_ROUTE_KEY = "amqp-route"


def route_of(message: Message) -> bytes:
    """The exchange and routing key a delivery of `message` reports, as two shortstrs; worked
    out from its topic once and kept with the message's other encodings."""
    encoded = message.encoded
    if encoded is None:
        encoded = message.encoded = {}
    else:
        route = encoded.get(_ROUTE_KEY)
        if route is not None:
            return route
    exchange, routing_key = exchange_and_key(message.topic)
    route = encoded[_ROUTE_KEY] = shortstr(exchange) + shortstr(routing_key)
    return route


def _route_names(route: bytes) -> tuple[str, str]:
    """(exchange, routing key) back from `route_of`'s two shortstrs."""
    n = route[0]
    m = route[1 + n]
    return route[1:1 + n].decode(), route[2 + n:2 + n + m].decode()


def _login_text(value: object) -> str | None:
    """An AMQPLAIN LOGIN or PASSWORD field as text (a byte string as UTF-8); None, which
    authentication refuses, for a missing field or one of another type."""
    if isinstance(value, bytes):
        return value.decode()
    return value if isinstance(value, str) else None


class Delivery:
    """An unacknowledged delivery on a channel."""

    __slots__ = ("queue", "entry", "consumer")

    def __init__(self, queue: Queue, entry: QueueEntry, consumer: QueueConsumer | None) -> None:
        self.queue = queue
        self.entry = entry
        self.consumer = consumer


class Transaction:
    """What a transactional channel did since its last commit or rollback (AMQP 0-9-1 §1.9
    class tx): publishes, and the acks/nacks/rejects of deliveries, in the order they came."""

    __slots__ = ("publishes", "settlements")

    def __init__(self) -> None:
        self.publishes: list[tuple[commands.Basic.Publish, Message]] = []
        # (requeue or None for an ack, deliveries with their delivery tags)
        self.settlements: list[tuple[bool | None, list[tuple[int, Delivery]]]] = []


class AmqpChannel:
    """One open channel: its consumers, unacked deliveries, prefetch, confirms, pending publish."""

    def __init__(self, connection: AmqpConnection, number: int) -> None:
        self.connection = connection
        self.number = number
        self.closing = False
        self.flow = True
        self.prefetch = 0  # channel-wide limit (basic.qos global=true)
        self.consumer_prefetch = 0  # for consumers created next (global=false)
        self.consumers: dict[str, QueueConsumer] = {}
        self.unacked: dict[int, Delivery] = {}
        self.next_tag = 1
        self.confirm = False
        self.publish_seq = 0
        self.unconfirmed: dict[int, bool] = {}
        self.last_queue = ""
        self.consumer_tags: dict[str, bytes] = {}
        # Highest publish sequence number covered by confirms waiting to be sent (multiple ack).
        self.confirm_ready = 0
        # Transaction (tx.select): publishes and settlements held until tx.commit, or None.
        self.tx: Transaction | None = None
        # Publishes of a tx.commit still being journaled; commit-ok waits for them.
        self.tx_landing = 0
        self.tx_failed = False
        # Direct reply-to consumer on this channel: its consumer tag and reply token.
        self.reply_consumer = ""
        self.reply_token = ""
        # Content being received: the publish method, its header, body parts.
        self.publish: commands.Basic.Publish | None = None
        self.content_props: commands.Basic.Properties | None = None
        self.content_raw: bytes = b""
        self.body_size = 0
        self.body: list[bytes] = []
        self.body_received = 0

    # ------------------------------------------------------------------ ConsumerChannel
    def can_deliver(self, consumer: QueueConsumer) -> bool:
        if self.closing or not self.flow:
            return False
        if not self.connection.writable:
            self.connection.stalled = True
            return False
        if consumer.no_ack:
            return True
        if consumer.prefetch and consumer.unacked >= consumer.prefetch:
            return False
        return not (self.prefetch and len(self.unacked) >= self.prefetch)

    def deliver(self, consumer: QueueConsumer, queue: Queue, entry: QueueEntry) -> None:
        tag = self.next_tag
        self.next_tag = tag + 1
        if consumer.no_ack:
            queue.settle(entry)
        else:
            self.unacked[tag] = Delivery(queue, entry, consumer)
            consumer.unacked += 1
        message = entry.message
        tag_bytes = self.consumer_tags.get(consumer.tag)
        if tag_bytes is None:
            tag_bytes = self.consumer_tags[consumer.tag] = shortstr(consumer.tag)
        self.connection.send_content(
            self.number,
            encode_deliver_route(self.number, tag_bytes, tag, entry.redelivered, route_of(message)),
            message,
        )
        self.connection.sent(message)

    # ------------------------------------------------------------------ acks
    def settle(self, tag: int, multiple: bool, method: type[commands.base.Frame]) -> list[Delivery]:
        """Remove and return the deliveries an ack/nack/reject covers."""
        return [delivery for _, delivery in self.settle_tagged(tag, multiple, method)]

    def settle_tagged(
        self, tag: int, multiple: bool, method: type[commands.base.Frame]
    ) -> list[tuple[int, Delivery]]:
        """Remove the deliveries an ack/nack/reject covers; returns them with their tags."""
        unacked = self.unacked
        settled: list[tuple[int, Delivery]]
        if multiple:
            if tag == 0:
                settled = list(unacked.items())
                unacked.clear()
            else:
                keys = [k for k in unacked if k <= tag]
                if not keys and tag >= self.next_tag:
                    raise ChannelException(
                        ReplyCode.PRECONDITION_FAILED, f"unknown delivery tag {tag}", *_ids(method)
                    )
                settled = [(k, unacked.pop(k)) for k in keys]
        else:
            delivery = unacked.pop(tag, None)
            if delivery is None:
                raise ChannelException(
                    ReplyCode.PRECONDITION_FAILED, f"unknown delivery tag {tag}", *_ids(method)
                )
            settled = [(tag, delivery)]
        for _, delivery in settled:
            consumer = delivery.consumer
            if consumer is not None:
                consumer.unacked -= 1
                self.connection.wake(consumer.queue)
            elif self.prefetch:
                self.connection.wake_channel(self)
        return settled

    def restore_unacked(self, tagged: list[tuple[int, Delivery]]) -> None:
        """tx.rollback: deliveries acknowledged inside the transaction are unacked again."""
        for tag, delivery in tagged:
            self.unacked[tag] = delivery
            if delivery.consumer is not None:
                delivery.consumer.unacked += 1
        self.unacked = dict(sorted(self.unacked.items()))

    def requeue_all(self) -> None:
        """Give every unacked delivery back to its queue (channel closed or basic.recover)."""
        deliveries = list(self.unacked.values())
        self.unacked.clear()
        by_queue: dict[Queue, list[QueueEntry]] = {}
        for delivery in deliveries:
            if delivery.consumer is not None:
                delivery.consumer.unacked -= 1
            by_queue.setdefault(delivery.queue, []).append(delivery.entry)
        for queue, entries in by_queue.items():
            queue.requeue(entries)

    def deliver_reply(self, routing_key: str, message: Message) -> None:
        """A direct reply-to response for this channel's reply consumer (no-ack)."""
        tag = self.next_tag
        self.next_tag = tag + 1
        self.connection.send_content(
            self.number,
            encode_deliver(self.number, shortstr(self.reply_consumer), tag, False, "", routing_key),
            message,
        )

    def release(self) -> list[Queue]:
        """Channel is going away: cancel consumers, requeue unacked; returns touched queues."""
        self.closing = True
        if self.reply_token:
            self.connection.service.reply_channels.pop(self.reply_token, None)
            self.reply_token = self.reply_consumer = ""
        queues = []
        for consumer in self.consumers.values():
            consumer.queue.remove_consumer(consumer)
            queues.append(consumer.queue)
        self.consumers.clear()
        self.requeue_all()
        return queues


class AmqpConnection:
    """One client connection's protocol state (sans-IO)."""

    _ids = itertools.count(1)

    def __init__(self, service: AmqpService, link: Link, remote: str, loopback: bool) -> None:
        self.service = service
        # Monotonic seconds from the service's scheduler (the adapter's loop, or a test clock).
        self._clock = service.scheduler.time
        self.settings = service.settings
        self.link = link
        self.remote = remote
        self.loopback = loopback
        self.id = f"amqp-{next(self._ids)}"
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
        self._confirm_channels: set[AmqpChannel] = set()
        self._paused = False
        self._held_by_alarm = False
        self._wake_queues: set[Queue] = set()
        # (exchange, exchange type, routing key) -> (core topic, encoded route), for repeated
        # publishes.
        self._topics: dict[tuple[str, str, str], tuple[str, bytes]] = {}
        self._ctag = itertools.count(1)
        self._ctag_prefix = os.urandom(6).hex()
        self._handlers: dict[type, Callable[[AmqpChannel, Any], None]] = {
            commands.Channel.Close: self._channel_close,
            commands.Channel.CloseOk: self._channel_close_ok,
            commands.Channel.Flow: self._channel_flow,
            commands.Channel.FlowOk: lambda ch, f: None,
            commands.Exchange.Declare: self._exchange_declare,
            commands.Exchange.Delete: self._exchange_delete,
            commands.Exchange.Bind: self._exchange_bind,
            commands.Exchange.Unbind: self._exchange_unbind,
            commands.Queue.Declare: self._queue_declare,
            commands.Queue.Bind: self._queue_bind,
            commands.Queue.Unbind: self._queue_unbind,
            commands.Queue.Purge: self._queue_purge,
            commands.Queue.Delete: self._queue_delete,
            commands.Basic.Qos: self._basic_qos,
            commands.Basic.Consume: self._basic_consume,
            commands.Basic.Cancel: self._basic_cancel,
            commands.Basic.Publish: self._basic_publish,
            commands.Basic.Get: self._basic_get,
            commands.Basic.Ack: self._basic_ack,
            commands.Basic.Nack: self._basic_nack,
            commands.Basic.Reject: self._basic_reject,
            commands.Basic.Recover: self._basic_recover,
            commands.Basic.RecoverAsync: self._basic_recover,
            commands.Confirm.Select: self._confirm_select,
            commands.Tx.Select: self._tx_select,
            commands.Tx.Commit: self._tx_commit,
            commands.Tx.Rollback: self._tx_rollback,
        }

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
        header = _CONTENT_HEADER_FRAME.pack(2, channel, 12 + len(properties), 60, 0, size)
        chunk = self.frame_max - 8
        if size <= chunk:
            if size:
                self._write(b"".join((
                    head, header, properties, _FRAME_END, _FRAME_HEADER.pack(3, channel, size),
                    payload, _FRAME_END,
                )))
            else:
                self._write(b"".join((head, header, properties, _FRAME_END)))
            return
        parts = [head, header, properties, _FRAME_END]
        for start in range(0, size, chunk):
            parts.append(frame_bytes(3, channel, payload[start:start + chunk]))
        self._write(b"".join(parts))

    def flush(self) -> None:
        self.flush_requested = False
        if self._confirm_channels:
            for channel in self._confirm_channels:
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

    # ================================================================== input
    def data_received(self, data: bytes) -> None:
        if self.state is State.CLOSED:
            return
        if self._paused:
            self.buffer += data
            return
        self.last_received = self._clock()
        buffer = self.buffer
        buffer += data
        if self.state is State.AWAIT_HEADER:
            if not self._protocol_header():
                return
        pos = 0
        size_limit = self.frame_max
        try:
            while self.state is not State.CLOSED and not self._paused:
                available = len(buffer) - pos
                if available < 7:
                    break
                frame_type, channel, size = _FRAME_HEADER.unpack_from(buffer, pos)
                if size + 8 > size_limit:
                    raise ConnectionException(
                        ReplyCode.FRAME_ERROR,
                        f"frame of {size + 8} bytes exceeds the negotiated frame-max {size_limit}",
                    )
                if available < size + 8:
                    break
                end = pos + 7 + size
                if buffer[end] != 0xCE:
                    raise ConnectionException(ReplyCode.FRAME_ERROR, "frame end byte is not 0xCE")
                if (
                    self._publishes_in_flight and frame_type == 1 and size >= 4
                    and struct.unpack_from(">I", buffer, pos + 7)[0] in _READS_QUEUE
                ):
                    # A read of queue state after publishes still being journaled: wait for
                    # them so this channel sees its own publishes (RabbitMQ's channel order).
                    self._paused = True
                    break
                if (
                    self.service.blocked and frame_type == 1 and size >= 4
                    and _INDEX.unpack_from(buffer, pos + 7)[0] == PUBLISH_INDEX
                ):
                    # Memory alarm: hold this publisher (stop reading) until it clears.
                    self._paused = True
                    self._held_by_alarm = True
                    pause = getattr(self.link, "pause_reading", None)
                    if pause is not None:
                        pause()
                    break
                if frame_type == 3:
                    self._body_frame(channel, bytes(buffer[pos + 7:end]))
                    pos = end + 1
                elif (
                    frame_type == 1 and size >= 4
                    and _INDEX.unpack_from(buffer, pos + 7)[0] == PUBLISH_INDEX
                ):
                    whole = self._whole_publish(buffer, pos, end, channel)
                    if whole:
                        pos = whole
                    else:
                        self._frame(frame_type, channel, bytes(buffer[pos:end + 1]))
                        pos = end + 1
                else:
                    self._frame(frame_type, channel, bytes(buffer[pos:end + 1]))
                    pos = end + 1
                if self.state is State.CLOSING and self.close_after_flush:
                    break
        except ConnectionException as exc:
            self.close(exc)
            pos = len(buffer)
        finally:
            del buffer[:pos]
            self._run_wakeups()

    def _whole_publish(self, buffer: bytearray, pos: int, end: int, number: int) -> int:
        """The common publish, handled in one go: basic.publish, its content header and a body
        in one frame (or none), all already buffered, on an open channel. Returns where the
        next frame starts, or 0 to take the frame-by-frame path (which also reports errors)."""
        channel = self.channels.get(number)
        if channel is None or channel.publish is not None or self.state is not State.OPEN:
            return 0
        header_at = end + 1
        if len(buffer) - header_at < 7:
            return 0
        frame_type, header_channel, size = _FRAME_HEADER.unpack_from(buffer, header_at)
        header_end = header_at + 7 + size
        if (
            frame_type != 2 or header_channel != number or size + 8 > self.frame_max
            or len(buffer) <= header_end or buffer[header_end] != 0xCE
        ):
            return 0
        frame = decode_publish(bytes(buffer[pos:end + 1]))
        header_bytes = bytes(buffer[header_at:header_end + 1])
        header = decode_content_header(header_bytes)
        if frame is None or frame.immediate or header is None:
            return 0
        body_size, props = header
        if body_size > self.settings.max_message_size:
            return 0
        after = header_end + 1
        if body_size:
            if len(buffer) - after < 7:
                return 0
            frame_type, body_channel, size = _FRAME_HEADER.unpack_from(buffer, after)
            body_end = after + 7 + size
            if (
                frame_type != 3 or body_channel != number or size != body_size
                or size + 8 > self.frame_max or len(buffer) <= body_end
                or buffer[body_end] != 0xCE
            ):
                return 0
            body = bytes(buffer[after + 7:body_end])
            after = body_end + 1
        else:
            body = b""
        if channel.confirm:
            channel.publish_seq += 1
        try:
            self._route(channel, frame, props, header_bytes[7 + 12:-1], body)
        except ChannelException as exc:
            self._close_channel(channel, exc)
        return after

    def _protocol_header(self) -> bool:
        buffer = self.buffer
        if len(buffer) < 8:
            if PROTOCOL_HEADER.startswith(bytes(buffer)) or bytes(buffer) == b"AMQP"[: len(buffer)]:
                return False
            self._reject_header()
            return False
        if bytes(buffer[:8]) != PROTOCOL_HEADER:
            self._reject_header()
            return False
        del buffer[:8]
        self.state = State.AWAIT_START_OK
        self.send_method(0, commands.Connection.Start(
            version_major=0, version_minor=9,
            server_properties={
                "product": self.settings.product,
                "version": __version__,
                "platform": "Python",
                "information": "Shardgate multi-protocol message gateway",
                "capabilities": {
                    "publisher_confirms": True,
                    "exchange_exchange_bindings": True,
                    "basic.nack": True,
                    "consumer_cancel_notify": True,
                    "connection.blocked": True,
                    "consumer_priorities": True,
                    "authentication_failure_close": True,
                    "per_consumer_qos": True,
                    "direct_reply_to": True,
                },
            },
            mechanisms="PLAIN AMQPLAIN", locales="en_US",
        ))
        return True

    def _reject_header(self) -> None:
        """Not an AMQP 0-9-1 header: answer with ours and close (§4.2.2)."""
        log.info("%s sent a bad protocol header %r", self.remote, bytes(self.buffer[:8]))
        self.buffer.clear()
        self._write(PROTOCOL_HEADER)
        self.state = State.CLOSING
        self.close_after_flush = True

    def _frame(self, frame_type: int, channel_number: int, data: bytes) -> None:
        if frame_type == 8:
            if channel_number != 0:
                raise ConnectionException(ReplyCode.FRAME_ERROR, "heartbeat frame on a channel")
            return
        if frame_type not in (1, 2):
            raise ConnectionException(ReplyCode.FRAME_ERROR, f"unknown frame type {frame_type}")
        if frame_type == 2:
            header = decode_content_header(data)
            if header is not None:
                if self.state is not State.CLOSING:
                    self._header_frame(channel_number, header[0], header[1], data)
                return
        value: Any = None
        if frame_type == 1 and len(data) >= 12:
            index = _INDEX.unpack_from(data, 7)[0]
            if index == PUBLISH_INDEX:
                value = decode_publish(data)
            elif index == ACK_INDEX:
                value = decode_ack(data)
        try:
            if value is None:
                _, _, value = pframe.unmarshal(data)
        except exceptions.UnmarshalingException as exc:
            if frame_type == 1 and len(data) >= 11:
                index = struct.unpack_from(">I", data, 7)[0]
                if index not in commands.INDEX_MAPPING:
                    raise ConnectionException(
                        ReplyCode.NOT_IMPLEMENTED,
                        f"unknown method class {index >> 16} method {index & 0xFFFF}",
                    ) from None
            raise ConnectionException(ReplyCode.SYNTAX_ERROR, f"malformed frame: {exc}") from None
        except Exception as exc:  # pamqp raises assorted errors on garbage
            raise ConnectionException(ReplyCode.SYNTAX_ERROR, f"malformed frame: {exc}") from None
        state = self.state
        if frame_type == 2:
            if state is not State.CLOSING:
                assert isinstance(value, pheader.ContentHeader)
                self._header_frame(channel_number, value.body_size, value.properties, data)
            return
        if state is State.CLOSING:
            if isinstance(value, commands.Connection.CloseOk | commands.Connection.Close):
                if isinstance(value, commands.Connection.Close):
                    self.send_method(0, commands.Connection.CloseOk())
                self.close_after_flush = True
                self._request_flush()
            return
        if channel_number == 0:
            self._connection_method(value)
            return
        if state is not State.OPEN:
            raise ConnectionException(
                ReplyCode.COMMAND_INVALID, f"{value.name} before the connection is open", *_ids(value)
            )
        channel = self.channels.get(channel_number)
        if channel is None:
            if isinstance(value, commands.Channel.Open):
                self._channel_open(channel_number)
                return
            if channel_number in self.closing_channels:
                if isinstance(value, commands.Channel.CloseOk):
                    self.closing_channels.discard(channel_number)
                elif isinstance(value, commands.Channel.Close):
                    self.send_method(channel_number, commands.Channel.CloseOk())
                return
            raise ConnectionException(
                ReplyCode.CHANNEL_ERROR, f"expected 'channel.open' on channel {channel_number}, "
                f"got '{value.name}'", *_ids(value),
            )
        if channel.publish is not None:
            raise ConnectionException(
                ReplyCode.UNEXPECTED_FRAME,
                f"expected content header for class 60, got method '{value.name}'", *_ids(value),
            )
        handler = self._handlers.get(type(value))
        if handler is None:
            if isinstance(value, commands.Channel.Open):
                raise ConnectionException(
                    ReplyCode.CHANNEL_ERROR, f"channel {channel_number} is already open", *_ids(value)
                )
            raise ConnectionException(
                ReplyCode.COMMAND_INVALID, f"'{value.name}' is not a client method here",
                *_ids(value),
            )
        try:
            handler(channel, value)
        except ChannelException as exc:
            self._close_channel(channel, exc)

    # ================================================================== connection class
    def _connection_method(self, value: commands.base.Frame) -> None:
        state = self.state
        if isinstance(value, commands.Connection.Close):
            self.send_method(0, commands.Connection.CloseOk())
            self.state = State.CLOSING
            self.close_after_flush = True
            self._release_all()
            return
        if state is State.AWAIT_START_OK and isinstance(value, commands.Connection.StartOk):
            self._start_ok(value)
        elif state is State.AWAIT_TUNE_OK and isinstance(value, commands.Connection.TuneOk):
            self._tune_ok(value)
        elif state is State.AWAIT_OPEN and isinstance(value, commands.Connection.Open):
            self._open(value)
        elif isinstance(value, commands.Connection.UpdateSecret) and state is State.OPEN:
            self.send_method(0, commands.Connection.UpdateSecretOk())
        else:
            raise ConnectionException(
                ReplyCode.COMMAND_INVALID,
                f"unexpected '{value.name}' on channel 0 in state {state.value}", *_ids(value),
            )

    def _start_ok(self, frame: commands.Connection.StartOk) -> None:
        self.client_properties = dict(frame.client_properties or {})
        caps = self.client_properties.get("capabilities")
        self.capabilities = dict(caps) if isinstance(caps, dict) else {}
        response = frame.response
        raw = response.encode("utf-8") if isinstance(response, str) else bytes(response or b"")
        user = password = None
        if frame.mechanism == "PLAIN":
            parts = raw.split(b"\x00")
            if len(parts) == 3:
                user, password = parts[1].decode("utf-8", "replace"), parts[2].decode("utf-8", "replace")
        elif frame.mechanism == "AMQPLAIN":
            try:
                _, table = decode.field_table(struct.pack(">I", len(raw)) + raw)
                login, secret = table.get("LOGIN"), table.get("PASSWORD")
                user, password = _login_text(login), _login_text(secret)
            except (ValueError, UnicodeDecodeError):
                pass
        else:
            raise ConnectionException(
                ReplyCode.ACCESS_REFUSED,
                f"unsupported authentication mechanism '{frame.mechanism}'", *_ids(frame),
            )
        refusal = self.service.authenticate(user, password, self.loopback)
        if refusal is not None:
            raise ConnectionException(ReplyCode.ACCESS_REFUSED, refusal, *_ids(frame))
        self.username = str(user)
        # ACL rules see AMQP clients by user only (no client id for `client =` or `%c`).
        self.principal = Principal("amqp", self.username, "", self.remote)
        self.state = State.AWAIT_TUNE_OK
        self.send_method(0, commands.Connection.Tune(
            channel_max=self.settings.channel_max, frame_max=self.settings.frame_max,
            heartbeat=self.settings.heartbeat,
        ))

    def _tune_ok(self, frame: commands.Connection.TuneOk) -> None:
        settings = self.settings
        frame_max = frame.frame_max or settings.frame_max
        if frame_max < FRAME_MIN_SIZE or frame_max > settings.frame_max:
            raise ConnectionException(
                ReplyCode.NOT_ALLOWED,
                f"frame_max={frame_max} outside [{FRAME_MIN_SIZE}, {settings.frame_max}]",
                *_ids(frame),
            )
        channel_max = frame.channel_max or settings.channel_max
        if channel_max > settings.channel_max:
            raise ConnectionException(
                ReplyCode.NOT_ALLOWED,
                f"channel_max={channel_max} above the server's {settings.channel_max}", *_ids(frame),
            )
        self.frame_max = frame_max
        self.channel_max = channel_max
        self.heartbeat = frame.heartbeat
        self.state = State.AWAIT_OPEN

    def _open(self, frame: commands.Connection.Open) -> None:
        vhost = self.service.vhost(frame.virtual_host)
        if vhost is None:
            raise ConnectionException(
                ReplyCode.NOT_ALLOWED, f"vhost '{frame.virtual_host}' not found", *_ids(frame)
            )
        self.vhost = vhost
        self.state = State.OPEN
        self.service.connection_opened(self)
        self.send_method(0, commands.Connection.OpenOk())

    def close(self, exc: ConnectionException) -> None:
        """Close the connection with a connection exception (connection.close)."""
        if self.state in (State.CLOSING, State.CLOSED):
            return
        log.info("closing AMQP connection %s: %s", self.remote, exc.reply_text)
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

    def shutdown(self, text: str = "broker shutting down") -> None:
        self.close(ConnectionException(ReplyCode.CONNECTION_FORCED, text))
        self.close_after_flush = True
        self._request_flush()

    def _request_flush(self) -> None:
        if not self.flush_requested:
            self.flush_requested = True
            self.service.request_flush(self)

    def connection_lost(self) -> None:
        self.state = State.CLOSED
        self._release_all()
        self.out.clear()

    def _release_all(self) -> None:
        touched: list[Queue] = []
        for channel in self.channels.values():
            touched.extend(channel.release())
        self.channels.clear()
        self.service.connection_closed(self, touched)

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
            if now - self.opened_at > self.settings.handshake_timeout and state is not State.AWAIT_OPEN:
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
                self._write(_HEARTBEAT)

    # ================================================================== channels
    def _channel_open(self, number: int) -> None:
        # RabbitMQ limits how many channels are open, not their numbers (any of 1..65535):
        # rabbit_reader:create_channel/2 closes the connection with 530 NOT_ALLOWED, class and
        # method 0, once channel_count reaches the negotiated channel_max.
        self.closing_channels.discard(number)
        if self.channel_max and len(self.channels) >= self.channel_max:
            raise ConnectionException(
                ReplyCode.NOT_ALLOWED,
                f"number of channels opened ({len(self.channels)}) has reached the negotiated "
                f"channel_max ({self.channel_max})",
            )
        self.channels[number] = AmqpChannel(self, number)
        self.send_method(number, commands.Channel.OpenOk())

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

    def _channel_close(self, channel: AmqpChannel, frame: commands.Channel.Close) -> None:
        self._drop_channel(channel)
        self.send_method(channel.number, commands.Channel.CloseOk())

    def _channel_close_ok(self, channel: AmqpChannel, frame: commands.Channel.CloseOk) -> None:
        raise ConnectionException(
            ReplyCode.COMMAND_INVALID, "channel.close-ok on an open channel", *_ids(frame)
        )

    def _channel_flow(self, channel: AmqpChannel, frame: commands.Channel.Flow) -> None:
        if not frame.active:
            # RabbitMQ 3.x does not let a client pause deliveries (rabbit_channel: 540).
            raise ConnectionException(ReplyCode.NOT_IMPLEMENTED, "active=false", *_ids(frame))
        channel.flow = bool(frame.active)
        self.send_method(channel.number, commands.Channel.FlowOk(active=channel.flow))
        if channel.flow:
            self.wake_channel(channel)

    # ================================================================== tx class
    def _tx_select(self, channel: AmqpChannel, frame: commands.Tx.Select) -> None:
        if channel.confirm:
            # rabbit_channel: tx.select on a channel in confirm mode.
            raise ChannelException(
                ReplyCode.PRECONDITION_FAILED, "cannot switch from confirm to tx mode", *_ids(frame)
            )
        if channel.tx is None:
            channel.tx = Transaction()
        self.send_method(channel.number, commands.Tx.SelectOk())

    def _tx_commit(self, channel: AmqpChannel, frame: commands.Tx.Commit) -> None:
        """Route the held publishes, then apply the held settlements (RabbitMQ's order); the
        commit-ok waits until the publishes to reliable streams are journaled, and this
        connection reads nothing more until then."""
        tx = channel.tx
        if tx is None:
            raise ChannelException(
                ReplyCode.PRECONDITION_FAILED, "channel is not transactional", *_ids(frame)
            )
        publishes, settlements = tx.publishes, tx.settlements
        channel.tx = Transaction()
        for publish, message in publishes:
            self._deliver_publish(channel, publish, message, -1)
        for requeue, tagged in settlements:
            deliveries = [delivery for _, delivery in tagged]
            if requeue is None:
                for delivery in deliveries:
                    delivery.queue.settle(delivery.entry)
            else:
                self._settle_negative(channel, deliveries, requeue)
        if channel.tx_landing:
            self._paused = True  # resumed, with the commit-ok sent, once they are stored
        else:
            self._commit_ok(channel)

    def _commit_ok(self, channel: AmqpChannel) -> None:
        if channel.closing or self.state is not State.OPEN:
            return
        if channel.tx_failed:
            channel.tx_failed = False
            self._close_channel(channel, ChannelException(
                ReplyCode.INTERNAL_ERROR, "the transaction's messages could not be stored",
                *_ids(commands.Tx.Commit),
            ))
            return
        self.send_method(channel.number, commands.Tx.CommitOk())

    def _tx_rollback(self, channel: AmqpChannel, frame: commands.Tx.Rollback) -> None:
        """Forget the held publishes; deliveries acknowledged in the transaction are
        unacknowledged again (rabbit_channel handle_method tx.rollback)."""
        tx = channel.tx
        if tx is None:
            raise ChannelException(
                ReplyCode.PRECONDITION_FAILED, "channel is not transactional", *_ids(frame)
            )
        channel.tx = Transaction()
        for _, tagged in tx.settlements:
            channel.restore_unacked(tagged)
        self.send_method(channel.number, commands.Tx.RollbackOk())

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

    # ================================================================== exchange & queue class
    def _may_bind(self) -> Callable[[str], bool] | None:
        """The front door's check of a binding's core filter (a subscribe), or None when
        nothing is checked."""
        edge = self.service.edge
        if edge.authorizer is None:
            return None
        principal = self.principal

        def allowed(topic_filter: str) -> bool:
            return edge.authorize(principal, Action.SUBSCRIBE, topic_filter)

        return allowed

    def _exchange_declare(self, channel: AmqpChannel, frame: commands.Exchange.Declare) -> None:
        assert self.vhost is not None
        self.vhost.declare_exchange(frame)
        if not frame.nowait:
            self.send_method(channel.number, commands.Exchange.DeclareOk())

    def _exchange_bind(self, channel: AmqpChannel, frame: commands.Exchange.Bind) -> None:
        assert self.vhost is not None
        self.vhost.bind_exchange(
            frame.destination, frame.source, frame.routing_key, frame.arguments,
            commands.Exchange.Bind, self._may_bind(),
        )
        if not frame.nowait:
            self.send_method(channel.number, commands.Exchange.BindOk())

    def _exchange_unbind(self, channel: AmqpChannel, frame: commands.Exchange.Unbind) -> None:
        assert self.vhost is not None
        self.vhost.unbind_exchange(
            frame.destination, frame.source, frame.routing_key, frame.arguments,
            commands.Exchange.Unbind,
        )
        if not frame.nowait:
            self.send_method(channel.number, commands.Exchange.UnbindOk())

    def _exchange_delete(self, channel: AmqpChannel, frame: commands.Exchange.Delete) -> None:
        assert self.vhost is not None
        self.vhost.delete_exchange(frame.exchange, frame.if_unused)
        if not frame.nowait:
            self.send_method(channel.number, commands.Exchange.DeleteOk())

    def _queue_name(self, channel: AmqpChannel, name: str, method: type[commands.base.Frame]) -> str:
        if name:
            return name
        if not channel.last_queue:
            raise ChannelException(ReplyCode.NOT_FOUND, "no previously declared queue", *_ids(method))
        return channel.last_queue

    def _queue_declare(self, channel: AmqpChannel, frame: commands.Queue.Declare) -> None:
        assert self.vhost is not None
        if frame.queue == REPLY_TO:
            # The pseudo-queue always "exists" (rabbit_channel declare_fast_reply_to).
            if not frame.nowait:
                self.send_method(channel.number, commands.Queue.DeclareOk(REPLY_TO, 0, 0))
            return
        queue, _ = self.vhost.declare_queue(frame, self)
        channel.last_queue = queue.name
        if not frame.nowait:
            queue.expire()
            self.send_method(channel.number, commands.Queue.DeclareOk(
                queue.name, len(queue.messages), len(queue.consumers)
            ))

    def _queue_bind(self, channel: AmqpChannel, frame: commands.Queue.Bind) -> None:
        assert self.vhost is not None
        name = self._queue_name(channel, frame.queue, commands.Queue.Bind)
        queue = self.vhost.queue(name, self, commands.Queue.Bind)
        allowed = self._may_bind()
        self.vhost.bind(
            queue, frame.exchange, frame.routing_key, frame.arguments, commands.Queue.Bind, allowed
        )
        if not frame.nowait:
            self.send_method(channel.number, commands.Queue.BindOk())

    def _queue_unbind(self, channel: AmqpChannel, frame: commands.Queue.Unbind) -> None:
        assert self.vhost is not None
        name = self._queue_name(channel, frame.queue, commands.Queue.Unbind)
        queue = self.vhost.queue(name, self, commands.Queue.Unbind)
        self.vhost.unbind(queue, frame.exchange, frame.routing_key, frame.arguments, commands.Queue.Unbind)
        self.send_method(channel.number, commands.Queue.UnbindOk())

    def _queue_purge(self, channel: AmqpChannel, frame: commands.Queue.Purge) -> None:
        assert self.vhost is not None
        name = self._queue_name(channel, frame.queue, commands.Queue.Purge)
        queue = self.vhost.queue(name, self, commands.Queue.Purge)
        count = queue.purge()
        if not frame.nowait:
            self.send_method(channel.number, commands.Queue.PurgeOk(count))

    def _queue_delete(self, channel: AmqpChannel, frame: commands.Queue.Delete) -> None:
        assert self.vhost is not None
        method = commands.Queue.Delete
        name = self._queue_name(channel, frame.queue, method)
        queue = self.vhost.queues.get(name)
        count = 0
        if queue is not None:
            self.vhost.check_access(queue, self, method)
            if frame.if_unused and queue.consumers:
                raise ChannelException(
                    ReplyCode.PRECONDITION_FAILED, f"queue '{name}' in vhost '{self.vhost.name}' in use",
                    *_ids(method),
                )
            if frame.if_empty and queue.messages:
                raise ChannelException(
                    ReplyCode.PRECONDITION_FAILED,
                    f"queue '{name}' in vhost '{self.vhost.name}' not empty", *_ids(method),
                )
            count = self.vhost.delete_queue(queue)
        if not frame.nowait:
            self.send_method(channel.number, commands.Queue.DeleteOk(count))

    def queue_deleted(self, queue: Queue) -> None:
        """`queue` was deleted: drop our consumers on it (basic.cancel if the client wants it)."""
        notify = bool(self.capabilities.get("consumer_cancel_notify"))
        for channel in self.channels.values():
            for tag, consumer in list(channel.consumers.items()):
                if consumer.queue is queue:
                    del channel.consumers[tag]
                    if notify:
                        self.send_method(channel.number, commands.Basic.Cancel(tag, nowait=True))
            for delivery in list(channel.unacked.values()):
                if delivery.queue is queue and delivery.consumer is not None:
                    delivery.consumer.unacked -= 1
                    delivery.consumer = None

    # ================================================================== basic class
    def _basic_qos(self, channel: AmqpChannel, frame: commands.Basic.Qos) -> None:
        if frame.prefetch_size:
            # rabbit_channel: a byte window is not implemented, and says so with 540.
            raise ConnectionException(
                ReplyCode.NOT_IMPLEMENTED, f"prefetch_size!=0 ({frame.prefetch_size})", *_ids(frame)
            )
        if frame.global_:
            channel.prefetch = frame.prefetch_count
        else:
            channel.consumer_prefetch = frame.prefetch_count
        self.send_method(channel.number, commands.Basic.QosOk())
        self.wake_channel(channel)

    def _basic_consume(self, channel: AmqpChannel, frame: commands.Basic.Consume) -> None:
        assert self.vhost is not None
        method = commands.Basic.Consume
        if frame.queue == REPLY_TO:
            self._reply_consume(channel, frame)
            return
        name = self._queue_name(channel, frame.queue, method)
        queue = self.vhost.queue(name, self, method)
        tag = frame.consumer_tag or f"amq.ctag-{self._ctag_prefix}-{next(self._ctag)}"
        if tag in channel.consumers:
            raise ConnectionException(
                ReplyCode.NOT_ALLOWED, f"attempt to reuse consumer tag '{tag}'", *_ids(method)
            )
        if queue.consumers and (frame.exclusive or any(c.exclusive for c in queue.consumers)):
            raise ChannelException(
                ReplyCode.ACCESS_REFUSED,
                f"queue '{name}' in vhost '{self.vhost.name}' in exclusive use", *_ids(method),
            )
        priority = (frame.arguments or {}).get("x-priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            priority = 0
        consumer = QueueConsumer(
            channel, tag, queue, bool(frame.no_ack), bool(frame.exclusive),
            channel.consumer_prefetch, priority,
        )
        channel.consumers[tag] = consumer
        queue.add_consumer(consumer)
        if not frame.nowait:
            self.send_method(channel.number, commands.Basic.ConsumeOk(tag))
        self._wake_queues.add(queue)

    def _reply_consume(self, channel: AmqpChannel, frame: commands.Basic.Consume) -> None:
        method = commands.Basic.Consume
        if not frame.no_ack:
            raise ChannelException(
                ReplyCode.PRECONDITION_FAILED, "reply consumer cannot acknowledge", *_ids(method)
            )
        if channel.reply_consumer:
            raise ChannelException(
                ReplyCode.PRECONDITION_FAILED, "reply consumer already set", *_ids(method)
            )
        tag = frame.consumer_tag or f"amq.ctag-{self._ctag_prefix}-{next(self._ctag)}"
        if tag in channel.consumers:
            raise ConnectionException(
                ReplyCode.NOT_ALLOWED, f"attempt to reuse consumer tag '{tag}'", *_ids(method)
            )
        channel.reply_consumer = tag
        channel.reply_token = secrets.token_urlsafe(24)
        self.service.reply_channels[channel.reply_token] = channel
        if not frame.nowait:
            self.send_method(channel.number, commands.Basic.ConsumeOk(tag))

    def _basic_cancel(self, channel: AmqpChannel, frame: commands.Basic.Cancel) -> None:
        if channel.reply_consumer and frame.consumer_tag == channel.reply_consumer:
            self.service.reply_channels.pop(channel.reply_token, None)
            channel.reply_consumer = channel.reply_token = ""
            if not frame.nowait:
                self.send_method(channel.number, commands.Basic.CancelOk(frame.consumer_tag))
            return
        consumer = channel.consumers.pop(frame.consumer_tag or "", None)
        if not frame.nowait:
            self.send_method(channel.number, commands.Basic.CancelOk(frame.consumer_tag))
        if consumer is not None:
            consumer.queue.remove_consumer(consumer)
            self.service.queues_released(self, [consumer.queue])
            self._wake_queues.add(consumer.queue)

    def _basic_publish(self, channel: AmqpChannel, frame: commands.Basic.Publish) -> None:
        if frame.immediate:
            raise ConnectionException(
                ReplyCode.NOT_IMPLEMENTED, "immediate=true is not supported", *_ids(frame)
            )
        channel.publish = frame

    def _header_frame(self, number: int, body_size: int, properties: Any, data: bytes) -> None:
        channel = self.channels.get(number)
        if channel is None:
            if number in self.closing_channels:
                return
            raise ConnectionException(ReplyCode.CHANNEL_ERROR, f"content header on unopened channel {number}")
        if channel.publish is None or channel.content_props is not None:
            raise ConnectionException(
                ReplyCode.UNEXPECTED_FRAME, f"unexpected content header on channel {number}"
            )
        if body_size > self.settings.max_message_size:
            raise ConnectionException(
                ReplyCode.FRAME_ERROR,
                f"message body of {body_size} bytes exceeds the maximum "
                f"{self.settings.max_message_size}",
            )
        channel.content_props = properties
        channel.content_raw = data[7 + 12:-1]
        channel.body_size = body_size
        channel.body = []
        channel.body_received = 0
        if body_size == 0:
            self._publish_complete(channel)

    def _body_frame(self, number: int, payload: bytes) -> None:
        if self.state is State.CLOSING:
            return
        channel = self.channels.get(number)
        if channel is None:
            if number in self.closing_channels:
                return
            raise ConnectionException(ReplyCode.CHANNEL_ERROR, f"content body on unopened channel {number}")
        if channel.content_props is None:
            raise ConnectionException(ReplyCode.UNEXPECTED_FRAME, f"unexpected content body on channel {number}")
        channel.body.append(payload)
        channel.body_received += len(payload)
        if channel.body_received > channel.body_size:
            raise ConnectionException(
                ReplyCode.FRAME_ERROR, "content body longer than announced in its header"
            )
        if channel.body_received == channel.body_size:
            self._publish_complete(channel)

    def _publish_complete(self, channel: AmqpChannel) -> None:
        frame = channel.publish
        props = channel.content_props
        assert frame is not None and props is not None and self.vhost is not None
        body = channel.body[0] if len(channel.body) == 1 else b"".join(channel.body)
        raw = channel.content_raw
        channel.publish = None
        channel.content_props = None
        channel.body = []
        channel.content_raw = b""
        if channel.confirm:
            channel.publish_seq += 1
        try:
            self._route(channel, frame, props, raw, body)
        except ChannelException as exc:
            self._close_channel(channel, exc)

    def _route(
        self, channel: AmqpChannel, frame: commands.Basic.Publish, props: BasicProperties,
        raw: bytes, body: bytes,
    ) -> None:
        vhost = self.vhost
        assert vhost is not None
        exchange = vhost.exchange(frame.exchange, commands.Basic.Publish)
        if exchange.internal:
            raise ChannelException(
                ReplyCode.ACCESS_REFUSED,
                f"cannot publish to internal exchange '{exchange.name}' in vhost '{vhost.name}'",
                *_ids(commands.Basic.Publish),
            )
        if props.user_id and str(props.user_id) != self.username:
            raise ChannelException(
                ReplyCode.PRECONDITION_FAILED,
                f"user_id property set to '{props.user_id}' but authenticated user was "
                f"'{self.username}'", *_ids(commands.Basic.Publish),
            )
        topics = self._topics
        known = topics.get((exchange.name, exchange.type, frame.routing_key))
        if known is None:
            if len(topics) >= 4096:
                topics.clear()
            known = topics[(exchange.name, exchange.type, frame.routing_key)] = (
                publish_topic(exchange.name, exchange.type, frame.routing_key),
                shortstr(frame.exchange) + shortstr(frame.routing_key),
            )
        topic, route = known
        if not self.service.edge.authorize(self.principal, Action.PUBLISH, topic):
            raise ChannelException(
                ReplyCode.ACCESS_REFUSED,
                f"user '{self.username}' may not publish to exchange '{exchange.name}' with "
                f"routing key '{frame.routing_key}'", *_ids(commands.Basic.Publish),
            )
        if props.reply_to == REPLY_TO:
            if not channel.reply_consumer:
                raise ChannelException(
                    ReplyCode.PRECONDITION_FAILED, "fast reply consumer does not exist",
                    *_ids(commands.Basic.Publish),
                )
            props.reply_to = REPLY_PREFIX + channel.reply_token
            raw = props.marshal()
        message = message_from_properties(topic, body, props, self.id, raw)
        # Deliveries report the exchange and routing key it was published with.
        if message.encoded is None:
            message.encoded = {_ROUTE_KEY: route}
        else:
            message.encoded[_ROUTE_KEY] = route
        if channel.tx is not None:
            channel.tx.publishes.append((frame, message))
            return
        self._deliver_publish(channel, frame, message, channel.publish_seq if channel.confirm else 0)

    def _deliver_publish(
        self, channel: AmqpChannel, frame: commands.Basic.Publish, message: Message, seq: int
    ) -> None:
        """Hand a checked publish to the core. `seq` is its publisher-confirm sequence number
        (0: no confirm; -1: part of a tx.commit, which waits for it)."""
        vhost = self.vhost
        assert vhost is not None
        replied = False
        if not frame.exchange and frame.routing_key.startswith(REPLY_PREFIX):
            target = self.service.reply_channels.get(frame.routing_key[len(REPLY_PREFIX):])
            if target is not None and not target.closing:
                target.deliver_reply(frame.routing_key, message)
            replied = True
        if not replied and frame.exchange:
            exchange = vhost.exchanges.get(frame.exchange)
            if exchange is not None and "alternate-exchange" in exchange.arguments:
                self._to_alternate_exchange(exchange, frame, message)
        if frame.mandatory and (replied or not vhost.routed(message)):
            # A mandatory publish to a reply-to name is returned as unroutable even when the
            # reply was delivered: RabbitMQ 3.x routes replies outside its queues (proven
            # against rabbitmq-server in tests/e2e/test_amqp_rpc.py).
            # basic.return goes out before the confirm (https://www.rabbitmq.com/docs/confirms:
            # "For unroutable messages, the broker will issue a confirm once the exchange
            # verifies a message won't route to any queue (returns an empty list of queues). If
            # the message is also published as mandatory, the basic.return is sent to the client
            # before basic.ack.")
            method = commands.Basic.Return(
                int(ReplyCode.NO_ROUTE), "NO_ROUTE", frame.exchange, frame.routing_key
            )
            self.send_content(channel.number, method, message)
            if seq > 0:
                self._confirm(channel, seq, True)
            return
        if replied:
            if seq > 0:
                self._confirm(channel, seq, True)
            return
        self.messages_in += 1
        try:
            pending = self.service.edge.publish(message)
        except PublishRejected as exc:
            log.warning("publish from %s rejected: %s", self.remote, exc)
            if seq > 0:
                self.send_method(channel.number, commands.Basic.Nack(seq, False, False))
            elif seq < 0:
                channel.tx_failed = True
            return
        if pending is None:
            # A queue with x-overflow reject-publish that was full makes it a nack.
            refused = vhost.take_refusal(message)
            if seq > 0:
                self._confirm(channel, seq, not refused)
            return
        # Stored once the journal's commit group is durable: one callback per group.
        waiting = self._landing.get(pending)
        if waiting is None:
            waiting = self._landing[pending] = []
            pending.add_done_callback(self._landed)
        waiting.append((channel, seq, message))
        self._publishes_in_flight += 1
        if seq > 0:
            channel.unconfirmed[seq] = False
        elif seq < 0:
            channel.tx_landing += 1

    def _to_alternate_exchange(
        self, exchange: Exchange, frame: commands.Basic.Publish, message: Message
    ) -> None:
        """A message its exchange cannot route goes to the exchange's alternate exchange
        (https://www.rabbitmq.com/docs/ae), and on to that one's alternate if it cannot route
        it either; consumers still see the exchange it was published to."""
        vhost = self.vhost
        assert vhost is not None
        seen = {exchange.name}
        while not vhost.routed(message):
            alternate = vhost.exchanges.get(str(exchange.arguments.get("alternate-exchange", "")))
            if alternate is None or alternate.name in seen:
                return
            seen.add(alternate.name)
            if message.encoded is None:
                message.encoded = {}
            message.encoded.setdefault(
                _ROUTE_KEY, shortstr(frame.exchange) + shortstr(frame.routing_key)
            )
            message.topic = publish_topic(alternate.name, alternate.type, frame.routing_key)
            exchange = alternate

    def block(self, reason: str) -> None:
        """The memory alarm went off: tell the client (if it listens) that publishes wait."""
        if self.state is State.OPEN and self.capabilities.get("connection.blocked"):
            self.send_method(0, commands.Connection.Blocked(reason))

    def unblock(self) -> None:
        if self.state is State.OPEN and self.capabilities.get("connection.blocked"):
            self.send_method(0, commands.Connection.Unblocked())
        if self._held_by_alarm:
            self._held_by_alarm = False
            resume = getattr(self.link, "resume_reading", None)
            if resume is not None:
                resume()
            if self._paused and self._publishes_in_flight == 0:
                self._paused = False
                self.data_received(b"")

    def _landed(self, future: asyncio.Future[None]) -> None:
        waiting = self._landing.pop(future, [])
        self._publishes_in_flight -= len(waiting)
        ok = not future.cancelled() and future.exception() is None
        vhost = self.vhost
        for channel, seq, message in waiting:
            # Routed to the queues by now (the broker delivers before this callback runs).
            refused = vhost is not None and vhost.take_refusal(message)
            if seq > 0:
                self._confirm(channel, seq, ok and not refused)
            elif seq < 0:
                channel.tx_failed = channel.tx_failed or not ok
                channel.tx_landing -= 1
                if channel.tx_landing == 0:
                    self._commit_ok(channel)
        if self._publishes_in_flight == 0 and self._paused and not self._held_by_alarm:
            self._paused = False
            if self.state is not State.CLOSED:
                self.data_received(b"")

    def _confirm(self, channel: AmqpChannel, tag: int, ok: bool) -> None:
        """Publish `tag` is stored (or failed). Acks are merged into one multiple ack per
        channel and flush; a tag is acked only once every lower tag is settled."""
        if channel.closing or self.state is not State.OPEN:
            return
        unconfirmed = channel.unconfirmed
        if not ok:
            unconfirmed.pop(tag, None)
            self.send_method(channel.number, commands.Basic.Nack(tag, False, False))
        elif not unconfirmed:
            channel.confirm_ready = tag
        else:
            unconfirmed[tag] = True
        last = 0
        for pending_tag, done in unconfirmed.items():
            if not done:
                break
            last = pending_tag
        if last:
            for pending_tag in [t for t in unconfirmed if t <= last]:
                del unconfirmed[pending_tag]
            channel.confirm_ready = max(channel.confirm_ready, last)
        if channel.confirm_ready:
            self._confirm_channels.add(channel)
            self._request_flush()

    def _basic_get(self, channel: AmqpChannel, frame: commands.Basic.Get) -> None:
        assert self.vhost is not None
        method = commands.Basic.Get
        name = self._queue_name(channel, frame.queue, method)
        queue = self.vhost.queue(name, self, method)
        entry = queue.take()
        if entry is None:
            self.send_method(channel.number, commands.Basic.GetEmpty())
            return
        tag = channel.next_tag
        channel.next_tag = tag + 1
        if frame.no_ack:
            queue.settle(entry)
        else:
            channel.unacked[tag] = Delivery(queue, entry, None)
        exchange, routing_key = _route_names(route_of(entry.message))
        self.send_content(channel.number, commands.Basic.GetOk(
            tag, entry.redelivered, exchange, routing_key, len(queue.messages)
        ), entry.message)
        self.sent(entry.message)

    def sent(self, message: Message) -> None:
        """Count one message delivered to this client (basic.deliver or basic.get-ok)."""
        self.messages_out += 1
        self.service.broker.stats.sent("amqp", message)

    def _basic_ack(self, channel: AmqpChannel, frame: commands.Basic.Ack) -> None:
        if channel.tx is not None:
            channel.tx.settlements.append(
                (None, channel.settle_tagged(frame.delivery_tag, frame.multiple, commands.Basic.Ack))
            )
            return
        for delivery in channel.settle(frame.delivery_tag, frame.multiple, commands.Basic.Ack):
            delivery.queue.settle(delivery.entry)

    def _settle_negative(self, channel: AmqpChannel, deliveries: list[Delivery], requeue: bool) -> None:
        if requeue:
            by_queue: dict[Queue, list[QueueEntry]] = {}
            for delivery in deliveries:
                by_queue.setdefault(delivery.queue, []).append(delivery.entry)
            for queue, entries in by_queue.items():
                queue.requeue(entries)
        else:
            for delivery in deliveries:
                delivery.queue.reject(delivery.entry)

    def _basic_nack(self, channel: AmqpChannel, frame: commands.Basic.Nack) -> None:
        tagged = channel.settle_tagged(frame.delivery_tag, frame.multiple, commands.Basic.Nack)
        if channel.tx is not None:
            channel.tx.settlements.append((bool(frame.requeue), tagged))
            return
        self._settle_negative(channel, [d for _, d in tagged], frame.requeue)

    def _basic_reject(self, channel: AmqpChannel, frame: commands.Basic.Reject) -> None:
        tagged = channel.settle_tagged(frame.delivery_tag or 0, False, commands.Basic.Reject)
        if channel.tx is not None:
            channel.tx.settlements.append((bool(frame.requeue), tagged))
            return
        self._settle_negative(channel, [d for _, d in tagged], frame.requeue)

    def _basic_recover(self, channel: AmqpChannel, frame: Any) -> None:
        if not frame.requeue:
            # rabbit_channel handles only requeue=true (connection.close 540).
            raise ConnectionException(ReplyCode.NOT_IMPLEMENTED, "requeue=false", *_ids(frame))
        channel.requeue_all()
        if isinstance(frame, commands.Basic.Recover):
            self.send_method(channel.number, commands.Basic.RecoverOk())

    def _confirm_select(self, channel: AmqpChannel, frame: commands.Confirm.Select) -> None:
        if channel.tx is not None:
            # rabbit_channel: confirm.select on a transactional channel.
            raise ChannelException(
                ReplyCode.PRECONDITION_FAILED, "cannot switch from tx to confirm mode", *_ids(frame)
            )
        channel.confirm = True
        if not frame.nowait:
            self.send_method(channel.number, commands.Confirm.SelectOk())
