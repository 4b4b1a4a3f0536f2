"""The replica protocol on the wire: requests and answers survive a protobuf round trip
(records packed in one field, empty records included), and malformed messages are refused
with a `ReplicaFrameError` that says what is wrong."""

from __future__ import annotations

import pytest
from shardgate.proto import cluster_pb2 as pb
from shardgate.storage.interfaces import StoredRecord

from shardgate.cluster.replica_epochs import (
    EpochEndAnswer,
    EpochEndRequest,
    EpochStart,
    FetchRequest,
    FetchResponse,
    Refused,
    ReplicaError,
)
from shardgate.cluster.replica_frames import (
    ReplicaFrameError,
    epoch_end_answer,
    epoch_end_answer_from,
    fetch_answer,
    fetch_answer_from,
    request_from,
    request_message,
    unpack_records,
)


def wire(message: pb.ReplicaRequest | pb.ReplicaAnswer) -> bytes:
    return message.SerializeToString()


def test_requests_round_trip() -> None:
    for request in (FetchRequest("b", 7, 120, 100, 90), EpochEndRequest("c", 7, 5)):
        message = pb.ReplicaRequest.FromString(wire(request_message(3, "s", 2, request)))
        assert (message.id, message.stream, message.shard) == (3, "s", 2)
        assert request_from(message) == request


def test_a_fetch_answer_round_trips_with_its_records_and_epochs() -> None:
    records = [StoredRecord(40, 1_700_000_000_000, b"one"), StoredRecord(41, 5, b""),
               StoredRecord(42, -1, b"x" * 70_000)]
    response = FetchResponse(7, 40, 43, 41, (EpochStart(6, 40), EpochStart(7, 42)))
    message = pb.ReplicaAnswer.FromString(wire(fetch_answer(9, (response, records))))
    assert message.id == 9
    assert fetch_answer_from(message) == (response, records)


def test_a_fetch_answer_carries_the_dispatched_mark_only_when_the_leader_knows_it() -> None:
    for mark in (None, 0, 38):
        response = FetchResponse(7, 40, 40, 41, (), mark)
        message = pb.ReplicaAnswer.FromString(wire(fetch_answer(9, (response, []))))
        assert fetch_answer_from(message) == (response, [])


def test_refusals_and_epoch_ends_round_trip() -> None:
    refused = Refused(ReplicaError.BEHIND_LOG_START, 500)
    assert fetch_answer_from(pb.ReplicaAnswer.FromString(wire(fetch_answer(1, refused)))) == refused
    answer = EpochEndAnswer(4, 1200)
    assert epoch_end_answer_from(pb.ReplicaAnswer.FromString(wire(epoch_end_answer(2, answer)))) == answer
    not_leader = Refused(ReplicaError.NOT_LEADER)
    assert epoch_end_answer_from(epoch_end_answer(3, not_leader)) == not_leader


def test_truncated_or_padded_records_are_refused() -> None:
    records = [StoredRecord(0, 1, b"abc"), StoredRecord(1, 2, b"de")]
    message = fetch_answer(1, (FetchResponse(1, 0, 2, 0, ()), records))
    packed = message.records
    with pytest.raises(ReplicaFrameError, match="record 1 is truncated"):
        unpack_records(packed[:-1], 0, 2)
    with pytest.raises(ReplicaFrameError, match="record 1 is missing"):
        unpack_records(packed[:15], 0, 2)
    with pytest.raises(ReplicaFrameError, match="bytes after the last record"):
        unpack_records(packed + b"\0", 0, 2)
    message.end = 3  # says three records, carries two
    with pytest.raises(ReplicaFrameError):
        fetch_answer_from(message)


def test_malformed_answers_and_requests_are_refused() -> None:
    with pytest.raises(ReplicaFrameError, match="unknown replica error"):
        fetch_answer_from(pb.ReplicaAnswer(error="bogus"))
    with pytest.raises(ReplicaFrameError, match="before its start"):
        fetch_answer_from(pb.ReplicaAnswer(start=5, end=4))
    with pytest.raises(ReplicaFrameError, match="pairs"):
        fetch_answer_from(pb.ReplicaAnswer(start=0, end=0, epochs=[1]))
    with pytest.raises(ReplicaFrameError, match="durable end"):
        request_from(pb.ReplicaRequest(stream="s", replica="b", fetch_offset=1, durable_end=2))
    with pytest.raises(ReplicaFrameError, match="stream or replica"):
        request_from(pb.ReplicaRequest(replica="b"))
