"""What an MQTT connection sends: its output buffer and flush (one write per loop turn),
output held until session state is durable, the output high-water mark, and the encoding of
each PUBLISH to a subscriber (per-message path: kept lean). A part of `MqttConnection`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...core.message import Message
from ...core.outbox import SLOW_SUBSCRIBER
from . import packets as p
from .codec import encode, encode_publish
from .connection_state import CLOSED, CONNECTED, MQTT_V5, RC, ConnectionState, State, log
from .timing import clock as timing_clock


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

if TYPE_CHECKING:
    import asyncio
    from concurrent.futures import Future


class Outbound(ConnectionState):
    __slots__ = ()

    # ------------------------------------------------------------------ output
    def _send(self, data: bytes) -> None:
        self._out.append(data)
        self._out_bytes += len(data)
        if not self._flush_requested:
            self._flush_requested = True
            self.service.request_flush(self)  # type: ignore[arg-type]

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

    def hold_output(self, start: int, durable: Future[None] | asyncio.Future[None]) -> bool:
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

    def refuse_held(self, durable: Any, reason: str) -> None:
        """What was held for `durable` (and after it) must not go out, since what it reports
        could not be kept: it is dropped and the connection closed (DISCONNECT 0x80 on 5.0);
        the client sends again what it was not answered."""
        held = self._held_from
        if held is None:
            return
        index = next((at for at, hold in enumerate(held) if hold[1] is durable), None)
        if index is None:
            return
        start = held[index][0]
        out = self._out
        del out[start:]
        self._out_bytes = sum(len(data) for data in out)
        self._held_from = held[:index] or None
        log.warning("%s %s: %s; closing the connection", self.remote, self.client_id, reason)
        self.close(RC.UNSPECIFIED_ERROR, reason)

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

