"""The follower of a replicated shard, driven alone with hand-made answers: it finds its
truncation point from the leader's "where does epoch E end" (KIP-101, and KIP-279 when the
leader never had its latest epoch), fetches one request at a time from its log end, reports
only what it holds durably, and handles each refusal as its reason says."""

from __future__ import annotations

from shardgate.cluster.replica_epochs import (
    UNDEFINED,
    EpochEndAnswer,
    EpochEndRequest,
    EpochHistory,
    EpochStart,
    FetchRequest,
    FetchResponse,
    Refused,
    ReplicaError,
)
from shardgate.cluster.replica_follower import (
    FollowerReplica,
    FollowerState,
    ResetLog,
    Truncate,
)


def follower(*epochs: tuple[int, int], log_end: int = 0, hw: int = 0, epoch: int = 5) -> FollowerReplica:
    return FollowerReplica("b", "a", epoch, history=EpochHistory(EpochStart(*e) for e in epochs),
                           log_end=log_end, durable_end=log_end, high_watermark=hw)


def test_an_empty_follower_fetches_from_the_start_at_once() -> None:
    replica = follower()
    assert replica.next_request() == FetchRequest("b", 5, 0, 0)
    assert replica.next_request() is None  # one request in flight


def test_it_fetches_again_only_once_what_it_appended_is_durable() -> None:
    replica = follower()
    replica.next_request()
    response = FetchResponse(5, 0, 3, 2, (EpochStart(4, 0), EpochStart(5, 2)))
    assert replica.accepts(response)
    assert replica.on_fetch(response) is None
    assert replica.log_end == 3
    assert replica.high_watermark == 2
    assert replica.history.entries == (EpochStart(4, 0), EpochStart(5, 2))
    assert replica.next_request() is None  # its 3 records are not durable yet
    replica.durable(3)
    # ... and says the high watermark it knows (a leaving leader waits for it)
    assert replica.next_request() == FetchRequest("b", 5, 3, 3, 2)


def test_the_high_watermark_never_passes_the_followers_own_end() -> None:
    replica = follower()
    replica.next_request()
    replica.on_fetch(FetchResponse(5, 0, 2, 9, ()))
    assert replica.high_watermark == 2


def test_a_stale_or_misplaced_response_is_ignored() -> None:
    replica = follower(log_end=4, hw=4)
    replica.state = FollowerState.FETCHING
    replica.next_request()
    stale = FetchResponse(4, 4, 6, 6, ())
    assert not replica.accepts(stale)
    replica.on_fetch(stale)
    assert replica.log_end == 4
    assert replica.next_request() is not None
    misplaced = FetchResponse(5, 2, 6, 6, ())
    assert not replica.accepts(misplaced)
    replica.on_fetch(misplaced)
    assert replica.log_end == 4


def test_a_follower_with_epochs_first_asks_where_its_latest_epoch_ends() -> None:
    replica = follower((1, 0), (3, 6), log_end=10, hw=6)
    assert replica.next_request() == EpochEndRequest("b", 5, 3)
    # the leader had epoch 3 too, and it ends at 8 there: b's records 8 and 9 never committed
    assert replica.on_epoch_end(EpochEndAnswer(3, 8)) == Truncate(8)
    assert replica.log_end == 8
    assert replica.state is FollowerState.FETCHING
    assert replica.next_request() == FetchRequest("b", 5, 8, 8, 6)


def test_no_truncation_when_the_leader_holds_at_least_as_much() -> None:
    replica = follower((1, 0), (3, 6), log_end=10)
    replica.next_request()
    assert replica.on_epoch_end(EpochEndAnswer(3, 12)) is None
    assert replica.next_request() == FetchRequest("b", 5, 10, 10)


def test_an_epoch_the_leader_never_had_is_cut_where_the_leaders_epoch_ends_here() -> None:
    # KIP-279: b wrote epoch 2 as a leader nobody followed; the new leader knows epochs 1, 3
    replica = follower((1, 0), (2, 5), log_end=9)
    assert replica.next_request() == EpochEndRequest("b", 5, 2)
    assert replica.on_epoch_end(EpochEndAnswer(1, 6)) == Truncate(5)
    assert replica.history.entries == (EpochStart(1, 0),)
    assert replica.state is FollowerState.FETCHING


def test_truncation_asks_again_until_both_name_the_same_epoch() -> None:
    # b: epoch 1 [0, 4), epoch 2 [4, 6), epoch 4 [6, 9); the leader: epoch 1 [0, 5), epoch 3 [5, ...)
    replica = follower((1, 0), (2, 4), (4, 6), log_end=9)
    assert replica.next_request() == EpochEndRequest("b", 5, 4)
    assert replica.on_epoch_end(EpochEndAnswer(3, 11)) == Truncate(6)
    assert replica.state is FollowerState.TRUNCATING
    assert replica.next_request() == EpochEndRequest("b", 5, 2)
    assert replica.on_epoch_end(EpochEndAnswer(1, 5)) == Truncate(4)
    assert replica.state is FollowerState.FETCHING
    assert replica.next_request() == FetchRequest("b", 5, 4, 4)


def test_a_leader_that_knows_no_such_epoch_leaves_only_the_committed_records() -> None:
    replica = follower((7, 0), log_end=9, hw=3)
    replica.next_request()
    assert replica.on_epoch_end(EpochEndAnswer(UNDEFINED, UNDEFINED)) == Truncate(3)


def test_a_log_written_before_replication_is_cut_to_its_high_watermark() -> None:
    replica = follower(log_end=9, hw=4)
    assert replica.next_request() == Truncate(4)
    assert replica.next_request() == FetchRequest("b", 5, 4, 4, 4)


def test_a_refused_request_waits_then_retries_the_same_step() -> None:
    replica = follower((1, 0), log_end=3)
    replica.next_request()
    assert replica.on_epoch_end(Refused(ReplicaError.NOT_LEADER)) is None
    assert replica.state is FollowerState.WAITING
    assert replica.next_request() is None
    replica.retry()
    assert replica.next_request() == EpochEndRequest("b", 5, 1)


def test_an_older_epoch_than_the_leaders_waits_for_the_new_placement() -> None:
    replica = follower()
    replica.next_request()
    replica.on_fetch(Refused(ReplicaError.FENCED_EPOCH))
    assert replica.state is FollowerState.WAITING
    assert replica.last_refusal is ReplicaError.FENCED_EPOCH


def test_a_fetch_past_the_leaders_end_looks_for_the_truncation_point_again() -> None:
    replica = follower((5, 0), log_end=4)
    replica.next_request()
    replica.on_epoch_end(EpochEndAnswer(5, 6))
    replica.next_request()
    replica.on_fetch(Refused(ReplicaError.OUT_OF_RANGE))
    assert replica.state is FollowerState.TRUNCATING
    assert replica.next_request() == EpochEndRequest("b", 5, 5)


def test_a_log_behind_the_leaders_retention_starts_again_at_the_leaders_start() -> None:
    replica = follower((2, 0), log_end=3, hw=3)
    replica.next_request()
    replica.on_epoch_end(EpochEndAnswer(2, 3))
    replica.next_request()
    assert replica.on_fetch(Refused(ReplicaError.BEHIND_LOG_START, 50)) == ResetLog(50)
    assert (replica.log_end, replica.durable_end, len(replica.history)) == (50, 50, 0)
    assert replica.next_request() == FetchRequest("b", 5, 50, 50, 50)


def test_epochs_below_the_answer_are_cut_where_the_followers_first_later_epoch_starts() -> None:
    # b knows only epoch 3 (from offset 10); the leader's largest epoch at or below 3 is 2,
    # ending at 12: everything b wrote in epoch 3 goes, whatever its cache says of epoch 2
    replica = follower((3, 10), log_end=14, hw=10)
    assert replica.next_request() == EpochEndRequest("b", 5, 3)
    assert replica.on_epoch_end(EpochEndAnswer(2, 12)) == Truncate(10)
    assert replica.state is FollowerState.FETCHING
    assert replica.next_request() == FetchRequest("b", 5, 10, 10, 10)


def test_an_empty_epoch_the_leader_never_had_is_dropped_and_not_asked_about_again() -> None:
    """A node that led epoch 3 without a record (its epoch began at its log end), follows in
    epoch 5 a leader that never had epoch 3: the answer cuts no record, but epoch 3 goes, and
    the next question is about epoch 1 (before, epoch 3 was asked about forever)."""
    replica = follower((1, 0), (3, 1), log_end=1, hw=0)
    assert replica.next_request() == EpochEndRequest("b", 5, 3)
    assert replica.on_epoch_end(EpochEndAnswer(2, 8)) is None
    assert replica.history.entries == (EpochStart(1, 0),)
    assert replica.next_request() == EpochEndRequest("b", 5, 1)
    assert replica.on_epoch_end(EpochEndAnswer(1, 5)) is None
    assert replica.state is FollowerState.FETCHING
    assert replica.next_request() == FetchRequest("b", 5, 1, 1)
