"""The retained-message store: the last retained message of each topic name, found by filter.

Messages are kept in a tree keyed by topic levels, so that `match("a/+/c")` walks only the
branches the filter can reach instead of scanning every retained topic. A filter starting with
a wildcard does not match topic names starting with `$` (MQTT-4.7.2-1).

It holds messages of any type and does no I/O: persisting retained messages (the metadata
store) and the empty-payload-clears rule belong to the caller.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from .topics import (
    MULTI_LEVEL,
    SEPARATOR,
    SINGLE_LEVEL,
    validate_topic_filter,
    validate_topic_name,
)

__all__ = ["RetainedStore"]

M = TypeVar("M")


class _Level(Generic[M]):
    """One topic level; `holds` tells whether a message is retained for the topic ending here."""

    __slots__ = ("children", "holds", "message")

    def __init__(self) -> None:
        self.children: dict[str, _Level[M]] = {}
        self.holds = False
        self.message: M | None = None


class RetainedStore(Generic[M]):
    """At most one retained message per topic name, matched by topic filter."""

    __slots__ = ("_by_topic", "_root")

    def __init__(self) -> None:
        self._by_topic: dict[str, M] = {}
        self._root: _Level[M] = _Level()

    def __len__(self) -> int:
        return len(self._by_topic)

    def __contains__(self, topic: object) -> bool:
        return topic in self._by_topic

    def set(self, topic: str, message: M) -> None:
        """Retain `message` for `topic`, replacing any earlier one. Raises TopicError for an
        invalid topic name."""
        validate_topic_name(topic)
        node = self._root
        for level in topic.split(SEPARATOR):
            child = node.children.get(level)
            if child is None:
                child = node.children[level] = _Level()
            node = child
        node.holds = True
        node.message = message
        self._by_topic[topic] = message

    def delete(self, topic: str) -> bool:
        """Forget the retained message of `topic`; True if there was one."""
        if self._by_topic.pop(topic, _MISSING) is _MISSING:
            return False
        path: list[tuple[_Level[M], str]] = []
        node = self._root
        for level in topic.split(SEPARATOR):
            path.append((node, level))
            node = node.children[level]
        node.holds = False
        node.message = None
        for parent, level in reversed(path):
            child = parent.children[level]
            if child.holds or child.children:
                break
            del parent.children[level]
        return True

    def get(self, topic: str) -> M | None:
        return self._by_topic.get(topic)

    def items(self) -> Iterator[tuple[str, M]]:
        """Every (topic, message) pair, in the order the topics were first retained."""
        return iter(list(self._by_topic.items()))

    def clear(self) -> None:
        self._by_topic.clear()
        self._root = _Level()

    def match(self, topic_filter: str) -> list[M]:
        """Every retained message whose topic name matches `topic_filter`.

        Raises TopicError for an invalid filter.
        """
        validate_topic_filter(topic_filter)
        if SINGLE_LEVEL not in topic_filter and MULTI_LEVEL not in topic_filter:
            if topic_filter in self._by_topic:
                return [self._by_topic[topic_filter]]
            return []
        levels = topic_filter.split(SEPARATOR)
        depth = len(levels)
        found: list[M] = []
        stack: list[tuple[_Level[M], int]] = [(self._root, 0)]
        while stack:
            node, index = stack.pop()
            if index == depth:
                if node.holds:
                    found.append(node.message)  # type: ignore[arg-type]
                continue
            level = levels[index]
            # MQTT-4.7.2-1: a first-level wildcard does not reach topic names starting with `$`.
            skip_dollar = index == 0
            if level == MULTI_LEVEL:
                # `#` matches the parent level too (`a/#` matches `a`); the root holds nothing.
                if node.holds:
                    found.append(node.message)  # type: ignore[arg-type]
                self._collect(node, skip_dollar, found)
            elif level == SINGLE_LEVEL:
                for key, child in node.children.items():
                    if not (skip_dollar and key[:1] == "$"):
                        stack.append((child, index + 1))
            else:
                exact = node.children.get(level)
                if exact is not None:
                    stack.append((exact, index + 1))
        return found

    @staticmethod
    def _collect(node: _Level[M], skip_dollar: bool, found: list[M]) -> None:
        """Append every message retained strictly below `node`."""
        stack = [
            child
            for key, child in node.children.items()
            if not (skip_dollar and key[:1] == "$")
        ]
        while stack:
            current = stack.pop()
            if current.holds:
                found.append(current.message)  # type: ignore[arg-type]
            stack.extend(current.children.values())


_MISSING = object()
