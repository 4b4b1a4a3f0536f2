"""The MQTT service's part that ends what a connection leaves behind: the client's Last Will
(published at once, or after the MQTT 5 will delay), the session's expiry timer, and the end
of a session that expired or lasted only as long as its connection. A takeover or a clean
start stops these timers (`stop_timers`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ...core.message import Message, now_ms
from . import packets as p
from .connection_state import MQTT_V5
from .service_state import ServiceState
from .session import NEVER_EXPIRES, MqttSession

if TYPE_CHECKING:
    from .connection import MqttConnection

# The service's logger, as before this part had a module of its own.
log = logging.getLogger("shardgate.protocols.mqtt.service")


def will_message(client_id: str, will: p.Will) -> Message:
    """The message a client's will publishes, its expiry counted from now."""
    props = will.properties
    expires = None
    if props.message_expiry_interval is not None:
        expires = now_ms() + props.message_expiry_interval * 1000
    return Message(
        will.topic, will.payload, will.qos, will.retain, None,
        props.user_properties or None, props.content_type, props.correlation_data,
        props.response_topic, props.payload_format_indicator, expires,
        producer_protocol="mqtt", producer_id=client_id,
    )


class SessionLifetimes(ServiceState):
    def stop_timers(self, client_id: str, *, publish_will: bool) -> None:
        """Stop the session's expiry timer and its pending will's (publishing the will now
        with `publish_will`)."""
        pending_will = self._will_timers.pop(client_id, None)
        if pending_will is not None:
            pending_will[0].cancel()
            if publish_will:
                self._publish_will(client_id, pending_will[1])
        timer = self._expiry_timers.pop(client_id, None)
        if timer is not None:
            timer.cancel()

    def connection_closed(self, connection: MqttConnection, *, normal: bool) -> None:
        self.connections.discard(connection)
        session = connection.session
        if session is None:
            return
        will = connection.will
        connection.will = None
        if session.connection is not connection:
            # Taken over: the new connection owns the session now.
            if will is not None and self.will_delay(connection, will) == 0:
                self._publish_will(connection.client_id, will)
            for will_changed in self.session_events.will_changed:
                will_changed(connection.client_id)
            return
        session.connection = None
        session.disconnected_at_ms = now_ms()
        if session.congested_since is not None:
            self.relieved(session)  # offline, its queue limit applies as it always did
        expiry = session.expiry_interval
        if will is not None:
            delay = self.will_delay(connection, will)
            if delay == 0 or expiry == 0:
                self._publish_will(session.client_id, will)
            else:
                delay = min(delay, expiry)
                handle = self.scheduler.call_later(delay, self._delayed_will, session.client_id, will)
                self._will_timers[session.client_id] = (handle, will)
        for will_changed in self.session_events.will_changed:
            will_changed(session.client_id)
        if expiry == 0:
            self._end_session(session)
            return
        self.save_session(session, acknowledged=False)  # a departure acknowledges nothing
        if expiry != NEVER_EXPIRES:
            self._expiry_timers[session.client_id] = self.scheduler.call_later(
                expiry, self._expire_session, session.client_id
            )

    def pending_will(self, client_id: str) -> p.Will | None:
        """The will of `client_id`'s offline session whose delay is running here, if any."""
        pending = self._will_timers.get(client_id)
        return None if pending is None else pending[1]

    @staticmethod
    def will_delay(connection: MqttConnection, will: p.Will) -> int:
        """How long `connection`'s will waits after it ends (MQTT 5's will delay interval)."""
        if connection.version != MQTT_V5:
            return 0
        return will.properties.will_delay_interval or 0

    def _delayed_will(self, client_id: str, will: p.Will) -> None:
        self._will_timers.pop(client_id, None)
        self._publish_will(client_id, will)

    def _publish_will(self, client_id: str, will: p.Will) -> None:
        message = will_message(client_id, will)
        log.info("publishing the will of %r to %r", client_id, will.topic)
        try:
            self.edge.publish(message)
        except Exception:
            log.exception("could not publish the will of %r", client_id)
        for will_changed in self.session_events.will_changed:
            will_changed(client_id)

    def _expire_session(self, client_id: str) -> None:
        self._expiry_timers.pop(client_id, None)
        session = self.sessions.get(client_id)
        if session is None or session.connection is not None:
            return
        self.group_writes(True)  # as a departure: one group commit per turn
        try:
            self._expire(session)
        finally:
            self.group_writes(False)

    def _expire(self, session: MqttSession) -> None:
        client_id = session.client_id
        pending_will = self._will_timers.pop(client_id, None)
        if pending_will is not None:
            pending_will[0].cancel()
            self._publish_will(client_id, pending_will[1])
        log.info("session %r expired", client_id)
        self._end_session(session)

    def _end_session(self, session: MqttSession) -> None:
        if self.sessions.get(session.client_id) is session:
            del self.sessions[session.client_id]
            for ended in self.session_events.ended:
                ended(session.client_id)
        session.discard()

