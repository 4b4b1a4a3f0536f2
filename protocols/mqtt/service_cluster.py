"""The MQTT service's part for sessions held on other nodes (cluster mode): a CONNECT waits
until the node has joined its cluster and, when the client's session lives elsewhere, until it
has been fetched (`RemoteSessions`, `remote.py`); a takeover on another node ends the
connection here. On a single node nothing is elsewhere and nothing waits.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from . import packets as p
from .remote import NO_REMOTE_SESSIONS, RemoteSessions
from .service_state import ServiceState
from .session import MqttSession

if TYPE_CHECKING:
    from .connection import MqttConnection

# The service's logger, as before this part had a module of its own.
log = logging.getLogger("shardgate.protocols.mqtt.service")


class ClusterSessions(ServiceState):
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
        session = self.sessions.get(client_id)
        if session is not None and (session.connection is not None
                                    or not self._remote.moved_on(client_id)):
            return None
        # not here, or only the copy another node's takeover left here (`find` replaces it)
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

    def await_session(self, connection: MqttConnection) -> None:
        """`connection`'s CONNECT waits for its session (`session_elsewhere`)."""
        self._awaiting_session.setdefault(connection.client_id, {})[connection] = None

    def session_awaited(self, connection: MqttConnection) -> str | None:
        """`connection` waits no more (its session came, or it closed): the node whose later
        CONNECT took the session over meanwhile, if one did. Such a CONNECT must not open a
        new, empty session here beside the one that moved on: it is refused, retryably, as
        a takeover on one node ends the earlier connection."""
        waiting = self._awaiting_session.get(connection.client_id)
        if waiting is None:
            return None
        overtaken_by = waiting.pop(connection, None)
        if not waiting:
            del self._awaiting_session[connection.client_id]
        return overtaken_by

    def remove_session(self, session: MqttSession) -> None:
        """Cluster mode: `session` lives on another node now (handed over, or moved while
        this node was away): it leaves this service, if it is still the one held here, and
        is discarded. Its timers are the caller's to stop."""
        if self.sessions.get(session.client_id) is session:
            del self.sessions[session.client_id]
        session.discard()

    def release_for_takeover(self, client_id: str, where: str, *,
                             clean_start: bool) -> MqttSession | None:
        """Cluster mode: another node took the client's session over. Its connection here
        ends with DISCONNECT 0x8E and no longer owns the session (its will goes as at a
        takeover), and the session's timers stop (a pending will is published when the new
        session starts clean). Returns the session, still here for its state to be taken
        (the caller then removes it); None when there is none."""
        waiting = self._awaiting_session.get(client_id, {})
        for waiting_connection in waiting:
            # a CONNECT here still waits for this session: `where`'s claim came after its own
            waiting[waiting_connection] = where
        session = self.sessions.get(client_id)
        if session is None:
            return None
        connection = session.connection
        if connection is not None:
            session.connection = None
            connection.close(p.ReasonCode.SESSION_TAKEN_OVER, f"session taken over on {where}")
        self.stop_timers(client_id, publish_will=clean_start)
        return session
