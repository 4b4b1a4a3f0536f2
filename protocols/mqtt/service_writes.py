"""The MQTT service's part that saves session state to the store (`ServiceState.store`):
while the packets of a read are handled, what they change (a persistent session's
subscriptions and expiry, QoS 2 inbound state) joins one group commit, and the output that
reports it (a CONNACK, a SUBACK, a PUBREC...) leaves once that group is durable, without the
event loop waiting for the fsync. Messages themselves are in the journal, never here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from .remote import NO_REMOTE_SESSIONS
from .service_state import ServiceState
from .session import MqttSession
from .snapshotting import capture

if TYPE_CHECKING:
    from .connection import MqttConnection

# The service's logger, as before this part had a module of its own.
log = logging.getLogger("shardgate.protocols.mqtt.service")


class SessionWrites(ServiceState):
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

    def hold_output_until_durable(self, connection: MqttConnection, start: int,
                                  replicated: asyncio.Future[None] | None = None) -> None:
        """`connection` wrote session state while it produced its output from `start` on (a
        CONNACK reporting a session, a SUBACK, a PUBREC, a PUBREL...): that output leaves
        once the writes are durable, without the event loop waiting for the fsync. In a
        cluster, output reporting QoS 2 state also waits for `replicated` (`take_replicated`);
        if that fails, the connection is closed instead (`_durable_done`)."""
        store = self.store
        waiter = store.durable_waiter() if store is not None else None
        if replicated is None:
            self.hold_output_until(connection, start, waiter)
        else:
            self.hold_output_until(connection, start,
                                   replicated if waiter is None else self._both(waiter, replicated))

    def hold_output_until(self, connection: MqttConnection, start: int,
                          durable: Future[None] | asyncio.Future[None] | None) -> None:
        """`connection`'s output from `start` on leaves once `durable` is done."""
        if durable is None or not connection.hold_output(start, durable):
            return
        waiting = self._held_for_durable.get(durable)
        if waiting is None:
            waiting = self._held_for_durable[durable] = []
            durable.add_done_callback(self._durable_in_sync_thread)
        waiting.append(connection)

    def _both(self, durable: Future[None], replicated: asyncio.Future[None]) -> asyncio.Future[None]:
        """Done (on the loop) once the store's commit is durable and `replicated` is done;
        failed as `replicated` failed."""
        both: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def check(_done: object = None) -> None:
            if both.done() or not (durable.done() and replicated.done()):
                return
            error = replicated.exception() if not replicated.cancelled() else RuntimeError("cancelled")
            if error is not None:
                both.set_exception(error)
                both.exception()  # retrieved: `_durable_done` reads it
            else:
                both.set_result(None)

        durable.add_done_callback(lambda _f: self._durable_in_sync_thread_call(check))
        replicated.add_done_callback(check)
        return both

    def _durable_in_sync_thread_call(self, call_back: Callable[[], None]) -> None:
        call = getattr(self.scheduler, "call_soon_threadsafe", None) or self.scheduler.call_soon
        try:
            call(call_back)
        except RuntimeError:
            pass  # the event loop is closed: the broker has stopped

    def _durable_in_sync_thread(self, durable: Future[None] | asyncio.Future[None]) -> None:
        # Runs in the store's sync thread (or here, when already done): back to the loop.
        call = getattr(self.scheduler, "call_soon_threadsafe", None) or self.scheduler.call_soon
        try:
            call(self._durable_done, durable)
        except RuntimeError:
            pass  # the event loop is closed: the broker has stopped

    def _durable_done(self, durable: Future[None] | asyncio.Future[None]) -> None:
        connections = self._held_for_durable.pop(durable, ())
        if isinstance(durable, asyncio.Future) and (durable.cancelled() or durable.exception()):
            # QoS 2 state another node would need could not be kept: what reports it is not
            # sent; the client sends its PUBLISH or PUBREL again on its next connection
            reason = f"the session's QoS 2 state could not be replicated: {durable.exception() if not durable.cancelled() else 'cancelled'}"
            for connection in connections:
                connection.refuse_held(durable, reason)
            return
        for connection in connections:
            connection.output_released()

    # ------------------------------------------------------------------ QoS 2 state in a cluster
    def exactly_once_changed(self, session: MqttSession) -> None:
        """A persistent session's QoS 2 state changed while a read is handled: told to the
        cluster as the read ends (`take_replicated`), once per session."""
        if session.durable and self._remote is not NO_REMOTE_SESSIONS:
            if self._grouping:
                self._exactly_once[session.client_id] = session
            else:
                self._remote.exactly_once(session)

    def take_replicated(self) -> asyncio.Future[None] | None:
        """As a read ends: the future the output reporting its QoS 2 changes waits for (None:
        none changed, or a single node)."""
        changed = self._exactly_once
        if not changed:
            return None
        replicated = None
        for session in changed.values():
            replicated = self._remote.exactly_once(session) or replicated
        changed.clear()
        return replicated

    def replicate_committed(self, session: MqttSession) -> asyncio.Future[None] | None:
        """A QoS 2 message of `session` is committed: the future its PUBREC waits for."""
        if not session.durable or self._remote is NO_REMOTE_SESSIONS:
            return None
        return self._remote.exactly_once(session)

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
    def remember_qos2(self, session: MqttSession, packet_id: int, present: bool) -> None:
        if not session.durable or self.store is None:
            return
        # Inside the write group of the read that brought the packet: committed once, with
        # the rest of that read's session state, before any acknowledgement goes out.
        try:
            self.store.save_qos2([(session.client_id, packet_id, present)])
        except Exception:
            log.exception("could not save the QoS 2 state of %r", session.client_id)
