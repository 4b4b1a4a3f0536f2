"""`RemoteSessions`: the port through which the MQTT service reaches sessions held on other
nodes of a cluster, and `NO_REMOTE_SESSIONS`, the single node's (nothing is elsewhere).

The service is given one at start (`MqttService.join_cluster`, once) and calls it at the
points where a session's life concerns the other nodes: a CONNECT whose session may be
elsewhere (`find`), a session held here that the cluster gave to another node meanwhile
(`moved_on`), a persistent session saved (`saved`) or forgotten (`forgotten`) here.
What the cluster does to a session held here (ending its connection for a takeover, taking
its snapshot, making one from a snapshot) goes through the service's own methods
(`MqttService.release_for_takeover`, `snapshot.capture`, `snapshot.rebuild`). This module
knows no cluster: it only names what the service asks.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .session import MqttSession


class RemoteSessions(Protocol):
    def find(self, client_id: str, clean_start: bool,
             username: str | None) -> asyncio.Future[None] | None:
        """Asked at every CONNECT for a session not held here (or held here only as a copy
        that moved on, `moved_on`), before it opens: an awaitable when the client's session
        must first come from (or be ended on) another node (it is in `MqttService.sessions`,
        offline, once that is done), None when nothing is elsewhere. It may fail with `SessionOfAnotherUser` (the CONNECT is refused as on the
        holder) or another error (refused with "server unavailable")."""

    def moved_on(self, client_id: str) -> bool:
        """Asked at a CONNECT for a session held here with no connection: whether another node
        took it over since (this node was away: frozen, or cut off from the cluster, past its
        lease), so that the copy here is older than the session. Such a CONNECT goes through
        `find` as for a session not held here, and the copy here gives way to the session
        `find` brings (resuming the copy would send the client again everything it
        acknowledged on the other node)."""

    def saved(self, client_id: str, *, offline: bool) -> None:
        """A persistent session was written to this node's store: as it went offline
        (`offline`), or while connected (its subscriptions may have changed)."""

    def forgotten(self, client_id: str) -> None:
        """A persistent session was removed from this node's store (it ended or moved)."""

    def exactly_once(self, session: MqttSession) -> asyncio.Future[None] | None:
        """A persistent session's QoS 2 state changed (a packet id it is to answer PUBREC for,
        one released by PUBREL, a PUBREL it is to send): a future done once a node resuming
        the session after this one's crash would know it (the output that reports it waits
        for that; failed: it could not be kept), None when nothing more than this node's
        store is needed. Called at most once per session per read; no await."""


class _NoRemoteSessions:
    """A single node: every session is here."""

    def find(self, client_id: str, clean_start: bool,
             username: str | None) -> asyncio.Future[None] | None:
        return None

    def moved_on(self, client_id: str) -> bool:
        return False

    def saved(self, client_id: str, *, offline: bool) -> None:
        pass

    def forgotten(self, client_id: str) -> None:
        pass

    def exactly_once(self, session: MqttSession) -> asyncio.Future[None] | None:
        return None


NO_REMOTE_SESSIONS: RemoteSessions = _NoRemoteSessions()
