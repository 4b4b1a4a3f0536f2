"""The key a shard log indexes a message record by, and which keys a subscription's filters
can match: what lets a durable subscription's replay read only the records of the topics it
subscribed to (the journal's key index, `storage/journal/keyindex.py`).

A record's key is its topic cut after `INDEX_LEVELS` levels: the topic itself when it has at
most that many levels, else its first `INDEX_LEVELS` levels and a trailing `/` (a *prefix
key*: "and deeper levels"). Cutting keeps the number of keys of a segment small when topics
carry ids in their deeper levels (`devices/<id>/...` stays one key per device, `a/b/c/<id>`
one key), and a filter is matched against a key as against every topic the key stands for, so
the index never hides a record a filter matches; the replay still checks each record's topic
against the filters (a key may stand for topics the filters do not match). A record that is
not a readable message record gets `UNREADABLE_KEY`, which every subscription reads, so that
the replay reports it as it does today.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from .records import READABLE_VERSIONS

INDEX_LEVELS: Final = 3
"""Topic levels a record's key keeps."""
UNREADABLE_KEY: Final = b"\xff"
"""The key of a record that is not a readable message record (not UTF-8: never a topic's)."""

_TOPIC_AT: Final = 16
"""Where a record's topic starts: after the fixed head (version, flags, qos, retain, i64 time)
and the topic's u32 length (see `core/records.py`)."""
_SLASH: Final = 0x2F


def record_index_key(data: bytes | memoryview) -> bytes:
    """The key of the message record `data` (see the module docstring). Never raises."""
    if len(data) < _TOPIC_AT or data[0] not in READABLE_VERSIONS:
        return UNREADABLE_KEY
    length = data[12] | (data[13] << 8) | (data[14] << 16) | (data[15] << 24)
    end = _TOPIC_AT + length
    if end > len(data):
        return UNREADABLE_KEY
    topic = bytes(data[_TOPIC_AT:end])
    cut = -1
    for _ in range(INDEX_LEVELS):
        cut = topic.find(b"/", cut + 1)
        if cut < 0:
            return topic
    return topic[: cut + 1]


def key_may_match(topic_filter: str, key: bytes) -> bool:
    """Whether `topic_filter` matches a topic the index key `key` stands for."""
    if key == UNREADABLE_KEY:
        return True
    try:
        text = key.decode("utf-8")
    except UnicodeDecodeError:
        return True  # the replay reports the record
    levels = text.split("/")
    prefix = len(levels) > INDEX_LEVELS  # a prefix key: its last level is the empty marker
    if prefix:
        levels.pop()
    if text[:1] == "$" and topic_filter[:1] in ("+", "#"):
        return False
    rule = topic_filter.split("/")
    for index, level in enumerate(rule):
        if level == "#":
            return True
        if index >= len(levels):
            # A prefix key stands for topics with more levels than it shows.
            return prefix
        if level != "+" and level != levels[index]:
            return False
    return len(rule) == len(levels) and not prefix


def any_may_match(filters: Iterable[str], key: bytes) -> bool:
    return any(key_may_match(topic_filter, key) for topic_filter in filters)
