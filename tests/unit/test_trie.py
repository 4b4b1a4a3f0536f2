"""The subscription trie: matching many topic filters against topic names."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shardgate.core.topics import TopicError, filter_matches
from shardgate.core.trie import TopicTrie


def matched(trie: TopicTrie[str], topic: str) -> list[tuple[str, str]]:
    return sorted(trie.match(topic))


def test_empty_trie_matches_nothing() -> None:
    trie: TopicTrie[str] = TopicTrie()
    assert trie.match("a/b") == []
    assert len(trie) == 0
    assert list(trie.filters()) == []


def test_add_reports_new_pairs_and_len_counts_pairs() -> None:
    trie: TopicTrie[str] = TopicTrie()
    assert trie.add("a/b", "s1") is True
    assert trie.add("a/b", "s1") is False
    assert trie.add("a/b", "s2") is True
    assert trie.add("a/+", "s1") is True
    assert trie.add("a/+", "s1") is False
    assert len(trie) == 3
    assert sorted(trie.filters()) == ["a/+", "a/b"]
    assert "a/b" in trie and "a/+" in trie and "a/#" not in trie
    assert trie.values("a/b") == {"s1", "s2"}
    assert trie.values("x") == frozenset()
    assert sorted(trie.items()) == [("a/+", "s1"), ("a/b", "s1"), ("a/b", "s2")]


def test_add_refuses_invalid_filters() -> None:
    trie: TopicTrie[str] = TopicTrie()
    for bad in ("", "a/#/b", "a+", "sport/tennis#"):
        with pytest.raises(TopicError):
            trie.add(bad, "s")
    assert len(trie) == 0


def test_spec_examples() -> None:
    trie: TopicTrie[str] = TopicTrie()
    for topic_filter in (
        "sport/tennis/player1/#", "sport/tennis/+", "sport/+", "sport/#", "+/+", "+", "#",
        "/finance", "/+", "$SYS/#", "$SYS/monitor/+", "+/monitor/Clients",
    ):
        trie.add(topic_filter, "v")
    names = lambda topic: sorted(f for f, _ in trie.match(topic))  # noqa: E731
    assert names("sport/tennis/player1") == ["#", "sport/#", "sport/tennis/+", "sport/tennis/player1/#"]
    assert names("sport/tennis/player1/ranking") == ["#", "sport/#", "sport/tennis/player1/#"]
    assert names("sport/tennis/player1/score/wimbledon") == ["#", "sport/#", "sport/tennis/player1/#"]
    assert names("sport") == ["#", "+", "sport/#"]
    assert names("sport/") == ["#", "+/+", "sport/#", "sport/+"]
    assert names("/finance") == ["#", "+/+", "/+", "/finance"]
    assert names("$SYS/monitor/Clients") == ["$SYS/#", "$SYS/monitor/+"]
    assert names("$SYS") == ["$SYS/#"]
    assert names("$other") == []


def test_value_under_two_matching_filters_appears_once_per_filter() -> None:
    trie: TopicTrie[str] = TopicTrie()
    trie.add("a/+", "sub")
    trie.add("a/#", "sub")
    trie.add("a/b", "sub")
    assert matched(trie, "a/b") == [("a/#", "sub"), ("a/+", "sub"), ("a/b", "sub")]


def test_empty_levels_are_levels() -> None:
    trie: TopicTrie[str] = TopicTrie()
    for topic_filter in ("a//b", "a/+/b", "a/b", "+/+/+", "a/#", "a/+", "a/"):
        trie.add(topic_filter, "v")
    assert sorted(f for f, _ in trie.match("a//b")) == ["+/+/+", "a/#", "a/+/b", "a//b"]
    assert sorted(f for f, _ in trie.match("a/")) == ["a/", "a/#", "a/+"]
    assert sorted(f for f, _ in trie.match("a")) == ["a/#"]


def test_hash_matches_parent_level() -> None:
    trie: TopicTrie[str] = TopicTrie()
    trie.add("a/#", "x")
    trie.add("a/b/#", "y")
    assert matched(trie, "a") == [("a/#", "x")]
    assert matched(trie, "a/b") == [("a/#", "x"), ("a/b/#", "y")]
    assert matched(trie, "b") == []


def test_remove_and_prune() -> None:
    trie: TopicTrie[str] = TopicTrie()
    trie.add("a/+/c/#", "s1")
    trie.add("a/+/c/#", "s2")
    trie.add("a/b", "s1")
    assert trie.remove("a/+/c/#", "s3") is False
    assert trie.remove("a/+/x", "s1") is False
    assert trie.remove("a/c", "s1") is False
    assert trie.remove("a/+/c/#", "s1") is True
    assert trie.remove("a/+/c/#", "s1") is False
    assert matched(trie, "a/z/c") == [("a/+/c/#", "s2")]
    assert trie.remove("a/+/c/#", "s2") is True
    assert trie.remove("a/b", "s1") is True
    assert len(trie) == 0
    assert trie.match("a/z/c") == []
    assert list(trie.filters()) == []
    assert trie._root.children == {} and trie._exact == {}


def test_prune_keeps_nodes_still_in_use() -> None:
    trie: TopicTrie[str] = TopicTrie()
    trie.add("a/+", "s")
    trie.add("a/+/#", "s")
    trie.remove("a/+/#", "s")
    assert matched(trie, "a/b") == [("a/+", "s")]
    trie.add("a/+/#", "s")
    trie.remove("a/+", "s")
    assert matched(trie, "a/b") == [("a/+/#", "s")]
    assert matched(trie, "a/b/c") == [("a/+/#", "s")]


def test_cache_is_invalidated_by_add_and_remove() -> None:
    trie: TopicTrie[str] = TopicTrie()
    trie.add("a/+", "s1")
    assert matched(trie, "a/b") == [("a/+", "s1")]
    trie.add("a/b", "s2")
    assert matched(trie, "a/b") == [("a/+", "s1"), ("a/b", "s2")]
    trie.remove("a/+", "s1")
    assert matched(trie, "a/b") == [("a/b", "s2")]
    trie.clear()
    assert trie.match("a/b") == []


def test_cache_is_bounded_and_results_are_not_shared() -> None:
    trie: TopicTrie[str] = TopicTrie(cache_size=8)
    trie.add("#", "s")
    for index in range(100):
        assert trie.match(f"t/{index}") == [("#", "s")]
    assert len(trie._cache) <= 8
    result = trie.match("t/1")
    result.append(("bogus", "x"))
    assert trie.match("t/1") == [("#", "s")]


def test_share_filters_are_stored_literally() -> None:
    trie: TopicTrie[str] = TopicTrie()
    trie.add("$share/g/a/#", "s")
    assert trie.match("a/b") == []
    assert matched(trie, "$share/g/a/b") == [("$share/g/a/#", "s")]


# --- properties: the trie agrees with the reference matcher ---------------------------------

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
    filters=st.lists(st.tuples(topic_filters(), st.integers(0, 3)), max_size=30),
    removals=st.lists(st.integers(0, 29), max_size=10),
    topics=st.lists(topic_names, min_size=1, max_size=10),
)
def test_trie_match_agrees_with_filter_matches(
    filters: list[tuple[str, int]], removals: list[int], topics: list[str]
) -> None:
    trie: TopicTrie[int] = TopicTrie()
    pairs: set[tuple[str, int]] = set()
    for topic_filter, value in filters:
        assert trie.add(topic_filter, value) is ((topic_filter, value) not in pairs)
        pairs.add((topic_filter, value))
    for topic in topics:  # fill the cache before removing
        trie.match(topic)
    for index in removals:
        if index < len(filters):
            pair = filters[index]
            assert trie.remove(*pair) is (pair in pairs)
            pairs.discard(pair)
    assert len(trie) == len(pairs)
    assert sorted(trie.items()) == sorted(pairs)
    for topic in topics:
        expected = sorted(p for p in pairs if filter_matches(p[0], topic))
        assert sorted(trie.match(topic)) == expected


# --- scale --------------------------------------------------------------------------------------


def build_large_trie(count: int, seed: int = 7) -> tuple[TopicTrie[int], list[str]]:
    """`count` subscriptions over a device tree: mostly exact, some `+` and `#` filters."""
    rng = random.Random(seed)
    trie: TopicTrie[int] = TopicTrie()
    filters: list[str] = []
    for value in range(count):
        site, device = rng.randrange(100), rng.randrange(1000)
        kind = rng.random()
        if kind < 0.6:
            topic_filter = f"site{site}/dev{device}/temp"
        elif kind < 0.8:
            topic_filter = f"site{site}/+/temp"
        elif kind < 0.95:
            topic_filter = f"site{site}/dev{device}/#"
        else:
            topic_filter = f"+/dev{device}/+"
        trie.add(topic_filter, value)
        filters.append(topic_filter)
    return trie, filters


def test_hundred_thousand_subscriptions_match_correctly() -> None:
    trie, filters = build_large_trie(100_000)
    assert len(trie) == 100_000
    rng = random.Random(1)
    topics = [f"site{rng.randrange(100)}/dev{rng.randrange(1000)}/temp" for _ in range(20)]
    for topic in topics:
        expected = sorted((f, v) for v, f in enumerate(filters) if filter_matches(f, topic))
        assert sorted(trie.match(topic)) == expected
    # Removing everything leaves an empty, pruned trie.
    for value, topic_filter in enumerate(filters):
        assert trie.remove(topic_filter, value)
    assert len(trie) == 0 and trie._root.children == {} and trie._exact == {}


def build_fleet_trie(count: int, seed: int = 5) -> tuple[TopicTrie[int], list[str]]:
    """`count` subscriptions over 20k devices: mostly distinct filters, few matches per topic."""
    rng = random.Random(seed)
    trie: TopicTrie[int] = TopicTrie()
    for value in range(count):
        device, kind = rng.randrange(20_000), rng.random()
        if kind < 0.7:
            topic_filter = f"fleet/d{device}/telemetry/temp"
        elif kind < 0.85:
            topic_filter = f"fleet/d{device}/+/temp"
        elif kind < 0.95:
            topic_filter = f"fleet/d{device}/#"
        else:
            topic_filter = f"+/d{device}/telemetry/+"
        trie.add(topic_filter, value)
    topics = [f"fleet/d{rng.randrange(20_000)}/telemetry/temp" for _ in range(20_000)]
    return trie, topics


def measure(trie: TopicTrie[int], topics: list[str]) -> tuple[float, float, float]:
    """(uncached matches/s, cached matches/s, pairs per topic)."""
    trie._cache_size = 0  # measure the walk itself, not the cache
    for topic in topics:  # first matches build each node's pair tuples
        trie.match(topic)
    start = time.perf_counter()
    total = 0
    for topic in topics:
        total += len(trie.match(topic))
    cold = len(topics) / (time.perf_counter() - start)
    trie._cache_size = 4096
    hot_topics = topics[:1000] * 20
    for topic in hot_topics[:1000]:
        trie.match(topic)
    start = time.perf_counter()
    for topic in hot_topics:
        trie.match(topic)
    hot = len(hot_topics) / (time.perf_counter() - start)
    return cold, hot, total / len(topics)


def test_match_rate_with_hundred_thousand_subscriptions(capsys: pytest.CaptureFixture[str]) -> None:
    """Prints uncached and cached match rates for two shapes of 100k subscriptions (no timing
    assertion: the numbers are for the record)."""
    devices, _ = build_large_trie(100_000)
    rng = random.Random(2)
    device_topics = [
        f"site{rng.randrange(100)}/dev{rng.randrange(1000)}/temp" for _ in range(20_000)
    ]
    fleet, fleet_topics = build_fleet_trie(100_000)
    lines = []
    for name, trie, topics in (
        ("shared filters", devices, device_topics),
        ("distinct filters", fleet, fleet_topics),
    ):
        assert len(trie) == 100_000
        cold, hot, pairs = measure(trie, topics)
        assert pairs > 0
        lines.append(
            f"100k subscriptions, {name}: {cold:,.0f} matches/s uncached, "
            f"{hot:,.0f} matches/s cached, {pairs:.1f} pairs per topic"
        )
    with capsys.disabled():
        print("\n" + "\n".join(lines))
