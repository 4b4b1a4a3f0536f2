"""Bridge filters and prefixes (`bridges.base.check_filters_under_prefix`): a filter names
topics of the side it is read from, that side's prefix included."""

from __future__ import annotations

import logging

import pytest

from shardgate.bridges.base import check_filters_under_prefix

LOG = logging.getLogger("test")


@pytest.mark.parametrize("topic_filter", ["edge1/commands/#", "edge1/#", "#", "+/commands/#"])
def test_filters_that_can_match_under_the_prefix_are_taken(topic_filter: str) -> None:
    check_filters_under_prefix("bridge", "b", "inbound", [topic_filter], "remote_prefix", "edge1/", LOG)


@pytest.mark.parametrize("topic_filter", ["commands/#", "edge2/#", "edge1", "+"])
def test_a_filter_that_matches_nothing_under_the_prefix_is_refused(topic_filter: str) -> None:
    with pytest.raises(ValueError, match="is not under remote_prefix 'edge1/'"):
        check_filters_under_prefix("bridge", "b", "inbound", [topic_filter], "remote_prefix",
                                   "edge1/", LOG)


def test_a_prefix_that_ends_inside_a_level() -> None:
    check_filters_under_prefix("bridge", "b", "out", ["site-1/#"], "local_prefix", "site-", LOG)
    with pytest.raises(ValueError):
        check_filters_under_prefix("bridge", "b", "out", ["plant/#"], "local_prefix", "site-", LOG)
