"""`FilterSet` (core/filter_sets.py) against the reference matcher `filter_matches`."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from shardgate.core.filter_sets import FilterSet, filter_pattern
from shardgate.core.topics import filter_matches

LEVEL = st.sampled_from(["a", "b", "", "$SYS", "$x", "ü", "ü/", ".*", "a+b", "(", "\n", "😀"])
FILTER_LEVEL = st.one_of(LEVEL, st.just("+"))


@st.composite
def topic_names(draw: st.DrawFn) -> str:
    return "/".join(draw(st.lists(LEVEL, min_size=1, max_size=4))).strip("/") or "a"


@st.composite
def topic_filters(draw: st.DrawFn) -> str:
    levels = draw(st.lists(FILTER_LEVEL, min_size=0, max_size=4))
    if draw(st.booleans()) or not levels:
        levels.append("#")
    return "/".join(levels)


@settings(max_examples=500, deadline=None)
@given(st.lists(topic_filters(), min_size=1, max_size=4, unique=True), topic_names())
def test_agrees_with_the_reference_matcher(filters: list[str], topic: str) -> None:
    expected = tuple(f for f in filters if filter_matches(f, topic))
    filter_set = FilterSet(filters)
    assert filter_set.matching_name(topic) == expected
    encoded = topic.encode()
    framed = b"\x00\x01" + encoded + b"/tail"
    assert filter_set.matching(memoryview(framed), 2, 2 + len(encoded)) == expected


def test_wildcards_levels_and_dollar_topics() -> None:
    cases = {
        ("#", "a"): True, ("#", "$SYS/x"): False, ("+/x", "$SYS/x"): False,
        ("$SYS/#", "$SYS"): True, ("$SYS/#", "$SYS/a/b"): True,
        ("a/#", "a"): True, ("a/#", "a/"): True, ("a/#", "ab"): False,
        ("+/+", "/finance"): True, ("+", "a/b"): False, ("a/+/c", "a//c"): True,
        ("a.b", "axb"): False, ("sport/tennis/+", "sport/tennis/player1/ranking"): False,
    }
    for (topic_filter, topic), expected in cases.items():
        assert FilterSet([topic_filter]).matching_name(topic) == ((topic_filter,) if expected else ()), (
            topic_filter, topic, filter_pattern(topic_filter))


def test_results_are_shared_and_in_filter_order() -> None:
    filter_set = FilterSet(["a/#", "x/y", "+/b"])
    first = filter_set.matching_name("a/b")
    assert first == ("a/#", "+/b")
    assert filter_set.matching_name("a/b") is first  # no new tuple per record
    single = FilterSet(["a/#"])
    assert single.matching_name("a/c") is single.filters
    assert FilterSet([]).matching_name("a") == ()
