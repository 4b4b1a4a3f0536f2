"""The MQTT service: sessions, connections and the timers they share.

One `MqttService` per broker holds every MQTT session (live or offline) and connection, takes
sessions over when a client id reconnects, publishes Last Will messages (with the MQTT 5 will
delay), expires sessions, checks keepalives, publishes the `$SYS/broker/...` topics, and batches
output: connections ask for a flush and the service writes every dirty connection once per
event-loop turn.

`MqttService` is assembled from parts over `ServiceState` (`service_state.py`):
`service_writes.py` (session state saved in one group commit per read), `service_lifetimes.py`
(wills and session expiry), `service_restore.py` (sessions restored at start),
`service_cluster.py` (sessions on other nodes); this module holds the lifecycle, output,
back-pressure, the policy hooks, the client registry, opening a session and the timers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from ... import __version__
from ...core.edge import KICK_REASON, Action, ClientInfo, Edge, Principal
from ...core.message import Message
from ...core.scheduling import Scheduler
from ...core.subscriptions import Subscription
from ..read_budget import ReadBudget
from . import packets as p
from .connection import MqttConnection, State
from .service_cluster import ClusterSessions
from .service_lifetimes import SessionLifetimes, will_message
from .service_restore import SessionRestore
from .service_state import ServiceState, SessionEvents
from .service_writes import SessionWrites
from .session import MqttSession
from .settings import MqttSettings

if TYPE_CHECKING:
    from ...core.ports import MqttSessionPorts

__all__ = ["MqttService", "ServiceState", "SessionEvents", "will_message"]

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
CONGESTION_GIVE_UP_S = 5.0
# Seconds between two log lines about messages dropped from full session queues, per reason.
DROP_LOG_INTERVAL_S = 10.0
TICK_S = 0.25
# Reads a connection has left for the next turn are read again after this at the latest.
DEFER_MAX_S = 1.0

MQTT_ADMINISTRATIVE_ACTION = p.ReasonCode.ADMINISTRATIVE_ACTION
VERSION_NAMES = {3: "MQTT 3.1", 4: "MQTT 3.1.1", 5: "MQTT 5.0"}


class MqttService(SessionWrites, SessionLifetimes, SessionRestore, ClusterSessions):
    """Every MQTT session and connection of the broker (see the module's docstring)."""

    def __init__(
        self, edge: Edge, settings: MqttSettings | None = None,
        store: MqttSessionPorts | None = None, scheduler: Scheduler | None = None,
        read_budget: ReadBudget | None = None, *, use_identity_as_username: bool = False,
    ) -> None:
        super().__init__(edge, settings, store, scheduler, read_budget,
                         use_identity_as_username=use_identity_as_username)
        edge.clients.register("mqtt", self)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._tick_handle = self.scheduler.call_later(TICK_S, self._tick)
        self.connect_timing.start_probe(
            self.scheduler, lambda: bool(self.connections or self._handshaking))
        if self.settings.sys_interval > 0:
            self._publish_sys()

    def block_publishers(self, blocked: bool) -> None:
        """The memory alarm went off (or cleared): publishing connections are not read
        meanwhile (`publishers_blocked`)."""
        self.publishers_blocked = blocked

    async def finish_in_flight(self, timeout_s: float) -> int:
        """A graceful stop's first step: send no new PUBLISH to any client, and wait up to
        `timeout_s` for the acknowledgements (PUBACK, PUBREC, PUBCOMP) of those in flight, so
        that what clients acknowledged is saved, and only what they did not is sent again
        after the restart. Returns how many were still in flight at the end."""
        self.draining = True
        deadline = self.scheduler.time() + timeout_s
        while True:
            left = sum(
                len(session.inflight) for session in self.sessions.values()
                if session.connection is not None and session.connection.open
            )
            if not left or self.scheduler.time() >= deadline:
                return left
            await asyncio.sleep(0.01)

    def stop(self, reason: int = p.ReasonCode.SERVER_SHUTTING_DOWN) -> None:
        for handle in (self._tick_handle, self._sys_handle):
            if handle is not None:
                handle.cancel()
        self.connect_timing.stop_probe()
        for connection in list(self.connections):
            connection.close(reason, "server shutting down")
        self._flush()
        for timer, _ in self._will_timers.values():
            timer.cancel()
        for timer in self._expiry_timers.values():
            timer.cancel()

    # ------------------------------------------------------------------ output batching
    def request_flush(self, connection: MqttConnection) -> None:
        self.output.request(connection)

    def _flush(self) -> None:
        self.output.flush()  # what the acknowledgements depend on is committed first
    # ------------------------------------------------------------------ read budget per turn
    def defer(self, connection: MqttConnection) -> None:
        """`connection` read a chunk that this turn's read budget (`protocols/read_budget.py`,
        shared with the other listeners) has no room left for: it is not read again until a
        later turn has handled that chunk (TCP back-pressure meanwhile)."""
        connection.link.throttle(DEFER_MAX_S)
        self.read_budget.defer(connection.run_deferred)

    # ------------------------------------------------------------------ back-pressure
    def dropped(self, session: MqttSession, reason: str) -> None:
        """A message dropped because `session`'s queue is at its limit (`reason`:
        "slow_subscriber" for `max_queued_messages`, "queue_bytes" for `max_queued_bytes`):
        counted by the broker (`shardgate_messages_dropped_by_reason_total`) and logged, the
        first at once, then at most one line per DROP_LOG_INTERVAL_S per reason with the
        count since, so that a flood of drops writes a few lines."""
        self.edge.stats.drop(reason)
        now = self.scheduler.time()
        last = self._drop_log.get(reason)
        if last is not None and now - last[0] < DROP_LOG_INTERVAL_S:
            self._drop_log[reason] = (last[0], last[1] + 1)
            return
        self._drop_log[reason] = (now, 0)
        since = f" ({last[1]} more dropped since the last report)" if last is not None and last[1] else ""
        settings = self.settings
        limit = (f"max_queued_bytes = {settings.max_queued_bytes}" if reason == "queue_bytes"
                 else f"max_queued_messages = {settings.max_queued_messages}")
        log.warning("session %r: queue full (%d messages, %d bytes; %s): a message was dropped%s",
                    session.client_id, len(session.queue), session.queued_bytes, limit, since,
                    extra={"event": "session_queue_full", "reason": reason})

    def congested(self, session: MqttSession, *, queue: bool = True) -> None:
        """`session` (online) queues more than it reads (`queue`), or its client's socket has
        more than `output_high_water` left to send: hold the client publishing to it, so
        that QoS 1/2 messages wait in the publisher's socket instead of overflowing the queue.
        A session that has not caught up for CONGESTION_GIVE_UP_S holds nobody any more (a
        subscriber that stopped reading must not stall its publishers): its queue limit then
        drops, as without back-pressure, until keepalive or the dead-subscriber timeout ends it."""
        now = self.scheduler.time()
        if session.congested_since is None:
            session.congested_since = now
            self._congested.add(session)
        elif now - session.congested_since > CONGESTION_GIVE_UP_S:
            if session in self._congested:
                self._congested.discard(session)
                self._queue_congested.discard(session)
                self.back_pressure.relieved(session)
            return
        if queue:
            self._queue_congested.add(session)
        self.back_pressure.congested(session, own=session.connection)

    def publish_batch_limit(self) -> int:
        """How many PUBLISHes of one read a connection may hand to the core at once. A batch
        is dispatched whole, and a publisher is held only between batches: a quarter of the
        queue limit keeps a subscriber below half its limit (where it holds publishers) short
        of the limit (where it drops). While a subscriber is congested, one at a time, so
        that a publisher is held right after the PUBLISH that reached a congested queue
        (a client that is slow to read its socket holds publishers too, but its queue is not
        at stake: batches stay whole)."""
        if self._queue_congested:
            return 1
        return max(1, self.settings.max_queued_messages >> 2)

    def relieved(self, session: MqttSession) -> None:
        """`session` caught up (or went away): release the held publishers once no session is
        congested any more."""
        session.congested_since = None
        self._congested.discard(session)
        self._queue_congested.discard(session)
        self.back_pressure.relieved(session)

    # ------------------------------------------------------------------ policy hooks
    def assign_client_id(self) -> str:
        return f"sg-{self._id_prefix}-{next(self._client_ids)}"

    def authenticate(
        self, username: str | None, password: bytes | None, client_id: str, remote: str,
    ) -> str | None | asyncio.Future[str | None]:
        """None to accept, a refusal, or a future of either while a password is hashed."""
        edge = self.edge
        # `mqtt.allow_anonymous = false` refuses clients without a user name on MQTT alone,
        # whatever the security policy (`auth.allow_anonymous`) allows the other protocols.
        if username is None and not self.settings.allow_anonymous:
            return "not-authorized"
        return edge.authenticate(Principal("mqtt", username, client_id, remote), password)

    def authorize_publish(self, connection: MqttConnection, topic: str) -> bool:
        return self.edge.authorize(connection.principal, Action.PUBLISH, topic)

    def authorize_will(self, principal: Principal, topic: str) -> bool:
        """May `principal` leave a will on `topic`: what a PUBLISH there needs (no $SYS)."""
        return not topic.startswith("$SYS") and self.edge.authorize(principal, Action.PUBLISH, topic)

    def authorize_subscribe(self, connection: MqttConnection, topic_filter: str) -> bool:
        return self.edge.authorize(connection.principal, Action.SUBSCRIBE, topic_filter)

    # ------------------------------------------------------------------ client registry
    def clients(self) -> list[ClientInfo]:
        return [
            ClientInfo(
                "mqtt", connection.client_id, connection.username, connection.remote,
                connection.transport_name, connection.connected_at, connection.messages_in,
                connection.messages_out,
                VERSION_NAMES.get(connection.version, f"MQTT {connection.version}"),
            )
            for connection in list(self.connections)
        ]

    def kick(self, client_id: str, reason: str = KICK_REASON) -> int:
        """Disconnect `client_id` with DISCONNECT 0x98 (administrative action) on MQTT 5."""
        for connection in list(self.connections):
            if connection.client_id == client_id:
                connection.close(MQTT_ADMINISTRATIVE_ACTION, reason)
                return 1
        return 0

    def reauthorize(self) -> int:
        """Check every session's subscriptions again (the users or the ACL rules changed),
        online or offline: a filter no longer allowed is removed, as an UNSUBSCRIBE would
        remove it, so that it stops receiving at once, and the messages it queued are dropped.
        An offline session is checked as its owner; one whose owner is not known yet (saved
        before owners were kept) is checked when it resumes (`open_session`). Nothing is
        checked per message. Returns how many filters were removed."""
        removed = 0
        for session in list(self.sessions.values()):
            connection = session.connection
            if connection is not None:
                if connection.state is not State.CONNECTED:
                    continue
                principal = connection.principal
            elif session.owned:
                principal = Principal("mqtt", session.owner, session.client_id, "")
            else:
                continue
            removed_here = self._reauthorize_session(principal, session)
            if removed_here:
                log.info("client %r%s: %d subscriptions no longer allowed were removed",
                         session.client_id, "" if connection is not None else " (offline)",
                         removed_here)
                self.save_session(session)
            removed += removed_here
        return removed

    def _reauthorize_session(self, principal: Principal, session: MqttSession) -> int:
        edge = self.edge
        removed = 0
        subscription = session.subscription
        if subscription is not None:
            for topic_filter in list(subscription.filters):
                if not edge.authorize(principal, Action.SUBSCRIBE, topic_filter):
                    edge.remove_filter(subscription, topic_filter)
                    removed += 1
        gone: list[Subscription] = []
        for name, entry in list(session.shared.items()):
            if not edge.authorize(principal, Action.SUBSCRIBE, name):
                session.shared.pop(name, None)
                gone.append(entry[0])
                edge.detach(entry[0], session)
                if not entry[0].consumers:
                    edge.remove_subscription(name)
                removed += 1
        if removed:
            session.forget_queued(gone)
        return removed

    # ------------------------------------------------------------------ sessions
    def open_session(
        self, connection: MqttConnection, client_id: str, clean_start: bool, expiry: int
    ) -> tuple[MqttSession, bool]:
        self.connections.add(connection)
        self._handshaking.pop(connection, None)
        self.total_connections += 1
        existing = self.sessions.get(client_id)
        if existing is not None and existing.connection is not None:
            old = existing.connection
            log.info("client %r taken over by a new connection from %s", client_id, connection.remote)
            old.close(p.ReasonCode.SESSION_TAKEN_OVER, "session taken over")  # [MQTT-3.1.4-3]
            # A session that lasted only as long as that connection (expiry 0, or clean
            # session on 3.1.1) has just ended with it: nothing is left to resume.
            existing = self.sessions.get(client_id)
        # a clean start ends the old session now: its pending will goes
        self.stop_timers(client_id, publish_will=clean_start)
        present = False
        if existing is not None and not clean_start:
            session = existing
            present = True
            # The rules may have changed while it was away (and an offline session whose
            # owner was not known could not be checked then).
            if self._reauthorize_session(connection.principal, session):
                log.info("client %r: subscriptions no longer allowed were removed on resume",
                         client_id)
        else:
            if existing is not None:
                existing.discard()
            durable = expiry > 0 and self.store is not None and self.edge.stores_messages
            session = self.sessions[client_id] = MqttSession(self, client_id, durable)
        if not session.owned:
            session.owner, session.owned = connection.username, True
        session.expiry_interval = expiry
        session.connection = connection
        session.disconnected_at_ms = None
        # A new persistent session is committed before its CONNACK is written (a crash of the
        # process right after it keeps the session) and fsynced before any later
        # acknowledgement to its client (`MqttConnection._opened`); a resumed one is durable
        # already: its CONNACK does not wait for this write.
        self.save_session(session, acknowledged=not present)
        if not present and session.durable and self._grouping:
            self._commit_at_read_end = True
        for opened in self.session_events.opened:
            opened(client_id)
        return session, present

    def owned_by_other(self, client_id: str, username: str | None) -> bool:
        """Whether `client_id` has a session here that another user made."""
        session = self.sessions.get(client_id)
        return session is not None and session.owned and session.owner != username

    # ------------------------------------------------------------------ timers
    def _tick(self) -> None:
        now = self.scheduler.time()
        for connection in list(self.connections):
            if connection.state is State.CONNECTED and connection.keep_alive:
                if now - connection.last_received > connection.keep_alive * 1.5:
                    log.info("client %r: keepalive timeout", connection.client_id)
                    connection.close(p.ReasonCode.KEEP_ALIVE_TIMEOUT, "keep alive timeout")
        dead_after = self.settings.dead_subscriber_timeout
        if dead_after:
            for connection in list(self.connections):
                session = connection.session
                if (
                    session is not None and session.inflight and connection.state is State.CONNECTED
                    and now - connection.last_ack > dead_after
                ):
                    log.warning("client %r: no acknowledgement for %.0fs; disconnected as dead",
                                connection.client_id, now - connection.last_ack)
                    connection.close(p.ReasonCode.KEEP_ALIVE_TIMEOUT, "dead subscriber")
        for connection, accepted in list(self._handshaking.items()):
            if connection.state is not State.AWAIT_CONNECT:
                del self._handshaking[connection]
            elif now - accepted > CONNECT_TIMEOUT_S:
                del self._handshaking[connection]
                log.info("%s: no CONNECT within %.0f s of accept; closed", connection.remote,
                         CONNECT_TIMEOUT_S)
                connection.close()
        self._tick_handle = self.scheduler.call_later(TICK_S, self._tick)

    def connection_made(self, connection: MqttConnection) -> None:
        self._handshaking[connection] = self.scheduler.time()
        self.connect_timing.resume_probe()

    def connection_gone(self, connection: MqttConnection) -> None:
        self._handshaking.pop(connection, None)
        # What a departure saves (the session, or its removal) acknowledges nothing: it joins
        # the turn's group commit (one fsync for every departure of the turn) instead of
        # committing, and fsyncing on the event loop, once per connection.
        self.group_writes(True)
        try:
            connection.connection_lost()
        finally:
            self.group_writes(False)

    def sys_values(self) -> dict[str, str]:
        stats = self.edge.stats
        return {
            "version": f"shardgate {__version__}",
            "uptime": f"{int(time.time() - stats.started_at)} seconds",
            "clients/connected": str(len(self.connections)),
            "clients/disconnected": str(len(self.sessions) - sum(1 for s in self.sessions.values() if s.connection)),
            "clients/total": str(len(self.sessions)),
            "clients/maximum": str(self.total_connections),
            "messages/received": str(stats.messages_in),
            "messages/sent": str(stats.messages_out),
            "messages/dropped": str(stats.messages_dropped),
            "bytes/received": str(stats.bytes_in),
            "bytes/sent": str(stats.bytes_out),
            "subscriptions/count": str(self.edge.subscription_count),
            "retained messages/count": str(self.edge.retained_count),
        }

    def _publish_sys(self) -> None:
        for name, value in self.sys_values().items():
            message = Message(f"$SYS/broker/{name}", value.encode(), 0, True, producer_protocol="sys")
            self.edge.publish(message)
        self._sys_handle = self.scheduler.call_later(self.settings.sys_interval, self._publish_sys)
