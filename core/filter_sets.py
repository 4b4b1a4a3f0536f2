"""Which of one subscription's topic filters match a topic, with no state per topic.

A durable subscription replaying a shard asks, for every record, which of its filters match
the record's topic. It used to remember the answer per topic (a dict per subscription, up to
10,000 topics each, by name and by encoded name): with topics that rarely repeat (a device id
or a sequence number in the topic) that was a few objects per record per subscription, most of
a loaded broker's small objects, and so most of the memory the broker kept after the load (the
allocator gives an arena back only once every object in it is gone).

`FilterSet` compiles the filters into regular expressions over the topic's UTF-8 bytes
instead, once per change of the filters: a record's topic is tested where it lies in a read
buffer (no slice, no decode), a record no filter matches costs one match call, and the result
tuples are shared. `filter_matches` (`topics.py`) stays the reference; the two agree on every
valid filter and topic name (`tests/unit/test_filter_sets.py`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

from .topics import MULTI_LEVEL, SEPARATOR, SINGLE_LEVEL

NO_FILTERS: Final[tuple[str, ...]] = ()
_MAX_SHARED_RESULTS: Final = 256
"""Distinct combinations of matching filters kept to hand out the same tuple each time."""


def filter_pattern(topic_filter: str) -> bytes:
    """A regular expression (bytes, for `re.fullmatch` with `re.DOTALL`) matching exactly the
    UTF-8 encoded topic names `topic_filter` matches. `/` is one byte in UTF-8 and never part of
    a longer character, so levels can be told apart in the encoded name."""
    parts: list[bytes] = []
    multi_level = False
    for level in topic_filter.split(SEPARATOR):
        if level == MULTI_LEVEL:
            multi_level = True
            break
        parts.append(b"[^/]*" if level == SINGLE_LEVEL else re.escape(level.encode("utf-8")))
    body = b"/".join(parts)
    if multi_level:
        # `a/#` matches `a` itself and everything below it; `#` alone matches every name.
        body = body + b"(?:/.*)?" if parts else b".*"
    if topic_filter[:1] in (SINGLE_LEVEL, MULTI_LEVEL):
        body = rb"(?!\$)" + body  # MQTT-4.7.2-1: no wildcard first level for `$` topics
    return body


class FilterSet:
    """The filters of one subscription, in their order, compiled for matching encoded topic
    names: `matching(buffer, start, end)` is the tuple of those matching the name at
    `buffer[start:end]` (the empty tuple when none does)."""

    __slots__ = ("filters", "_any", "_each", "_shared")

    def __init__(self, filters: Iterable[str]) -> None:
        self.filters: tuple[str, ...] = tuple(filters)
        patterns = [filter_pattern(topic_filter) for topic_filter in self.filters]
        self._any = re.compile(b"|".join(b"(?:" + p + b")" for p in patterns), re.DOTALL).fullmatch \
            if patterns else None
        self._each = [re.compile(p, re.DOTALL).fullmatch for p in patterns] if len(patterns) > 1 else []
        self._shared: dict[tuple[str, ...], tuple[str, ...]] = {}

    def matching(self, buffer: bytes | bytearray | memoryview, start: int = 0, end: int | None = None) -> tuple[str, ...]:
        any_match = self._any
        if end is None:
            end = len(buffer)
        if any_match is None or any_match(buffer, start, end) is None:
            return NO_FILTERS
        if not self._each:
            return self.filters
        found = tuple(f for f, match in zip(self.filters, self._each, strict=True) if match(buffer, start, end))
        shared = self._shared.get(found)
        if shared is None:
            if len(self._shared) < _MAX_SHARED_RESULTS:
                self._shared[found] = found
            return found
        return shared

    def matching_name(self, topic: str) -> tuple[str, ...]:
        """`matching` for a topic name given as text."""
        return self.matching(topic.encode("utf-8"))
