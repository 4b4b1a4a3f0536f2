"""The MQTT service's part that saves session state to the store (`ServiceState.store`):
while the packets of a read are handled, what they change (a persistent session's
subscriptions and expiry, QoS 2 inbound state) joins one group commit, and the output that
reports it (a CONNACK, a SUBACK, a PUBREC...) leaves once that group is durable, without the
event loop waiting for the fsync. Messages themselves are in the journal, never here.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING

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
