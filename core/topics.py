"""Topic names and topic filters: validation, shared-subscription filters and the reference matcher.

Topic names are `/`-separated levels (MQTT style); a topic filter may use `+` (exactly one level)
and `#` (this level and every level below it, as the whole last level). The rules follow
MQTT 5.0 section 4.7 (Topic Names and Topic Filters) and 4.8.2 (Shared Subscriptions).

This module knows nothing about protocols, subscriptions or storage: it only judges strings.
`filter_matches` is the one-off reference matcher; routing many filters at once is the job of
`shardgate.core.trie.TopicTrie`.
"""

from __future__ import annotations

from typing import NamedTuple

from .errors import CoreError

__all__ = [
    "MAX_TOPIC_BYTES",
    "SHARE_PREFIX",
    "SharedFilter",
    "TopicError",
    "filter_covers",
    "filter_matches",
    "filters_overlap",
    "is_wildcard",
    "parse_shared_filter",
    "validate_topic_filter",
    "validate_topic_name",
]

# MQTT-1.5.4: a UTF-8 encoded string is at most 65535 bytes long.
MAX_TOPIC_BYTES = 65535
# MQTT 4.8.2: a shared subscription filter is `$share/{ShareName}/{filter}`.
SHARE_PREFIX = "$share/"

SEPARATOR = "/"
SINGLE_LEVEL = "+"
MULTI_LEVEL = "#"


class TopicError(CoreError, ValueError):
    """A topic name or topic filter breaks the rules of MQTT section 4.7 / 4.8.2."""


class SharedFilter(NamedTuple):
    """A parsed `$share/{group}/{topic_filter}` subscription filter."""

    group: str
    topic_filter: str


def _check_string(text: str, kind: str) -> None:
    """Rules shared by names and filters: non-empty (MQTT-4.7.3-1), no U+0000 (MQTT-1.5.4-2),
    no surrogates (MQTT-1.5.4-1), at most 65535 UTF-8 bytes."""
    if not text:
        raise TopicError(f"{kind} must not be empty")
    if "\x00" in text:
        raise TopicError(f"{kind} must not contain U+0000")
    # A code point takes at most 4 UTF-8 bytes: short strings need no encoding to check size.
    if len(text) * 4 > MAX_TOPIC_BYTES or not text.isascii():
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError:
            raise TopicError(f"{kind} must not contain surrogate code points") from None
        if size > MAX_TOPIC_BYTES:
            raise TopicError(f"{kind} is {size} UTF-8 bytes, more than {MAX_TOPIC_BYTES}")


def validate_topic_name(name: str) -> None:
    """Raise TopicError unless `name` is a valid topic name (one a message is published to).

    A topic name is non-empty (MQTT-4.7.3-1), holds no wildcard (MQTT-4.7.1-1 / 3.3.2-2), no
    U+0000 (MQTT-1.5.4-2) and is at most 65535 UTF-8 bytes.
    """
    _check_string(name, "topic name")
    if SINGLE_LEVEL in name or MULTI_LEVEL in name:
        raise TopicError(f"topic name {name!r} must not contain a wildcard")


def validate_topic_filter(topic_filter: str) -> None:
    """Raise TopicError unless `topic_filter` is a valid topic filter.

    `#` must be the whole last level (MQTT-4.7.1-2), `+` must be a whole level (MQTT-4.7.1-3);
    the filter is non-empty (MQTT-4.7.3-1), holds no U+0000 and is at most 65535 UTF-8 bytes.
    A `$share/...` filter is not special here: use `parse_shared_filter` first.
    """
    _check_string(topic_filter, "topic filter")
    if SINGLE_LEVEL not in topic_filter and MULTI_LEVEL not in topic_filter:
        return
    levels = topic_filter.split(SEPARATOR)
    last = len(levels) - 1
    for index, level in enumerate(levels):
        if level == SINGLE_LEVEL:
            continue
        if level == MULTI_LEVEL:
            if index != last:
                raise TopicError(f"topic filter {topic_filter!r}: '#' must be the last level")
            continue
        if SINGLE_LEVEL in level or MULTI_LEVEL in level:
            raise TopicError(
                f"topic filter {topic_filter!r}: a wildcard must occupy a whole level"
            )


def parse_shared_filter(topic_filter: str) -> SharedFilter | None:
    """Split a shared subscription filter `$share/{group}/{filter}`.

    Returns None when `topic_filter` does not start with `$share/` (an ordinary filter).
    Raises TopicError when the share name is empty or holds `/`, `+` or `#` (MQTT-4.8.2-1,
    MQTT-4.8.2-2), or when the filter part is missing or invalid.
    """
    if not topic_filter.startswith(SHARE_PREFIX):
        return None
    _check_string(topic_filter, "shared filter")
    rest = topic_filter[len(SHARE_PREFIX) :]
    group, slash, inner = rest.partition(SEPARATOR)
    if not group:
        raise TopicError(f"shared filter {topic_filter!r}: the share name must not be empty")
    if SINGLE_LEVEL in group or MULTI_LEVEL in group:
        raise TopicError(f"shared filter {topic_filter!r}: the share name must not hold a wildcard")
    if not slash or not inner:
        raise TopicError(f"shared filter {topic_filter!r}: a topic filter must follow the share name")
    validate_topic_filter(inner)
    return SharedFilter(group, inner)


def is_wildcard(topic_filter: str) -> bool:
    """True when the filter holds `+` or `#` (so it can match more than one topic name)."""
    return SINGLE_LEVEL in topic_filter or MULTI_LEVEL in topic_filter


def filter_matches(topic_filter: str, topic_name: str) -> bool:
    """True when the (valid) `topic_filter` matches the (valid) `topic_name`.

    `+` matches exactly one level, `#` matches its parent level and every level below
    (`a/#` matches `a`), empty levels are real levels (`+/+` matches `/finance`), and a filter
    starting with a wildcard does not match a topic name starting with `$` (MQTT-4.7.2-1).
    Inputs are not validated; this is the reference matcher, not the routing hot path.
    """
    if topic_name[:1] == "$" and topic_filter[:1] in (SINGLE_LEVEL, MULTI_LEVEL):
        return False
    if not is_wildcard(topic_filter):
        return topic_filter == topic_name
    filter_levels = topic_filter.split(SEPARATOR)
    name_levels = topic_name.split(SEPARATOR)
    depth = len(name_levels)
    for index, level in enumerate(filter_levels):
        if level == MULTI_LEVEL:
            return True
        if index >= depth:
            return False
        if level != SINGLE_LEVEL and level != name_levels[index]:
            return False
    return len(filter_levels) == depth


def filter_covers(outer: str, inner: str) -> bool:
    """True when every topic name the filter `inner` can match is matched by `outer`
    (`a/#` covers `a/+/b`, `a/+` does not cover `a/#`)."""
    wanted = inner.split(SEPARATOR)
    rule = outer.split(SEPARATOR)
    if wanted[0][:1] == "$" and rule[0] in (SINGLE_LEVEL, MULTI_LEVEL):
        return False
    for index, level in enumerate(rule):
        if level == MULTI_LEVEL:
            return True
        if index >= len(wanted):
            return False
        asked = wanted[index]
        if asked == MULTI_LEVEL:
            return False
        if level == SINGLE_LEVEL:
            continue
        if level != asked:
            return False
    return len(rule) == len(wanted)


def filters_overlap(first: str, second: str) -> bool:
    """True when some topic name matches both filters."""
    a, b = first.split(SEPARATOR), second.split(SEPARATOR)
    # Wildcards never match a `$` first level: a `$` topic needs that same literal in both.
    if (a[0][:1] == "$" or b[0][:1] == "$") and a[0] != b[0]:
        return False
    for index in range(max(len(a), len(b))):
        x = a[index] if index < len(a) else None
        y = b[index] if index < len(b) else None
        if x == MULTI_LEVEL or y == MULTI_LEVEL:
            return True
        if x is None or y is None:
            return False
        if x != SINGLE_LEVEL and y != SINGLE_LEVEL and x != y:
            return False
    return True
