"""Messages and routes to and from the frames of the peer link (`proto/cluster.proto`).

A message without properties (no key, headers, MQTT 5 or AMQP properties, expiry) travels as
its few fields, which protobuf's C code reads and writes; any other travels as its journal
record (`core.records`), encoded once however many nodes it goes to. Stream, shard and
offset travel beside it. Nothing here touches a socket.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..core.message import Message
from ..core.records import RecordFormatError, decode_to_message, encode_message
from ..proto import cluster_pb2 as pb
from .routes import Route, RouteDelta

__all__ = [
    "RecordFormatError",
    "body_of",
    "forward_frame",
    "message_from_forward",
    "message_from_push",
    "push_frame",
    "route_update",
    "routes_from_update",
]

NO_GROUPS: frozenset[str] = frozenset()


def is_plain(message: Message) -> bool:
    """True when the message has nothing beyond what the plain form carries."""
    return (
        message.key is None and message.headers is None and message.content_type is None
        and message.correlation_data is None and message.reply_to is None
        and message.payload_format is None and message.expires_at_ms is None
        and message.native_properties is None
    )


def body_of(message: Message) -> dict[str, Any]:
    """The frame fields that carry the message itself (shared by every node it goes to)."""
    if is_plain(message):
        return {
            "topic": message.topic, "payload": message.payload, "qos": message.qos,
            "retain": message.retain, "publish_time_ms": message.publish_time_ms,
            "producer_protocol": message.producer_protocol, "producer_id": message.producer_id,
        }
    return {"record": encode_message(message)}


def forward_frame(message: Message, epoch: int, body: dict[str, Any] | None = None) -> pb.Forward:
    return pb.Forward(stream=message.stream, shard=message.shard, epoch=epoch,
                      **(body if body is not None else body_of(message)))


def push_frame(message: Message, body: dict[str, Any], share_groups: Iterable[str] = ()) -> pb.Push:
    return pb.Push(stream=message.stream, shard=message.shard, offset=message.offset, plain=True,
                   share_groups=share_groups, **body)


def _message(frame: pb.Forward | pb.Push, offset: int) -> Message:
    if frame.record:
        return decode_to_message(frame.record, frame.stream, frame.shard, offset)
    return Message(
        frame.topic, frame.payload, frame.qos, frame.retain, publish_time_ms=frame.publish_time_ms,
        producer_protocol=frame.producer_protocol, producer_id=frame.producer_id,
        stream=frame.stream, shard=frame.shard, offset=offset,
    )


def message_from_forward(forward: pb.Forward) -> Message:
    """The forwarded publish, as the receiving owner publishes it (raises RecordFormatError)."""
    return _message(forward, -1)


def message_from_push(push: pb.Push) -> Message:
    """The stored message pushed by its owner, for local dispatch (raises RecordFormatError)."""
    return _message(push, push.offset)


def record_of(push: pb.Push) -> bytes:
    """The push's message as a journal record (for a received log)."""
    return push.record or encode_message(message_from_push(push))


def frame_size(frame: pb.Forward | pb.Push) -> int:
    return len(frame.record) + len(frame.payload) + len(frame.topic)


def route_update(delta: RouteDelta, reset: bool = False) -> pb.RouteUpdate:
    return pb.RouteUpdate(
        reset=reset,
        added=[_route(r) for r in delta.added], removed=[_route(r) for r in delta.removed],
    )


def _route(route: Route) -> pb.Route:
    return pb.Route(topic_filter=route.topic_filter, share_group=route.share_group,
                    weight=route.weight, durable=route.durable)


def routes_from_update(update: pb.RouteUpdate) -> RouteDelta:
    return RouteDelta(
        [Route(r.topic_filter, r.share_group, r.weight, r.durable) for r in update.added],
        [Route(r.topic_filter, r.share_group, r.weight, r.durable) for r in update.removed],
    )
