"""The per-connection MQTT state machine (sans-IO).

Bytes come in through `data_received`; packets go out through the `Link` the adapter gives
(a transport's write and close, or a list in tests). The connection decodes packets with the
codec, checks them against the spec, and turns them into calls on the core broker and the
session. It never touches a socket and never awaits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from ...core.edge import Principal
from ...core.errors import PublishRejected, SchemaMismatch, StoreFull
from ...core.message import Message, now_ms
from ...core.outbox import SLOW_SUBSCRIBER
from ...core.scheduling import Timer
from ...core.subscriptions import SubscriptionType
from ...core.topics import (
    TopicError,
    parse_shared_filter,
    validate_topic_filter,
    validate_topic_name,
)
from . import packets as p
from .codec import (
    MQTTCodecError,
    PacketParser,
    PacketTooLarge,
    UnsupportedProtocolVersion,
    encode,
    encode_publish,
)
from .session import (
    NEVER_EXPIRES,
    NO_PACKET_IDS,
    MqttSession,
    SessionOfAnotherUser,
    SubscriptionOptions,
    open_packet_ids,
)
from .timing import clock as timing_clock

if TYPE_CHECKING:
    import asyncio
    from concurrent.futures import Future

    from .service import MqttService

log = logging.getLogger(__name__)

RC = p.ReasonCode
MQTT_V5 = 5
# The longest a publisher is held for a subscriber that does not catch up (see `held`).
HOLD_MAX_S = 0.5
# While the memory alarm holds publishers, a publishing connection is read again this often
# (one read's publishes each time), to see whether it cleared.
BLOCKED_RECHECK_S = 1.0


class Link(Protocol):
    """What the connection needs of its transport."""

    def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...

    def buffered(self) -> int:
        """Bytes written but not yet sent to the network."""

    def throttle(self, seconds: float) -> None:
        """Stop reading from the client for `seconds` (back-pressure)."""

    def resume(self) -> None:
        """Read from the client again before a `throttle` runs out."""


class State(Enum):
    AWAIT_CONNECT = "await-connect"
    # CONNECT accepted, CONNACK waits for the session (a cluster fetches it from another node)
    OPENING = "opening"
    CONNECTED = "connected"
    CLOSED = "closed"


# The states and the success code as plain names for the per-message path (reads, PUBLISH,
# delivery, acknowledgements): on CPython 3.11 reading a member off its Enum class costs about
# as much as a function call. Code off that path keeps `State.X` / `RC.X`.
AWAIT_CONNECT, OPENING, CONNECTED, CLOSED = State.AWAIT_CONNECT, State.OPENING, State.CONNECTED, State.CLOSED
SUCCESS = RC.SUCCESS


class ProtocolViolation(Exception):
    """The client broke the protocol: the connection ends with this reason code."""

    def __init__(self, reason_code: int, message: str) -> None:
        super().__init__(message)
        self.reason_code = reason_code


def _publish_properties(
    message: Message, subscription_ids: tuple[int, ...], topic_alias: int | None
) -> p.Properties | None:
    if not (
        message.headers or message.content_type or message.reply_to or message.correlation_data
        or message.payload_format is not None or message.expires_at_ms is not None
        or subscription_ids or topic_alias
    ):
        return None
    props = p.Properties()
    props.payload_format_indicator = message.payload_format
    props.content_type = message.content_type
    props.response_topic = message.reply_to
    props.correlation_data = message.correlation_data
    if message.headers:
        props.user_properties = list(message.headers)
    if message.expires_at_ms is not None:
        props.message_expiry_interval = message.remaining_expiry_s()
    if subscription_ids:
        props.subscription_identifiers = list(subscription_ids)
    props.topic_alias = topic_alias
    return props


def _packet_id_offset(packet: bytes, topic_length: int) -> bytes:
    """`_packet_id_position`, as three little-endian bytes (what an encoding cache holds)."""
    return _packet_id_position(packet, topic_length).to_bytes(3, "little")


def _packet_id_position(packet: bytes, topic_length: int) -> int:
    index = 1
    while packet[index] & 0x80:
        index += 1
    return index + 1 + 2 + topic_length


class MqttConnection:
    # Slots, not a __dict__: an idle connection costs about 1.3 KiB less (a class with more
    # than 30 attributes gets no key-sharing dict).
    __slots__ = (
        "service", "link", "remote", "transport_name", "state", "parser", "version", "client_id",
        "username", "principal", "certificate_identity", "session", "keep_alive",
        "last_received", "connected_at", "send_window", "client_max_packet_size",
        "client_topic_alias_max", "problem_info", "inbound_aliases", "outbound_aliases",
        "inbound_pending", "qos2_open", "will", "session_expiry_at_connect", "_out", "_out_bytes",
        "_flush_requested", "messages_in", "messages_out", "last_ack", "_tokens", "_tokens_at",
        "_throttled_for", "_backlog", "_backlog_error", "_valid_topic", "held", "_hold_timer",
        "_allowed_topic", "_read_ms", "_link_buffered", "_acks_waiting", "_held_subacks",
        "_sent_stream", "_sent_count", "_sent_bytes",
        "_held_from", "_close_when_sent", "_connect_marks", "_drain_wanted", "_after_connack",
        "_checked",
    )

    def __init__(self, service: MqttService, link: Link, remote: str = "", transport_name: str = "tcp") -> None:
        self.service = service
        self.link = link
        self.remote = remote
        self.transport_name = transport_name
        self.state = State.AWAIT_CONNECT
        settings = service.settings
        # Until it has authenticated, a client may send no more than a small CONNECT.
        self.parser = PacketParser(max_packet_size=min(
            settings.max_packet_size, settings.max_packet_size_unauthenticated or settings.max_packet_size))
        self.version = 4
        self.client_id = ""
        self.username: str | None = None
        # Who this client is to the front door's authorization (set once connected).
        self.principal = Principal("mqtt", None, "", remote)
        # Set by the adapter from a verified client certificate when the listener maps
        # certificate identities to users.
        self.certificate_identity: str | None = None
        # The verdict of a password checked off the event loop, for the CONNECT handled again.
        self._checked: tuple[str | None] | None = None
        self.session: MqttSession | None = None
        self.keep_alive = 0
        self.last_received = self.service.clock()
        self.connected_at = time.time()
        self.send_window = service.settings.max_inflight
        self.client_max_packet_size = 0
        self.client_topic_alias_max = 0
        # Request Problem Information 0: no reason string on acknowledgements [MQTT-3.1.2-29].
        self.problem_info = True
        self.inbound_aliases: dict[int, str] = {}
        self.outbound_aliases: dict[str, int] = {}
        # QoS 1 publishes waiting for the journal, and QoS 2 publishes received on this
        # connection and not yet completed: together they use the Receive Maximum quota.
        self.inbound_pending = 0
        self.qos2_open: set[int] = NO_PACKET_IDS  # a set of its own from the first
        self.will: p.Will | None = None
        self.session_expiry_at_connect = 0
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._flush_requested = False
        self.messages_in = 0
        self.messages_out = 0
        self.last_ack = self.service.clock()
        self._tokens = float(service.settings.max_publish_rate)
        self._tokens_at = self.service.clock()
        self._throttled_for = 0.0
        self._backlog: list[p.Packet] = []
        self._backlog_error: MQTTCodecError | None = None
        self._valid_topic = ""
        # The topic this client was last allowed to publish to, during the current read only
        # (authorization is asked once per topic per read, not once per PUBLISH).
        self._allowed_topic: str | None = None
        # Publish time of the messages of the current read (one clock read per read).
        self._read_ms = 0
        # The link's send buffer when it was last asked: it grows only when `flush` writes,
        # so between flushes it is an upper bound of what the link still holds.
        self._link_buffered = 0
        # Commit futures of QoS 1/2 publishes → what to acknowledge, in order, once each is
        # durable: one callback per commit group and connection, not one per PUBLISH.
        self._acks_waiting: dict[asyncio.Future[None], list[tuple[int, int]]] | None = None
        # Held: a subscriber this client publishes to has more queued than it reads; this
        # client is not read until that subscriber catches up (or HOLD_MAX_S passes).
        self.held = False
        self._hold_timer: Timer | None = None
        # SUBACKs waiting, in order, for the cluster's other nodes to know the subscription.
        self._held_subacks: list[list[Any]] | None = None
        # Messages sent since the broker's statistics last counted them, all of one stream:
        # counted at the next flush (or sooner, when a message of another stream comes).
        self._sent_stream = ""
        self._sent_count = 0
        self._sent_bytes = 0
        # Output held for session state to be durable: [index in `_out` from which output
        # waits, future of the metadata commit it waits for], oldest first (they resolve in
        # order). Closed while output was held: the link closes once it is sent.
        self._held_from: list[list[Any]] | None = None
        self._close_when_sent = False
        # CONNECT → CONNACK inside the broker: [read, session open, commit durable] clock
        # values, until the CONNACK is handed to the link (`timing.ConnectTiming`).
        self._connect_marks: list[float] | None = None
        # Output passed `output_high_water` while a session wanted to send more (replay, or
        # live QoS 1/2 messages): the session is told when it has drained.
        self._drain_wanted = False
        # A new persistent session's CONNACK was just queued: the index in `_out` after it,
        # from which output waits for the session's commit to be durable (see `_opened`).
        self._after_connack: int | None = None

    @property
    def open(self) -> bool:
        return self.state is not CLOSED

    # ------------------------------------------------------------------ output
    def _send(self, data: bytes) -> None:
        self._out.append(data)
        self._out_bytes += len(data)
        if not self._flush_requested:
            self._flush_requested = True
            self.service.request_flush(self)

    def _send_packet(self, packet: p.Packet) -> None:
        data = encode(packet, self.version)
        if self.client_max_packet_size and len(data) > self.client_max_packet_size:
            return
        self._send(data)

    def _count_sent(self) -> None:
        """Add the messages sent since the last count to the broker's statistics."""
        if self._sent_count:
            self.service.edge.stats.sent_many("mqtt", self._sent_stream, self._sent_count, self._sent_bytes)
            self._sent_count = self._sent_bytes = 0

    def flush(self) -> None:
        self._flush_requested = False
        if self._sent_count:
            self._count_sent()
        held = self._held_from
        if held is not None:
            while held and held[0][1].done():
                del held[0]
            if held:
                self._flush_before(held)
                return
            self._held_from = None
        if self._out:
            data = b"".join(self._out) if len(self._out) > 1 else self._out[0]
            self._out.clear()
            self._out_bytes = 0
            if self.state is not CLOSED or data:
                self.link.write(data)
                if self._connect_marks is not None:
                    self._connack_written()
            self._link_buffered = self.link.buffered()
        if self._drain_wanted:
            self.output_drained()
        if self._close_when_sent:
            self._close_when_sent = False
            self.link.close()

    def _connack_written(self) -> None:
        marks, self._connect_marks = self._connect_marks, None
        if marks is not None and self.state is State.CONNECTED:
            self.service.connect_timing.record(marks, timing_clock(), self.session_expiry_at_connect != 0)

    def _flush_before(self, held: list[list[Any]]) -> None:
        """Write the output that waits for nothing (before the first hold)."""
        cut = held[0][0]
        if not cut:
            return
        out = self._out
        data = b"".join(out[:cut])
        del out[:cut]
        for hold in held:
            hold[0] -= cut
        self._out_bytes -= len(data)
        self.link.write(data)
        if self._connect_marks is not None:
            self._connack_written()
        self._link_buffered = self.link.buffered()

    # ------------------------------------------------------------------ output high-water mark
    def output_room(self) -> bool:
        """Whether the client is taking what is written to it: the output waiting for it
        (this turn's and the link's buffer) is below `output_high_water`. When it is not,
        the session hears of it once the client has read most of it (`output_drained`), so
        that neither a replay nor a publisher builds a large queue in front of one socket."""
        if self._out_bytes + self._link_buffered <= self.service.settings.output_high_water:
            return True
        self._drain_wanted = True
        return False

    def output_drained(self) -> None:
        """The link wrote out what it held, or a flush left no more than the high-water mark:
        if the session was waiting for room, it may send again (replay resumes, publishers
        held for this client are released). Above the mark the link's buffer is above it too
        (the transport paused writing), and the link tells again once it is below a quarter."""
        if not self._drain_wanted:
            return
        self._link_buffered = buffered = self.link.buffered()
        if self._out_bytes + buffered > self.service.settings.output_high_water:
            return
        self._drain_wanted = False
        session = self.session
        if session is not None and session.connection is self and self.state is State.CONNECTED:
            session.output_drained()

    def hold_output(self, start: int, durable: Future[None]) -> bool:
        """Output from index `start` of what is pending on waits until `durable` is done;
        False when it already waits for that future."""
        held = self._held_from
        if held is None:
            self._held_from = [[start, durable]]
            return True
        if held[-1][1] is durable:
            return False  # the same commit: the earlier start covers it
        held.append([start, durable])
        return True

    def output_released(self) -> None:
        """A commit that held output is durable: what waited for it goes out now (one write
        per connection per commit, so no need to wait for the turn's batched flush)."""
        if self._connect_marks is not None and not self._connect_marks[2]:
            self._connect_marks[2] = timing_clock()
        if self._held_from is not None:
            self.flush()

    def send_publish(
        self,
        message: Message,
        qos: int,
        retain: bool,
        subscription_ids: tuple[int, ...],
        packet_id: int | None,
        dup: bool,
    ) -> bool:
        """Queue a PUBLISH for the client; False if it could not be sent (too large, closed,
        or a QoS 0 message dropped for a slow client)."""
        if self.state is not CONNECTED:
            return False
        if qos == 0 and self._out_bytes + self._link_buffered > self.service.settings.max_outbound_buffer:
            # Over the bound, which may be stale: ask the link what it really still holds.
            self._link_buffered = self.link.buffered()
            if self._out_bytes + self._link_buffered > self.service.settings.max_outbound_buffer:
                self.service.edge.stats.drop(SLOW_SUBSCRIBER)
                return False
        version = self.version
        personal = version == MQTT_V5 and (
            subscription_ids or message.expires_at_ms is not None or self.client_topic_alias_max
        )
        if personal or dup:
            topic = message.topic
            alias = new_alias = None
            if self.client_topic_alias_max and not dup:
                alias = self.outbound_aliases.get(topic)
                if alias is not None:
                    topic = ""
                elif len(self.outbound_aliases) < self.client_topic_alias_max:
                    alias = new_alias = len(self.outbound_aliases) + 1
            props = _publish_properties(message, subscription_ids, alias) if version == MQTT_V5 else None
            data = encode_publish(topic, message.payload, qos, retain, dup, packet_id, props, version)
            if new_alias is not None and not (self.client_max_packet_size and len(data) > self.client_max_packet_size):
                # Only a mapping the client has received may be used later [MQTT-3.3.2-10].
                self.outbound_aliases[topic] = new_alias
        else:
            key = (version, qos, retain)
            cache = message.encoded
            if cache is None:
                cache = message.encoded = {}
            cached = cache.get(key)
            if cached is None:
                # The first subscriber's encoding, with its packet id: the next ones (fan-out)
                # take it from the cache and write their own packet id over it.
                props = _publish_properties(message, (), None) if version == MQTT_V5 else None
                data = cache[key] = encode_publish(
                    message.topic, message.payload, qos, retain, False,
                    (1 if packet_id is None else packet_id) if qos else None, props, version,
                )
            elif qos and packet_id is not None:
                data = cached
                # Where the packet id sits, kept beside the encoding in the same cache.
                where = cache.get((version, "pid"))
                if where is None:
                    where = cache[(version, "pid")] = _packet_id_offset(data, len(message.topic.encode()))
                position = int.from_bytes(where, "little")
                buffer = bytearray(data)
                buffer[position] = packet_id >> 8
                buffer[position + 1] = packet_id & 0xFF
                data = bytes(buffer)
            else:
                data = cached
        if self.client_max_packet_size and len(data) > self.client_max_packet_size:
            return False
        if packet_id is not None and self.session is not None:
            if len(self.session.inflight) <= 1:
                self.last_ack = self.service.clock()  # the dead-subscriber clock starts with the window
            if (
                self._link_buffered > self.service.settings.output_high_water
                and self.service.back_pressure.current is not None
            ):
                # A QoS 1/2 message to a client whose socket had more than the high-water mark
                # left to send at the last flush: hold the client publishing it until this one
                # has read it (this turn's own output alone holds nobody: a fast reader takes
                # a large turn at once).
                self._drain_wanted = True
                self.service.congested(self.session, queue=False)
        self.messages_out += 1
        if message.producer_protocol != "sys":  # the broker's own $SYS statistics are not messages
            if message.stream != self._sent_stream:
                self._count_sent()
                self._sent_stream = message.stream
            self._sent_count += 1
            self._sent_bytes += len(message.payload)
        self._send(data)
        return True

    def send_pubrel(self, packet_id: int) -> None:
        self._send_packet(p.Pubrel(packet_id))

    # ------------------------------------------------------------------ input
    def data_received(self, data: bytes) -> None:
        if self.state is CLOSED:
            return
        self.last_received = self.service.clock()
        if self.state is AWAIT_CONNECT and self._connect_marks is None:
            self._connect_marks = [timing_clock(), 0.0, 0.0]
        if self.state is AWAIT_CONNECT and data and not self.parser.buffered and data[0] >> 4 != 1:
            # [MQTT-3.1.0-1] the first packet must be CONNECT: no need to wait for the rest.
            log.info("%s: first packet is not CONNECT (first byte 0x%02x)", self.remote, data[0])
            self.close()
            return
        error: MQTTCodecError | None = None
        try:
            packets = self.parser.feed(data)
        except MQTTCodecError as exc:
            # Packets decoded before the bad one in the same chunk are still handled.
            packets, error = list(getattr(exc, "packets", []) or []), exc
        if self._backlog or self.held or self.state is OPENING:
            self._backlog.extend(packets)  # still throttled, held or opening: keep the order
            if error is not None:
                self._backlog_error = error
            return
        if packets and self.state is not AWAIT_CONNECT and self.service.read_budget.spent():
            # This loop turn has done its share of reads: the rest waits for the next turn, so
            # that new connections are accepted and CONNECTs answered meanwhile (a CONNECT
            # never waits here).
            self._backlog.extend(packets)
            if error is not None:
                self._backlog_error = error
            self.service.defer(self)
            return
        self._process(packets, error)

    def run_deferred(self) -> None:
        """Handle what a turn's read budget left for later (see `MqttService.defer`)."""
        if self.state is CLOSED or self.held or self.state is OPENING:
            return  # a hold or an opening session resumes it in its own time
        self.link.resume()
        if self._backlog or self._backlog_error is not None:
            self._resume_backlog()

    def _process(self, packets: list[p.Packet], error: MQTTCodecError | None = None) -> None:
        service = self.service
        outer, service.publishing = service.publishing, self
        back_pressure = service.back_pressure
        outer_publisher, back_pressure.current = back_pressure.current, self
        if outer is None:
            service.group_writes(True)
        self._allowed_topic = None
        self._read_ms = now_ms()
        start = len(self._out)
        writes = service.store_writes()
        connecting = self.state is AWAIT_CONNECT
        try:
            self._process_packets(packets, error)
        finally:
            service.publishing = outer
            back_pressure.current = outer_publisher
            if outer is None:
                service.group_writes(False)
            after_connack, self._after_connack = self._after_connack, None
            if service.store_writes() != writes:
                # What this read answers may report session state just written (SUBACK,
                # PUBREC, PUBREL): it waits until that is durable. A new persistent session's
                # CONNACK does not (see `_opened`): what follows it does.
                service.hold_output_until_durable(self, start if after_connack is None else after_connack)
        if connecting and self.state is CONNECTED and self._out:
            # A CONNACK leaves now, not after the turn's other reads and the batched flush of
            # every connection's output (whatever waits for a commit stays behind).
            self.flush()

    def _process_packets(self, packets: list[p.Packet], error: MQTTCodecError | None) -> None:
        connected = CONNECTED
        publish = p.Publish
        puback = p.Puback  # a QoS 1 subscriber's acknowledgements: no dispatch either
        last = len(packets) - 1
        # The PUBLISHes of a run of them in this read, handed to the core in one call (one
        # journal append per shard) when the run ends, before any other packet is handled.
        messages: list[Message] = []
        packet_ids: list[int | None] = []
        limit = self.service.publish_batch_limit()
        for index, packet in enumerate(packets):
            state = self.state
            if state is CLOSED:
                return
            try:
                if state is connected and type(packet) is publish:
                    message = self._accept_publish(packet)  # type: ignore[arg-type]
                    if message is not None:
                        messages.append(message)
                        packet_ids.append(packet.packet_id)  # type: ignore[attr-defined]
                    if (
                        index < last and type(packets[index + 1]) is publish
                        and len(messages) < limit and not self._throttled_for > 0
                    ):
                        continue
                    if messages:
                        self._publish_batch(messages, packet_ids)
                        messages, packet_ids = [], []
                        limit = self.service.publish_batch_limit()
                elif state is connected and type(packet) is puback:
                    self._on_puback(packet)  # type: ignore[arg-type]
                else:
                    self._handle(packet)
            except ProtocolViolation as exc:
                if messages:  # the ones before the offending packet were fine
                    self._publish_batch(messages, packet_ids)
                log.info("%s %s: protocol violation: %s", self.remote, self.client_id, exc)
                self.close(exc.reason_code, str(exc))
                return
            if self.state is OPENING:
                # The rest waits for the session (see `_on_connect`).
                self._backlog.extend(packets[index + 1:])
                if error is not None:
                    self._backlog_error = error
                return
            if self.held and self.state is not CLOSED:
                # Back-pressure: the rest waits, and the socket is not read meanwhile.
                self._backlog.extend(packets[index + 1:])
                if error is not None:
                    self._backlog_error = error
                self.link.throttle(HOLD_MAX_S)
                self._hold_timer = self.service.scheduler.call_later(HOLD_MAX_S, self.release)
                return
            if self._throttled_for > 0:
                # Over the publish rate: the rest waits, and the socket is not read meanwhile.
                self._backlog.extend(packets[index + 1:])
                if error is not None:
                    self._backlog_error = error
                delay, self._throttled_for = self._throttled_for, 0.0
                self.link.throttle(delay)
                self.service.scheduler.call_later(delay, self._resume_backlog)
                return
        if error is not None and self.state is not CLOSED:
            self._codec_error(error)

    def hold(self) -> None:
        """Stop reading this client after the packet in hand (see `held`)."""
        self.held = True

    def release(self) -> None:
        """Read this client again, beginning with what a hold left unprocessed."""
        if not self.held:
            return
        self.held = False
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        if self.state is State.CLOSED:
            return
        self.link.resume()
        if self._backlog or self._backlog_error is not None:
            self._resume_backlog()

    def _resume_backlog(self) -> None:
        packets = list(self._backlog)
        self._backlog.clear()
        error, self._backlog_error = self._backlog_error, None
        self._process(packets, error)

    def _codec_error(self, exc: MQTTCodecError) -> None:
        if isinstance(exc, UnsupportedProtocolVersion):
            log.info("%s: unsupported protocol version %s", self.remote, exc.protocol_level)
            if self.state is State.AWAIT_CONNECT:
                if exc.protocol_level == MQTT_V5:
                    self._send(encode(p.Connack(False, RC.UNSUPPORTED_PROTOCOL_VERSION), MQTT_V5))
                else:
                    self._send(encode(p.Connack(False, p.ConnackCode311.UNACCEPTABLE_PROTOCOL_VERSION), 4))
            self.close()
        elif isinstance(exc, PacketTooLarge):
            log.info("%s %s: packet too large: %s", self.remote, self.client_id, exc)
            self.close(RC.PACKET_TOO_LARGE)
        else:
            log.info("%s %s: malformed packet: %s", self.remote, self.client_id, exc)
            self.close(exc.reason_code)

    def _handle(self, packet: p.Packet) -> None:
        if self.state is State.AWAIT_CONNECT:
            if not isinstance(packet, p.Connect):
                # [MQTT-3.1.0-1] the first packet must be CONNECT.
                raise ProtocolViolation(RC.PROTOCOL_ERROR, "the first packet must be CONNECT")
            self._on_connect(packet)
            return
        handler = self._handlers.get(type(packet))
        if handler is None:
            raise ProtocolViolation(RC.PROTOCOL_ERROR, f"{type(packet).__name__} is not allowed from a client")
        handler(self, packet)

    # ------------------------------------------------------------------ CONNECT
    def _refuse(self, v5_code: int, v3_code: int, reason: str) -> None:
        log.info("%s: connection refused: %s", self.remote, reason)
        if self.version == MQTT_V5:
            props = p.Properties(reason_string=reason)
            self._send(encode(p.Connack(False, v5_code, props), MQTT_V5))
        else:
            self._send(encode(p.Connack(False, v3_code), self.version))
        self.close()

    def _on_connect(self, connect: p.Connect) -> None:
        settings = self.service.settings
        self.version = connect.protocol_level
        v5 = self.version == MQTT_V5
        props = connect.properties
        client_id = connect.client_id
        assigned = None
        if not client_id:
            if not v5 and not connect.clean_start:
                # [MQTT-3.1.3-8] empty client id needs clean session on 3.1.1.
                self._refuse(RC.CLIENT_IDENTIFIER_NOT_VALID, p.ConnackCode311.IDENTIFIER_REJECTED,
                             "an empty client identifier needs clean session")
                return
            client_id = assigned = self.service.assign_client_id()
        elif len(client_id) > settings.max_client_id_length:
            self._refuse(RC.CLIENT_IDENTIFIER_NOT_VALID, p.ConnackCode311.IDENTIFIER_REJECTED,
                         "client identifier too long")
            return
        if v5 and props.authentication_method is not None:
            self._refuse(RC.BAD_AUTHENTICATION_METHOD, p.ConnackCode311.NOT_AUTHORIZED,
                         f"authentication method {props.authentication_method!r} is not supported")
            return
        if connect.will is not None:
            try:
                validate_topic_name(connect.will.topic)
            except TopicError as exc:
                self._refuse(RC.TOPIC_NAME_INVALID, p.ConnackCode311.SERVER_UNAVAILABLE, f"will topic: {exc}")
                return
            if connect.will.qos > settings.maximum_qos:
                self._refuse(RC.QOS_NOT_SUPPORTED, p.ConnackCode311.SERVER_UNAVAILABLE, "will QoS not supported")
                return
            if connect.will.retain and not settings.retain_available:
                self._refuse(RC.RETAIN_NOT_SUPPORTED, p.ConnackCode311.SERVER_UNAVAILABLE, "retain not supported")
                return
        if settings.max_connections and len(self.service.connections) >= settings.max_connections:
            self._refuse(RC.SERVER_BUSY, p.ConnackCode311.SERVER_UNAVAILABLE, "too many connections")
            return
        username = connect.username
        verdict: str | None
        if self.certificate_identity is not None:
            # The TLS layer verified a client certificate that names the user: no password.
            username, verdict = self.certificate_identity, None
        elif self._checked is not None:
            verdict, self._checked = self._checked[0], None  # checked off the loop (below)
        else:
            answer = self.service.authenticate(connect.username, connect.password, client_id, self.remote)
            if answer is not None and not isinstance(answer, str):  # a future of the verdict
                # A password is being hashed off the event loop: nothing else of this client
                # is handled until the verdict is in; then the CONNECT is handled again.
                self.state = State.OPENING
                answer.add_done_callback(lambda done: self._authenticated_later(connect, done))
                return
            verdict = answer
        if verdict is not None:
            bad_credentials = verdict == "bad-credentials"
            self._refuse(
                RC.BAD_USER_NAME_OR_PASSWORD if bad_credentials else RC.NOT_AUTHORIZED,
                p.ConnackCode311.BAD_USERNAME_OR_PASSWORD if bad_credentials else p.ConnackCode311.NOT_AUTHORIZED,
                "bad user name or password" if bad_credentials else "not authorized",
            )
            return
        principal = Principal("mqtt", username, client_id, self.remote)
        if connect.will is not None and not self.service.authorize_will(principal, connect.will.topic):
            # A will is a publish the client makes at CONNECT (retained or not): the publish
            # ACL decides, and a will on $SYS is refused as a PUBLISH there is (as mosquitto).
            self._refuse(RC.NOT_AUTHORIZED, p.ConnackCode311.NOT_AUTHORIZED,
                         f"will topic {connect.will.topic!r} not authorized")
            return
        clean_start = connect.clean_start
        if self.service.owned_by_other(client_id, username):
            if self._refuse_other_user(client_id):
                return
            clean_start = True  # a new session for the newcomer
        self.parser.max_packet_size = settings.max_packet_size  # logged in: the full limit
        self.client_id = client_id
        self.username = username
        self.principal = principal
        self.keep_alive = connect.keep_alive
        server_keep_alive = None
        if v5 and settings.max_keepalive and (self.keep_alive == 0 or self.keep_alive > settings.max_keepalive):
            # Server Keep Alive exists on 5.0 only [MQTT-3.2.2-21]; a 3.1.1 client's value stands.
            self.keep_alive = server_keep_alive = settings.max_keepalive
        if v5:
            expiry = props.session_expiry_interval or 0
            self.send_window = props.receive_maximum or 65535
            self.client_max_packet_size = props.maximum_packet_size or 0
            self.client_topic_alias_max = props.topic_alias_maximum or 0
            self.problem_info = props.request_problem_information != 0
        else:
            expiry = 0 if connect.clean_start else (settings.persistent_session_expiry or NEVER_EXPIRES)
        self.session_expiry_at_connect = expiry
        self.will = connect.will
        fetching = self.service.session_elsewhere(client_id, clean_start, username)
        if fetching is not None:
            # Cluster: the session lives on (or must be ended on) another node first; CONNACK
            # and every later packet wait until it is here.
            self.state = State.OPENING
            fetching.add_done_callback(
                lambda done: self._opened_later(done, client_id, clean_start, expiry, assigned,
                                                server_keep_alive))
            return
        self._opened(client_id, clean_start, expiry, assigned, server_keep_alive)

    def _refuse_other_user(self, client_id: str) -> bool:
        """`client_id`'s session belongs to another user: True when the CONNECT is refused
        (`mqtt.session_takeover_by_other_user = "refuse"`), False when it gets a new session."""
        if self.service.settings.session_takeover_by_other_user != "refuse":
            log.info("%s: client %r has a session of another user; it starts anew", self.remote,
                     client_id)
            return False
        self._refuse(RC.NOT_AUTHORIZED, p.ConnackCode311.NOT_AUTHORIZED,
                     f"client identifier {client_id!r} has a session of another user")
        return True

    def _authenticated_later(self, connect: p.Connect, done: asyncio.Future[str | None]) -> None:
        """The password check of `connect` is done: handle the CONNECT with its verdict, then
        whatever the client sent meanwhile, as one read."""
        if self.state is not State.OPENING:
            return  # the client left meanwhile
        self.state = State.AWAIT_CONNECT
        verdict = "bad-credentials" if done.cancelled() or done.exception() is not None else done.result()
        self._checked = (verdict,)
        packets: list[p.Packet] = [connect, *self._backlog]
        self._backlog.clear()
        error, self._backlog_error = self._backlog_error, None
        self._process(packets, error)
        if self.state is State.CLOSED:
            self._checked = None

    def _opened_later(self, fetching: asyncio.Future[None], client_id: str, clean_start: bool, expiry: int,
                      assigned: str | None, server_keep_alive: int | None) -> None:
        """The session came from another node: open it as a read would, its store write in
        a group committed off the loop, and the CONNACK of a resumed session (and whatever
        follows a new one's CONNACK) held until that write is durable (a write outside a group
        would wait for its fsync on the event loop). A session that could not be brought here
        now (the future's error) refuses the CONNECT, retryably: a new session would drop the
        one held elsewhere."""
        failure = None if fetching.cancelled() else fetching.exception()
        if isinstance(failure, SessionOfAnotherUser):
            # held on another node by another user: refused there, nothing ended anywhere
            if self.state is not State.CLOSED:
                self._refuse(RC.NOT_AUTHORIZED, p.ConnackCode311.NOT_AUTHORIZED,
                             f"client identifier {client_id!r} has a session of another user")
            return
        if failure is not None:
            if self.state is not State.CLOSED:
                self._refuse(RC.SERVER_UNAVAILABLE, p.ConnackCode311.SERVER_UNAVAILABLE, str(failure))
            return
        service = self.service
        if service.owned_by_other(client_id, self.username):
            # the session came from another node, made by another user
            if self._refuse_other_user(client_id):
                return
            clean_start = True
        grouping = service.publishing is None  # (a callback runs outside any read's group)
        start = len(self._out)
        writes = service.store_writes()
        if grouping:
            service.group_writes(True)
        try:
            self._opened(client_id, clean_start, expiry, assigned, server_keep_alive)
        finally:
            if grouping:
                service.group_writes(False)
            after_connack, self._after_connack = self._after_connack, None
            if service.store_writes() != writes:
                service.hold_output_until_durable(self, start if after_connack is None else after_connack)
        if self.state is State.CONNECTED and self._out:
            self.flush()  # the CONNACK, unless it waits for a commit

    def _opened(self, client_id: str, clean_start: bool, expiry: int, assigned: str | None,
                server_keep_alive: int | None) -> None:
        if self.state is State.CLOSED:
            return  # the client left while its session was fetched
        settings = self.service.settings
        v5 = self.version == MQTT_V5
        resumed = self.state is State.OPENING
        self.state = State.CONNECTED
        session, present = self.service.open_session(self, client_id, clean_start, expiry)
        self.session = session
        if self._connect_marks is not None:
            self._connect_marks[1] = timing_clock()
        connack_props = p.Properties()
        if v5:
            connack_props.receive_maximum = settings.receive_maximum
            connack_props.maximum_packet_size = settings.max_packet_size
            connack_props.topic_alias_maximum = settings.topic_alias_maximum
            if settings.maximum_qos < 2:
                connack_props.maximum_qos = settings.maximum_qos
            if not settings.retain_available:
                connack_props.retain_available = 0
            connack_props.assigned_client_identifier = assigned
            connack_props.server_keep_alive = server_keep_alive
        self._send(encode(p.Connack(present, RC.SUCCESS, connack_props), self.version))
        if not present and session.durable:
            # A new persistent session: its CONNACK reports no session (session present 0), so
            # it need not wait for the fsync of the session's commit (which is committed, into
            # the metadata WAL, before the CONNACK is written: a crash of the process keeps it).
            # Everything after the CONNACK (SUBACK, PUBACK, PUBREC, ...) waits for that fsync,
            # so no acknowledgement leaves before the session record is durable: after a
            # machine crash the client is told its session is gone, never half of it.
            self._after_connack = len(self._out)
        log.info("%s: client %r connected (MQTT %s, clean=%s, keepalive=%s)", self.remote, client_id,
                 {3: "3.1", 4: "3.1.1", 5: "5.0"}[self.version], clean_start, self.keep_alive,
                 extra={"event": "client_connected", "protocol": "mqtt", "client_id": client_id,
                        "peer": self.remote})
        session.resend_inflight()
        if resumed and (self._backlog or self._backlog_error is not None):
            self._resume_backlog()

    # ------------------------------------------------------------------ PUBLISH
    def _rate_limit(self, rate: float) -> None:
        now = self.service.clock()
        self._tokens = min(rate, self._tokens + (now - self._tokens_at) * rate) - 1
        self._tokens_at = now
        if self._tokens < 0:
            self._throttled_for = -self._tokens / rate

    def _on_publish(self, packet: p.Publish) -> None:
        """One PUBLISH on its own (see `_process_packets` for runs of them)."""
        message = self._accept_publish(packet)
        if message is not None:
            self._publish_batch([message], [packet.packet_id])

    def _accept_publish(self, packet: p.Publish) -> Message | None:
        """Check a PUBLISH and build its core message; None when it is answered already
        (refused, or a QoS 2 retransmission). Raises ProtocolViolation."""
        settings = self.service.settings
        if settings.max_publish_rate:
            self._rate_limit(settings.max_publish_rate)
        v5 = self.version == MQTT_V5
        qos = packet.qos
        if qos > settings.maximum_qos:
            raise ProtocolViolation(RC.QOS_NOT_SUPPORTED, f"QoS {qos} is not supported")  # [MQTT-3.3.2-11]
        if packet.retain and not settings.retain_available:
            raise ProtocolViolation(RC.RETAIN_NOT_SUPPORTED, "retain is not supported")
        props = packet.properties
        topic = packet.topic
        if v5 and props.topic_alias is not None:
            alias = props.topic_alias
            if alias == 0 or alias > settings.topic_alias_maximum:
                raise ProtocolViolation(RC.TOPIC_ALIAS_INVALID, f"topic alias {alias} is out of range")
            if topic:
                self.inbound_aliases[alias] = topic
            else:
                known = self.inbound_aliases.get(alias)
                if known is None:
                    raise ProtocolViolation(RC.PROTOCOL_ERROR, f"topic alias {alias} is not defined")
                topic = known
        if topic != self._valid_topic:  # publishers mostly repeat their topic: check it once
            try:
                validate_topic_name(topic)  # [MQTT-3.3.2-2]
            except TopicError as exc:
                raise ProtocolViolation(RC.TOPIC_NAME_INVALID, f"invalid topic name: {exc}") from None
            self._valid_topic = topic
        if v5 and props.subscription_identifiers:
            raise ProtocolViolation(RC.PROTOCOL_ERROR, "subscription identifier in a client PUBLISH")  # [MQTT-3.3.4-6]
        if v5 and props.response_topic is not None:
            try:
                validate_topic_name(props.response_topic)
            except TopicError as exc:
                raise ProtocolViolation(RC.PROTOCOL_ERROR, f"invalid response topic: {exc}") from None
        session = self.session
        assert session is not None
        packet_id = packet.packet_id
        if qos == 2 and packet_id in session.inbound_qos2:
            # A retransmission of a QoS 2 message already accepted [MQTT-4.3.3-9].
            self._send_packet(p.Pubrec(packet_id))
            return None
        if qos and self.inbound_pending + len(self.qos2_open) >= settings.receive_maximum:
            raise ProtocolViolation(RC.RECEIVE_MAXIMUM_EXCEEDED, "receive maximum exceeded")  # [MQTT-3.3.4-9]
        refusal = None
        if topic != self._allowed_topic:
            if not topic.startswith("$SYS") and self.service.authorize_publish(self, topic):
                self._allowed_topic = topic
            else:
                refusal = RC.NOT_AUTHORIZED
        if refusal is None and v5 and props.payload_format_indicator == 1:
            try:
                packet.payload.decode("utf-8")
            except UnicodeDecodeError:
                refusal = RC.PAYLOAD_FORMAT_INVALID
        if refusal is not None:
            log.info("%s %s: publish to %r refused (%s)", self.remote, self.client_id, topic, refusal.name)
            self._ack(qos, packet_id, refusal)
            return None
        expires = None
        if v5 and props.message_expiry_interval is not None:
            expires = now_ms() + props.message_expiry_interval * 1000
        message = Message(
            topic,
            packet.payload,
            qos,
            packet.retain,
            None,
            props.user_properties or None if v5 else None,
            props.content_type if v5 else None,
            props.correlation_data if v5 else None,
            props.response_topic if v5 else None,
            props.payload_format_indicator if v5 else None,
            expires,
            self._read_ms,
            "mqtt",
            self.client_id,
        )
        self.messages_in += 1
        if qos == 1:
            # Counted against Receive Maximum from now on (until acknowledged or refused).
            self.inbound_pending += 1
        elif qos == 2:
            session.inbound_qos2 = open_packet_ids(session.inbound_qos2)
            session.inbound_qos2.add(packet_id)  # type: ignore[arg-type]
            self.qos2_open = open_packet_ids(self.qos2_open)
            self.qos2_open.add(packet_id)  # type: ignore[arg-type]
            self.service.remember_qos2(session, packet_id, True)  # type: ignore[arg-type]
        return message

    def _publish_batch(self, messages: list[Message], packet_ids: list[int | None]) -> None:
        """Hand accepted PUBLISHes to the core in one call and acknowledge each: at once when
        it is stored already or refused, else once its commit group is durable.

        MQTT 3.1.1 has no negative acknowledgement: a refused PUBLISH closes the connection,
        and nothing after it in the batch is handed to the core (see `_forget_unprocessed`)."""
        v5 = self.version == MQTT_V5
        service = self.service
        if service.publishers_blocked and self._throttled_for <= 0:
            # the memory alarm: this publisher's socket is not read for a while (see `_process`)
            self._throttled_for = BLOCKED_RECHECK_S
        outcomes = service.edge.publish_many(messages, stop_at_refusal=not v5)
        if len(outcomes) < len(messages):
            self._forget_unprocessed(messages[len(outcomes):], packet_ids[len(outcomes):])
        waiting = self._acks_waiting
        for message, packet_id, outcome in zip(messages, packet_ids, outcomes, strict=False):
            qos = message.qos
            if outcome is None:
                if qos:
                    if qos == 1:
                        self.inbound_pending -= 1
                    self._ack(qos, packet_id, SUCCESS)
                continue
            if isinstance(outcome, PublishRejected):
                if qos == 1:
                    self.inbound_pending -= 1
                elif qos == 2:
                    self.session.inbound_qos2.discard(packet_id)  # type: ignore[union-attr,arg-type]
                    self.qos2_open.discard(packet_id)  # type: ignore[arg-type]
                # (the broker logs schema refusals, rate-limited; a full disk refuses every
                # publish: not a line each)
                if not isinstance(outcome, SchemaMismatch):
                    log.log(logging.DEBUG if isinstance(outcome, StoreFull) else logging.WARNING,
                            "%s %s: publish to %r rejected: %s", self.remote, self.client_id,
                            message.topic, outcome)
                if not v5:
                    self.close()
                    return
                if isinstance(outcome, SchemaMismatch):
                    reason = RC.PAYLOAD_FORMAT_INVALID
                elif isinstance(outcome, StoreFull):
                    reason = RC.QUOTA_EXCEEDED
                else:
                    reason = RC.UNSPECIFIED_ERROR
                self._ack(qos, packet_id, reason, str(outcome))
                continue
            if not qos:
                continue
            if waiting is None:
                waiting = self._acks_waiting = {}
            acks = waiting.get(outcome)
            if acks is None:
                acks = waiting[outcome] = []
                outcome.add_done_callback(self._on_durable)
            acks.append((qos, packet_id))  # type: ignore[arg-type]

    def _forget_unprocessed(self, messages: list[Message], packet_ids: list[int | None]) -> None:
        """PUBLISHes after a refusal that closes the connection: the core never saw them,
        so they are neither acknowledged nor remembered (a QoS 2 one resent on the next
        connection is a new message, not a duplicate to drop)."""
        session = self.session
        for message, packet_id in zip(messages, packet_ids, strict=True):
            self.messages_in -= 1
            if message.qos == 1:
                self.inbound_pending -= 1
            elif message.qos == 2 and session is not None:
                session.inbound_qos2.discard(packet_id)  # type: ignore[arg-type]
                self.qos2_open.discard(packet_id)  # type: ignore[arg-type]
                self.service.remember_qos2(session, packet_id, False)  # type: ignore[arg-type]

    def _on_durable(self, fut: asyncio.Future[None]) -> None:
        """A commit group is durable (or failed): acknowledge its publishes from this client."""
        waiting = self._acks_waiting
        acks = waiting.pop(fut, None) if waiting is not None else None
        if not acks:
            return
        if self.state is CLOSED:
            self.inbound_pending -= sum(1 for qos, _ in acks if qos == 1)
            return
        if not (fut.cancelled() or fut.exception() is not None):
            # Success without properties: each PUBACK or PUBREC is four bytes (see `_ack`),
            # written together.
            out = bytearray()
            pending = self.inbound_pending
            for qos, packet_id in acks:
                if qos == 1:
                    pending -= 1
                    out += b"\x40\x02"
                else:
                    out += b"\x50\x02"
                out += packet_id.to_bytes(2, "big")
            self.inbound_pending = pending
            self._send(bytes(out))
            return
        for qos, _ in acks:
            if qos == 1:
                self.inbound_pending -= 1
        error = None if fut.cancelled() else fut.exception()
        for qos, packet_id in acks:
            if qos == 2 and self.session is not None:
                self.session.inbound_qos2.discard(packet_id)
                self.qos2_open.discard(packet_id)
            if self.version != MQTT_V5:
                self.close()
                return
            self._ack(qos, packet_id, RC.UNSPECIFIED_ERROR, str(error) if error else None)

    def _ack(self, qos: int, packet_id: int | None, reason: int, reason_string: str | None = None) -> None:
        if not reason and packet_id is not None:
            # Success without properties: PUBACK or PUBREC is four bytes on every version
            # (the reason code may be left out when it is 0, v5 §3.4.2.1).
            self._send(bytes((0x40 if qos == 1 else 0x50, 2, packet_id >> 8, packet_id & 0xFF)))
            return
        if reason_string and self.version == MQTT_V5 and self.problem_info:
            props = p.Properties(reason_string=reason_string)
        else:
            props = p.Properties()
        if qos == 1:
            self._send_packet(p.Puback(packet_id, reason, props))  # type: ignore[arg-type]
        elif qos == 2:
            if reason >= 0x80 and self.session is not None:
                self.session.inbound_qos2.discard(packet_id)  # type: ignore[arg-type]
                self.qos2_open.discard(packet_id)  # type: ignore[arg-type]
            self._send_packet(p.Pubrec(packet_id, reason, props))  # type: ignore[arg-type]

    def _on_puback(self, packet: p.Puback) -> None:
        assert self.session is not None
        self.last_ack = self.service.clock()
        self.session.acknowledge(packet.packet_id)

    def _on_pubrec(self, packet: p.Pubrec) -> None:
        assert self.session is not None
        self.last_ack = self.service.clock()
        if packet.packet_id not in self.session.inflight:
            if self.version == MQTT_V5:
                self._send_packet(p.Pubrel(packet.packet_id, RC.PACKET_IDENTIFIER_NOT_FOUND))
            else:
                self._send_packet(p.Pubrel(packet.packet_id))
            return
        if self.session.received(packet.packet_id, packet.reason_code >= 0x80):
            self._send_packet(p.Pubrel(packet.packet_id))

    def _on_pubrel(self, packet: p.Pubrel) -> None:
        assert self.session is not None
        self.qos2_open.discard(packet.packet_id)
        if packet.packet_id in self.session.inbound_qos2:
            self.session.inbound_qos2.discard(packet.packet_id)
            self.service.remember_qos2(self.session, packet.packet_id, False)
            self._send_packet(p.Pubcomp(packet.packet_id))
        else:
            reason = RC.PACKET_IDENTIFIER_NOT_FOUND if self.version == MQTT_V5 else RC.SUCCESS
            self._send_packet(p.Pubcomp(packet.packet_id, reason))

    def _on_pubcomp(self, packet: p.Pubcomp) -> None:
        assert self.session is not None
        self.last_ack = self.service.clock()
        self.session.acknowledge(packet.packet_id)

    # ------------------------------------------------------------------ SUBSCRIBE
    def _on_subscribe(self, packet: p.Subscribe) -> None:
        session = self.session
        assert session is not None
        settings = self.service.settings
        edge = self.service.edge
        v5 = self.version == MQTT_V5
        subscription_id = None
        if v5 and packet.properties.subscription_identifiers:
            subscription_id = packet.properties.subscription_identifiers[0]
        codes: list[int] = []
        retained: list[tuple[Message, int]] = []
        failure = 0x80
        for request in packet.subscriptions:
            topic_filter = request.topic_filter
            try:
                shared = parse_shared_filter(topic_filter)
                validate_topic_filter(shared.topic_filter if shared else topic_filter)
            except TopicError as exc:
                log.info("%s %s: invalid filter %r: %s", self.remote, self.client_id, topic_filter, exc)
                codes.append(RC.TOPIC_FILTER_INVALID if v5 else failure)
                continue
            if shared is not None and request.no_local:
                raise ProtocolViolation(RC.PROTOCOL_ERROR, "no local on a shared subscription")  # [MQTT-3.8.3-4]
            if not self.service.authorize_subscribe(self, topic_filter):
                codes.append(RC.NOT_AUTHORIZED if v5 else failure)
                continue
            granted = min(request.qos, settings.maximum_qos)
            options = SubscriptionOptions(
                granted, request.no_local, request.retain_as_published, request.retain_handling, subscription_id
            )
            if shared is None:
                new = edge.add_filter(session.subscription, topic_filter, options)
                edge.attach(session.subscription, session)
                handling = request.retain_handling
                if handling == 0 or (handling == 1 and new):
                    for message in edge.retained_matching(topic_filter):
                        retained.append((message, granted))
            else:
                name = f"$share/{shared.group}/{shared.topic_filter}"
                sub = edge.subscription(name, SubscriptionType.SHARED)
                edge.add_filter(sub, shared.topic_filter, None)
                edge.attach(sub, session)
                session.shared[name] = (sub, options)
            codes.append(granted)
        if session.durable:
            # Cursors start here, and are saved before SUBACK: whatever is published from now
            # on reaches this session even if the broker crashes right after.
            subscription = session.subscription
            subscription.open_cursors("latest")  # type: ignore[attr-defined]
            subscription.save()  # type: ignore[attr-defined]
            edge.flush_cursors()
        self.service.save_session(session)
        # In a cluster, SUBACK waits (bounded) until the other nodes know the subscription,
        # so a publish anywhere after the SUBACK reaches it; SUBACKs keep their order.
        ready = edge.routes_ready()
        if ready is None and not self._held_subacks:
            self._subscribed(packet.packet_id, codes, retained, subscription_id)
            return
        entry: list[Any] = [ready is None, packet.packet_id, codes, retained, subscription_id]
        if self._held_subacks is None:
            self._held_subacks = []
        self._held_subacks.append(entry)
        if ready is not None:
            ready.add_done_callback(lambda _ready: self._release_subacks(entry))

    def _release_subacks(self, entry: list[Any]) -> None:
        entry[0] = True
        held = self._held_subacks
        while held and held[0][0]:
            _, packet_id, codes, retained, subscription_id = held.pop(0)
            if self.state is not State.CLOSED:
                self._subscribed(packet_id, codes, retained, subscription_id)

    def _subscribed(
        self, packet_id: int, codes: list[int], retained: list[tuple[Message, int]], subscription_id: int | None
    ) -> None:
        session = self.session
        assert session is not None
        self._send_packet(p.Suback(packet_id, codes))
        now = now_ms()
        for message, granted in retained:
            if message.expired(now):
                continue
            ids = (subscription_id,) if subscription_id else ()
            # Retained messages sent on subscription carry RETAIN=1 [MQTT-3.3.1-9].
            session.send_message(message, min(granted, message.qos), True, ids)

    def _on_unsubscribe(self, packet: p.Unsubscribe) -> None:
        session = self.session
        assert session is not None
        edge = self.service.edge
        codes: list[int] = []
        for topic_filter in packet.topic_filters:
            found = False
            try:
                shared = parse_shared_filter(topic_filter)
            except TopicError:
                shared = None
            if shared is not None:
                name = f"$share/{shared.group}/{shared.topic_filter}"
                entry = session.shared.pop(name, None)
                if entry is not None:
                    found = True
                    edge.detach(entry[0], session)
                    if not entry[0].consumers:
                        edge.remove_subscription(name)
            else:
                found = edge.remove_filter(session.subscription, topic_filter)
            codes.append(RC.SUCCESS if found else RC.NO_SUBSCRIPTION_EXISTED)
        self.service.save_session(session)
        self._send_packet(p.Unsuback(packet.packet_id, codes))

    def _on_pingreq(self, packet: p.Pingreq) -> None:
        self._send_packet(p.Pingresp())

    def _on_disconnect(self, packet: p.Disconnect) -> None:
        if self.version == MQTT_V5:
            expiry = packet.properties.session_expiry_interval
            if expiry is not None:
                if self.session_expiry_at_connect == 0 and expiry != 0:
                    raise ProtocolViolation(RC.PROTOCOL_ERROR, "session expiry set on DISCONNECT after 0")  # [MQTT-3.14.2-2]
                assert self.session is not None
                self.session.expiry_interval = expiry
            if packet.reason_code != RC.DISCONNECT_WITH_WILL:
                self.will = None
        else:
            self.will = None  # [MQTT-3.14.4-3]
        self.close(None, normal=True)

    def _on_auth(self, packet: p.Auth) -> None:
        raise ProtocolViolation(RC.PROTOCOL_ERROR, "AUTH without an authentication method")

    _handlers: dict[type, Callable[[MqttConnection, Any], None]] = {
        p.Publish: _on_publish,
        p.Puback: _on_puback,
        p.Pubrec: _on_pubrec,
        p.Pubrel: _on_pubrel,
        p.Pubcomp: _on_pubcomp,
        p.Subscribe: _on_subscribe,
        p.Unsubscribe: _on_unsubscribe,
        p.Pingreq: _on_pingreq,
        p.Disconnect: _on_disconnect,
        p.Auth: _on_auth,
    }

    # ------------------------------------------------------------------ ending
    def close(self, reason_code: int | None = None, reason: str | None = None, *, normal: bool = False) -> None:
        """End the connection; on 5.0 a server-sent DISCONNECT carries `reason_code` first."""
        if self.state is State.CLOSED:
            return
        was_connected = self.state is State.CONNECTED
        if reason_code is not None and was_connected and self.version == MQTT_V5 and not normal:
            props = p.Properties(reason_string=reason) if reason else p.Properties()
            self._send(encode(p.Disconnect(reason_code, props), MQTT_V5))
        self.state = State.CLOSED
        if self._out:
            # The last acknowledgements go out once what they report is durable.
            self.service.commit_writes()
            self.service.hold_output_until_durable(self, 0)
        self.flush()
        if self._held_from is not None:
            self._close_when_sent = True  # the rest once durable, then the link closes
        else:
            self.link.close()
        if was_connected:
            self._log_disconnected("client sent DISCONNECT" if normal else (
                reason or (f"reason code 0x{reason_code:02x}" if reason_code is not None
                           else "closed by the broker")))
            self.service.connection_closed(self, normal=normal)

    def _log_disconnected(self, reason: str) -> None:
        log.info("%s: client %r disconnected: %s", self.remote, self.client_id, reason,
                 extra={"event": "client_disconnected", "protocol": "mqtt",
                        "client_id": self.client_id, "peer": self.remote, "reason": reason})

    def connection_lost(self) -> None:
        """The network connection went away (or the adapter closed it)."""
        if self.state is State.CLOSED:
            return
        was_connected = self.state is State.CONNECTED
        self.state = State.CLOSED
        self._out.clear()
        self._count_sent()
        self._held_from = None
        self._close_when_sent = False
        if was_connected:
            self._log_disconnected("connection lost")
            self.service.connection_closed(self, normal=False)
