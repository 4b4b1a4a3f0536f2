"""Messages and routes to and from the frames of the peer link (`proto/cluster.proto`).

A message travels as its journal record (`storage.records`), encoded once however many nodes
it goes to; stream, shard and offset travel beside it. Nothing here touches a socket.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..core.message import Message, message_from_record
from ..proto import cluster_pb2 as pb
from ..storage.records import RecordFormatError, decode_message, encode_message
from .routes import Route, RouteDelta

__all__ = [
    "RecordFormatError",
    "encode_record",
    "forward_frame",
    "message_from_forward",
    "message_from_push",
    "push_frame",
    "route_update",
    "routes_from_update",
]


def encode_record(message: Message) -> bytes:
    return encode_message(message)


def forward_frame(message: Message, epoch: int, record: bytes | None = None) -> pb.Forward:
    return pb.Forward(
        stream=message.stream, shard=message.shard, epoch=epoch,
        record=record if record is not None else encode_message(message),
    )


def push_frame(message: Message, record: bytes, share_groups: Iterable[str] = ()) -> pb.Push:
    return pb.Push(
        stream=message.stream, shard=message.shard, offset=message.offset, record=record,
        plain=True, share_groups=share_groups,
    )


def message_from_forward(forward: pb.Forward) -> Message:
    """The forwarded publish, as the receiving owner publishes it (raises RecordFormatError)."""
    return message_from_record(decode_message(forward.record), forward.stream, forward.shard, -1)


def message_from_push(push: pb.Push) -> Message:
    """The stored message pushed by its owner, for local dispatch (raises RecordFormatError)."""
    return message_from_record(decode_message(push.record), push.stream, push.shard, push.offset)


def route_update(delta: RouteDelta, reset: bool = False) -> pb.RouteUpdate:
    return pb.RouteUpdate(
        reset=reset,
        added=[pb.Route(topic_filter=r.topic_filter, share_group=r.share_group) for r in delta.added],
        removed=[pb.Route(topic_filter=r.topic_filter, share_group=r.share_group) for r in delta.removed],
    )


def routes_from_update(update: pb.RouteUpdate) -> RouteDelta:
    return RouteDelta(
        [Route(r.topic_filter, r.share_group) for r in update.added],
        [Route(r.topic_filter, r.share_group) for r in update.removed],
    )
