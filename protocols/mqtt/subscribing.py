"""SUBSCRIBE and UNSUBSCRIBE of an MQTT connection: the checks of each filter, the
subscriptions made on the session, and SUBACKs held until the cluster knows the
subscription. A part of `MqttConnection`.
"""

from __future__ import annotations

from typing import Any

from ...core.message import Message, now_ms
from ...core.subscriptions import SubscriptionType
from ...core.topics import TopicError, parse_shared_filter, validate_topic_filter
from . import packets as p
from .connection_state import MQTT_V5, RC, ConnectionState, ProtocolViolation, State, log
from .session import SubscriptionOptions


class SubscribeHandling(ConnectionState):
    __slots__ = ()

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
            if not self.service.authorize_subscribe(self, topic_filter):  # type: ignore[arg-type]
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

