"""PUBLISH from a client and the QoS 1/2 handshakes: the checks and topic aliases of each
PUBLISH, the publish rate, the run of PUBLISHes of one read handed to the core together, and
the acknowledgements sent once their messages are durable (per-message path: kept lean). A
part of `MqttConnection`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ...core.errors import PublishRejected, SchemaMismatch, StoreFull
from ...core.message import Message, now_ms
from ...core.topics import TopicError, validate_topic_name
from . import packets as p
from .connection_state import (
    BLOCKED_RECHECK_S,
    CLOSED,
    MQTT_V5,
    RC,
    SUCCESS,
    ConnectionState,
    ProtocolViolation,
    log,
)
from .session import open_packet_ids

if TYPE_CHECKING:
    import asyncio


class PublishHandling(ConnectionState):
    __slots__ = ()

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
            # A retransmission of a QoS 2 message already accepted [MQTT-4.3.3-9]: PUBREC
            # again, once its message is committed (while it is not, its own PUBREC comes
            # then) and, in a cluster, once another node would know it (`exactly_once_changed`).
            if packet_id not in session.qos2_committing:
                self.service.exactly_once_changed(session)
                self._send_packet(p.Pubrec(packet_id))
            return None
        if qos and self.inbound_pending + len(self.qos2_open) >= settings.receive_maximum:
            raise ProtocolViolation(RC.RECEIVE_MAXIMUM_EXCEEDED, "receive maximum exceeded")  # [MQTT-3.3.4-9]
        refusal = None
        if topic != self._allowed_topic:
            if not topic.startswith("$SYS") and self.service.authorize_publish(self, topic):  # type: ignore[arg-type]
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
                    elif self.session is not None:  # (see `_on_durable`)
                        self.service.hold_output_until(
                            self, len(self._out), self.service.replicate_committed(self.session))  # type: ignore[arg-type]
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
            if qos == 2:
                session = self.session
                assert session is not None
                session.qos2_committing = open_packet_ids(session.qos2_committing)
                session.qos2_committing.add(packet_id)  # type: ignore[arg-type]

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
        session = self.session
        committed = not (fut.cancelled() or fut.exception() is not None)
        qos2 = False
        if session is not None and session.qos2_committing:
            for qos, packet_id in acks:
                if qos == 2:
                    session.qos2_committing.discard(packet_id)
                    qos2 = True
        if self.state is CLOSED:
            self.inbound_pending -= sum(1 for qos, _ in acks if qos == 1)
            return
        if committed:
            if qos2 and session is not None:
                # In a cluster the PUBRECs leave once a node resuming the session would know
                # their packet ids (only ids of committed messages are told, `capture`).
                self.service.hold_output_until(
                    self, len(self._out), self.service.replicate_committed(session))  # type: ignore[arg-type]
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
            # (in a cluster the PUBCOMP waits until a node resuming the session would know
            # the id is free again: the client may use it for a new message after it)
            self.service.exactly_once_changed(self.session)
            self._send_packet(p.Pubcomp(packet.packet_id))
        else:
            reason = RC.PACKET_IDENTIFIER_NOT_FOUND if self.version == MQTT_V5 else RC.SUCCESS
            self._send_packet(p.Pubcomp(packet.packet_id, reason))

    def _on_pubcomp(self, packet: p.Pubcomp) -> None:
        assert self.session is not None
        self.last_ack = self.service.clock()
        self.session.acknowledge(packet.packet_id)

