"""The replica protocol's requests and answers as protobuf messages (`ReplicaRequest`,
`ReplicaAnswer` of `proto/cluster.proto`), and back.

A fetch answer's records travel packed in one bytes field: per record its timestamp (int64),
its length (uint32) and its data, little-endian, back to back, encoded and decoded in one
pass with no protobuf object per record (empty records, the journal's skipped offsets, travel
too: a follower's offsets are its leader's). A message that does not decode raises
`ReplicaFrameError`, naming what is wrong. Nothing here touches a socket.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from ..proto import cluster_pb2 as pb
from ..storage.interfaces import StoredRecord
from .replica_epochs import (
    EpochEndAnswer,
    EpochEndRequest,
    EpochStart,
    FetchRequest,
    FetchResponse,
    Refused,
    ReplicaError,
)

_HEAD = struct.Struct("<qI")
_ERRORS = {error.value: error for error in ReplicaError}


class ReplicaFrameError(ValueError):
    """A replica request or answer that does not decode."""


def pack_records(records: Sequence[StoredRecord]) -> bytes:
    pack = _HEAD.pack
    parts: list[bytes] = []
    for record in records:
        parts.append(pack(record.timestamp_ms, len(record.data)))
        parts.append(record.data)
    return b"".join(parts)


def unpack_records(data: bytes, start: int, count: int) -> list[StoredRecord]:
    """The `count` records packed in `data`, at offsets from `start`."""
    out: list[StoredRecord] = []
    unpack = _HEAD.unpack_from
    size = _HEAD.size
    position = 0
    end = len(data)
    for offset in range(start, start + count):
        if end - position < size:
            raise ReplicaFrameError(f"record {offset} is missing or truncated in a fetch answer")
        timestamp, length = unpack(data, position)
        position += size
        if end - position < length:
            raise ReplicaFrameError(f"record {offset} is truncated in a fetch answer")
        out.append(StoredRecord(offset, timestamp, data[position:position + length]))
        position += length
    if position != end:
        raise ReplicaFrameError(f"{end - position} bytes after the last record of a fetch answer")
    return out


def request_message(request_id: int, stream: str, shard: int,
                    request: FetchRequest | EpochEndRequest) -> pb.ReplicaRequest:
    if isinstance(request, FetchRequest):
        return pb.ReplicaRequest(
            id=request_id, stream=stream, shard=shard, replica=request.replica,
            leader_epoch=request.leader_epoch, fetch_offset=request.fetch_offset,
            durable_end=request.durable_end, high_watermark=request.high_watermark)
    return pb.ReplicaRequest(
        id=request_id, stream=stream, shard=shard, replica=request.replica,
        leader_epoch=request.leader_epoch, epoch_end=True, epoch=request.epoch)


def request_from(message: pb.ReplicaRequest) -> FetchRequest | EpochEndRequest:
    if not message.stream or not message.replica:
        raise ReplicaFrameError("a replica request without its stream or replica")
    if message.epoch_end:
        return EpochEndRequest(message.replica, message.leader_epoch, message.epoch)
    if message.durable_end > message.fetch_offset:
        raise ReplicaFrameError(f"a fetch whose durable end {message.durable_end} is past its "
                                f"offset {message.fetch_offset}")
    return FetchRequest(message.replica, message.leader_epoch, message.fetch_offset,
                        message.durable_end, message.high_watermark)


def fetch_answer(request_id: int,
                 answer: tuple[FetchResponse, Sequence[StoredRecord]] | Refused) -> pb.ReplicaAnswer:
    if isinstance(answer, Refused):
        return _refused(request_id, answer)
    response, records = answer
    epochs: list[int] = []
    for entry in response.epochs:
        epochs += (entry.epoch, entry.start_offset)
    return pb.ReplicaAnswer(
        id=request_id, leader_epoch=response.leader_epoch, start=response.start,
        end=response.end, high_watermark=response.high_watermark, epochs=epochs,
        records=pack_records(records), dispatched_end=response.dispatched_end)


def epoch_end_answer(request_id: int, answer: EpochEndAnswer | Refused) -> pb.ReplicaAnswer:
    if isinstance(answer, Refused):
        return _refused(request_id, answer)
    return pb.ReplicaAnswer(id=request_id, epoch=answer.epoch, end_offset=answer.end_offset)


def _refused(request_id: int, refused: Refused) -> pb.ReplicaAnswer:
    return pb.ReplicaAnswer(id=request_id, error=refused.error.value, log_start=refused.log_start)


def refusal_from(message: pb.ReplicaAnswer) -> Refused | None:
    if not message.error:
        return None
    error = _ERRORS.get(message.error)
    if error is None:
        raise ReplicaFrameError(f"unknown replica error {message.error!r}")
    return Refused(error, message.log_start)


def fetch_answer_from(message: pb.ReplicaAnswer
                      ) -> tuple[FetchResponse, list[StoredRecord]] | Refused:
    refused = refusal_from(message)
    if refused is not None:
        return refused
    if message.end < message.start:
        raise ReplicaFrameError(f"a fetch answer ending at {message.end} before its start "
                                f"{message.start}")
    if len(message.epochs) % 2:
        raise ReplicaFrameError("a fetch answer's epochs are not (epoch, offset) pairs")
    pairs = message.epochs
    epochs = tuple(EpochStart(pairs[i], pairs[i + 1]) for i in range(0, len(pairs), 2))
    records = unpack_records(message.records, message.start, message.end - message.start)
    response = FetchResponse(
        message.leader_epoch, message.start, message.end, message.high_watermark, epochs,
        message.dispatched_end if message.HasField("dispatched_end") else None)
    return response, records


def epoch_end_answer_from(message: pb.ReplicaAnswer) -> EpochEndAnswer | Refused:
    refused = refusal_from(message)
    if refused is not None:
        return refused
    return EpochEndAnswer(message.epoch, message.end_offset)
