"""Placement rules: keep what is placed, give homeless shards to the least-loaded node,
balance by moving non-reliable shards only, bump an epoch on every move."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from shardgate.cluster.membership import ShardAssignment
from shardgate.cluster.placement import ShardPlacement, ShardSpec, place


def specs(stream: str, count: int, reliable: bool = False) -> list[ShardSpec]:
    return [ShardSpec(stream, index, reliable) for index in range(count)]


def counts(result: dict[tuple[str, int], ShardPlacement]) -> Counter[str]:
    return Counter(placed.leader for placed in result.values())


def test_new_shards_are_spread_evenly_with_epoch_one() -> None:
    result = place(specs("s", 10), {}, ["a", "b", "c"])
    assert sorted(counts(result).values()) == [3, 3, 4]
    assert {placed.leader_epoch for placed in result.values()} == {1}


def test_a_stable_cluster_moves_nothing() -> None:
    first = place(specs("s", 9), {}, ["a", "b", "c"])
    assert place(specs("s", 9), first, ["a", "b", "c"]) == first


def test_a_joining_node_takes_a_fair_share_and_moved_shards_get_a_new_epoch() -> None:
    first = place(specs("s", 8), {}, ["a"])
    second = place(specs("s", 8), first, ["a", "b"])
    assert counts(second) == {"a": 4, "b": 4}
    for placed in second.values():
        assert placed.leader_epoch == (2 if placed.leader == "b" else 1)


def test_a_dead_nodes_non_reliable_shards_move_and_reliable_ones_stay() -> None:
    shards = specs("fast", 4) + specs("safe", 4, reliable=True)
    first = place(shards, {}, ["a", "b"])
    after = place(shards, first, ["a"])
    for (stream, index), placed in after.items():
        if stream == "fast":
            assert placed.leader == "a"
        else:
            assert placed == first[(stream, index)]  # unavailable until b returns


def test_reliable_shards_are_never_moved_to_balance() -> None:
    shards = specs("safe", 6, reliable=True)
    first = place(shards, {}, ["a"])
    assert place(shards, first, ["a", "b", "c"]) == first
    # but new reliable shards go to the emptiest node
    more = shards + [ShardSpec("other", 0, True)]
    assert place(more, first, ["a", "b"])[("other", 0)].leader == "b"


def test_load_breaks_ties_between_nodes_with_as_many_shards() -> None:
    result = place(specs("s", 1), {}, ["a", "b"], load={"a": 100.0, "b": 1.0})
    assert result[("s", 0)].leader == "b"


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
    assert all(result[("safe", i)].leader == "a" for i in range(5))


def test_a_new_shard_has_one_replica_its_leader_in_sync() -> None:
    placed = place(specs("s", 1), {}, ["a"])[("s", 0)]
    assert placed == ShardPlacement("a", ("a",), ("a",), 1)


def test_a_move_names_the_new_leader_as_its_only_replica() -> None:
    first = place(specs("s", 2), {}, ["a"])
    second = place(specs("s", 2), first, ["a", "b"])
    moved = next(placed for placed in second.values() if placed.leader == "b")
    assert (moved.replicas, moved.isr, moved.leader_epoch) == (("b",), ("b",), 2)


def test_placement_round_trips_through_its_etcd_form_and_reads_the_old_pair() -> None:
    placed = ShardPlacement("a", ("a", "b", "c"), ("a", "c"), 7)
    assert ShardPlacement.from_json(json.loads(json.dumps(placed.to_json()))) == placed
    assert ShardPlacement.from_json(["b", 3]) == ShardPlacement.single("b", 3)


@pytest.mark.parametrize("leader, replicas, isr, epoch", [
    ("", ("a",), ("a",), 1),          # no leader
    ("a", ("b",), ("b",), 1),         # the leader is not a replica
    ("a", ("a",), ("a", "z"), 1),     # an in-sync replica that is no replica
    ("a", ("a",), ("a",), -1),        # a negative epoch
])
def test_an_inconsistent_placement_is_refused(
    leader: str, replicas: tuple[str, ...], isr: tuple[str, ...], epoch: int,
) -> None:
    with pytest.raises(ValueError):
        ShardPlacement(leader, replicas, isr, epoch)


def test_an_assignment_defaults_to_one_replica_and_gives_its_placement() -> None:
    assignment = ShardAssignment("s", 0, "a", 4)
    assert assignment.placement == ShardPlacement.single("a", 4)
    full = ShardPlacement("a", ("a", "b"), ("a",), 5)
    assert ShardAssignment.of("s", 1, full).placement == full
