"""The MQTT service: sessions, connections and the timers they share.

One `MqttService` per broker holds every MQTT session (live or offline) and connection, takes
sessions over when a client id reconnects, publishes Last Will messages (with the MQTT 5 will
delay), expires sessions, checks keepalives, publishes the `$SYS/broker/...` topics, and batches
output: connections ask for a flush and the service writes every dirty connection once per
event-loop turn.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from ... import __version__
from ...core.edge import KICK_REASON, Action, ClientInfo, Edge, Principal
from ...core.errors import CoreError
from ...core.message import Message, now_ms
from ...core.ports import SavedSession
from ...core.restoring import set_aside
from ...core.scheduling import Scheduler, Timer
from ...core.subscriptions import Subscription
from ..output import OutputBatcher
from ..read_budget import ReadBudget
from . import packets as p
from .connection import MQTT_V5, MqttConnection, State
from .remote import NO_REMOTE_SESSIONS, RemoteSessions
from .session import NEVER_EXPIRES, MqttSession, Outgoing
from .settings import MqttSettings
from .snapshot import SessionSnapshot
from .snapshotting import capture
from .timing import ConnectTiming

if TYPE_CHECKING:
    from ...core.ports import MqttSessionPorts

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

def _no_clock() -> float:
    raise RuntimeError("MqttService needs a scheduler: the asyncio adapter passes its event loop")


class SessionEvents:
    """Who is told, by client id, of a session opening here (`opened`: new, resumed or taken
    over), of a session ending here (`ended`: not merely disconnected) and of a client's will
    being published, dropped or scheduled here (`will_changed`). Cluster mode adds its
    listeners; on a single node the lists stay empty."""

    __slots__ = ("opened", "ended", "will_changed")

    def __init__(self) -> None:
        self.opened: list[Callable[[str], None]] = []
        self.ended: list[Callable[[str], None]] = []
        self.will_changed: list[Callable[[str], None]] = []


class MqttService:
    # The memory alarm (`shardgate.resources`): connections that publish are not read
    # meanwhile (each looks again every `BLOCKED_RECHECK_S`).
    publishers_blocked = False
    def __init__(
        self, edge: Edge, settings: MqttSettings | None = None,
        store: MqttSessionPorts | None = None, scheduler: Scheduler | None = None,
        read_budget: ReadBudget | None = None,
    ) -> None:
        self.edge = edge
        # Time and timers, from the I/O adapter (an asyncio loop is one) or a test's clock.
        self._scheduler = scheduler
        # Monotonic seconds of that scheduler: one bound method for every connection to call.
        self.clock: Callable[[], float] = scheduler.time if scheduler is not None else _no_clock
        # Where persistent sessions are saved; None keeps them in memory only.
        self.store = store
        self.settings = settings or MqttSettings()
        self.sessions: dict[str, MqttSession] = {}
        self.connections: set[MqttConnection] = set()
        # Set by a graceful stop: no new PUBLISH goes out (see `finish_in_flight`).
        self.draining = False
        # Cluster mode: who is told of sessions opening and ending here and of wills changing
        # (the session registry, wills kept in etcd), in the order they were added.
        self.session_events = SessionEvents()
        # Sessions held on other nodes (`remote.py`): a cluster's, given once at its join
        # (`join_cluster`); on a single node, nothing is elsewhere.
        self._remote: RemoteSessions = NO_REMOTE_SESSIONS
        # Cluster mode, while the node starts: done once it has joined its cluster (see
        # `hold_sessions_until`); until then every CONNECT waits before its session opens.
        self._joined: asyncio.Future[None] | None = None
        # TLS listeners: a verified client certificate's subject CN is the user name.
        self.use_identity_as_username = False
        # Output of a loop turn leaves after the session state it acknowledges is committed.
        self.output: OutputBatcher[MqttConnection] = OutputBatcher(
            lambda flush: self.scheduler.call_soon(flush), before_flush=self.commit_writes)
        # Sessions saved while a read's writes are grouped: written once each as the group
        # closes (by client id, so that forgetting a session drops its pending save).
        self._grouping = False
        self._unsaved: dict[str, MqttSession] = {}
        # A new persistent session was saved in the read being handled: its group commits at
        # the end of that read, not of the turn, so that the session is committed before its
        # CONNACK is written and the fsync that every later acknowledgement to it waits for
        # starts at once (and the commit is small: one read's writes).
        self._commit_at_read_end = False
        self.store_writes_deferred = 0
        # Of those, the ones no output waits for (`save_session(acknowledged=False)`), and how
        # many such writes were made: `store_writes` leaves them out.
        self._quiet: set[str] = set()
        self._quiet_writes = 0
        # Connections whose output waits for a metadata commit to be durable, by its future.
        self._held_for_durable: dict[Future[None], list[MqttConnection]] = {}
        # QoS 2 inbound state changes of durable sessions, written in one batch per loop turn.
        self._will_timers: dict[str, tuple[Timer, p.Will]] = {}
        self._expiry_timers: dict[str, Timer] = {}
        self._client_ids = itertools.count(1)
        self._id_prefix = os.urandom(4).hex()
        self._tick_handle: Timer | None = None
        self._sys_handle: Timer | None = None
        self.total_connections = 0
        # Connections not yet past CONNECT -> when they were accepted: the CONNECT timeout
        # runs from accept, whatever the client trickles in meanwhile.
        self._handshaking: dict[MqttConnection, float] = {}
        # The connection whose packets are being handled (its writes are grouped).
        self.publishing: MqttConnection | None = None
        # Back-pressure (`core/backpressure.py`, shared with every publisher of the broker: a
        # cluster peer's link too): the online sessions whose queue is over half full hold
        # the current publisher until they catch up.
        self.back_pressure = edge.back_pressure
        self._congested: set[MqttSession] = set()
        # ... of which those whose queue (not only their socket's output) is over half full.
        self._queue_congested: set[MqttSession] = set()
        # Drops of a full session queue, by reason -> (when the last line was logged, drops
        # since): logged at most once per DROP_LOG_INTERVAL_S per reason.
        self._drop_log: dict[str, tuple[float, int]] = {}
        # Where CONNECTs wait (read → session open → CONNACK written) and the loop's lateness.
        self.connect_timing = ConnectTiming()
        # The reads one loop turn handles, shared with the broker's other listeners.
        self.read_budget = read_budget or ReadBudget(
            call_soon=lambda handle: self.scheduler.call_soon(handle),
            clock=lambda: self.scheduler.time())
        edge.clients.register("mqtt", self)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._tick_handle = self.scheduler.call_later(TICK_S, self._tick)
        self.connect_timing.start_probe(
            self.scheduler, lambda: bool(self.connections or self._handshaking))
        if self.settings.sys_interval > 0:
            self._publish_sys()

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

    @property
    def scheduler(self) -> Scheduler:
        if self._scheduler is None:
            raise RuntimeError("MqttService needs a scheduler: the asyncio adapter passes its event loop")
        return self._scheduler

    # ------------------------------------------------------------------ output batching
    def request_flush(self, connection: MqttConnection) -> None:
        self.output.request(connection)

    def _flush(self) -> None:
        self.output.flush()  # what the acknowledgements depend on is committed first

    # ------------------------------------------------------------------ metadata group commit
    def group_writes(self, on: bool) -> None:
        """While the packets of a read are handled, session state saved to the store joins
        one transaction, committed by `commit_writes` before the turn's output is flushed;
        the output that depends on it waits for its fsync (`hold_output_until_durable`)."""
        store = self.store
        if store is None:
            return
        if on:
            self._grouping = True
        else:
            self._grouping = False
            self._save_unsaved()
        store.group_writes(on)
        if not on and self._commit_at_read_end:
            self._commit_at_read_end = False
            self.commit_writes()
        if not on and store.group_pending:
            self.output.schedule()

    def _save_unsaved(self) -> None:
        """Write, once each, the sessions saved while the group was open (a read with many
        PUBRECs of one session writes it once)."""
        unsaved = self._unsaved
        quiet = self._quiet
        while unsaved:
            session = unsaved.pop(next(iter(unsaved)))
            self._write_session(session)
            if quiet and session.client_id in quiet:
                quiet.discard(session.client_id)
                self._quiet_writes += 1

    def commit_writes(self) -> None:
        """Commit the turn's group; it becomes durable in the store's sync thread, and the
        output held for it (`hold_output_until_durable`) goes out then."""
        if self.store is None:
            return
        self._save_unsaved()
        try:
            self.store.commit_group()
        except Exception:
            # As a failed save always was: logged, and the session lives on in memory.
            log.exception("could not save MQTT session state")

    def store_writes(self) -> int:
        """How many writes the store has taken or will take at the group's end (compared
        before and after handling a read)."""
        store = self.store
        return 0 if store is None else store.write_count + self.store_writes_deferred - self._quiet_writes

    def hold_output_until_durable(self, connection: MqttConnection, start: int) -> None:
        """`connection` wrote session state while it produced its output from `start` on (a
        CONNACK reporting a session, a SUBACK, a PUBREC, a PUBREL...): that output leaves
        once the writes are durable, without the event loop waiting for the fsync."""
        store = self.store
        durable = store.durable_waiter() if store is not None else None
        if durable is None or not connection.hold_output(start, durable):
            return
        waiting = self._held_for_durable.get(durable)
        if waiting is None:
            waiting = self._held_for_durable[durable] = []
            durable.add_done_callback(self._durable_in_sync_thread)
        waiting.append(connection)

    def _durable_in_sync_thread(self, durable: Future[None]) -> None:
        # Runs in the store's sync thread (or here, when already done): back to the loop.
        call = getattr(self.scheduler, "call_soon_threadsafe", None) or self.scheduler.call_soon
        try:
            call(self._durable_done, durable)
        except RuntimeError:
            pass  # the event loop is closed: the broker has stopped

    def _durable_done(self, durable: Future[None]) -> None:
        for connection in self._held_for_durable.pop(durable, ()):
            connection.output_released()

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

    def hold_sessions_until(self, joined: asyncio.Future[None]) -> None:
        """Cluster mode, at start (before the listeners): no session opens before `joined` is
        done, since only then does this node know which sessions it holds (those restored from
        its store may have moved or ended while it was away; one it handed over at its last
        stop is elsewhere). A CONNECT that comes earlier waits, then opens as any other; had it
        opened at once, a client whose session lives on another node would get a new, empty
        one here. A `joined` that fails or is cancelled refuses the waiting CONNECTs
        (server unavailable)."""
        self._joined = joined

    def join_cluster(self, remote: RemoteSessions) -> None:
        """Cluster mode, once, as the node joins: where sessions held on other nodes are
        reached from now on (`remote.py`)."""
        if self._remote is not NO_REMOTE_SESSIONS:
            raise RuntimeError("the MQTT service has joined a cluster already")
        self._remote = remote

    def session_elsewhere(self, client_id: str, clean_start: bool,
                          username: str | None = None) -> asyncio.Future[None] | None:
        """What a CONNECT waits for before its session opens (`RemoteSessions.find` and
        `hold_sessions_until`)."""
        joined = self._joined
        if joined is not None and not joined.done():
            return asyncio.ensure_future(self._after_joining(joined, client_id, clean_start, username))
        if client_id in self.sessions:
            return None
        return self._remote.find(client_id, clean_start, username)

    async def _after_joining(self, joined: asyncio.Future[None], client_id: str, clean_start: bool,
                             username: str | None) -> None:
        try:
            await asyncio.shield(joined)
        except asyncio.CancelledError:
            raise ConnectionRefusedError("the node stopped before it joined its cluster") from None
        except Exception as exc:  # noqa: BLE001 - the CONNECT is refused with it
            raise ConnectionRefusedError(f"the node could not join its cluster: {exc}") from None
        fetching = self.session_elsewhere(client_id, clean_start, username)
        if fetching is not None:
            await fetching

    def session_taken_elsewhere(self, client_id: str, where: str) -> bool:
        """Cluster mode: the client connected to another node; end its connection here with
        DISCONNECT 0x8E as a takeover on one node would. Whether a connection was ended."""
        session = self.sessions.get(client_id)
        if session is None or session.connection is None:
            return False
        log.info("client %r taken over by a connection to %s", client_id, where)
        session.connection.close(p.ReasonCode.SESSION_TAKEN_OVER, f"session taken over on {where}")
        return True

    def release_for_takeover(self, client_id: str, where: str, *,
                             clean_start: bool) -> MqttSession | None:
        """Cluster mode: another node took the client's session over. Its connection here
        ends with DISCONNECT 0x8E and no longer owns the session (its will goes as at a
        takeover), and the session's timers stop (a pending will is published when the new
        session starts clean). Returns the session, still here for its state to be taken
        (the caller then removes it); None when there is none."""
        session = self.sessions.get(client_id)
        if session is None:
            return None
        connection = session.connection
        if connection is not None:
            session.connection = None
            connection.close(p.ReasonCode.SESSION_TAKEN_OVER, f"session taken over on {where}")
        self.stop_timers(client_id, publish_will=clean_start)
        return session

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

    # ------------------------------------------------------------------ persistence
    def save_session(self, session: MqttSession, *, acknowledged: bool = True) -> None:
        """Persist a durable session's subscriptions and expiry (not its messages: those are
        in the journal, and the session's cursors say how far it got). Inside a read's write
        group the write waits for the group's end, once per session.

        `acknowledged` False: no output reports this write (a resumed session's new expiry
        and connection time, a departure's time), so nothing is held until it is durable. It
        still commits in the group, before any later write's acknowledgement."""
        if not session.durable or self.store is None:
            return
        if self._grouping:
            client_id = session.client_id
            if acknowledged:
                self._quiet.discard(client_id)
                self.store_writes_deferred += 1
            elif client_id not in self._unsaved:
                self._quiet.add(client_id)
            self._unsaved[client_id] = session
            return
        self._write_session(session)

    def _write_session(self, session: MqttSession) -> None:
        assert self.store is not None
        data = capture(session, local=True).encode()
        try:
            self.store.save_session(
                session.client_id, session.expiry_interval, session.disconnected_at_ms, data
            )
            self._remote.saved(session.client_id, offline=session.disconnected_at_ms is not None)
        except Exception:
            log.exception("could not save session %r", session.client_id)

    def forget_session(self, client_id: str) -> None:
        if self.store is None:
            return
        self._unsaved.pop(client_id, None)
        self._quiet.discard(client_id)
        try:
            self.store.forget_session(client_id)
            self._remote.forgotten(client_id)
        except Exception:
            log.exception("could not delete session %r", client_id)

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
                session = MqttSession(self, record.client_id, durable=True)
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

    def remember_qos2(self, session: MqttSession, packet_id: int, present: bool) -> None:
        if not session.durable or self.store is None:
            return
        # Inside the write group of the read that brought the packet: committed once, with
        # the rest of that read's session state, before any acknowledgement goes out.
        try:
            self.store.save_qos2([(session.client_id, packet_id, present)])
        except Exception:
            log.exception("could not save the QoS 2 state of %r", session.client_id)

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
