"""Exchange + routing key ⇄ core topic mapping and binding ⇄ filter conversion."""

from __future__ import annotations

import pytest
from shardgate.core.message import Message
from shardgate.core.topics import filter_matches
from shardgate.protocols.amqp.routing import (
    binding_for,
    exchange_and_key,
    headers_check,
    publish_topic,
    queue_topic,
    topic_matches,
)


def test_amq_topic_swaps_dots_and_slashes():
    assert publish_topic("amq.topic", "topic", "a.b.c") == "a/b/c"
    assert publish_topic("amq.topic", "topic", "a/x.b") == "a.x/b"
    assert exchange_and_key("a.x/b") == ("amq.topic", "a/x.b")


def test_default_exchange_round_trip():
    topic = queue_topic("orders/eu")
    assert topic == "$amqp/amq.default/orders%2Feu"
    assert publish_topic("", "direct", "orders/eu") == topic
    assert exchange_and_key(topic) == ("", "orders/eu")


@pytest.mark.parametrize("key", ["plain", "a.b", "with/slash", "plus+hash#", "50%", ""])
def test_direct_keys_are_one_escaped_level(key):
    topic = publish_topic("d", "direct", key)
    assert topic.count("/") == 2
    assert exchange_and_key(topic) == ("d", key)


def test_topic_exchange_binding_filters_match_like_amqp():
    cases = [
        ("a.*", "a.b", True), ("a.*", "a.b.c", False), ("a.#", "a", True),
        ("a.#", "a.b.c", True), ("#", "x.y", True), ("*.b", "a.b", True),
    ]
    for pattern, key, expected in cases:
        for exchange in ("amq.topic", "t"):
            binding = binding_for(exchange, "topic", pattern, None)
            topic = publish_topic(exchange, "topic", key)
            assert filter_matches(binding.topic_filter, topic) == expected, (exchange, pattern, key)
            assert topic_matches(pattern.split("."), key.split(".")) == expected


def test_hash_before_the_end_gets_an_exact_check():
    binding = binding_for("amq.topic", "topic", "#.end", None)
    assert binding.topic_filter == "#" and binding.check is not None
    assert binding.accepts(Message("x/y/end", b""))
    assert not binding.accepts(Message("x/end/y", b""))


def test_fanout_binding_covers_every_key():
    binding = binding_for("f", "fanout", "ignored", None)
    assert filter_matches(binding.topic_filter, publish_topic("f", "fanout", "any.key"))


def test_headers_match_all_and_any():
    all_ = headers_check({"x-match": "all", "a": "1", "b": 2})
    any_ = headers_check({"x-match": "any", "a": "1", "b": 2})
    both = Message("t", b"", headers=[("a", "1"), ("b", "2")])
    one = Message("t", b"", headers=[("a", "1")])
    assert all_(both) and not all_(one)
    assert any_(both) and any_(one) and not any_(Message("t", b""))


@pytest.mark.parametrize("name", ["#x", "dave-x/#", "a+b", "50%", "nul\x00", "bad name!", "%23"])
@pytest.mark.parametrize("kind", ["direct", "fanout", "topic", "headers"])
def test_any_exchange_name_is_one_escaped_level(name: str, kind: str) -> None:
    from shardgate.core.topics import validate_topic_filter, validate_topic_name

    topic = publish_topic(name, kind, "k.+.#")
    validate_topic_name(topic)
    assert topic.split("/")[1] not in ("+", "#") and topic.count("/") >= 2
    assert exchange_and_key(topic) == (name, "k.+.#")
    binding = binding_for(name, kind, "k.*.#" if kind == "topic" else "k.+.#", None)
    validate_topic_filter(binding.topic_filter)
    assert filter_matches(binding.topic_filter, topic)
    # a name never widens a grant on another exchange's subtree
    assert not filter_matches("$amqp/dave-x/#", topic)


@pytest.mark.parametrize("name", ["bad name!", "q/+#", "nul\x00", "%2F"])
def test_any_queue_name_round_trips(name: str) -> None:
    from shardgate.core.topics import validate_topic_name

    topic = queue_topic(name)
    validate_topic_name(topic)
    assert exchange_and_key(topic) == ("", name)


def test_amq_topic_binding_words_escape_wildcards_as_published_keys_do() -> None:
    binding = binding_for("amq.topic", "topic", "a+b.*.c#", None)
    assert binding.topic_filter == "a%2Bb/+/c%23"
    assert filter_matches(binding.topic_filter, publish_topic("amq.topic", "topic", "a+b.x.c#"))
