"""The leader of a replicated shard, driven alone with hand-made fetches on a manual clock:
the high watermark is the lowest durable end of the in-sync set, a publish is acknowledged
only past it and with enough replicas in sync, lagging followers are proposed out and
caught-up ones back in, a superseded leader or one without a live lease acknowledges
nothing, and a leader that leaves knows when its in-sync followers know where it ends."""

from __future__ import annotations

import math

import pytest

from shardgate.cluster.replica_epochs import (
    EpochEndAnswer,
    EpochEndRequest,
    EpochHistory,
    EpochStart,
    FetchPlan,
    FetchRequest,
    Refused,
    ReplicaError,
)
from shardgate.cluster.replica_leader import IsrProposal, LeaderReplica


def leader(isr: tuple[str, ...] = ("a", "b", "c"), *, min_insync: int = 2, log_end: int = 0,
           history: EpochHistory | None = None, lease: float = math.inf) -> LeaderReplica[str]:
    return LeaderReplica(
        "a", 3, ("a", "b", "c"), isr, min_insync=min_insync, lag_time_max_s=10.0,
        history=history if history is not None else EpochHistory(), log_end=log_end,
        durable_end=log_end, high_watermark=0, now=0.0, lease_deadline=lease)


def append(replica: LeaderReplica[str], count: int, now: float = 0.0, durable: bool = True) -> list[str]:
    """Append `count` records, each waiting for its commit; returns their waiters' names."""
    names = []
    for _ in range(count):
        assert replica.check_append(now) is None
        end = replica.log_end + 1
        replica.appended(end)
        names.append(f"m{end - 1}")
        replica.await_commit(end, names[-1], now)
    if durable:
        replica.durable(replica.log_end, now)
    return names


def fetch(replica: LeaderReplica[str], name: str, offset: int, now: float = 0.0,
          durable: int | None = None, epoch: int = 3, knows: int = 0) -> FetchPlan | Refused:
    return replica.on_fetch(
        FetchRequest(name, epoch, offset, offset if durable is None else durable, knows), now)


def test_the_high_watermark_is_the_lowest_durable_end_of_the_in_sync_set() -> None:
    replica = leader()
    append(replica, 5)
    assert replica.high_watermark == 0  # no follower has fetched in this epoch
    fetch(replica, "b", 5)
    assert replica.high_watermark == 0
    plan = fetch(replica, "c", 3)
    assert replica.high_watermark == 3
    assert plan == FetchPlan(3, 5, 3, (EpochStart(3, 3),))
    fetch(replica, "c", 5)
    assert replica.high_watermark == 5


def test_a_follower_counts_what_it_holds_durably_not_what_it_appended() -> None:
    replica = leader()
    append(replica, 4)
    fetch(replica, "b", 4, durable=2)
    fetch(replica, "c", 4)
    assert replica.high_watermark == 2


def test_the_leaders_own_durable_end_bounds_the_high_watermark() -> None:
    replica = leader()
    append(replica, 4, durable=False)
    fetch(replica, "b", 4)
    fetch(replica, "c", 4)
    assert replica.high_watermark == 0
    replica.durable(2, 0.0)
    assert replica.high_watermark == 2
    replica.durable(4, 0.0)
    assert replica.high_watermark == 4
    assert replica.on_fetch(FetchRequest("b", 3, 5, 5), 0.0) == Refused(ReplicaError.OUT_OF_RANGE)


def test_a_publish_is_acknowledged_once_the_high_watermark_passes_it() -> None:
    replica = leader()
    names = append(replica, 3)
    fetch(replica, "b", 3)
    assert replica.take_completed() == []
    fetch(replica, "c", 2)
    assert replica.take_completed() == [("m0", None), ("m1", None)]
    fetch(replica, "c", 3)
    assert replica.take_completed() == [(names[2], None)]


def test_a_single_replica_leader_acknowledges_on_its_own_durability() -> None:
    replica = LeaderReplica("a", 1, ("a",), ("a",), min_insync=1, lag_time_max_s=10.0,
                            history=EpochHistory(), log_end=0, durable_end=0, high_watermark=0,
                            now=0.0)
    append(replica, 2)
    assert replica.take_completed() == [("m0", None), ("m1", None)]


def test_below_min_insync_publishes_are_refused_retryably() -> None:
    replica = leader(isr=("a",))
    assert replica.check_append(0.0) is ReplicaError.NOT_ENOUGH_REPLICAS
    replica.isr_changed({"a", "b"}, 1, 0.0)
    assert replica.check_append(0.0) is None


def test_messages_the_mark_passed_below_the_minimum_wait_for_the_set_to_come_back() -> None:
    """Not refused: they are in the shard for good, and a client sending them again would
    have them stored twice. Acknowledged once a follower holding them is back in the set."""
    replica = leader()
    append(replica, 2)
    fetch(replica, "b", 1)
    replica.isr_changed({"a"}, 1, 0.0)  # b and c out: the mark is the leader's own end
    assert replica.high_watermark == 2
    assert replica.take_completed() == []
    assert replica.check_append(0.0) is ReplicaError.NOT_ENOUGH_REPLICAS  # new ones are refused
    fetch(replica, "b", 2)
    assert replica.take_proposal() == IsrProposal("a", 3, 1, frozenset({"a", "b"}))
    assert replica.take_completed() == []  # the controller has not written it yet
    replica.isr_changed({"a", "b"}, 2, 0.0)
    assert replica.take_completed() == [("m0", None), ("m1", None)]


def test_messages_waiting_below_the_minimum_are_refused_when_the_leadership_ends() -> None:
    replica = leader()
    append(replica, 2)
    replica.isr_changed({"a"}, 1, 0.0)
    assert replica.high_watermark == 2 and replica.take_completed() == []
    replica.supersede()
    assert replica.take_completed() == [("m0", ReplicaError.NOT_LEADER),
                                        ("m1", ReplicaError.NOT_LEADER)]


def test_a_follower_not_caught_up_for_the_lag_time_is_proposed_out() -> None:
    replica = leader()
    append(replica, 2)
    fetch(replica, "b", 2, now=1.0)
    fetch(replica, "c", 1, now=1.0)  # behind: last caught up when the epoch began, at 0
    replica.tick(9.5)
    assert replica.take_proposal() is None
    replica.tick(10.5)
    proposal = replica.take_proposal()
    assert proposal == IsrProposal("a", 3, 0, frozenset({"a", "b"}))
    assert replica.take_proposal() is None  # sent once


def test_a_follower_that_keeps_fetching_but_never_reaches_the_end_falls_out() -> None:
    replica = leader()
    now = 0.0
    for step in range(15):  # the leader grows faster than c follows
        append(replica, 2, now=now)
        fetch(replica, "b", replica.log_end, now=now)
        fetch(replica, "c", step, now=now)
        now += 1.0
        replica.tick(now)
    proposal = replica.take_proposal()
    assert proposal is not None and proposal.isr == {"a", "b"}


def test_a_follower_that_reached_the_end_at_its_previous_fetch_stays_in() -> None:
    # Kafka's rule: catching up to the leader's end as it was at the previous fetch counts
    replica = leader()
    now = 0.0
    for _ in range(30):
        fetch(replica, "b", replica.log_end, now=now)
        fetch(replica, "c", replica.log_end, now=now)
        append(replica, 1, now=now)
        now += 1.0
        replica.tick(now)
    assert replica.take_proposal() is None


def test_the_high_watermark_waits_for_a_proposed_removal_to_be_written() -> None:
    replica = leader()
    append(replica, 3)
    fetch(replica, "b", 3, now=11.0)
    replica.tick(11.0)  # c never fetched: out
    assert replica.pending_proposal is not None
    assert replica.high_watermark == 0  # c still counts until the controller wrote it
    proposal = replica.take_proposal()
    assert proposal is not None
    replica.isr_changed(proposal.isr, 1, 11.0)
    assert replica.high_watermark == 3
    assert [error for _name, error in replica.take_completed()] == [None, None, None]


def test_a_caught_up_follower_is_proposed_back_and_counts_at_once() -> None:
    replica = leader(isr=("a", "b"))
    append(replica, 3)
    fetch(replica, "b", 3)
    assert replica.high_watermark == 3
    fetch(replica, "c", 1)
    assert replica.pending_proposal is None  # below the high watermark: not yet
    fetch(replica, "c", 3)
    proposal = replica.take_proposal()
    assert proposal == IsrProposal("a", 3, 0, frozenset({"a", "b", "c"}))
    append(replica, 1)
    fetch(replica, "b", 4)
    assert replica.high_watermark == 3  # the maximal set counts c while its return is pending
    replica.proposal_failed()
    assert replica.high_watermark == 3
    fetch(replica, "c", 4)
    assert replica.pending_proposal is not None


def test_fetches_of_older_epochs_and_unknown_replicas_are_refused() -> None:
    replica = leader()
    assert fetch(replica, "b", 0, epoch=2) == Refused(ReplicaError.FENCED_EPOCH)
    assert fetch(replica, "z", 0) == Refused(ReplicaError.UNKNOWN_REPLICA)
    assert fetch(replica, "b", 0, durable=1) == Refused(ReplicaError.OUT_OF_RANGE)
    assert not replica.fenced


def test_a_request_of_a_newer_epoch_is_refused_retryably_and_fences_nothing() -> None:
    """A follower asks only the leader its own view names: a request naming epoch 4 here
    means this node leads epoch 4 too, and the follower saw that placement first. What waits
    stays waiting, and is carried over to epoch 4 (`hand_over`), acknowledged there."""
    replica = leader()
    append(replica, 2)
    assert fetch(replica, "b", 2, epoch=4) == Refused(ReplicaError.UNKNOWN_LEADER_EPOCH)
    assert replica.on_epoch_end(EpochEndRequest("c", 4, 3)) == Refused(ReplicaError.UNKNOWN_LEADER_EPOCH)
    assert not replica.fenced
    assert replica.take_completed() == []
    assert replica.high_watermark == 0  # a refused fetch moves nothing
    assert replica.check_append(0.0) is None
    carried = replica.hand_over()  # this node's view now shows epoch 4: it leads again
    assert carried == [(1, "m0"), (2, "m1")]
    assert replica.fenced
    again = LeaderReplica(
        "a", 4, ("a", "b", "c"), ("a", "b", "c"), min_insync=2, lag_time_max_s=10.0,
        history=replica.history, log_end=2, durable_end=2, high_watermark=replica.high_watermark,
        now=0.0)
    for end, waiter in carried:
        again.await_commit(end, waiter, 0.0)
    assert again.take_completed() == []
    fetch(again, "b", 2, epoch=4)
    fetch(again, "c", 2, epoch=4)
    assert again.take_completed() == [("m0", None), ("m1", None)]


def test_a_superseded_leader_refuses_what_waits_and_every_request() -> None:
    replica = leader()
    append(replica, 2)
    replica.supersede()  # the placement names another leader
    assert replica.fenced
    assert replica.take_completed() == [("m0", ReplicaError.NOT_LEADER), ("m1", ReplicaError.NOT_LEADER)]
    assert replica.check_append(0.0) is ReplicaError.NOT_LEADER
    for epoch in (3, 4):
        assert fetch(replica, "c", 2, epoch=epoch) == Refused(ReplicaError.NOT_LEADER)
    assert replica.high_watermark == 0
    replica.await_commit(3, "late", 0.0)
    assert replica.take_completed() == [("late", ReplicaError.NOT_LEADER)]


def test_without_a_live_lease_nothing_is_acknowledged_or_taken() -> None:
    replica = leader(lease=5.0)
    append(replica, 2, now=1.0)
    fetch(replica, "b", 2, now=6.0)
    fetch(replica, "c", 2, now=6.0)
    assert replica.take_completed() == []  # paused past its lease: no acknowledgement
    assert replica.check_append(6.0) is ReplicaError.NOT_LEADER
    replica.renew_lease(20.0, 7.0)  # the same lease, kept alive after all
    assert [error for _name, error in replica.take_completed()] == [None, None]


def test_a_new_leader_records_its_epoch_at_its_log_end() -> None:
    history = EpochHistory([EpochStart(1, 0)])
    replica = leader(log_end=7, history=history)
    assert history.entries == (EpochStart(1, 0), EpochStart(3, 7))
    assert replica.epoch_start == 7
    answer = replica.on_epoch_end(EpochEndRequest("b", 3, 1))
    assert answer == EpochEndAnswer(1, 7)
    assert replica.on_epoch_end(EpochEndRequest("b", 3, 3)) == EpochEndAnswer(3, 7)


def test_a_leader_cannot_be_made_from_a_log_of_a_later_epoch() -> None:
    with pytest.raises(ValueError):
        leader(history=EpochHistory([EpochStart(5, 0)]))
    with pytest.raises(ValueError):
        LeaderReplica("a", 1, ("a", "b"), ("b",), min_insync=1, lag_time_max_s=1.0,
                      history=EpochHistory(), log_end=0, durable_end=0, high_watermark=0, now=0.0)


def test_lag_counts_records_a_follower_lacks() -> None:
    replica = leader()
    append(replica, 6)
    fetch(replica, "b", 4)
    assert replica.lag("b") == 2
    assert replica.lag("c") == 6


def test_a_follower_behind_the_leaders_retention_is_told_where_the_log_starts() -> None:
    replica = leader()
    append(replica, 6)
    replica.retained_from(4)
    assert fetch(replica, "b", 2) == Refused(ReplicaError.BEHIND_LOG_START, 4)
    assert fetch(replica, "b", 4) == FetchPlan(4, 6, 0, (EpochStart(3, 4),))


def test_a_leaving_leader_takes_no_publish_and_commits_what_it_holds() -> None:
    replica = leader()
    append(replica, 4)
    fetch(replica, "b", 4)
    fetch(replica, "c", 2)
    replica.close()
    assert replica.check_append(0.0) is ReplicaError.NOT_LEADER  # retryable
    assert not replica.final_mark_known()  # the mark may still move
    fetch(replica, "c", 4)
    assert replica.high_watermark == 4
    assert replica.take_completed() == [(f"m{i}", None) for i in range(4)]
    # where it ends is known once each in-sync follower's fetch says it knows the mark
    assert not replica.final_mark_known()
    fetch(replica, "b", 4, knows=4)
    assert not replica.final_mark_known()
    fetch(replica, "c", 4, knows=4)
    assert replica.final_mark_known()


def test_a_frozen_leaving_leader_commits_nothing_more_and_ends_at_its_mark() -> None:
    replica = leader()
    append(replica, 4)
    fetch(replica, "b", 4)
    fetch(replica, "c", 2)
    assert replica.take_completed() == [("m0", None), ("m1", None)]
    replica.close()
    replica.freeze()
    fetch(replica, "c", 4, knows=2)  # caught up, but the mark stays where it is
    assert replica.high_watermark == 2
    assert replica.take_completed() == []
    assert not replica.final_mark_known()  # b's last fetch did not say it knows 2
    fetch(replica, "b", 4, knows=2)
    assert replica.final_mark_known()
    replica.supersede()  # the next leader commits and hands on the rest
    assert replica.take_completed() == [("m2", ReplicaError.NOT_LEADER), ("m3", ReplicaError.NOT_LEADER)]


def test_only_in_sync_followers_need_to_know_where_a_leaving_leader_ends() -> None:
    replica = leader(("a", "b"), min_insync=1)
    append(replica, 3)
    fetch(replica, "b", 3, knows=0)
    replica.close()
    assert not replica.final_mark_known()
    fetch(replica, "b", 3, knows=3)
    assert replica.final_mark_known()  # c, not in sync, never fetched


def test_a_drained_leader_whose_move_is_called_off_takes_publishes_and_commits_again() -> None:
    replica = leader()
    append(replica, 4)
    fetch(replica, "b", 4)
    fetch(replica, "c", 2)
    replica.close()
    replica.freeze()
    fetch(replica, "c", 4)
    assert replica.high_watermark == 2
    replica.reopen()  # the controller wants it moved no more
    assert replica.check_append(0.0) is None
    fetch(replica, "c", 4)
    assert replica.high_watermark == 4
    assert replica.take_completed() == [(f"m{i}", None) for i in range(4)]
