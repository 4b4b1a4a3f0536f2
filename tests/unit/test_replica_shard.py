"""A replicated shard of three in-process nodes (leader, followers and controller talking by
direct calls, `replica_fakes.Shard`): acknowledged means held by the in-sync set, failover
from the in-sync set with a new epoch loses nothing acknowledged, a returning old leader cuts
its unacknowledged tail instead of diverging (KIP-101), and a seeded random run of kills,
restarts, partial syncs and elections keeps every acknowledged message at its offset on
every replica."""

from __future__ import annotations

import random

import pytest

from shardgate.cluster.replica_control import ReplicaSet, apply_proposal, elect
from shardgate.cluster.replica_epochs import ReplicaError
from shardgate.cluster.replica_leader import IsrProposal
from tests.unit.replica_fakes import LAG_MAX_S, Shard


def test_messages_are_acknowledged_once_every_in_sync_replica_holds_them() -> None:
    shard = Shard(["a", "b", "c"])
    for index in range(5):
        assert shard.publish(f"m{index}") is None
    assert shard.acknowledged() == []
    shard.pump()
    assert shard.acknowledged() == [f"m{index}" for index in range(5)]
    assert shard.nodes["a"].records == shard.nodes["b"].records == shard.nodes["c"].records


def test_an_acknowledgement_waits_for_the_followers_fsync() -> None:
    shard = Shard(["a", "b", "c"], auto_sync=False)
    shard.publish("m0")
    shard.sync("a")
    shard.pump()
    assert shard.acknowledged() == []  # b and c appended it but have not made it durable
    shard.sync("b")
    shard.pump()
    assert shard.acknowledged() == []
    shard.sync("c")
    shard.pump()
    assert shard.acknowledged() == ["m0"]


def test_a_dead_follower_leaves_the_in_sync_set_and_publishing_goes_on() -> None:
    shard = Shard(["a", "b", "c"])
    shard.kill("c")
    shard.publish("m0")
    shard.pump()
    assert shard.acknowledged() == []  # c still counts until it is out of the set
    for _ in range(int(LAG_MAX_S) + 1):  # b keeps fetching (a long poll), c does not
        shard.advance(1.0)
        shard.pump()
    assert shard.record.isr == {"a", "b"}
    assert shard.acknowledged() == ["m0"]
    shard.publish("m1")
    shard.pump()
    assert shard.acknowledged() == ["m0", "m1"]


def test_the_controller_drops_a_dead_follower_at_once() -> None:
    shard = Shard(["a", "b", "c"])
    shard.publish("m0")
    shard.kill("c")
    shard.elect()
    assert shard.record.isr == {"a", "b"} and shard.record.epoch == 1
    shard.pump()
    assert shard.acknowledged() == ["m0"]


def test_below_min_insync_publishes_are_refused_and_never_acknowledged() -> None:
    shard = Shard(["a", "b", "c"], min_insync=2)
    shard.kill("b")
    shard.kill("c")
    shard.elect()
    assert shard.record.isr == {"a"}
    assert shard.publish("m0") is ReplicaError.NOT_ENOUGH_REPLICAS
    shard.restart("b")
    shard.pump()  # b catches up and is proposed back
    assert shard.record.isr == {"a", "b"}
    assert shard.publish("m1") is None
    shard.pump()
    assert shard.acknowledged() == ["m1"]


def test_a_returning_follower_catches_up_before_it_counts_again() -> None:
    shard = Shard(["a", "b", "c"])
    shard.kill("c")
    shard.elect()
    for index in range(50):
        shard.publish(f"m{index}")
    shard.pump(only={"b"})
    assert len(shard.acknowledged()) == 50
    shard.restart("c")
    shard.pump()
    assert shard.record.isr == {"a", "b", "c"}
    assert shard.nodes["c"].records == shard.nodes["a"].records


def test_failover_elects_an_in_sync_replica_with_a_new_epoch_and_loses_nothing_acknowledged() -> None:
    shard = Shard(["a", "b", "c"])
    for index in range(10):
        shard.publish(f"m{index}")
    shard.pump()
    acknowledged = shard.acknowledged()
    shard.publish("unacknowledged")  # only on a when it dies
    shard.kill("a")
    shard.elect()
    assert shard.record.leader == "b" and shard.record.epoch == 2
    assert shard.record.isr == {"b", "c"}
    assert "unacknowledged" not in shard.outcomes  # its client was never told anything
    shard.publish("after")
    shard.pump()
    assert shard.acknowledged() == acknowledged + ["after"]
    assert [payload for _e, payload in shard.committed()] == acknowledged + ["after"]


def test_a_returning_old_leader_truncates_its_unacknowledged_tail() -> None:
    # the KIP-101 case: a's last record never reached b; b leads epoch 2 and writes another
    # record at that offset; a must not keep its own
    shard = Shard(["a", "b"], min_insync=1)
    shard.publish("m0")
    shard.pump()
    shard.publish("only-on-a")
    shard.kill("a")  # it was durable on a
    assert shard.nodes["a"].records[-1] == (1, "only-on-a")
    shard.elect()
    assert shard.record.leader == "b"
    shard.publish("m1-on-b")
    shard.restart("a")
    shard.pump()
    assert shard.nodes["a"].records == shard.nodes["b"].records == [(1, "m0"), (2, "m1-on-b")]
    assert shard.nodes["a"].history.entries == shard.nodes["b"].history.entries
    assert "m1-on-b" in shard.acknowledged()


def test_a_deposed_leader_that_still_runs_acknowledges_nothing_more() -> None:
    shard = Shard(["a", "b", "c"])
    shard.publish("m0")
    shard.pump()
    old = shard.nodes["a"].leader
    assert old is not None
    old.appended(2)
    old.await_commit(2, "late", shard.now)
    shard.live.discard("a")  # its lease ran out (paused); the controller elects b
    shard.elect()
    shard.live.add("a")  # running again, it has not seen the new placement yet
    shard.pump()  # the followers fetch from b now: no fetch of a's epoch reaches a
    assert old.take_completed() == []
    # a request naming the new epoch (a follower asks only the leader its view names, so
    # none comes here) would move nothing either
    from shardgate.cluster.replica_epochs import FetchRequest, Refused
    assert old.on_fetch(FetchRequest("c", shard.record.epoch, 1, 1), shard.now) == Refused(
        ReplicaError.UNKNOWN_LEADER_EPOCH)
    assert old.take_completed() == [] and old.high_watermark == 1
    old.supersede()  # the placement reaches a
    assert old.take_completed() == [("late", ReplicaError.NOT_LEADER)]


def test_with_no_live_in_sync_replica_the_shard_has_no_leader_until_one_returns() -> None:
    shard = Shard(["a", "b", "c"])
    shard.publish("m0")
    shard.pump()
    shard.kill("b")
    shard.kill("c")
    shard.elect()
    shard.kill("a")
    shard.elect()
    assert shard.record.leader is None and shard.record.isr == {"a"}
    assert shard.publish("m1") is ReplicaError.NOT_LEADER
    shard.restart("c")  # not in sync: never elected (no unclean election)
    shard.elect()
    assert shard.record.leader is None
    shard.restart("a")
    shard.elect()
    assert shard.record.leader == "a" and shard.record.epoch == 3
    shard.restart("c")
    shard.pump()
    assert shard.nodes["c"].records == [(1, "m0")]


def test_the_controller_refuses_stale_or_invalid_proposals() -> None:
    record = ReplicaSet("a", ("a", "b", "c"), frozenset({"a", "b", "c"}), 4, 7)
    live = {"a", "b", "c"}
    good = IsrProposal("a", 4, 7, frozenset({"a", "b"}))
    assert apply_proposal(record, good, live) == ReplicaSet("a", ("a", "b", "c"), frozenset({"a", "b"}), 4, 8)
    assert apply_proposal(record, IsrProposal("a", 3, 7, frozenset({"a"})), live) is None
    assert apply_proposal(record, IsrProposal("a", 4, 6, frozenset({"a"})), live) is None
    assert apply_proposal(record, IsrProposal("b", 4, 7, frozenset({"b"})), live) is None
    assert apply_proposal(record, IsrProposal("a", 4, 7, frozenset({"b"})), live) is None
    assert apply_proposal(record, IsrProposal("a", 4, 7, frozenset({"a", "z"})), live) is None
    shrunk = ReplicaSet("a", ("a", "b", "c"), frozenset({"a"}), 4, 7)
    assert apply_proposal(shrunk, IsrProposal("a", 4, 7, frozenset({"a", "c"})), {"a", "b"}) is None


def test_a_leader_that_gives_the_shard_up_is_replaced_by_an_in_sync_replica_in_a_new_epoch() -> None:
    record = ReplicaSet("a", ("a", "b", "c"), frozenset({"a", "b", "c"}), 4, 7)
    live = {"a", "b", "c"}
    # its journal cannot write (a full disk): the first live in-sync replica leads, without it
    gives_up = IsrProposal("a", 4, 7, frozenset({"b", "c"}), gives_up=True)
    assert apply_proposal(record, gives_up, live) == ReplicaSet(
        "b", ("a", "b", "c"), frozenset({"b", "c"}), 5, 8)
    assert apply_proposal(record, gives_up, {"a", "c"}) == ReplicaSet(
        "c", ("a", "b", "c"), frozenset({"c"}), 5, 8)
    # made against an older in-sync set or epoch: refused, as any proposal
    assert apply_proposal(record, IsrProposal("a", 4, 6, frozenset({"b", "c"}), gives_up=True),
                          live) is None
    assert apply_proposal(record, IsrProposal("a", 3, 7, frozenset({"b", "c"}), gives_up=True),
                          live) is None
    # no other in-sync replica: the same leader leads again, in a new epoch
    alone = ReplicaSet("a", ("a", "b", "c"), frozenset({"a"}), 4, 7)
    assert apply_proposal(alone, IsrProposal("a", 4, 7, frozenset(), gives_up=True), live) == (
        ReplicaSet("a", ("a", "b", "c"), frozenset({"a"}), 5, 7))


def test_election_prefers_replica_order_among_live_in_sync_replicas() -> None:
    record = ReplicaSet("a", ("a", "b", "c"), frozenset({"a", "c"}), 1)
    assert elect(record, {"a", "b", "c"}) is record
    moved = elect(record, {"b", "c"})
    assert (moved.leader, moved.epoch, moved.isr) == ("c", 2, frozenset({"c"}))


@pytest.mark.parametrize("seed", range(60))
def test_a_random_run_of_faults_keeps_every_acknowledged_message(seed: int) -> None:
    rng = random.Random(seed)
    names = ["a", "b", "c"]
    shard = Shard(names, min_insync=2, auto_sync=False)
    published = 0
    for _ in range(400):
        roll = rng.random()
        if roll < 0.35:
            shard.publish(f"m{published}")
            published += 1
        elif roll < 0.6:
            shard.step(rng.choice(names))
        elif roll < 0.75:
            node = rng.choice(names)
            if node in shard.live:
                shard.sync(node)
        elif roll < 0.8:
            shard.controller_round()
        elif roll < 0.85:
            shard.advance(rng.uniform(0.5, LAG_MAX_S))
        elif roll < 0.9 and len(shard.live) == len(names):
            shard.kill(rng.choice(names))
            if rng.random() < 0.7:
                shard.elect()
        elif roll < 0.95:
            for node in names:
                if node not in shard.live:
                    shard.restart(node)
                    break
            shard.elect()
    # heal: everyone back, synced, fetching
    for node in names:
        if node not in shard.live:
            shard.restart(node)
    shard.elect()
    for _ in range(5):
        for node in names:
            shard.sync(node)
        shard.pump()
        shard.advance(0.1)
    leader = shard.leader_node()
    assert leader is not None
    committed = shard.committed()
    payloads = [payload for _epoch, payload in committed]
    for payload in shard.acknowledged():
        assert payloads.count(payload) == 1, f"acknowledged {payload} lost or doubled"
    for node in shard.nodes.values():
        assert node.records[:len(committed)] == committed  # the same bytes at the same offsets
        assert node.records == leader.records
