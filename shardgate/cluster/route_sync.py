"""Route sync: telling the peers which filters this node's clients hold (a reset on every new
link, then debounced deltas, each numbered by a generation), and waiting for the peers to have
applied them (a SUBACK waits, `routes_ready`) and to have pushed everything chosen under
older routes (`pushes_settled`, a session moving here waits).

The peers' routes, as received, are `routes.RemoteRoutes` (applied by `inbox.py`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ..proto import cluster_pb2 as pb
from .frames import route_update
from .routes import Route, RouteDelta, diff, local_routes

if TYPE_CHECKING:
    from .data_plane import DataPlane

ROUTE_DEBOUNCE_S = 0.02
# A SUBACK waits at most this long for the peers to apply the new routes (a slow peer).
ROUTE_WAIT_S = 1.0


class RouteSync:
    """This node's routes as told to its peers, and who waits for the peers (one per data
    plane)."""

    def __init__(self, plane: DataPlane, route_debounce_s: float = ROUTE_DEBOUNCE_S) -> None:
        self.plane = plane
        self.links = plane.links
        self.route_debounce_s = route_debounce_s
        self._advertised: set[Route] = set()
        self._flush_handle: asyncio.Handle | None = None
        self._last_flush = 0.0
        # Bumped by every route update sent; each link knows the last its peer applied.
        self.generation = 0
        self._route_waiters: list[tuple[int, asyncio.Future[None]]] = []
        # Per peer: the highest route generation of this node it had applied before the pushes
        # of the frames from it applied so far (`PeerFrame.routes_applied`), and who waits.
        self.pushes_under: dict[str, int] = {}
        self._push_waiters: list[tuple[int, asyncio.Future[None]]] = []
        # The next route update goes out (with a new generation) even with nothing in it
        # (`pushes_flushed`).
        self._barrier = False

    def start(self) -> None:
        """Take what this node's clients hold now as what the peers are told first."""
        self._advertised = local_routes(self.plane.broker.subscriptions.values())

    def stop(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None

    def pushes_applied_under(self, peer: str, generation: int) -> None:
        """`peer` says the pushes it sent so far were chosen under this node's routes of
        `generation` or later (`PeerFrame.routes_applied`)."""
        if generation > self.pushes_under.get(peer, 0):
            self.pushes_under[peer] = generation
            if self._push_waiters:
                self.settle_push_waiters()

    def snapshot(self) -> pb.RouteUpdate:
        """Everything this node's clients hold, as a reset for a new link."""
        update = route_update(RouteDelta(sorted(self._advertised), []), reset=True)
        update.generation = self.generation
        return update

    def changed(self) -> None:
        """Local subscriptions changed: tell the peers soon (the first change at once, then
        at most one update per debounce interval)."""
        if self._flush_handle is not None or not self.plane.started:
            return
        loop = asyncio.get_running_loop()
        wait = self._last_flush + self.route_debounce_s - loop.time()
        if wait <= 0:
            self._flush_handle = loop.call_soon(self._flush_routes)
        else:
            self._flush_handle = loop.call_later(wait, self._flush_routes)

    def _flush_routes(self) -> None:
        self._flush_handle = None
        self._last_flush = asyncio.get_running_loop().time()
        now = local_routes(self.plane.broker.subscriptions.values())
        delta = diff(self._advertised, now)
        self._advertised = now
        barrier, self._barrier = self._barrier, False
        if not delta and not barrier:
            self.link_state_changed()  # nothing new to wait for
            return
        self.generation += 1
        update = route_update(delta)
        update.generation = self.generation
        for link in self.links.values():
            link.send_routes(update, self.generation)

    def routes_ready(self) -> asyncio.Future[None] | None:
        """None when every peer in the view has applied this node's routes as they are now
        (subscriptions made so far); else a future that resolves once they have, or after
        ROUTE_WAIT_S (a slow peer). A peer whose link is still dialing (a node just joined or
        restarted) is waited for too, as it may own a shard and store for the subscription
        before it knows of it; a peer found away (two failed dials, or silent) is not: it gets
        the whole route set when its link comes back."""
        target = self.generation + (1 if self._flush_handle is not None else 0)
        if self._routes_reached(target):
            return None
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._route_waiters.append((target, future))
        loop.call_later(ROUTE_WAIT_S, _resolve, future)
        return future

    def _routes_reached(self, target: int) -> bool:
        if self._flush_handle is None:
            target = min(target, self.generation)
        return all(link.routes_answered >= target for link in self.links.values()
                   if link.connected or link.reachable)

    def pushes_settled(self) -> asyncio.Future[None] | None:
        """None when every peer this node is linked to has applied its routes as they are now
        and every push it chose this node for under older routes has arrived here and been
        dispatched; else a future that resolves once so (each peer says so on its own link,
        behind its pushes: `PeerFrame.routes_applied`), or after ROUTE_WAIT_S (a slow peer)."""
        target = self.generation + (1 if self._flush_handle is not None else 0)
        if self._pushes_reached(target):
            return None
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._push_waiters.append((target, future))
        loop.call_later(ROUTE_WAIT_S, _resolve, future)
        return future

    def pushes_flushed(self, timeout_s: float = ROUTE_WAIT_S) -> asyncio.Future[None] | None:
        """As `pushes_settled`, but also when this node's routes did not change: every push a
        peer chose this node for before now has arrived here and been dispatched. A session
        handed over from here waits for this before its stand-in leaves (`SessionRelease.
        collect`): the node's routes stay the same when other sessions here hold the same
        filters, yet a peer may have pushed a message for the session just before it learnt
        of the session's new node. An update with nothing in it (a new generation) goes to
        every peer, each answers it behind its pushes. None when no peer is linked; else the
        future resolves once so, or after `timeout_s` (a slow peer)."""
        if not any(link.connected for link in self.links.values()):
            return None
        self._barrier = True
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        self._flush_routes()
        target = self.generation
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._push_waiters.append((target, future))
        loop.call_later(timeout_s, _resolve, future)
        return future

    def _pushes_reached(self, target: int) -> bool:
        if self._flush_handle is None:
            target = min(target, self.generation)
        under = self.pushes_under
        return all(under.get(peer, 0) >= target for peer, link in self.links.items() if link.connected)

    def settle_push_waiters(self) -> None:
        waiting = []
        for target, future in self._push_waiters:
            if future.done():
                continue
            if self._pushes_reached(target):
                future.set_result(None)
            else:
                waiting.append((target, future))
        self._push_waiters = waiting

    def link_state_changed(self) -> None:
        """A link came up, went down, or its peer applied routes: settle the route waiters."""
        if self._push_waiters:
            self.settle_push_waiters()
        if not self._route_waiters:
            return
        waiting = []
        for target, future in self._route_waiters:
            if future.done():
                continue
            if self._routes_reached(target):
                future.set_result(None)
            else:
                waiting.append((target, future))
        self._route_waiters = waiting


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
