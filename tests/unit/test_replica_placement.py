"""The controller's placement rules for replicated shards (`replica_placement.py`), pure: new
shards spread, failover from the in-sync set, no unclean election, rejoin, proposals, drain and
re-replication; and a stream's replication settings (`replication.py`)."""

from __future__ import annotations

from collections import Counter

from shardgate.cluster.placement import ShardPlacement
from shardgate.cluster.replica_leader import IsrProposal
from shardgate.cluster.replica_placement import Nodes, ReplicaPlacer, ReplicatedSpec
from shardgate.cluster.replication import DEFAULT_REPLICAS, Replication, stream_replication

ABC = frozenset({"a", "b", "c"})
KEY = ("s", 0)
SPEC = [ReplicatedSpec("s", 0, 3)]


def nodes(alive: set[str] | frozenset[str] = ABC, **kw: frozenset[str]) -> Nodes:
    draining = kw.get("draining", frozenset())
    return Nodes(frozenset(alive), frozenset(alive) - draining, kw.get("rejoined", frozenset()),
                 draining)


def test_stream_replication_reads_the_definition_with_defaults_and_caps() -> None:
    default = Replication(DEFAULT_REPLICAS, min(2, DEFAULT_REPLICAS))
    assert stream_replication({"mode": "reliable"}) == default
    assert stream_replication({"mode": "reliable", "replicas": None}) == default
    assert stream_replication({"mode": "reliable", "replicas": 3}) == Replication(3, 2)
    assert stream_replication({"mode": "reliable", "replicas": 1}) == Replication(1, 1)
    assert stream_replication({"mode": "reliable", "replicas": 3, "min_insync_replicas": 5}) \
        == Replication(3, 3)
    assert stream_replication({"mode": "non-reliable", "replicas": 3}) == Replication(1, 1)
    assert stream_replication({"replicas": "x", "min_insync_replicas": 0}) == default
    assert not stream_replication({"replicas": 1}).replicated


def test_new_shards_get_every_replica_in_sync_with_leaders_spread_evenly() -> None:
    specs = [ReplicatedSpec("s", index, 3) for index in range(6)]
    placed = ReplicaPlacer().place(specs, {}, nodes(), now=0.0)
    assert len(placed) == 6
    for shard in placed.values():
        assert len(set(shard.replicas)) == 3 and set(shard.isr) == ABC
        assert shard.replicas[0] == shard.leader and shard.leader_epoch == 1
    assert Counter(shard.leader for shard in placed.values()) == {"a": 2, "b": 2, "c": 2}


def test_replicas_are_capped_by_the_live_nodes_then_grow_when_nodes_join() -> None:
    placer = ReplicaPlacer()
    placed = placer.place(SPEC, {}, nodes({"a"}), now=0.0)
    assert placed[KEY] == ShardPlacement("a", ("a",), ("a",), 1)
    grown = placer.place(SPEC, placed, nodes(), now=1.0)[KEY]
    assert grown.leader == "a" and grown.replicas == ("a", "b", "c") and grown.isr == ("a",)
    assert grown.leader_epoch == 2  # new replicas: the leader leads again knowing them


def test_a_replica_added_counts_towards_the_in_sync_minimum_only_once_it_caught_up() -> None:
    placer = ReplicaPlacer()
    placed = placer.place([ReplicatedSpec("s", 0, 2)], {}, nodes({"a"}), now=0.0)
    assert placed[KEY].counted == 1
    # b joins: the shard grows, b is being added (not counted: a alone still acknowledges)
    grown = placer.place([ReplicatedSpec("s", 0, 2)], placed, nodes({"a", "b"}), now=1.0)[KEY]
    assert grown.replicas == ("a", "b") and grown.isr == ("a",) and grown.adding == ("b",)
    assert grown.counted == 1
    assert ShardPlacement.from_json(grown.to_json()) == grown
    # the leader proposes b once it caught up: in sync, counted from now on
    caught_up = IsrProposal("a", grown.leader_epoch, grown.isr_version, frozenset({"a", "b"}))
    synced = placer.place([ReplicatedSpec("s", 0, 2)], {KEY: grown}, nodes({"a", "b"}), now=2.0,
                          proposals={KEY: caught_up})[KEY]
    assert synced.isr == ("a", "b") and synced.adding == () and synced.counted == 2
    assert "adding" not in synced.to_json()
    # out of sync again (dead): still counted, so the minimum of 2 refuses, as Kafka's
    dead = placer.place([ReplicatedSpec("s", 0, 2)], {KEY: synced}, nodes({"a"}), now=3.0)[KEY]
    assert dead.isr == ("a",) and dead.adding == () and dead.counted == 2


def test_a_replica_added_after_a_death_or_for_a_drain_is_adding_until_in_sync() -> None:
    four = frozenset({"a", "b", "c", "d"})
    current = {KEY: ShardPlacement("a", ("a", "b", "c"), ("a", "b"), 1)}
    placer = ReplicaPlacer(re_replicate_after_s=0.0)
    moved = placer.place(SPEC, current, nodes(four - {"c"}), now=0.0)[KEY]
    assert moved.replicas == ("a", "b", "d") and moved.adding == ("d",) and moved.counted == 2
    # a placement of an earlier version has no `adding`
    assert ShardPlacement.from_json({"leader": "a", "replicas": ["a", "b"], "isr": ["a"],
                                     "leader_epoch": 1}).adding == ()


def test_a_dead_leader_is_replaced_by_a_live_in_sync_replica_in_a_new_epoch() -> None:
    current = {KEY: ShardPlacement("a", ("a", "b", "c"), ("a", "c"), 4, 2)}
    placed = ReplicaPlacer().place(SPEC, current, nodes({"b", "c"}), now=0.0)[KEY]
    # b is live but was not in sync: never elected
    assert placed == ShardPlacement("c", ("a", "b", "c"), ("c",), 5, 3)


def test_no_live_in_sync_replica_leaves_the_record_and_the_shard_unavailable() -> None:
    current = {KEY: ShardPlacement("a", ("a", "b", "c"), ("a",), 4, 2)}
    placer = ReplicaPlacer()
    assert placer.place(SPEC, current, nodes({"b", "c"}), now=0.0)[KEY] is current[KEY]
    # unless unclean election is allowed
    unclean = ReplicaPlacer(unclean=True).place(SPEC, current, nodes({"b", "c"}), now=0.0)[KEY]
    assert unclean.leader == "b" and unclean.isr == ("b",) and unclean.leader_epoch == 5


def test_a_leader_registered_again_leads_in_a_new_epoch() -> None:
    current = {KEY: ShardPlacement("a", ("a", "b", "c"), ("a", "b", "c"), 4)}
    placed = ReplicaPlacer().place(SPEC, current, nodes(rejoined=frozenset({"a"})), now=0.0)[KEY]
    assert placed.leader == "a" and placed.leader_epoch == 5
    # a follower registered again changes nothing
    same = ReplicaPlacer().place(SPEC, current, nodes(rejoined=frozenset({"b"})), now=0.0)[KEY]
    assert same is current[KEY]


def test_a_proposal_is_applied_only_against_the_current_epoch_and_version() -> None:
    current = {KEY: ShardPlacement("a", ("a", "b", "c"), ("a", "b", "c"), 4, 7)}
    shrink = IsrProposal("a", 4, 7, frozenset({"a", "b"}))
    placed = ReplicaPlacer().place(SPEC, current, nodes(), now=0.0, proposals={KEY: shrink})[KEY]
    assert placed.isr == ("a", "b") and placed.isr_version == 8 and placed.leader_epoch == 4
    stale = IsrProposal("a", 4, 6, frozenset({"a", "b"}))
    assert ReplicaPlacer().place(SPEC, current, nodes(), now=0.0,
                                 proposals={KEY: stale})[KEY] is current[KEY]


def test_a_dead_follower_is_replaced_only_after_the_re_replication_delay() -> None:
    four = frozenset({"a", "b", "c", "d"})
    current = {KEY: ShardPlacement("a", ("a", "b", "c"), ("a", "b", "c"), 1)}
    placer = ReplicaPlacer(re_replicate_after_s=30.0)
    first = placer.place(SPEC, current, nodes(four - {"c"}), now=100.0)[KEY]
    assert first.replicas == ("a", "b", "c") and first.isr == ("a", "b")
    waiting = placer.place(SPEC, {KEY: first}, nodes(four - {"c"}), now=120.0)[KEY]
    assert waiting is first
    moved = placer.place(SPEC, {KEY: first}, nodes(four - {"c"}), now=131.0)[KEY]
    assert moved.replicas == ("a", "b", "d") and moved.isr == ("a", "b")
    assert moved.leader_epoch == 2
    assert placer.under_replicated_since == {}


def test_drain_adds_a_replica_then_moves_leadership_once_it_caught_up() -> None:
    four = frozenset({"a", "b", "c", "d"})
    current = {KEY: ShardPlacement("a", ("a", "b", "c"), ("a", "b", "c"), 3, 1)}
    draining = nodes(four, draining=frozenset({"a"}))
    placer = ReplicaPlacer()
    step1 = placer.place(SPEC, current, draining, now=0.0)[KEY]
    assert step1.replicas == ("a", "b", "c", "d") and step1.leader == "a"
    assert step1.isr == ("a", "b", "c") and step1.leader_epoch == 4
    # not caught up yet: nothing moves
    assert placer.place(SPEC, {KEY: step1}, draining, now=1.0)[KEY] is step1
    assert placer.quiesce_wanted == {}
    caught_up = IsrProposal("a", 4, 1, frozenset({"a", "b", "c", "d"}))
    step2 = placer.place(SPEC, {KEY: step1}, draining, now=2.0, proposals={KEY: caught_up})[KEY]
    # caught up: the leader, live, is asked to quiesce the shard first
    assert step2.leader == "a" and step2.isr == ("a", "b", "c", "d") and step2.leader_epoch == 4
    assert placer.quiesce_wanted == {KEY: ("a", 4)}
    assert placer.place(SPEC, {KEY: step2}, draining, now=3.0)[KEY] is step2
    # it answered for its epoch: off it goes
    answered = Nodes(draining.alive, draining.placeable, draining=draining.draining,
                     quiesced={KEY: ("a", 4)})
    step3 = placer.place(SPEC, {KEY: step2}, answered, now=3.5)[KEY]
    assert step3.replicas == ("b", "c", "d") and step3.isr == ("b", "c", "d")
    assert step3.leader == "b" and step3.leader_epoch == 5
    assert placer.quiesce_wanted == {} and placer.quiesce_since == {}


def test_a_drained_leader_that_does_not_answer_is_moved_after_the_bound() -> None:
    current = {KEY: ShardPlacement("a", ("a", "b", "c"), ("a", "b", "c"), 3, 1)}
    draining = nodes(draining=frozenset({"a"}))
    placer = ReplicaPlacer(quiesce_wait_s=6.0)
    assert placer.place(SPEC, current, draining, now=10.0)[KEY] is current[KEY]
    assert placer.quiesce_wanted == {KEY: ("a", 3)}
    # an answer for another epoch is not one for this
    stale = Nodes(draining.alive, draining.placeable, draining=draining.draining,
                  quiesced={KEY: ("a", 2)})
    assert placer.place(SPEC, current, stale, now=15.9)[KEY] is current[KEY]
    moved = placer.place(SPEC, current, draining, now=16.0)[KEY]
    assert moved.leader == "b" and moved.replicas == ("b", "c") and moved.leader_epoch == 4
    assert placer.quiesce_wanted == {}


def test_a_leaving_leader_is_not_asked_to_quiesce_nor_one_no_longer_drained() -> None:
    current = {KEY: ShardPlacement("a", ("a", "b", "c"), ("a", "b", "c"), 3, 1)}
    # a leaving node quiesced what it leads before it said it leaves
    leaving = Nodes(ABC, ABC - {"a"}, draining=frozenset({"a"}), leaving=frozenset({"a"}))
    placer = ReplicaPlacer()
    moved = placer.place(SPEC, current, leaving, now=0.0)[KEY]
    assert moved.leader == "b" and moved.leader_epoch == 4 and placer.quiesce_wanted == {}
    # a drain withdrawn before the leader answered: no request is wanted any more
    placer.place(SPEC, current, nodes(draining=frozenset({"a"})), now=1.0)
    assert placer.quiesce_wanted == {KEY: ("a", 3)}
    assert placer.place(SPEC, current, nodes(), now=2.0)[KEY] is current[KEY]
    assert placer.quiesce_wanted == {} and placer.quiesce_since == {}


def test_drain_without_a_spare_node_shrinks_the_replicas() -> None:
    current = {KEY: ShardPlacement("b", ("a", "b", "c"), ("a", "b", "c"), 3, 1)}
    placed = ReplicaPlacer().place(SPEC, current, nodes(draining=frozenset({"a"})), now=0.0)[KEY]
    assert placed.replicas == ("b", "c") and placed.leader == "b" and placed.leader_epoch == 4


class _Registration:
    replication = True


class _Leading:
    high_watermark = 40
    log_end = 42

    def lag(self, replica: str) -> int:
        return {"b": 2, "c": 30}[replica]


def test_status_shows_each_replicated_shard_with_its_leaders_figures_and_renders_them() -> None:
    from shardgate.cluster.cli import render_status
    from shardgate.cluster.replica_status import shard_status

    placement = {"s": [ShardPlacement("a", ("a", "b", "c"), ("a", "b"), 3, 1),
                       ShardPlacement("b", ("b", "c", "a"), ("b", "c", "a"), 1)],
                 "plain": [ShardPlacement.single("a", 1)]}
    streams = {"s": {"mode": "reliable", "replicas": 3}, "plain": {"mode": "non-reliable"}}
    live = {node: _Registration() for node in "abc"}
    status = shard_status(placement, streams, live,
                          lambda stream, shard: _Leading() if (stream, shard) == ("s", 0) else None)
    assert set(status) == {"s/0", "s/1"}
    assert status["s/0"]["under_replicated"] and not status["s/1"]["under_replicated"]
    assert status["s/0"]["high_watermark"] == 40 and status["s/0"]["lag"] == {"b": 2, "c": 30}
    assert "high_watermark" not in status["s/1"]
    # no node runs the replication data path: nothing is counted under-replicated
    assert shard_status({"s": [ShardPlacement.single("a", 1)]}, streams, {"a": object()}, None) == {}
    text = render_status({"cluster": "c", "controller": "a", "shards": 3, "streams": 2,
                          "nodes": [], "replicated_shards": status,
                          "under_replicated_shards": ["s/0"], "draining": {"c": ["s/0"]}})
    assert "s/0    a       3      a,b,c     a,b      40              b:2,c:30" in text
    assert "under-replicated: s/0" in text and "draining c: still holds s/0" in text


def test_a_drain_cut_short_by_the_leaving_nodes_return_goes_back_to_the_replicas_wanted() -> None:
    one = [ReplicatedSpec("s", 0, 1)]
    # a left with a reliable shard of a one-replica stream: the drain gave it a replica on b
    current = {KEY: ShardPlacement("a", ("a",), ("a",), 3)}
    placer = ReplicaPlacer()
    copying = placer.place(one, current, nodes(draining=frozenset({"a"})), now=0.0)[KEY]
    assert copying.replicas == ("a", "b") and copying.isr == ("a",) and copying.leader == "a"
    # a stopped before b was in sync and came back (no longer leaving): b's copy is dropped
    # rather than kept as a second replica nobody asked for
    back = placer.place(one, {KEY: copying}, nodes(), now=1.0)[KEY]
    assert back.replicas == ("a",) and back.isr == ("a",) and back.leader == "a"
    assert back.leader_epoch == copying.leader_epoch + 1
    # while it still drains, the copy stays
    assert placer.place(one, {KEY: copying}, nodes(draining=frozenset({"a"})), now=2.0)[KEY] is copying
    # a three-replica shard with a fourth (out of sync, or dead) drops that one
    four = frozenset({"a", "b", "c", "d"})
    extra = {KEY: ShardPlacement("b", ("a", "b", "c", "d"), ("a", "b", "c"), 5, 2)}
    shrunk = placer.place(SPEC, extra, nodes(four), now=3.0)[KEY]
    assert shrunk.replicas == ("a", "b", "c") and shrunk.isr == ("a", "b", "c") and shrunk.leader == "b"
