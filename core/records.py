"""The record format of a message in a shard log (journal) and in the archive's source data.

The format belongs to the core (the journal, the archive and the cluster's frames all store
or carry it; `storage` imports it from here). `encode_message` encodes a core `Message` (or a
`MessageRecord`, the same fields without a place in a shard); `encode_records` encodes the
messages of one read at once, as journal records. Going back, `decode_message`
returns a `MessageRecord` (what the archive's columns are built from) and `decode_to_message`
a core `Message` at its place in a shard: that function is the one conversion from a record to
a `Message` (`message_from_record` is its second half, for a record already decoded).

Layout (little endian), version 2:

    u8 version | u8 present-flags | u8 qos | u8 retain | i64 publish_time_ms
    u32 len + topic (UTF-8) | u32 len + payload
    then, for each flag set, in this order:
    key (u32 len + bytes), headers (u16 count, then u16 len + key, u32 len + value per entry),
    content_type (u16 len + UTF-8), correlation_data (u32 len + bytes), reply_to (u16 len + UTF-8),
    payload_format (u8), expires_at_ms (i64)
    u16 len + producer_protocol | u16 len + producer_id
    then, if F_NATIVE is set (version 2 only): native properties,
    u8 count, then u8 len + format name (ASCII), u32 len + bytes per entry

Native properties are the exact encoding of a message's properties in the format of the
protocol that sent them (e.g. `amqp-0-9-1`: an AMQP content header's property flags and
property list, typed header table included), for what the common fields cannot say. This
module keeps them as opaque bytes; the protocol that owns a format reads it back.

Version 1 is version 2 without native properties: version 1 records (journals written before
native properties existed) decode unchanged. Every record is written as version 2, so an older
reader refuses it rather than silently dropping the native properties.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from .message import Message

VERSION = 2
READABLE_VERSIONS = frozenset((1, 2))
_HEAD = struct.Struct("<BBBBq")
_U32 = struct.Struct("<I")
_U16 = struct.Struct("<H")
_I64 = struct.Struct("<q")

F_KEY, F_HEADERS, F_CONTENT_TYPE, F_CORRELATION, F_REPLY_TO, F_FORMAT, F_EXPIRY, F_NATIVE = (
    1, 2, 4, 8, 16, 32, 64, 128
)


class RecordFormatError(ValueError):
    pass


@dataclass(slots=True)
class MessageRecord:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    publish_time_ms: int
    key: bytes | None = None
    headers: list[tuple[str, str]] | None = None
    content_type: str | None = None
    correlation_data: bytes | None = None
    reply_to: str | None = None
    payload_format: int | None = None
    expires_at_ms: int | None = None
    producer_protocol: str = ""
    producer_id: str = ""
    native_properties: dict[str, bytes] | None = None


def encode_native_properties(native: dict[str, bytes]) -> bytes:
    """The native properties section (count, then name and bytes per format)."""
    if len(native) > 255:
        raise RecordFormatError("a message carries at most 255 native property formats")
    parts = [bytes((len(native),))]
    for name, data in native.items():
        name_bytes = name.encode("ascii")
        if len(name_bytes) > 255:
            raise RecordFormatError(f"native property format name too long: {name!r}")
        parts += (bytes((len(name_bytes),)), name_bytes, _U32.pack(len(data)), data)
    return b"".join(parts)


def decode_native_properties(data: bytes | memoryview) -> dict[str, bytes]:
    """The inverse of `encode_native_properties` (the section alone, nothing after it)."""
    native, end = native_properties_at(memoryview(data), 0)
    if end != len(data):
        raise RecordFormatError("trailing bytes after native properties")
    return native


def native_properties_at(view: memoryview, pos: int) -> tuple[dict[str, bytes], int]:
    try:
        count = view[pos]
        pos += 1
        native: dict[str, bytes] = {}
        for _ in range(count):
            size = view[pos]
            name = bytes(view[pos + 1 : pos + 1 + size]).decode("ascii")
            pos += 1 + size
            (size,) = _U32.unpack_from(view, pos)
            pos += 4
            if pos + size > len(view):
                raise RecordFormatError("truncated native properties")
            native[name] = bytes(view[pos : pos + size])
            pos += size
    except (struct.error, UnicodeDecodeError, IndexError) as exc:
        raise RecordFormatError(f"malformed native properties: {exc}") from exc
    return native, pos


# The fixed head and the topic's length: one pack for a message of topic and payload only.
_HEAD_TOPIC = struct.Struct("<BBBBqI")
# Encoded producer fields (u16 len + protocol, u16 len + id) by (protocol, id): a publisher
# sends many messages, each ending with the same bytes.
_producer_tails: dict[tuple[str, str], bytes] = {}
_PRODUCER_TAILS_LIMIT = 4096


def _producer_tail(protocol: str, producer_id: str) -> bytes:
    tail = _producer_tails.get((protocol, producer_id))
    if tail is None:
        protocol_bytes = protocol.encode()
        producer = producer_id.encode()
        tail = b"".join(
            (_U16.pack(len(protocol_bytes)), protocol_bytes, _U16.pack(len(producer)), producer)
        )
        if len(_producer_tails) >= _PRODUCER_TAILS_LIMIT:
            _producer_tails.clear()
        _producer_tails[(protocol, producer_id)] = tail
    return tail


def forget_producer_tails() -> None:
    """Empty the producer field cache (see `forget_topic_fields` in the MQTT encoders: an
    idle broker keeps nothing per producer of the last load)."""
    _producer_tails.clear()


def encode_message(message: Message | MessageRecord) -> bytes:
    if (
        message.key is None and not message.headers and message.content_type is None
        and message.correlation_data is None and message.reply_to is None
        and message.payload_format is None and message.expires_at_ms is None
        and not message.native_properties
    ):
        # The common message (topic and payload only, no flag set): four parts, one join.
        topic = message.topic.encode()
        payload = message.payload
        return b"".join((
            _HEAD_TOPIC.pack(VERSION, 0, message.qos, 1 if message.retain else 0,
                             message.publish_time_ms, len(topic)),
            topic, _U32.pack(len(payload)), payload,
            _producer_tail(message.producer_protocol, message.producer_id),
        ))
    flags = 0
    parts: list[bytes] = []
    topic = message.topic.encode()
    payload = message.payload
    if message.key is not None:
        flags |= F_KEY
        parts += (_U32.pack(len(message.key)), message.key)
    if message.headers:
        flags |= F_HEADERS
        parts.append(_U16.pack(len(message.headers)))
        for name, value in message.headers:
            name_bytes, value_bytes = name.encode(), value.encode()
            parts += (_U16.pack(len(name_bytes)), name_bytes, _U32.pack(len(value_bytes)), value_bytes)
    if message.content_type is not None:
        flags |= F_CONTENT_TYPE
        data = message.content_type.encode()
        parts += (_U16.pack(len(data)), data)
    if message.correlation_data is not None:
        flags |= F_CORRELATION
        parts += (_U32.pack(len(message.correlation_data)), message.correlation_data)
    if message.reply_to is not None:
        flags |= F_REPLY_TO
        data = message.reply_to.encode()
        parts += (_U16.pack(len(data)), data)
    if message.payload_format is not None:
        flags |= F_FORMAT
        parts.append(bytes((message.payload_format,)))
    if message.expires_at_ms is not None:
        flags |= F_EXPIRY
        parts.append(_I64.pack(message.expires_at_ms))
    protocol = message.producer_protocol.encode()
    producer = message.producer_id.encode()
    parts += (_U16.pack(len(protocol)), protocol, _U16.pack(len(producer)), producer)
    native = message.native_properties
    if native:
        flags |= F_NATIVE
        parts.append(encode_native_properties(native))
    return b"".join((
        _HEAD.pack(VERSION, flags, message.qos, 1 if message.retain else 0, message.publish_time_ms),
        _U32.pack(len(topic)), topic, _U32.pack(len(payload)), payload, *parts,
    ))


def encode_records(messages: Sequence[Message]) -> list[tuple[int, bytes]]:
    """The journal records, (publish time, encoded message), of `messages`: what
    `encode_message` gives for each, with the topic and producer fields encoded once for a
    run of messages that repeat them (the messages of one read)."""
    records: list[tuple[int, bytes]] = []
    append = records.append
    join = b"".join
    pack_head = _HEAD_TOPIC.pack
    pack_u32 = _U32.pack
    topic: str | None = None
    topic_bytes = b""
    protocol: str | None = None
    producer: str | None = None
    tail = b""
    for message in messages:
        native = message.native_properties
        if (
            message.key is None and not message.headers and message.content_type is None
            and message.correlation_data is None and message.reply_to is None
            and message.payload_format is None and message.expires_at_ms is None
            and (not native or len(native) == 1)
        ):
            if message.topic != topic:
                topic = message.topic
                topic_bytes = topic.encode()
            if message.producer_id != producer or message.producer_protocol != protocol:
                protocol, producer = message.producer_protocol, message.producer_id
                tail = _producer_tail(protocol, producer)
            payload = message.payload
            time_ms = message.publish_time_ms
            if not native:
                append((time_ms, join((
                    pack_head(VERSION, 0, message.qos, 1 if message.retain else 0, time_ms,
                              len(topic_bytes)),
                    topic_bytes, pack_u32(len(payload)), payload, tail,
                ))))
                continue
            # one native property (a producer's identity, say): its section follows the tail
            ((name, data),) = native.items()
            append((time_ms, join((
                pack_head(VERSION, F_NATIVE, message.qos, 1 if message.retain else 0, time_ms,
                          len(topic_bytes)),
                topic_bytes, pack_u32(len(payload)), payload, tail, _one_native_name(name),
                pack_u32(len(data)), data,
            ))))
        else:
            append((message.publish_time_ms, encode_message(message)))
    return records


# The start of a native properties section of one format, by its name.
_one_native_names: dict[str, bytes] = {}


def _one_native_name(name: str) -> bytes:
    head = _one_native_names.get(name)
    if head is None:
        name_bytes = name.encode("ascii")
        if len(name_bytes) > 255:
            raise RecordFormatError(f"native property format name too long: {name!r}")
        head = bytes((1, len(name_bytes))) + name_bytes
        if len(_one_native_names) < 64:  # (format names are few: a bound all the same)
            _one_native_names[name] = head
    return head


def decode_message(data: bytes) -> MessageRecord:
    try:
        view = memoryview(data)
        version, flags, qos, retain, publish_time = _HEAD.unpack_from(view, 0)
        if version not in READABLE_VERSIONS or (version == 1 and flags & F_NATIVE):
            raise RecordFormatError(f"message record version {version} is not supported")
        pos = _HEAD.size

        def take32() -> bytes:
            nonlocal pos
            (length,) = _U32.unpack_from(view, pos)
            pos += 4
            if pos + length > len(view):
                raise RecordFormatError("truncated message record")
            chunk = bytes(view[pos : pos + length])
            pos += length
            return chunk

        def take16() -> bytes:
            nonlocal pos
            (length,) = _U16.unpack_from(view, pos)
            pos += 2
            if pos + length > len(view):
                raise RecordFormatError("truncated message record")
            chunk = bytes(view[pos : pos + length])
            pos += length
            return chunk

        record = MessageRecord(take32().decode(), take32(), qos, bool(retain), publish_time)
        if flags & F_KEY:
            record.key = take32()
        if flags & F_HEADERS:
            (count,) = _U16.unpack_from(view, pos)
            pos += 2
            headers = []
            for _ in range(count):
                name = take16().decode()
                headers.append((name, take32().decode()))
            record.headers = headers
        if flags & F_CONTENT_TYPE:
            record.content_type = take16().decode()
        if flags & F_CORRELATION:
            record.correlation_data = take32()
        if flags & F_REPLY_TO:
            record.reply_to = take16().decode()
        if flags & F_FORMAT:
            record.payload_format = view[pos]
            pos += 1
        if flags & F_EXPIRY:
            (record.expires_at_ms,) = _I64.unpack_from(view, pos)
            pos += 8
        record.producer_protocol = take16().decode()
        record.producer_id = take16().decode()
        if flags & F_NATIVE:
            record.native_properties, pos = native_properties_at(view, pos)
        return record
    except (struct.error, UnicodeDecodeError, IndexError) as exc:
        raise RecordFormatError(f"malformed message record: {exc}") from exc


def record_topic(data: bytes | memoryview) -> str:
    """The topic of an encoded message record, without decoding the rest: a reader that
    filters by topic (a durable subscription replaying a shard) decodes only what it keeps."""
    try:
        version = data[0]
        if version not in READABLE_VERSIONS:
            raise RecordFormatError(f"message record version {version} is not supported")
        start = _HEAD.size + 4
        (length,) = _U32.unpack_from(data, _HEAD.size)
        if start + length > len(data):
            raise RecordFormatError("truncated message record")
        return bytes(data[start : start + length]).decode("utf-8")
    except (IndexError, struct.error, UnicodeDecodeError) as exc:
        raise RecordFormatError(f"malformed message record: {exc}") from exc


def message_from_record(record: MessageRecord, stream: str, shard: int, offset: int) -> Message:
    """The core `Message` of a decoded record, at `offset` of `shard` of `stream` (offset -1,
    stream "": a message kept outside the shard logs, e.g. retained or delayed)."""
    r = record
    return Message(
        r.topic, r.payload, r.qos, r.retain, r.key, r.headers, r.content_type,
        r.correlation_data, r.reply_to, r.payload_format, r.expires_at_ms,
        r.publish_time_ms, r.producer_protocol, r.producer_id,
        stream, shard, offset, r.native_properties,
    )


def decode_to_message(data: bytes, stream: str = "", shard: int = 0, offset: int = -1) -> Message:
    """Decode a record straight into a core `Message` (see `message_from_record`)."""
    return message_from_record(decode_message(data), stream, shard, offset)
