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


The connection is assembled from small modules: `frames` (layout and states), `base` (shared
state, output, closing), `channel` (a channel's state), and one mixin per concern:
`handshake`, `topology` (exchanges and queues), `consuming`, `publishing` (with confirms),
`transactions`. This module reads frames and dispatches them.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pamqp import commands, exceptions
from pamqp import frame as pframe
from pamqp import header as pheader

from .channel import AmqpChannel
from .consuming import ConsumingMixin
from .errors import ChannelException, ConnectionException, ReplyCode
from .frames import (
    CLOSED,
    CLOSING,
    EXPECTED_BODY,
    EXPECTED_HEADER,
    FRAME_HEADER,
    METHOD_INDEX,
    OPEN,
    PROTOCOL_HEADER,
    READS_QUEUE,
    Link,
    State,
    frame_bytes,
    frame_error_text,
    method_ids,
)
from .handshake import HandshakeMixin
from .hotpath import ACK_INDEX, PUBLISH_INDEX, decode_ack, decode_content_header, decode_publish
from .publishing import PublishingMixin
from .topology import TopologyMixin
from .transactions import TransactionsMixin

if TYPE_CHECKING:
    from .service import AmqpService

_OPEN_OK_PAYLOAD = struct.pack(">HHI", 20, 11, 0)

__all__ = ["PROTOCOL_HEADER", "AmqpChannel", "AmqpConnection", "Link", "State"]


class AmqpConnection(
    HandshakeMixin, TopologyMixin, ConsumingMixin, PublishingMixin, TransactionsMixin
):
    """One client connection's protocol state (sans-IO)."""

    def __init__(self, service: AmqpService, link: Link, remote: str, loopback: bool) -> None:
        super().__init__(service, link, remote, loopback)
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


    # ================================================================== input
    def data_received(self, data: bytes) -> None:
        if self.state is CLOSED:
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
            while self.state is not CLOSED and not self._paused:
                available = len(buffer) - pos
                if available < 7:
                    break
                frame_type, channel, size = FRAME_HEADER.unpack_from(buffer, pos)
                if size + 8 > size_limit:
                    raise ConnectionException(ReplyCode.FRAME_ERROR, frame_error_text(
                        frame_type, b"", f"{{frame_too_large,{size},{size_limit - 8}}}"
                    ))
                if available < size + 8:
                    break
                end = pos + 7 + size
                if buffer[end] != 0xCE:
                    raise ConnectionException(ReplyCode.FRAME_ERROR, frame_error_text(
                        frame_type, bytes(buffer[pos + 7:end]),
                        f"{{invalid_frame_end_marker,{buffer[end]}}}",
                    ))
                if (
                    self._publish_batch and frame_type == 1 and size >= 4
                    and METHOD_INDEX.unpack_from(buffer, pos + 7)[0] != PUBLISH_INDEX
                ):
                    # Another method after publishes: they reach the core first.
                    self._flush_publishes()
                if (
                    self._publishes_in_flight and frame_type == 1 and size >= 4
                    and struct.unpack_from(">I", buffer, pos + 7)[0] in READS_QUEUE
                ):
                    # A read of queue state after publishes still being journaled: wait for
                    # them so this channel sees its own publishes (RabbitMQ's channel order).
                    self._paused = True
                    break
                if (
                    self.service.blocked and frame_type == 1 and size >= 4
                    and METHOD_INDEX.unpack_from(buffer, pos + 7)[0] == PUBLISH_INDEX
                ):
                    # Memory alarm: hold this publisher (stop reading) until it clears; one
                    # that connected during the alarm learns it now, as from RabbitMQ.
                    self.block("low on memory")
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
                    and METHOD_INDEX.unpack_from(buffer, pos + 7)[0] == PUBLISH_INDEX
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
                if self.close_after_flush and self.state is CLOSING:
                    break
        except ConnectionException as exc:
            self.close(exc)
            pos = len(buffer)
        finally:
            del buffer[:pos]
            # Every publish of this read goes to the core in one call.
            self._flush_publishes()
            self._run_wakeups()

    def _frame(self, frame_type: int, channel_number: int, data: bytes) -> None:
        if frame_type == 8:
            if channel_number != 0:
                raise ConnectionException(ReplyCode.FRAME_ERROR, "heartbeat frame on a channel")
            return
        if frame_type not in (1, 2):
            raise ConnectionException(
                ReplyCode.FRAME_ERROR, frame_error_text(frame_type, data[7:-1], "unknown_frame")
            )
        if frame_type == 2:
            header = decode_content_header(data)
            if header is not None:
                if self.state is not CLOSING:
                    self._header_frame(channel_number, header[0], header[1], data)
                return
        value: Any = None
        if frame_type == 1 and len(data) >= 12:
            index = METHOD_INDEX.unpack_from(data, 7)[0]
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
            if state is not CLOSING:
                assert isinstance(value, pheader.ContentHeader)
                self._header_frame(channel_number, value.body_size, value.properties, data)
            return
        if state is CLOSING:
            if isinstance(value, commands.Connection.CloseOk | commands.Connection.Close):
                if isinstance(value, commands.Connection.Close):
                    self.send_method(0, commands.Connection.CloseOk())
                self.close_after_flush = True
                self._request_flush()
            return
        if channel_number == 0:
            self._connection_method(value)
            return
        if state is not OPEN:
            raise ConnectionException(
                ReplyCode.COMMAND_INVALID, f"{value.name} before the connection is open", *method_ids(value)
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
                ReplyCode.CHANNEL_ERROR, "expected 'channel.open'", *method_ids(value),
            )
        if channel.publish is not None:
            # rabbit_command_assembler: a method while a publish's content is incomplete.
            raise ConnectionException(
                ReplyCode.UNEXPECTED_FRAME,
                EXPECTED_HEADER if channel.content_props is None else EXPECTED_BODY,
                *method_ids(commands.Basic.Publish),
            )
        handler = self._handlers.get(type(value))
        if handler is None:
            if isinstance(value, commands.Channel.Open):
                raise ConnectionException(
                    ReplyCode.CHANNEL_ERROR, "second 'channel.open' seen", *method_ids(value)
                )
            raise ConnectionException(
                ReplyCode.COMMAND_INVALID, f"'{value.name}' is not a client method here",
                *method_ids(value),
            )
        try:
            handler(channel, value)
        except ChannelException as exc:
            self._close_channel(channel, exc)


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
        # channel.open-ok with RabbitMQ's empty reserved long string (pamqp insists on "0").
        self._write(frame_bytes(1, number, _OPEN_OK_PAYLOAD))

    def _channel_close(self, channel: AmqpChannel, frame: commands.Channel.Close) -> None:
        self._drop_channel(channel)
        self.send_method(channel.number, commands.Channel.CloseOk())

    def _channel_close_ok(self, channel: AmqpChannel, frame: commands.Channel.CloseOk) -> None:
        raise ConnectionException(
            ReplyCode.COMMAND_INVALID, "channel.close-ok on an open channel", *method_ids(frame)
        )

    def _channel_flow(self, channel: AmqpChannel, frame: commands.Channel.Flow) -> None:
        if not frame.active:
            # RabbitMQ 3.x does not let a client pause deliveries (rabbit_channel: 540).
            raise ConnectionException(ReplyCode.NOT_IMPLEMENTED, "active=false", *method_ids(frame))
        channel.flow = bool(frame.active)
        self.send_method(channel.number, commands.Channel.FlowOk(active=channel.flow))
        if channel.flow:
            self.wake_channel(channel)

