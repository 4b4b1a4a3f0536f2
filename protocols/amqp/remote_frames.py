"""The frames of a consumer link between a client's node and a queue's home node, and the
encodings a remote queue call shares: an AMQP field table as JSON text (`encode_table`), a
delivery with its message's AMQP properties (`encode_delivery`), several frames in one
transport message (`pack_frames`), a list of delivery ids (`pack_ids`). Bytes only: no queue,
no transport (see `remote.py` for what travels when).
"""

from __future__ import annotations

import base64
import struct
from typing import Any, cast

from pamqp import decode, encode

from ...core.message import Message
from .properties import NATIVE_FORMAT, encoded_properties
from .queues import QueueEntry

ACK, REQUEUE, REJECT, CANCEL, HANDED = b"A", b"R", b"J", b"X", b"W"
CONSUMING, REFUSED, DELIVERY, DELETED = b"O", b"E", b"D", b"C"
_DELIVERY = struct.Struct(">QBHI")
# Deliveries a home node has handed to a link and the transport has not written yet.
MAX_IN_FLIGHT = 512


def encode_table(table: dict[str, Any] | None) -> str:
    """An AMQP field table for a JSON request (its values keep their AMQP types; a byte array,
    which pamqp cannot encode, travels as a long string)."""
    if not table:
        return ""
    try:
        raw = encode.field_table(table)
    except (TypeError, ValueError):
        raw = encode.field_table(_encodable(table))
    return base64.b64encode(raw).decode()


def _encodable(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("latin-1")
    if isinstance(value, dict):
        return {key: _encodable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_encodable(item) for item in value]
    return value


def decode_table(text: str) -> dict[str, Any]:
    if not text:
        return {}
    return cast(dict[str, Any], decode.field_table(base64.b64decode(text))[1])


def encode_delivery(delivery_id: int, entry: QueueEntry) -> bytes:
    message = entry.message
    topic = message.topic.encode()
    properties = encoded_properties(message)
    return b"".join((
        DELIVERY, _DELIVERY.pack(delivery_id, entry.redelivered, len(topic), len(properties)),
        topic, properties, message.payload,
    ))


def decode_delivery(frame: bytes | memoryview) -> tuple[int, bool, Message]:
    view = memoryview(frame)
    delivery_id, redelivered, topic_size, properties_size = _DELIVERY.unpack_from(view, 1)
    position = 1 + _DELIVERY.size
    topic = bytes(view[position:position + topic_size]).decode()
    position += topic_size
    properties = bytes(view[position:position + properties_size])
    position += properties_size
    message = Message(topic, bytes(view[position:]), producer_protocol="amqp",
                      native_properties={NATIVE_FORMAT: properties})
    return delivery_id, bool(redelivered), message


_SIZE = struct.Struct(">I")


def pack_frames(frames: list[bytes]) -> bytes:
    """Frames of a consumer link in one transport message, each after its length."""
    return b"".join(_SIZE.pack(len(frame)) + frame for frame in frames)


def unpack_frames(data: bytes) -> list[bytes]:
    frames = []
    position = 0
    while position < len(data):
        (size,) = _SIZE.unpack_from(data, position)
        position += _SIZE.size
        frames.append(data[position:position + size])
        position += size
    return frames


def frame_ids(frame: bytes) -> list[int]:
    return list(struct.unpack(f">{(len(frame) - 1) // 8}Q", frame[1:]))


def pack_ids(kind: bytes, ids: list[int]) -> bytes:
    return kind + struct.pack(f">{len(ids)}Q", *ids)


