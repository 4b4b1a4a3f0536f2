"""The route table: which topic filters the clients of every other node hold (as EMQX keeps it).

A node tells its peers the filters its local subscriptions hold (`local_routes`, diffed into
`RouteDelta`s and sent over the peer links); the owner of a shard then pushes each stored
message once to each node that wants it (`RemoteRoutes.lookup`). A plain subscription wants
every matching message; a shared one (an MQTT `$share/group/filter`, an AMQP queue, a gRPC
shared subscription: any `SubscriptionType.SHARED`) is one group across the cluster, named by
its subscription name, and each message goes to one of the nodes holding it.

Routes travel over the peer links, not through etcd. Subscriptions come and go at client
speed (a reconnect storm is thousands a second), while etcd takes about a thousand fsynced
writes a second for everything the cluster agrees on; and routes need no agreement: each node
is the only authority on its own clients. A link starts with the node's whole route set
(`reset`), then carries debounced deltas in order with the data; a peer forgets a node's routes
when its link ends or it leaves the view (its lease in etcd is the liveness that counts), and
relearns them in full when the node dials again. A node that joins learns everyone's routes as
they dial it, with no etcd reads.

Pure data: no sockets, no event loop, no etcd.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from ..core.subscriptions import Subscription, SubscriptionType
from ..core.trie import TopicTrie

LOOKUP_CACHE_LIMIT = 50_000
PLAIN = ""


class Route(NamedTuple):
    """A topic filter held on a node; `share_group` is "" for a plain subscription."""

    topic_filter: str
    share_group: str = PLAIN
    # For a share: the node's consumers in it, so a group's messages spread per member.
    weight: int = 0
    # Held by a durable subscription (a persistent session, a durable queue): it replays the
    # owner's journal, so even a transient message it wants is stored there with an offset.
    durable: bool = False


@dataclass(slots=True)
class RouteDelta:
    added: list[Route] = field(default_factory=list)
    removed: list[Route] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)


def local_routes(subscriptions: Iterable[Subscription]) -> set[Route]:
    """The routes this node's subscriptions hold. A live shared subscription counts only while
    a consumer is attached (so the others are not handed messages nobody here takes); a
    durable one always does, with a weight of at least one: its cursors keep what is
    published while no consumer is attached, for the consumers to come."""
    routes: set[Route] = set()
    for sub in subscriptions:
        if not sub.filters:
            continue
        if sub.type is SubscriptionType.SHARED:
            # a consumer with `in_routes` False only takes what is still on its way here (a
            # moved session's stand-in, `session_release.GroupStandIn`)
            members = sum(getattr(consumer, "in_routes", True) for consumer in sub.consumers) or int(sub.durable)
            if members:
                routes.update(
                    Route(topic_filter, sub.name, members, sub.durable) for topic_filter in sub.filters
                )
        elif not sub.consumers or any(getattr(consumer, "in_routes", True) for consumer in sub.consumers):
            # (a plain subscription whose one consumer is a moved session's stand-in that its
            # new node collects takes only what is on its way here: out of the routes)
            routes.update(Route(topic_filter, durable=sub.durable) for topic_filter in sub.filters)
    return routes


def diff(before: set[Route], after: set[Route]) -> RouteDelta:
    return RouteDelta(sorted(after - before), sorted(before - after))


class Interest(NamedTuple):
    """Who wants a topic: nodes with a plain subscription, and per share group its nodes with
    their weights (consumers); `durable` when a durable subscription is among them."""

    plain: frozenset[str]
    groups: Mapping[str, tuple[tuple[str, int], ...]]
    durable: bool = False


NOBODY = Interest(frozenset(), {})


class RemoteRoutes:
    """The routes of every other node, matched against topic names (cached per topic)."""

    def __init__(self) -> None:
        self._by_node: dict[str, set[Route]] = {}
        # filter -> (node, share group, weight, durable) entries
        self._trie: TopicTrie[tuple[str, str, int, bool]] = TopicTrie()
        self._cache: dict[str, Interest] = {}

    def nodes(self) -> list[str]:
        return [node for node, routes in self._by_node.items() if routes]

    def routes_of(self, node: str) -> frozenset[Route]:
        return frozenset(self._by_node.get(node, ()))

    def __len__(self) -> int:
        return sum(len(routes) for routes in self._by_node.values())

    def reset(self, node: str, routes: Iterable[Route]) -> None:
        """Replace everything known of `node` with `routes`."""
        self.forget(node)
        self.apply(node, RouteDelta(list(routes), []))

    def apply(self, node: str, delta: RouteDelta) -> None:
        held = self._by_node.setdefault(node, set())
        for route in delta.removed:
            if route in held:
                held.discard(route)
                self._trie.remove(route.topic_filter, _entry(node, route))
        for route in delta.added:
            if route not in held:
                held.add(route)
                self._trie.add(route.topic_filter, _entry(node, route))
        self._cache.clear()

    def forget(self, node: str) -> None:
        """Drop every route of `node` (it left the cluster, or its link ended)."""
        held = self._by_node.pop(node, None)
        if not held:
            return
        for route in held:
            self._trie.remove(route.topic_filter, _entry(node, route))
        self._cache.clear()

    def lookup(self, topic: str) -> Interest:
        interest = self._cache.get(topic)
        if interest is not None:
            return interest
        plain: set[str] = set()
        groups: dict[str, dict[str, int]] = {}
        durable = False
        for _filter, (node, group, weight, held_durably) in self._trie.match(topic):
            durable = durable or held_durably
            if group:
                members = groups.setdefault(group, {})
                members[node] = max(members.get(node, 0), weight, 1)
            else:
                plain.add(node)
        interest = (
            Interest(frozenset(plain), {
                group: tuple(sorted(members.items())) for group, members in groups.items()
            }, durable)
            if plain or groups else NOBODY
        )
        if len(self._cache) >= LOOKUP_CACHE_LIMIT:
            self._cache.clear()
        self._cache[topic] = interest
        return interest


def _entry(node: str, route: Route) -> tuple[str, str, int, bool]:
    return (node, route.share_group, route.weight, route.durable)
