"""Publishing (class basic, the publisher side, and class confirm): a publish assembled from
its method, content header and body frames (or taken whole from the read buffer when all three
are there), checked, routed onto a core topic and handed to the front door; mandatory returns,
alternate exchanges, direct reply-to responses, publisher confirms once the message is stored,
and holding publishers during a memory alarm (connection.blocked)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from pamqp import commands

from ...core.edge import Action
from ...core.errors import PublishRejected, SchemaMismatch
from ...core.message import Message
from .base import ConnectionBase
from .channel import REPLY_PREFIX, REPLY_TO, ROUTE_KEY, AmqpChannel
from .errors import ChannelException, ConnectionException, ReplyCode
from .frames import (
    CLOSING,
    EXPECTED_BODY,
    EXPECTED_HEADER,
    EXPECTED_METHOD,
    FRAME_HEADER,
    OPEN,
    State,
    method_ids,
    unchecked,
)
from .hotpath import BasicProperties, decode_content_header, decode_publish, shortstr
from .properties import message_from_properties
from .routing import publish_topic

if TYPE_CHECKING:
    from .vhost import Exchange

log = logging.getLogger(__name__)

PUBLISH = Action.PUBLISH  # (a plain name: an Enum member lookup costs a call on CPython 3.11)


def expiration_problem(expiration: object) -> str | None:
    """Why rabbit_basic:parse_expiration/1 refuses an expiration property (an Erlang term, as
    its 406 text shows it), or None for a valid one: Erlang's string:to_integer/1 then a
    non-negative check."""
    text = expiration.decode("latin-1") if isinstance(expiration, bytes) else str(expiration)
    digits = len(text) - len(text.lstrip("+-"))
    if digits > 1:
        return "no_integer"
    end = digits
    while end < len(text) and text[end].isdigit():
        end += 1
    if end == digits:
        return "no_integer"
    if end < len(text):
        return f'{{leftover_string,"{text[end:]}"}}'
    value = int(text[:end])
    if value < 0:
        return f"{{value_negative,{value}}}"
    return None


class PublishingMixin(ConnectionBase):
    """basic.publish and its content, confirm.select, publisher confirms, connection.blocked."""

    def _basic_publish(self, channel: AmqpChannel, frame: commands.Basic.Publish) -> None:
        if frame.immediate:
            raise ConnectionException(
                ReplyCode.NOT_IMPLEMENTED, "immediate=true", *method_ids(frame)
            )
        channel.publish = frame

    def _header_frame(self, number: int, body_size: int, properties: Any, data: bytes) -> None:
        channel = self.channels.get(number)
        if channel is None:
            if number in self.closing_channels:
                return
            raise ConnectionException(ReplyCode.CHANNEL_ERROR, f"content header on unopened channel {number}")
        if channel.publish is None:
            raise ConnectionException(ReplyCode.UNEXPECTED_FRAME, EXPECTED_METHOD)
        if channel.content_props is not None:
            raise ConnectionException(
                ReplyCode.UNEXPECTED_FRAME, EXPECTED_BODY, *method_ids(commands.Basic.Publish)
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
        if self.state is CLOSING:
            return
        channel = self.channels.get(number)
        if channel is None:
            if number in self.closing_channels:
                return
            raise ConnectionException(ReplyCode.CHANNEL_ERROR, f"content body on unopened channel {number}")
        if channel.content_props is None:
            if channel.publish is None:
                raise ConnectionException(ReplyCode.UNEXPECTED_FRAME, EXPECTED_METHOD)
            raise ConnectionException(
                ReplyCode.UNEXPECTED_FRAME, EXPECTED_HEADER, *method_ids(commands.Basic.Publish)
            )
        channel.body.append(payload)
        channel.body_received += len(payload)
        if channel.body_received > channel.body_size:
            # rabbit_command_assembler takes the excess as a frame that is not the body.
            raise ConnectionException(
                ReplyCode.UNEXPECTED_FRAME, EXPECTED_BODY, *method_ids(commands.Basic.Publish)
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
        raw: bytes, body: bytes, looked_up: bool = False,
    ) -> None:
        vhost = self.vhost
        assert vhost is not None
        if (not looked_up and frame.exchange not in vhost.exchanges
                and vhost.exchange_directory is not None):
            # In a cluster, an exchange declared on another node an instant ago: asked of the
            # cluster's store before the 404 (no later frame is read meanwhile).
            self.hold_until(channel, vhost.exchange_directory.lookup(vhost, [frame.exchange]),
                            lambda _: self._route(channel, frame, props, raw, body, True))
            return
        exchange = vhost.exchange(frame.exchange, commands.Basic.Publish)
        if exchange.internal:
            raise ChannelException(
                ReplyCode.ACCESS_REFUSED,
                f"cannot publish to internal exchange '{exchange.name}' in vhost '{vhost.name}'",
                *method_ids(commands.Basic.Publish),
            )
        if props.user_id and str(props.user_id) != self.username:
            raise ChannelException(
                ReplyCode.PRECONDITION_FAILED,
                f"user_id property set to '{props.user_id}' but authenticated user was "
                f"'{self.username}'", *method_ids(commands.Basic.Publish),
            )
        if props.expiration is not None:
            problem = expiration_problem(props.expiration)
            if problem is not None:
                raise ChannelException(
                    ReplyCode.PRECONDITION_FAILED,
                    f"invalid expiration '{props.expiration}': {problem}",
                    *method_ids(commands.Basic.Publish),
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
        if not self.service.edge.authorize(self.principal, PUBLISH, topic):
            raise ChannelException(
                ReplyCode.ACCESS_REFUSED,
                f"user '{self.username}' may not publish to exchange '{exchange.name}' with "
                f"routing key '{frame.routing_key}'", *method_ids(commands.Basic.Publish),
            )
        if props.reply_to == REPLY_TO:
            if not channel.reply_consumer:
                raise ChannelException(
                    ReplyCode.PRECONDITION_FAILED, "fast reply consumer does not exist",
                    *method_ids(commands.Basic.Publish),
                )
            props.reply_to = REPLY_PREFIX + channel.reply_token
            raw = props.marshal()
        message = message_from_properties(topic, body, props, self.id, raw)
        # Deliveries report the exchange and routing key it was published with.
        if message.encoded is None:
            message.encoded = {ROUTE_KEY: route}
        else:
            message.encoded[ROUTE_KEY] = route
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
            method = unchecked(
                commands.Basic.Return,
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
        # Handed to the core with the other publishes of this read (`_flush_publishes`); its
        # confirm is owed from now on, so a later tag is never acked before it.
        self._publish_batch.append((channel, seq, message))
        if seq > 0:
            channel.unconfirmed[seq] = False
        elif seq < 0:
            channel.tx_landing += 1

    def _flush_publishes(self) -> None:
        """Hand the publishes of this read to the core in one call (one journal append per
        shard); each is confirmed once the commit that holds it is durable. Called when the
        read ends, before any other method is handled (so a channel's later commands see its
        publishes), and by tx.commit."""
        batch = self._publish_batch
        if not batch:
            return
        self._publish_batch = []
        vhost = self.vhost
        outcomes = self.service.edge.publish_many([message for _, _, message in batch])
        landing = self._landing
        for (channel, seq, message), pending in zip(batch, outcomes, strict=True):
            if pending is None:
                # A queue with x-overflow reject-publish that was full makes it a nack.
                refused = vhost is not None and vhost.take_refusal(message)
                if seq > 0:
                    self._confirm(channel, seq, not refused)
                elif seq < 0:
                    channel.tx_landing -= 1
                continue
            if isinstance(pending, PublishRejected):
                if not isinstance(pending, SchemaMismatch):  # the broker logs those, rate-limited
                    log.warning("publish from %s rejected: %s", self.remote, pending)
                if seq > 0:
                    self._confirm(channel, seq, False)
                elif seq < 0:
                    channel.tx_failed = True
                    channel.tx_landing -= 1
                continue
            # Stored once the journal's commit group is durable: one callback per group.
            waiting = landing.get(pending)
            if waiting is None:
                waiting = landing[pending] = []
                pending.add_done_callback(self._landed)
            waiting.append((channel, seq, message))
            self._publishes_in_flight += 1

    def _to_alternate_exchange(
        self, exchange: Exchange, frame: commands.Basic.Publish, message: Message
    ) -> None:
        """A message its exchange cannot route goes to the exchange's alternate exchange
        (https://www.rabbitmq.com/docs/ae), and on to that one's alternate if it cannot route
        it either; consumers still see the exchange it was published to. The publisher must
        be allowed to publish to the topic the alternate exchange gives it (the publish ACL),
        else it stays unroutable."""
        vhost = self.vhost
        assert vhost is not None
        seen = {exchange.name}
        while not vhost.routed(message):
            alternate = vhost.exchanges.get(str(exchange.arguments.get("alternate-exchange", "")))
            if alternate is None or alternate.name in seen:
                return
            seen.add(alternate.name)
            topic = publish_topic(alternate.name, alternate.type, frame.routing_key)
            if not self.service.edge.authorize(self.principal, PUBLISH, topic):
                log.info("AMQP %s: alternate exchange %r of %r refused: user %r may not publish "
                         "to %r", self.remote, alternate.name, exchange.name, self.username, topic)
                return
            if message.encoded is None:
                message.encoded = {}
            message.encoded.setdefault(
                ROUTE_KEY, shortstr(frame.exchange) + shortstr(frame.routing_key)
            )
            message.topic = topic
            exchange = alternate

    def block(self, reason: str) -> None:
        """The memory alarm went off: tell the client (if it listens) that publishes wait."""
        if (self.state is State.OPEN and self.capabilities.get("connection.blocked")
                and not self._told_blocked):
            self._told_blocked = True
            self.send_method(0, commands.Connection.Blocked(reason))

    def unblock(self) -> None:
        if self._told_blocked and self.state is State.OPEN:
            self._told_blocked = False
            self.send_method(0, commands.Connection.Unblocked())
        if self._held_by_alarm:
            self._held_by_alarm = False
            resume = getattr(self.link, "resume_reading", None)
            if resume is not None:
                resume()
            self.resume_reading()

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
        if self._publishes_in_flight == 0:
            self.resume_reading()

    def _confirm(self, channel: AmqpChannel, tag: int, ok: bool) -> None:
        """Publish `tag` is stored (or failed). Acks are merged into one multiple ack per
        channel and flush; a tag is acked only once every lower tag is settled (the flush
        finds how far that is, once per channel: `settled_confirms`)."""
        if channel.closing or self.state is not OPEN:
            return
        unconfirmed = channel.unconfirmed
        if not ok:
            unconfirmed.pop(tag, None)
            self.send_method(channel.number, commands.Basic.Nack(tag, False, True))
        elif not unconfirmed:
            if tag > channel.confirm_ready:
                channel.confirm_ready = tag
        else:
            unconfirmed[tag] = True
        confirming = self._confirm_channels
        if channel not in confirming:
            confirming.add(channel)
            self._request_flush()

    def _confirm_select(self, channel: AmqpChannel, frame: commands.Confirm.Select) -> None:
        if channel.tx is not None:
            # rabbit_channel: confirm.select on a transactional channel.
            raise ChannelException(
                ReplyCode.PRECONDITION_FAILED, "cannot switch from tx to confirm mode", *method_ids(frame)
            )
        channel.confirm = True
        if not frame.nowait:
            self.send_method(channel.number, commands.Confirm.SelectOk())
    def _whole_publish(self, buffer: bytearray, pos: int, end: int, number: int) -> int:
        """The common publish, handled in one go: basic.publish, its content header and a body
        in one frame (or none), all already buffered, on an open channel. Returns where the
        next frame starts, or 0 to take the frame-by-frame path (which also reports errors)."""
        channel = self.channels.get(number)
        if channel is None or channel.publish is not None or self.state is not OPEN:
            return 0
        header_at = end + 1
        if len(buffer) - header_at < 7:
            return 0
        frame_type, header_channel, size = FRAME_HEADER.unpack_from(buffer, header_at)
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
            frame_type, body_channel, size = FRAME_HEADER.unpack_from(buffer, after)
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

