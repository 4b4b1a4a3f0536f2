"""The MQTT service's part that brings back, at start, the persistent sessions an earlier run
saved (`restore_sessions`): offline until their client reconnects, with their subscriptions,
their cursors, the messages they had in flight and their expiry timers. A session whose record
cannot be read is set aside (`core/restoring.py`) and leaves nothing behind in the broker.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, cast

from ...core.errors import CoreError
from ...core.message import now_ms
from ...core.ports import SavedSession
from ...core.restoring import set_aside
from .service_state import ServiceState
from .session import NEVER_EXPIRES, MqttSession, Outgoing
from .snapshot import SessionSnapshot

if TYPE_CHECKING:
    from .service import MqttService

# The service's logger, as before this part had a module of its own.
log = logging.getLogger("shardgate.protocols.mqtt.service")


class SessionRestore(ServiceState):
    def restore_sessions(self) -> int:
        """Bring back persistent sessions saved by an earlier run (offline until their client
        reconnects); returns how many."""
        if self.store is None or not self.edge.stores_messages:
            return 0
        restored = 0
        now = now_ms()
        for record in self.store.load_sessions():
            disconnected = record.disconnected_ms or now
            if record.expiry_interval != NEVER_EXPIRES and disconnected + record.expiry_interval * 1000 <= now:
                self.forget_session(record.client_id)
                continue
            session = None
            try:
                session = MqttSession(cast("MqttService", self), record.client_id, durable=True)
                self._restore_session(session, record, disconnected, now)
            except Exception as exc:
                set_aside(log, f"persistent session {record.client_id!r}", record, exc)
                if session is not None:
                    self._drop_restored(session)
                continue
            restored += 1
        return restored

    def _drop_restored(self, session: MqttSession) -> None:
        """Undo what a session that could not be restored left in the broker (the stored
        session itself stays as it was)."""
        client_id = session.client_id
        if self.sessions.get(client_id) is session:
            del self.sessions[client_id]
        timer = self._expiry_timers.pop(client_id, None)
        if timer is not None:
            timer.cancel()
        for sub, _options in session.shared.values():
            self.edge.detach(sub, session)
        if self.edge.subscriptions.get(session.subscription.name) is session.subscription:
            self.edge.remove_subscription(session.subscription.name, forget=False)

    def _restore_session(self, session: MqttSession, record: SavedSession, disconnected: int,
                         now: int) -> None:
        """Fill the restored `session` from `record`; a filter the topic layer refuses is set
        aside alone, anything else wrong with the record raises."""
        from ...core.subscriptions import SubscriptionType
        from .session import SubscriptionOptions

        store = self.store
        assert store is not None
        # any version written so far (`snapshot.py`: this store's records before it are read too)
        data = SessionSnapshot.decode(record.data)
        if data.owned:
            session.owner, session.owned = data.owner, True
        session.generation = data.generation
        session.expiry_interval = record.expiry_interval
        session.disconnected_at_ms = disconnected
        for own in data.subscriptions:
            try:
                self.edge.add_filter(session.subscription, own.topic_filter, own.options)
            except CoreError as exc:
                set_aside(log, f"filter of persistent session {record.client_id!r}",
                          own.topic_filter, exc)
        self.edge.attach(session.subscription, session)
        for group in data.shared:
            sub = self.edge.subscription(group.name, SubscriptionType(group.type))
            for topic_filter in group.filters:
                try:
                    self.edge.add_filter(sub, topic_filter)
                except CoreError as exc:
                    set_aside(log, f"shared filter of persistent session {record.client_id!r}",
                              topic_filter, exc)
            self.edge.attach(sub, session)
            session.shared[group.name] = (sub, SubscriptionOptions(
                group.qos, False, group.retain_as_published, 0, group.subscription_id))
        for cursor in store.load_cursors(session.subscription.name):
            if cursor.acked:
                session.subscription.restore_cursor(cursor.stream, cursor.shard, cursor.acked)  # type: ignore[attr-defined]
        durable_sub = session.subscription
        for flight in data.inflight:
            message = durable_sub.read_message(flight.stream, flight.shard, flight.offset)  # type: ignore[attr-defined]
            if message is None:
                continue
            session.inflight[flight.packet_id] = Outgoing(
                message, flight.qos, flight.retain, tuple(flight.subscription_ids), durable_sub,
                flight.released)
            durable_sub.adopt(message, session)  # type: ignore[attr-defined]
        session.inbound_qos2 = store.qos2_inbound(record.client_id)
        self.sessions[record.client_id] = session
        if record.expiry_interval != NEVER_EXPIRES:
            remaining = max(0.0, (disconnected + record.expiry_interval * 1000 - now) / 1000)
            self._expiry_timers[record.client_id] = self.scheduler.call_later(
                remaining, self._expire_session, record.client_id
            )
