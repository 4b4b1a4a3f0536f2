"""Placement rules: keep what is placed, give homeless shards to the least-loaded node,
balance by moving non-reliable shards only, bump an epoch on every move."""

from __future__ import annotations

from collections import Counter

from shardgate.cluster.placement import Placed, ShardSpec, place


def specs(stream: str, count: int, reliable: bool = False) -> list[ShardSpec]:
    return [ShardSpec(stream, index, reliable) for index in range(count)]


def counts(result: dict[tuple[str, int], Placed]) -> Counter[str]:
    return Counter(placed.node_id for placed in result.values())


def test_new_shards_are_spread_evenly_with_epoch_one() -> None:
    result = place(specs("s", 10), {}, ["a", "b", "c"])
    assert sorted(counts(result).values()) == [3, 3, 4]
    assert {placed.epoch for placed in result.values()} == {1}


def test_a_stable_cluster_moves_nothing() -> None:
    first = place(specs("s", 9), {}, ["a", "b", "c"])
    assert place(specs("s", 9), first, ["a", "b", "c"]) == first


def test_a_joining_node_takes_a_fair_share_and_moved_shards_get_a_new_epoch() -> None:
    first = place(specs("s", 8), {}, ["a"])
    second = place(specs("s", 8), first, ["a", "b"])
    assert counts(second) == {"a": 4, "b": 4}
    for placed in second.values():
        assert placed.epoch == (2 if placed.node_id == "b" else 1)


def test_a_dead_nodes_non_reliable_shards_move_and_reliable_ones_stay() -> None:
    shards = specs("fast", 4) + specs("safe", 4, reliable=True)
    first = place(shards, {}, ["a", "b"])
    after = place(shards, first, ["a"])
    for (stream, index), placed in after.items():
        if stream == "fast":
            assert placed.node_id == "a"
        else:
            assert placed == first[(stream, index)]  # unavailable until b returns


def test_reliable_shards_are_never_moved_to_balance() -> None:
    shards = specs("safe", 6, reliable=True)
    first = place(shards, {}, ["a"])
    assert place(shards, first, ["a", "b", "c"]) == first
    # but new reliable shards go to the emptiest node
    more = shards + [ShardSpec("other", 0, True)]
    assert place(more, first, ["a", "b"])[("other", 0)].node_id == "b"


def test_load_breaks_ties_between_nodes_with_as_many_shards() -> None:
    result = place(specs("s", 1), {}, ["a", "b"], load={"a": 100.0, "b": 1.0})
    assert result[("s", 0)].node_id == "b"


def test_no_live_node_leaves_non_reliable_shards_unassigned() -> None:
    first = place(specs("s", 2) + specs("r", 1, True), {}, ["a"])
    assert set(place(specs("s", 2) + specs("r", 1, True), first, [])) == {("r", 0)}


def test_a_deleted_stream_is_dropped() -> None:
    first = place(specs("s", 2) + specs("gone", 2), {}, ["a"])
    assert set(place(specs("s", 2), first, ["a"])) == {("s", 0), ("s", 1)}


def test_balance_with_immovable_shards_on_the_fullest_node() -> None:
    shards = specs("safe", 5, reliable=True) + specs("fast", 5)
    first = place(shards, {}, ["a"])
    result = place(shards, first, ["a", "b"])
    assert counts(result) == {"a": 5, "b": 5}
    assert all(result[("safe", i)].node_id == "a" for i in range(5))
