"""The per-connection MQTT state machine (sans-IO).

Bytes come in through `data_received`; packets go out through the `Link` the adapter gives
(a transport's write and close, or a list in tests). The connection decodes packets with the
codec, checks them against the spec, and turns them into calls on the core broker and the
session. It never touches a socket and never awaits.

`MqttConnection` is assembled from parts, one concern each, over `ConnectionState`
(`connection_state.py`): `outbound.py` (output), `connect.py` (CONNECT), `inbound_publish.py`
(PUBLISH and its acknowledgements), `subscribing.py`; this module reads packets and
dispatches them, and ends the connection.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...core.message import Message, now_ms
from . import packets as p
from .codec import MQTTCodecError, PacketTooLarge, UnsupportedProtocolVersion, encode
from .connect import ConnectHandling
from .connection_state import (  # noqa: F401  (re-exported: the service and tests import them here)
    AWAIT_CONNECT,
    BLOCKED_RECHECK_S,
    CLOSED,
    CONNECTED,
    HOLD_MAX_S,
    MQTT_V5,
    OPENING,
    RC,
    SUCCESS,
    Link,
    ProtocolViolation,
    State,
    log,
)
from .inbound_publish import PublishHandling
from .outbound import Outbound
from .subscribing import SubscribeHandling
from .timing import clock as timing_clock


class MqttConnection(Outbound, ConnectHandling, PublishHandling, SubscribeHandling):
    __slots__ = ()

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
            replicated = None
            if outer is None:
                service.group_writes(False)
                replicated = service.take_replicated()
            after_connack, self._after_connack = self._after_connack, None
            if service.store_writes() != writes or replicated is not None:
                # What this read answers may report session state just written (SUBACK,
                # PUBREC, PUBREL): it waits until that is durable (and, in a cluster, QoS 2
                # state replicated). A new persistent session's CONNACK does not (see
                # `_opened`): what follows it does.
                service.hold_output_until_durable(self, start if after_connack is None else after_connack,
                                                  replicated)
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
        p.Publish: PublishHandling._on_publish,
        p.Puback: PublishHandling._on_puback,
        p.Pubrec: PublishHandling._on_pubrec,
        p.Pubrel: PublishHandling._on_pubrel,
        p.Pubcomp: PublishHandling._on_pubcomp,
        p.Subscribe: SubscribeHandling._on_subscribe,
        p.Unsubscribe: SubscribeHandling._on_unsubscribe,
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
