"""Unrouted holding: a message stored here while some node's routes are not known yet is held
for that node, and pushed to it once its routes are.

An owner can store a message before it knows what every other node's clients hold: it has just
joined (or restarted) and a peer's route set is still on its way over that peer's link, or a peer
dialed it before its own view lists that peer (no link to push on yet). Such a message is pushed
at once to the nodes whose routes are known (`fanout.py`), and held (`_Unrouted`) for the others:
once a node's whole route set arrives, and this node links to it, the held messages it wants are
pushed to it, in order, before anything stored later. Nothing is acknowledged later for it, as a
push never is. Bounded: a node whose routes do not come within `UNROUTED_WAIT_S` (or past
`MAX_UNROUTED` held messages), is given up on, counted as dropped pushes and told so
(`pushes_lost`: its durable cursors read this node's journal again), as for a full link.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..core.subscriptions import Subscription, SubscriptionType
from .peer_link import MAX_PUSHES_QUEUED

if TYPE_CHECKING:
    from ..core.message import Message
    from .data_plane import DataPlane

log = logging.getLogger(__name__)

# A message stored while some node's routes are not known here yet waits this long for them
# (see the module docstring); at most this many such messages are held.
UNROUTED_WAIT_S = 10.0
MAX_UNROUTED = MAX_PUSHES_QUEUED


class _Unrouted:
    """A message stored while the routes of `waiting` (nodes) were not known here: pushed to
    each of them that wants it once its routes are (`UnroutedHold._release`). `groups`: the
    share groups it was given to already (or taken by here), never given again."""

    __slots__ = ("message", "waiting", "groups", "held_at")

    def __init__(self, message: Message, waiting: set[str], groups: set[str], held_at: float) -> None:
        self.message = message
        self.waiting = waiting
        self.groups = groups
        self.held_at = held_at


class UnroutedHold:
    """The messages held for peers whose routes are not known here yet (one per data plane)."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
        self.links = plane.links
        self.remote = plane.remote
        self.stats = plane.stats
        self.node_id = plane.node_id
        # Peers whose whole route set this node applied in their current link session.
        self.routes_known: set[str] = set()
        # Peers a stored message cannot be routed to yet: in the view with their routes not
        # known, or with routes known and no link to push on. Empty in a steady cluster.
        self.unknown: frozenset[str] = frozenset()
        # Messages stored meanwhile, oldest first, held for those peers (see `_Unrouted`).
        self._unrouted: deque[_Unrouted] = deque()
        self._unrouted_timer: asyncio.TimerHandle | None = None

    def held(self) -> int:
        """How many stored messages wait for some node's routes (see `_Unrouted`)."""
        return len(self._unrouted)

    def clear(self) -> None:
        """Drop what is held and forget the unknown peers (the data plane stops)."""
        if self._unrouted_timer is not None:
            self._unrouted_timer.cancel()
            self._unrouted_timer = None
        self._unrouted.clear()
        self.unknown = frozenset()

    def refresh(self) -> None:
        """Work out which peers a stored message cannot be routed to yet (see `unknown`), and
        push the held messages to those that can be now."""
        nodes = self.plane.view.nodes() if self.plane.started else {}
        known, links = self.routes_known, self.links
        unknown = frozenset(
            [node for node in nodes if node != self.node_id and node not in known]
            + [node for node in known if node not in links]
        )
        if unknown == self.unknown:
            return
        before, self.unknown = self.unknown, unknown
        if self._unrouted and before - unknown:
            self._release()

    def hold(self, message: Message, local: list[tuple[Subscription, tuple[str, ...]]],
             given: Sequence[str]) -> None:
        """Hold `message` for the peers whose routes are not known yet. The share groups
        matched here, and those given to a known node, are not given again."""
        groups = {sub.name for sub, _ in local if sub.type is SubscriptionType.SHARED}
        groups.update(given)
        unrouted = self._unrouted
        if len(unrouted) >= MAX_UNROUTED:
            self._give_up(max(1, MAX_UNROUTED // 10))  # (a tenth at once: one warning each)
        unrouted.append(_Unrouted(message, set(self.unknown), groups, time.monotonic()))
        if self._unrouted_timer is None:
            self._unrouted_timer = asyncio.get_running_loop().call_later(
                UNROUTED_WAIT_S, self._give_up_late)

    def _release(self) -> None:
        """Push each held message to every peer it waits for that is no longer unknown and
        wants it (oldest first, so before anything stored after); forget the peers that left."""
        unknown, links, lookup = self.unknown, self.links, self.remote.lookup
        kept: deque[_Unrouted] = deque()
        for held in self._unrouted:
            ready = [node for node in held.waiting if node not in unknown]
            for node in ready:
                held.waiting.discard(node)
                link = links.get(node)
                if link is None:
                    continue  # it left the view: its routes went with it
                interest = lookup(held.message.topic)
                groups = tuple(sorted(
                    group for group, members in interest.groups.items()
                    if group not in held.groups and any(member == node for member, _ in members)
                ))
                if node in interest.plain or groups:
                    link.push(held.message, groups)
                    self.stats.pushed += 1
                    held.groups.update(groups)
            if held.waiting:
                kept.append(held)
        self._unrouted = kept
        if not kept and self._unrouted_timer is not None:
            self._unrouted_timer.cancel()
            self._unrouted_timer = None

    def _give_up_late(self) -> None:
        """Give up the held messages older than UNROUTED_WAIT_S; look again when the next is."""
        self._unrouted_timer = None
        unrouted = self._unrouted
        limit = time.monotonic() - UNROUTED_WAIT_S
        late = 0
        while late < len(unrouted) and unrouted[late].held_at <= limit:
            late += 1
        if late:
            self._give_up(late)
        if unrouted:
            self._unrouted_timer = asyncio.get_running_loop().call_later(
                max(0.0, unrouted[0].held_at + UNROUTED_WAIT_S - time.monotonic()), self._give_up_late)

    def _give_up(self, count: int) -> None:
        """Drop the `count` oldest held messages, counted as pushes dropped for each node they
        waited for; those nodes are told (their durable cursors read this journal again)."""
        unrouted = self._unrouted
        nodes: dict[str, int] = {}
        for _ in range(min(count, len(unrouted))):
            for node in unrouted.popleft().waiting:
                nodes[node] = nodes.get(node, 0) + 1
        for node, dropped in nodes.items():
            self.stats.pushes_dropped += dropped
            self.plane.broker.stats.drop("cluster_routes_unknown", dropped)
            link = self.links.get(node)
            if link is not None:
                link.lost_pushes()
            log.warning("cluster: the routes of node %s did not reach this node in time; %d "
                        "messages stored meanwhile were not pushed to it", node, dropped)
