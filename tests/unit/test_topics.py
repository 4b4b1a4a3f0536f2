"""Topic names, topic filters, shared filters and the reference matcher (MQTT 5.0 §4.7, §4.8.2)."""

from __future__ import annotations

import pytest
from shardgate.core.errors import CoreError
from shardgate.core.topics import (
    MAX_TOPIC_BYTES,
    SharedFilter,
    TopicError,
    filter_covers,
    filter_matches,
    filters_overlap,
    is_wildcard,
    parse_shared_filter,
    validate_topic_filter,
    validate_topic_name,
)


def test_topic_error_is_a_value_error_and_a_core_error() -> None:
    assert issubclass(TopicError, ValueError)
    assert issubclass(TopicError, CoreError)


@pytest.mark.parametrize(
    "name",
    ["a", "a/b/c", "/", "/finance", "a//b", "a/", "$SYS/broker/load", "sport/tennis/player1",
     "ünïcödé/トピック", " ", "a b/c"],
)
def test_valid_topic_names(name: str) -> None:
    validate_topic_name(name)


@pytest.mark.parametrize(
    "name", ["", "a/+", "+", "#", "a/#", "a+b", "a#", "a/\x00/b", "\x00"],
)
def test_invalid_topic_names(name: str) -> None:
    with pytest.raises(TopicError):
        validate_topic_name(name)


def test_topic_name_length_is_counted_in_utf8_bytes() -> None:
    validate_topic_name("a" * MAX_TOPIC_BYTES)
    with pytest.raises(TopicError):
        validate_topic_name("a" * (MAX_TOPIC_BYTES + 1))
    # 'é' is two bytes in UTF-8: fewer characters than the limit, more bytes.
    validate_topic_name("é" * (MAX_TOPIC_BYTES // 2))
    with pytest.raises(TopicError):
        validate_topic_name("é" * (MAX_TOPIC_BYTES // 2 + 1))


def test_topic_name_with_surrogate_is_refused() -> None:
    with pytest.raises(TopicError):
        validate_topic_name("a/\ud800")


@pytest.mark.parametrize(
    "topic_filter",
    ["#", "+", "+/+", "/+", "+/", "sport/#", "sport/tennis/#", "sport/+", "sport/+/player1",
     "+/tennis/#", "a//b", "$SYS/#", "$SYS/+/x", "a/+/+/#", "/", "a"],
)
def test_valid_topic_filters(topic_filter: str) -> None:
    validate_topic_filter(topic_filter)


@pytest.mark.parametrize(
    "topic_filter",
    ["", "sport/tennis#", "sport/tennis/#/ranking", "#/a", "sport+", "sport/+tennis", "a/b+/c",
     "##", "++", "a/#/", "a/\x00", "a#/b"],
)
def test_invalid_topic_filters(topic_filter: str) -> None:
    with pytest.raises(TopicError):
        validate_topic_filter(topic_filter)


def test_topic_filter_length_limit() -> None:
    validate_topic_filter("+/" + "a" * (MAX_TOPIC_BYTES - 2))
    with pytest.raises(TopicError):
        validate_topic_filter("+/" + "a" * (MAX_TOPIC_BYTES - 1))


def test_is_wildcard() -> None:
    assert is_wildcard("a/+") and is_wildcard("#") and is_wildcard("a/#")
    assert not is_wildcard("a/b") and not is_wildcard("$SYS/x")


def test_parse_shared_filter() -> None:
    assert parse_shared_filter("sport/#") is None
    assert parse_shared_filter("$SYS/#") is None
    assert parse_shared_filter("$share") is None
    parsed = parse_shared_filter("$share/consumer1/sport/tennis/+")
    assert parsed == SharedFilter("consumer1", "sport/tennis/+")
    assert parsed.group == "consumer1" and parsed.topic_filter == "sport/tennis/+"
    assert parse_shared_filter("$share/g/#") == SharedFilter("g", "#")
    assert parse_shared_filter("$share/g//finance") == SharedFilter("g", "/finance")


@pytest.mark.parametrize(
    "shared",
    ["$share/", "$share//a", "$share/g", "$share/g/", "$share/g+/a", "$share/#/a", "$share/+/a",
     "$share/g/a/#/b", "$share/g/a+", "$share/g\x00/a"],
)
def test_invalid_shared_filters(shared: str) -> None:
    with pytest.raises(TopicError):
        parse_shared_filter(shared)


@pytest.mark.parametrize(
    ("topic_filter", "topic", "expected"),
    [
        # MQTT 4.7.1.2: multi-level wildcard.
        ("sport/tennis/player1/#", "sport/tennis/player1", True),
        ("sport/tennis/player1/#", "sport/tennis/player1/ranking", True),
        ("sport/tennis/player1/#", "sport/tennis/player1/score/wimbledon", True),
        ("sport/tennis/player1/#", "sport/tennis/player2", False),
        ("sport/#", "sport", True),
        ("#", "sport/tennis", True),
        ("#", "/", True),
        # MQTT 4.7.1.3: single-level wildcard.
        ("sport/tennis/+", "sport/tennis/player1", True),
        ("sport/tennis/+", "sport/tennis/player2", True),
        ("sport/tennis/+", "sport/tennis/player1/ranking", False),
        ("sport/+", "sport", False),
        ("sport/+", "sport/", True),
        ("+", "sport", True),
        ("+", "/finance", False),
        ("+/+", "/finance", True),
        ("/+", "/finance", True),
        ("+/tennis/#", "sport/tennis/player1", True),
        ("+/tennis/#", "sport/tennis", True),
        ("+/tennis/#", "sport/golf", False),
        # Empty levels are levels.
        ("a//b", "a//b", True),
        ("a/+/b", "a//b", True),
        ("a/b", "a//b", False),
        ("a/#", "a//b", True),
        ("+/+/+", "a//b", True),
        ("a/+", "a/", True),
        ("a/", "a", False),
        # Exact filters.
        ("a/b", "a/b", True),
        ("a/b", "a/b/c", False),
        ("/finance", "/finance", True),
        ("/finance", "finance", False),
        # MQTT 4.7.2: `$` topics.
        ("#", "$SYS/broker", False),
        ("+/monitor/Clients", "$SYS/monitor/Clients", False),
        ("$SYS/#", "$SYS/monitor/Clients", True),
        ("$SYS/monitor/+", "$SYS/monitor/Clients", True),
        ("$SYS/#", "$SYS", True),
        ("+", "$", False),
        ("a/+", "a/$b", True),
        ("a/#", "a/$b", True),
    ],
)
def test_filter_matches(topic_filter: str, topic: str, expected: bool) -> None:
    validate_topic_filter(topic_filter)
    validate_topic_name(topic)
    assert filter_matches(topic_filter, topic) is expected


# ---------------------------------------------------------------------------- filter relations (ACL rules)
@pytest.mark.parametrize(("acl", "topic", "expected"), [
    ("a/b", "a/b", True),
    ("a/+", "a/b", True),
    ("a/+", "a/b/c", False),
    ("a/#", "a", True),
    ("a/#", "a/b/c", True),
    ("#", "a/b", True),
    ("#", "$SYS/x", False),
    ("+/x", "$SYS/x", False),
    ("$SYS/#", "$SYS/x", True),
    ("a/b", "a/c", False),
])
def test_acl_filter_matches_topic(acl: str, topic: str, expected: bool) -> None:
    assert filter_matches(acl, topic) is expected


@pytest.mark.parametrize(("acl", "wanted", "expected"), [
    ("a/#", "a/+/b", True),
    ("a/#", "a/#", True),
    ("a/+", "a/#", False),
    ("a/+", "a/+", True),
    ("a/b", "a/+", False),
    ("#", "#", True),
    ("+/+", "a/+", True),
])
def test_filter_covers(acl: str, wanted: str, expected: bool) -> None:
    assert filter_covers(acl, wanted) is expected


@pytest.mark.parametrize(("first", "second", "expected"), [
    ("secret/#", "#", True),
    ("secret/#", "+/x", True),
    ("secret/#", "public/#", False),
    ("a/+/c", "a/b/+", True),
    ("a/b", "a/b/c", False),
    ("a/#", "a", True),
    ("#", "$SYS/x", False),
    ("$SYS/#", "$SYS/+", True),
])
def test_filters_overlap(first: str, second: str, expected: bool) -> None:
    assert filters_overlap(first, second) is expected
    assert filters_overlap(second, first) is expected
