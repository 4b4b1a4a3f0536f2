"""Fan-out: which other nodes get a message stored here, pushed once each over the link to
them; a share group's next message goes to one node, round robin over its consumers.

The other nodes' routes come over their links (`routes.RemoteRoutes`, applied by `inbox.py`).
While some node's routes are not known here yet, a stored message is also held for it
(`unrouted.py`).
"""

from __future__ import annotations

from collections.abc import Container
from typing import TYPE_CHECKING

from ..core.subscriptions import Subscription, SubscriptionType
from .forwarding import NODE_LOCAL_STREAMS
from .routes import NOBODY

if TYPE_CHECKING:
    from ..core.message import Message
    from .data_plane import DataPlane


class PushFanout:
    """Pushes stored messages to the nodes that want them (one per data plane)."""

    def __init__(self, plane: DataPlane) -> None:
        self.remote = plane.remote
        self.links = plane.links
        self.stats = plane.stats
        self.node_id = plane.node_id
        self.unrouted = plane.unrouted
        # share group -> the turn of its next message (`_choose`)
        self._turns: dict[str, int] = {}
        # (stream, shard) -> the offset after the last stored message of it dispatched here
        # (the core dispatches a shard's messages in offset order): how far a replicated
        # shard's leader dispatched (`dispatch_marks.py`)
        self.dispatched: dict[tuple[str, int], int] = {}

    def push(
        self, message: Message, local: list[tuple[Subscription, tuple[str, ...]]]
    ) -> Container[str] | None:
        if message.offset >= 0:
            self.dispatched[(message.stream, message.shard)] = message.offset + 1
        interest = self.remote.lookup(message.topic)
        unknown = self.unrouted.unknown
        if message.stream in NODE_LOCAL_STREAMS:
            return None
        if interest is NOBODY:
            if unknown:
                self.unrouted.hold(message, local, ())
            return None
        targets: dict[str, list[str]] = {node: [] for node in interest.plain}
        allowed: set[str] | None = None
        if interest.groups:
            local_shared = {
                sub.name: sub for sub, _ in local if sub.type is SubscriptionType.SHARED
            }
            allowed = {name for name in local_shared if name not in interest.groups}
            for group, members in interest.groups.items():
                here = local_shared.get(group)
                if here is not None and here.consumers:
                    members = (*members, (self.node_id, len(here.consumers)))
                chosen = self._choose(group, members)
                if chosen == self.node_id:
                    allowed.add(group)
                else:
                    targets.setdefault(chosen, []).append(group)
        links = self.links
        given: list[str] = []
        for node_id, groups in targets.items():
            link = links.get(node_id)
            if link is not None and node_id not in unknown:
                link.push(message, tuple(groups))
                self.stats.pushed += 1
                given += groups
        if unknown:
            self.unrouted.hold(message, local, given)
        return allowed

    def wanted_elsewhere(self, topic: str) -> bool:
        return self.remote.lookup(topic) is not NOBODY

    def wanted_durably_elsewhere(self, topic: str) -> bool:
        # (a node whose routes are not known yet may hold a durable subscription: journaled)
        return bool(self.unrouted.unknown) or self.remote.lookup(topic).durable

    def _choose(self, group: str, members: tuple[tuple[str, int], ...]) -> str:
        """The node that takes the next message of a share group: round robin over the
        group's consumers, so each node gets its members' part."""
        total = sum(weight for _node, weight in members)
        turn = self._turns.get(group, 0)
        self._turns[group] = turn + 1
        slot = turn % total
        for node, weight in members:
            if slot < weight:
                return node
            slot -= weight
        return members[-1][0]

