"""The broker's subscriptions: live and durable subscriptions made, changed and removed, their
filters in the topic trie, and the per-topic match cache the publish path reads; those who are
told of each change (the store, the cluster's route table, durable watchers).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from .durable import CursorSink, DurableOptions, DurableSubscription
from .errors import SubscriptionBusy, SubscriptionNotFound
from .kept_state import INTERNAL_PREFIX
from .placement import DurableWatcher, Fanout
from .store_ports import PortSlot, StateKeeper
from .streams import Stream
from .subscriptions import Consumer, Subscription, SubscriptionType
from .trie import TopicTrie

if TYPE_CHECKING:
    from .broker import Broker


MATCH_CACHE_LIMIT = 50_000

# One entry per matched subscription: the subscription and the filters of it that matched.
Matches = list[tuple[Subscription, tuple[str, ...]]]


class SubscriptionRegistry:
    """The subscription registry part of `Broker` (`core/broker.py`), which holds the state."""

    _durable_watchers: list[DurableWatcher]
    _match_cache: dict[str, Matches]
    _match_results: dict[tuple[tuple[Subscription, tuple[str, ...]], ...], Matches]
    _topic_stream_cache: dict[str, Stream]
    _trie: TopicTrie[Subscription]
    cursor_sink: CursorSink | None
    fanout: Fanout | None
    keeper: PortSlot[StateKeeper]
    on_routes_changed: Callable[[], None] | None
    restored_cursors_wait: bool
    subscriptions: dict[str, Subscription]

    def subscription(
        self,
        name: str,
        type: SubscriptionType = SubscriptionType.EXCLUSIVE,
        *,
        durable: bool = False,
        create: bool = True,
        owner: object = None,
    ) -> Subscription:
        sub = self.subscriptions.get(name)
        if sub is None:
            if not create:
                raise SubscriptionNotFound(f"subscription {name!r} does not exist")
            if durable:
                return self.durable_subscription(name, type, owner=owner)
            sub = self.subscriptions[name] = Subscription(name, type, False, owner)
        return sub

    def durable_subscription(
        self,
        name: str,
        type: SubscriptionType = SubscriptionType.EXCLUSIVE,
        *,
        options: DurableOptions | None = None,
        owner: object = None,
        initial_position: str | int = "latest",
    ) -> DurableSubscription:
        """Get or create a durable subscription (cursors, acks, redelivery)."""
        sub = self.subscriptions.get(name)
        if isinstance(sub, DurableSubscription):
            return sub
        if sub is not None:
            raise SubscriptionBusy(f"subscription {name!r} exists and is not durable")
        sub = DurableSubscription(cast("Broker", self), name, type, options, owner, initial_position, self.cursor_sink)
        self.subscriptions[name] = sub
        if initial_position != "latest":
            sub.open_cursors()
        self._durable_defined(sub)
        return sub

    def _durable_defined(self, sub: Subscription) -> None:
        if isinstance(sub, DurableSubscription):
            if (keeper := self.keeper.current) is not None:
                keeper.durable_defined(sub)
            for watcher in self._durable_watchers:
                watcher.durable_defined(sub)

    def durable_changed(self, sub: DurableSubscription) -> None:
        """`sub`'s definition changed in a way only its owner knows (its options): saved again,
        as when its filters change."""
        self._durable_defined(sub)

    def watch_durables(self, watcher: DurableWatcher) -> None:
        """Tell `watcher` of every durable subscription defined, changed or removed from now
        on, after the store was told (the keeper's `durable_defined`, `subscription_removed`)."""
        self._durable_watchers.append(watcher)

    def restored_cursors_placed(self) -> None:
        """The cluster knows the shard map: restored cursors no longer wait to be placed."""
        self.restored_cursors_wait = False

    def add_filter(self, sub: Subscription, topic_filter: str, options: object = None) -> bool:
        """Add (or update the options of) a filter; True if the filter is new to `sub`."""
        new = topic_filter not in sub.filters
        if new:
            # First: a filter the trie refuses (TopicError) never becomes part of `sub`, so
            # it is never saved with it either.
            self._trie.add(topic_filter, sub)
        sub.filters[topic_filter] = options
        if new:
            sub.filters_changed()
            self._forget_matches()
            if self.on_routes_changed is not None:
                self.on_routes_changed()
            self._durable_defined(sub)
        return new

    def remove_filter(self, sub: Subscription, topic_filter: str) -> bool:
        if topic_filter not in sub.filters:
            return False
        del sub.filters[topic_filter]
        self._trie.remove(topic_filter, sub)
        sub.filters_changed()
        self._forget_matches()
        if self.on_routes_changed is not None:
            self.on_routes_changed()
        self._durable_defined(sub)
        return True

    def remove_subscription(self, name: str, *, forget: bool = True) -> Subscription | None:
        """Remove subscription `name`; a durable one is forgotten by its store and watchers
        too, unless `forget` is False (one that was never fully restored: its stored record
        stays as it was)."""
        sub = self.subscriptions.pop(name, None)
        if isinstance(sub, DurableSubscription):
            sub.close()
            if forget and (keeper := self.keeper.current) is not None:
                keeper.subscription_removed(sub)
            for watcher in self._durable_watchers if forget else ():
                watcher.durable_removed(sub)
        if sub is not None:
            for topic_filter in list(sub.filters):
                self._trie.remove(topic_filter, sub)
            sub.filters.clear()
            sub.filters_changed()
            self._forget_matches()
            if self.on_routes_changed is not None:
                self.on_routes_changed()
        return sub

    def attach(self, sub: Subscription, consumer: Consumer) -> None:
        sub.attach(consumer)
        sub.wake()
        if self.on_routes_changed is not None:
            self.on_routes_changed()

    def detach(self, sub: Subscription, consumer: Consumer) -> None:
        sub.detach(consumer)
        if self.on_routes_changed is not None:
            self.on_routes_changed()

    def routes_ready(self) -> asyncio.Future[None] | None:
        """None when a subscription made now is already known wherever a message for it may
        be stored (always on a single node); else a future that resolves once it is (a
        cluster's other nodes: `Fanout.routes_ready`)."""
        fanout = self.fanout
        return None if fanout is None else fanout.routes_ready()

    @property
    def subscription_count(self) -> int:
        return len(self._trie)

    def forget_cached_matches(self) -> None:
        """Drop the per-topic caches (topic → stream, topic → subscriptions, and each durable
        subscription's), which are rebuilt on demand: an idle broker gives their memory back."""
        self._match_cache = {}
        self._match_results = {}
        self._topic_stream_cache = {}
        for sub in list(self.subscriptions.values()):
            if isinstance(sub, DurableSubscription):
                sub.forget_cached_matches()

    def _forget_matches(self) -> None:
        self._match_cache.clear()
        self._match_results.clear()

    def match(self, topic: str) -> Matches:
        matches = self._match_cache.get(topic)
        if matches is None:
            grouped: dict[Subscription, list[str]] = {}
            # the broker's own records (`$internal/`) go to no subscription
            found_filters = () if topic.startswith(INTERNAL_PREFIX) else self._trie.match(topic)
            for topic_filter, sub in found_filters:
                grouped.setdefault(sub, []).append(topic_filter)
            matches = [(sub, tuple(filters)) for sub, filters in grouped.items()]
            found = tuple(matches)
            shared = self._match_results.get(found)
            if shared is None:
                self._match_results[found] = matches
            else:
                matches = shared
            if len(self._match_cache) >= MATCH_CACHE_LIMIT:
                self._forget_matches()
            self._match_cache[topic] = matches
        return matches
