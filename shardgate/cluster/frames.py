"""Messages and routes to and from the frames of the peer link (`proto/cluster.proto`).

Forwarded publishes travel packed: a run of messages for one shard is one `ForwardBatch`,
whose `records` field holds every message's journal record (`core.records`) behind its length.
The sender encodes the run in one pass, and the receiver decodes it in one pass
(`unpack_records`), with no protobuf object per message.

A pushed message without properties (no key, headers, MQTT 5 or AMQP properties, expiry)
travels as its few fields, which protobuf's C code reads and writes; any other travels as its
journal record, encoded once however many nodes it goes to. Stream, shard and offset travel
beside it. Nothing here touches a socket.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any

from ..core.message import Message
from ..core.records import (
    VERSION,
    RecordFormatError,
    decode_to_message,
    encode_message,
    encode_records,
)
from ..proto import cluster_pb2 as pb
from .routes import Route, RouteDelta

__all__ = [
    "RecordFormatError",
    "body_of",
    "forward_frame",
    "message_from_forward",
    "message_from_push",
    "pack_records",
    "push_frame",
    "unpack_records",
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


_U32 = struct.Struct("<I")
_U16 = struct.Struct("<H")
# A record's length, then the fixed head of a record with no flag set (records._HEAD_TOPIC):
# version, flags, qos, retain, publish time, topic length.
_PACKED_HEAD = struct.Struct("<IBBBBqI")


def pack_records(messages: Sequence[Message]) -> bytes:
    """The `records` of a `ForwardBatch`: each message's journal record behind its length
    (raises ValueError, OverflowError or struct.error for a field a record cannot hold)."""
    pack = _U32.pack
    parts: list[bytes] = []
    append = parts.append
    for _time, record in encode_records(messages):
        append(pack(len(record)))
        append(record)
    return b"".join(parts)


def unpack_records(data: bytes, stream: str, shard: int) -> list[Message | RecordFormatError]:
    """The messages of a `ForwardBatch`'s `records`, in order, for `stream`/`shard`; a record
    that does not decode is its `RecordFormatError` in its place. A record of topic and
    payload only (the common message) is read here directly; topics and producer fields that
    repeat are decoded once."""
    items: list[Message | RecordFormatError] = []
    append = items.append
    unpack_head = _PACKED_HEAD.unpack_from
    unpack_u32 = _U32.unpack_from
    unpack_u16 = _U16.unpack_from
    end = len(data)
    position = 0
    topic_bytes = b""
    topic = ""
    tail = b""
    protocol = producer = ""
    while position < end:
        if end - position < 4:
            append(RecordFormatError("a truncated record length in a forwarded batch"))
            break
        (size,) = unpack_u32(data, position)
        start = position + 4
        stop = start + size
        if stop > end:
            append(RecordFormatError("a truncated record in a forwarded batch"))
            break
        position = stop
        try:
            if size < 24 or data[start] != VERSION or data[start + 1]:
                append(decode_to_message(data[start:stop], stream, shard, -1))
                continue
            _size, _version, _flags, qos, retain, time_ms, topic_size = unpack_head(data, start - 4)
            at = start + 16
            if topic_size != len(topic_bytes) or not data.startswith(topic_bytes, at):
                topic = data[at:at + topic_size].decode()
                topic_bytes = data[at:at + topic_size]
            at += topic_size
            (payload_size,) = unpack_u32(data, at)
            at += 4
            payload = data[at:at + payload_size]
            at += payload_size
            if at + 4 > stop or len(payload) != payload_size:
                raise RecordFormatError("truncated message record")
            if stop - at != len(tail) or not data.startswith(tail, at):
                tail_start = at
                (protocol_size,) = unpack_u16(data, at)
                new_protocol = data[at + 2:at + 2 + protocol_size].decode()
                at += 2 + protocol_size
                (producer_size,) = unpack_u16(data, at)
                if at + 2 + producer_size != stop:
                    raise RecordFormatError("malformed message record: bad producer fields")
                producer = data[at + 2:stop].decode()
                protocol = new_protocol
                tail = data[tail_start:stop]
            append(Message(topic, payload, qos, bool(retain), None, None, None, None, None, None,
                           None, time_ms, protocol, producer, stream, shard))
        except RecordFormatError as exc:
            append(exc)
        except (struct.error, UnicodeDecodeError, IndexError) as exc:
            append(RecordFormatError(f"malformed message record: {exc}"))
    return items


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
