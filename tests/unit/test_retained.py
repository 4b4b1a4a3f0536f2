"""The retained-message store: one message per topic name, found by topic filter."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shardgate.core.retained import RetainedStore
from shardgate.core.topics import TopicError, filter_matches


def store_of(*topics: str) -> RetainedStore[str]:
    store: RetainedStore[str] = RetainedStore()
    for topic in topics:
        store.set(topic, f"m:{topic}")
    return store


def topics_matching(store: RetainedStore[str], topic_filter: str) -> list[str]:
    return sorted(message.removeprefix("m:") for message in store.match(topic_filter))


def test_set_get_replace_delete() -> None:
    store: RetainedStore[str] = RetainedStore()
    assert store.get("a/b") is None and len(store) == 0
    store.set("a/b", "one")
    store.set("a/b", "two")
    assert store.get("a/b") == "two" and len(store) == 1 and "a/b" in store
    assert store.match("a/b") == ["two"]
    assert store.delete("a/b") is True
    assert store.delete("a/b") is False
    assert store.delete("never/seen") is False
    assert store.get("a/b") is None and len(store) == 0 and store.match("a/#") == []


def test_set_refuses_invalid_topic_names() -> None:
    store: RetainedStore[str] = RetainedStore()
    for bad in ("", "a/+", "a/#", "a\x00"):
        with pytest.raises(TopicError):
            store.set(bad, "m")
    assert len(store) == 0


def test_match_refuses_invalid_filters() -> None:
    with pytest.raises(TopicError):
        store_of("a").match("a/#/b")


def test_items_lists_every_retained_message() -> None:
    store = store_of("b", "a/c", "a")
    assert sorted(store.items()) == [("a", "m:a"), ("a/c", "m:a/c"), ("b", "m:b")]


def test_spec_examples() -> None:
    store = store_of(
        "sport/tennis/player1", "sport/tennis/player1/ranking",
        "sport/tennis/player1/score/wimbledon", "sport/tennis/player2", "sport", "sport/",
        "/finance", "finance", "$SYS/monitor/Clients", "$SYS",
    )
    assert topics_matching(store, "sport/tennis/player1/#") == [
        "sport/tennis/player1", "sport/tennis/player1/ranking",
        "sport/tennis/player1/score/wimbledon",
    ]
    assert topics_matching(store, "sport/tennis/+") == ["sport/tennis/player1", "sport/tennis/player2"]
    assert topics_matching(store, "sport/+") == ["sport/"]
    assert topics_matching(store, "sport/#") == [
        "sport", "sport/", "sport/tennis/player1", "sport/tennis/player1/ranking",
        "sport/tennis/player1/score/wimbledon", "sport/tennis/player2",
    ]
    assert topics_matching(store, "+") == ["finance", "sport"]
    assert topics_matching(store, "+/+") == ["/finance", "sport/"]
    assert topics_matching(store, "/+") == ["/finance"]
    assert topics_matching(store, "/finance") == ["/finance"]
    # MQTT-4.7.2-1: wildcards at the first level never reach `$` topics.
    assert "$SYS/monitor/Clients" not in topics_matching(store, "#")
    assert "$SYS" not in topics_matching(store, "#")
    assert topics_matching(store, "+/monitor/Clients") == []
    assert topics_matching(store, "$SYS/#") == ["$SYS", "$SYS/monitor/Clients"]
    assert topics_matching(store, "$SYS/monitor/+") == ["$SYS/monitor/Clients"]


def test_empty_levels() -> None:
    store = store_of("a//b", "a/b", "a/", "a")
    assert topics_matching(store, "a/+/b") == ["a//b"]
    assert topics_matching(store, "a//b") == ["a//b"]
    assert topics_matching(store, "a/+") == ["a/", "a/b"]
    assert topics_matching(store, "a/#") == ["a", "a/", "a//b", "a/b"]
    assert topics_matching(store, "+/+/+") == ["a//b"]


def test_delete_prunes_levels_but_keeps_neighbours() -> None:
    store = store_of("a", "a/b/c", "a/b/d")
    assert store.delete("a/b/c")
    assert topics_matching(store, "a/#") == ["a", "a/b/d"]
    assert store.delete("a/b/d")
    assert topics_matching(store, "a/#") == ["a"]
    assert store._root.children["a"].children == {}
    assert store.delete("a")
    assert store._root.children == {}


def test_clear() -> None:
    store = store_of("a", "b/c")
    store.clear()
    assert len(store) == 0 and store.match("#") == [] and list(store.items()) == []


# --- properties: the store agrees with the reference matcher --------------------------------

LEVELS = ["a", "b", "", "$s"]
topic_names = st.lists(st.sampled_from(LEVELS), min_size=1, max_size=5).map("/".join).filter(bool)


@st.composite
def topic_filters(draw: st.DrawFn) -> str:
    levels = draw(st.lists(st.sampled_from([*LEVELS, "+"]), min_size=0, max_size=4))
    if draw(st.booleans()):
        levels.append("#")
    topic_filter = "/".join(levels)
    return topic_filter or draw(st.sampled_from(["#", "+", "a"]))


@settings(max_examples=300, deadline=None)
@given(
    topics=st.lists(topic_names, max_size=30),
    deletions=st.lists(topic_names, max_size=10),
    filters=st.lists(topic_filters(), min_size=1, max_size=10),
)
def test_match_agrees_with_filter_matches(
    topics: list[str], deletions: list[str], filters: list[str]
) -> None:
    store: RetainedStore[str] = RetainedStore()
    kept: set[str] = set()
    for topic in topics:
        store.set(topic, topic)
        kept.add(topic)
    for topic in deletions:
        assert store.delete(topic) is (topic in kept)
        kept.discard(topic)
    assert len(store) == len(kept)
    for topic_filter in filters:
        expected = sorted(t for t in kept if filter_matches(topic_filter, t))
        assert sorted(store.match(topic_filter)) == expected


def test_many_retained_messages() -> None:
    rng = random.Random(3)
    store: RetainedStore[str] = RetainedStore()
    topics = {f"site{rng.randrange(50)}/dev{rng.randrange(500)}/{rng.choice(['t', 'h'])}"
              for _ in range(20_000)}
    for topic in topics:
        store.set(topic, topic)
    for topic_filter in ("site7/+/t", "site7/#", "+/dev3/+", "#", "site1/dev1/t"):
        expected = sorted(t for t in topics if filter_matches(topic_filter, t))
        assert sorted(store.match(topic_filter)) == expected
