"""The subscription trie: which topic filters, and the values registered under them, match a topic.

`TopicTrie` maps topic filters to sets of hashable values (subscriptions, in the broker). Exact
filters (no wildcard) live in one dict; wildcard filters live in a tree of per-level dict nodes,
so matching a topic name costs about its number of levels, whatever the number of filters.
A bounded cache of recent results (topic name -> matches) is cleared on every change.

It holds no protocol knowledge and does no I/O; a `$share/...` filter is stored literally, so
callers strip the share prefix first (see `shardgate.core.topics.parse_shared_filter`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from .topics import MULTI_LEVEL, SEPARATOR, SINGLE_LEVEL, is_wildcard, validate_topic_filter

__all__ = ["DEFAULT_CACHE_SIZE", "TopicTrie"]

V = TypeVar("V")

# How many topic names keep their match result; the oldest is evicted first.
DEFAULT_CACHE_SIZE = 4096


class _Node(Generic[V]):
    """One level of a wildcard filter, or one exact filter.

    `values` belong to the filter that ends here; `pairs` holds their `(filter, value)` tuples,
    built on first match and dropped whenever `values` changes.
    """

    __slots__ = ("children", "pairs", "topic_filter", "values")

    def __init__(self, topic_filter: str = "") -> None:
        self.children: dict[str, _Node[V]] = {}
        self.topic_filter = topic_filter
        self.values: set[V] = set()
        self.pairs: tuple[tuple[str, V], ...] | None = None

    def matched(self) -> tuple[tuple[str, V], ...]:
        pairs = self.pairs
        if pairs is None:
            topic_filter = self.topic_filter
            pairs = self.pairs = tuple([(topic_filter, value) for value in self.values])
        return pairs


class TopicTrie(Generic[V]):
    """Topic filters mapped to sets of values, matched against topic names.

    `match(topic)` returns one `(topic_filter, value)` pair per matching filter and value, so a
    value registered under two matching filters appears twice, once with each filter. Filters
    starting with a wildcard do not match topic names starting with `$` (MQTT-4.7.2-1).
    """

    __slots__ = ("_cache", "_cache_size", "_exact", "_root", "_size")

    def __init__(self, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self._exact: dict[str, _Node[V]] = {}
        self._root: _Node[V] = _Node()
        self._size = 0
        self._cache: dict[str, tuple[tuple[str, V], ...]] = {}
        self._cache_size = cache_size

    def __len__(self) -> int:
        """The number of (filter, value) pairs."""
        return self._size

    def __contains__(self, topic_filter: object) -> bool:
        """True when at least one value is registered under `topic_filter`."""
        return isinstance(topic_filter, str) and self._find(topic_filter) is not None

    def add(self, topic_filter: str, value: V) -> bool:
        """Register `value` under `topic_filter`; True if the pair is new.

        Raises `TopicError` for an invalid filter.
        """
        validate_topic_filter(topic_filter)
        if is_wildcard(topic_filter):
            node = self._root
            for level in topic_filter.split(SEPARATOR):
                child = node.children.get(level)
                if child is None:
                    child = node.children[level] = _Node()
                node = child
            node.topic_filter = topic_filter
        else:
            found = self._exact.get(topic_filter)
            if found is None:
                found = self._exact[topic_filter] = _Node(topic_filter)
            node = found
        if value in node.values:
            return False
        node.values.add(value)
        node.pairs = None
        self._size += 1
        self._cache.clear()
        return True

    def remove(self, topic_filter: str, value: V) -> bool:
        """Unregister `value` from `topic_filter`; True if it was there. Empty nodes are pruned."""
        if not is_wildcard(topic_filter):
            node = self._exact.get(topic_filter)
            if node is None or value not in node.values:
                return False
            node.values.remove(value)
            node.pairs = None
            if not node.values:
                del self._exact[topic_filter]
        else:
            path: list[tuple[_Node[V], str]] = []
            node = self._root
            for level in topic_filter.split(SEPARATOR):
                child = node.children.get(level)
                if child is None:
                    return False
                path.append((node, level))
                node = child
            if value not in node.values:
                return False
            node.values.remove(value)
            node.pairs = None
            # Prune, from the leaf up, every node left with neither values nor children.
            for parent, level in reversed(path):
                child = parent.children[level]
                if child.values or child.children:
                    break
                del parent.children[level]
        self._size -= 1
        self._cache.clear()
        return True

    def values(self, topic_filter: str) -> frozenset[V]:
        """The values registered under exactly this filter (not the filters it would match)."""
        node = self._find(topic_filter)
        return frozenset(node.values) if node is not None else frozenset()

    def filters(self) -> Iterator[str]:
        """Every filter with at least one value: exact filters first, then wildcard filters."""
        yield from list(self._exact)
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.values:
                yield node.topic_filter
            stack.extend(node.children.values())

    def items(self) -> Iterator[tuple[str, V]]:
        """Every (filter, value) pair."""
        for topic_filter in list(self.filters()):
            for value in self.values(topic_filter):
                yield topic_filter, value

    def clear(self) -> None:
        self._exact.clear()
        self._root = _Node()
        self._size = 0
        self._cache.clear()

    def match(self, topic_name: str) -> list[tuple[str, V]]:
        """Every (filter, value) pair whose filter matches the topic name.

        The topic name is assumed valid (the caller validated it on publish). Results are
        cached per topic name until the next add or remove; the returned list is the caller's.
        """
        cache = self._cache
        cached = cache.get(topic_name)
        if cached is None:
            cached = self._match(topic_name)
            if self._cache_size > 0:
                if len(cache) >= self._cache_size:
                    # Evict the oldest entry (dicts keep insertion order).
                    del cache[next(iter(cache))]
                cache[topic_name] = cached
        return list(cached)

    def _find(self, topic_filter: str) -> _Node[V] | None:
        """The node of exactly this filter, if it holds values."""
        if not is_wildcard(topic_filter):
            return self._exact.get(topic_filter)
        node: _Node[V] | None = self._root
        for level in topic_filter.split(SEPARATOR):
            node = node.children.get(level) if node is not None else None
        return node if node is not None and node.values else None

    def _match(self, topic_name: str) -> tuple[tuple[str, V], ...]:
        found: list[tuple[str, V]] = []
        exact = self._exact.get(topic_name)
        if exact is not None:
            found.extend(exact.pairs or exact.matched())
        root = self._root
        if not root.children:
            return tuple(found)
        levels = topic_name.split(SEPARATOR)
        depth = len(levels)
        stack: list[tuple[_Node[V], int]]
        if topic_name[:1] != "$":
            stack = [(root, 0)]
        else:
            # MQTT-4.7.2-1: a first-level wildcard does not match a `$` topic name.
            child = root.children.get(levels[0])
            if child is None:
                return tuple(found)
            stack = [(child, 1)]
        pop, push = stack.pop, stack.append
        while stack:
            node, index = pop()
            if index == depth and node.values:
                found.extend(node.pairs or node.matched())
            children = node.children
            if not children:
                continue
            rest = children.get(MULTI_LEVEL)
            if rest is not None:
                # `#` matches the parent level and every level below it (`a/#` matches `a`).
                found.extend(rest.pairs or rest.matched())
            if index < depth:
                level = levels[index]
                if level != SINGLE_LEVEL and level != MULTI_LEVEL:
                    child = children.get(level)
                    if child is not None:
                        push((child, index + 1))
                child = children.get(SINGLE_LEVEL)
                if child is not None:
                    push((child, index + 1))
        return tuple(found)
