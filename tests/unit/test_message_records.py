"""The message record format: every field and every protocol's native properties survive
encode/decode exactly, and records of the previous format version still read."""

from __future__ import annotations

import datetime
import decimal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pamqp import commands, header
from shardgate.core.message import Message
from shardgate.core.records import (
    VERSION,
    RecordFormatError,
    decode_message,
    decode_native_properties,
    decode_to_message,
    encode_message,
    encode_native_properties,
)
from shardgate.protocols.amqp.properties import (
    NATIVE_FORMAT,
    content_header_payload,
    encoded_properties,
    message_from_properties,
)
from shardgate.storage.archive import build_table, records_from_table
from shardgate.storage.archive.columns import encode_parquet
from shardgate.storage.archive.decode import decode_batch
from shardgate.storage.interfaces import StoredRecord

# A version 1 record as Shardgate wrote it before native properties existed (topic sensors/t1,
# payload b"\0hello", QoS 1, key k1, headers a=1 b=x a=2, content type text/plain, correlation
# data 01 02, reply-to replies/1, payload format 1, expiry and publish time, mqtt / dev-1).
VERSION_1_RECORD = bytes.fromhex(
    "017f0100b49f5e09a20100000a00000073656e736f72732f7431060000000068656c6c6f020000006b3103"
    "000100610100000031010062010000007801006101000000320a00746578742f706c61696e020000000102"
    "09007265706c6965732f310100c15f09a201000004006d71747405006465762d31"
)


def test_record_written_in_version_1_still_reads() -> None:
    record = decode_message(VERSION_1_RECORD)
    assert (record.topic, record.payload, record.qos, record.retain) == ("sensors/t1", b"\0hello", 1, False)
    assert record.key == b"k1"
    assert record.headers == [("a", "1"), ("b", "x"), ("a", "2")]
    assert record.content_type == "text/plain"
    assert record.correlation_data == b"\x01\x02"
    assert record.reply_to == "replies/1"
    assert record.payload_format == 1
    assert record.expires_at_ms == 1795453600000
    assert record.publish_time_ms == 1795453525940
    assert (record.producer_protocol, record.producer_id) == ("mqtt", "dev-1")
    assert record.native_properties is None


def test_every_field_round_trips_in_the_current_version() -> None:
    message = Message(
        "a/b", b"\xff\x00", qos=2, retain=True, key=b"", headers=[("k", "1"), ("k", ""), ("é", "ü")],
        content_type="", correlation_data=b"", reply_to="", payload_format=0, expires_at_ms=-5,
        publish_time_ms=123, producer_protocol="mqtt", producer_id="c",
        native_properties={NATIVE_FORMAT: b"\x00\x00", "other": b""},
    )
    data = encode_message(message)
    assert data[0] == VERSION == 2
    copy = decode_to_message(data, "s", 3, 9)
    for name in ("topic", "payload", "qos", "retain", "key", "headers", "content_type",
                 "correlation_data", "reply_to", "payload_format", "expires_at_ms",
                 "publish_time_ms", "producer_protocol", "producer_id", "native_properties"):
        assert getattr(copy, name) == getattr(message, name), name
    assert (copy.stream, copy.shard, copy.offset) == ("s", 3, 9)


def test_unknown_versions_and_malformed_native_properties_are_refused() -> None:
    data = bytearray(encode_message(Message("t", b"p", native_properties={"f": b"xyz"})))
    with pytest.raises(RecordFormatError, match="version 3"):
        decode_message(bytes([3]) + bytes(data[1:]))
    with pytest.raises(RecordFormatError):  # version 1 had no native properties
        decode_message(bytes([1]) + bytes(data[1:]))
    with pytest.raises(RecordFormatError):
        decode_message(bytes(data[:-1]))
    with pytest.raises(RecordFormatError):
        decode_native_properties(encode_native_properties({"f": b"x"}) + b"!")


def decode_properties(raw: bytes) -> commands.Basic.Properties:
    content = header.ContentHeader()
    content.unmarshal(content_header_payload(raw, 0))
    return content.properties


def amqp_properties() -> commands.Basic.Properties:
    """Basic properties using every property and every field-table value type."""
    stamp = datetime.datetime(2026, 11, 23, 17, 4, 33, tzinfo=datetime.UTC)
    return commands.Basic.Properties(
        content_type="application/json", content_encoding="utf-8",
        headers={
            "void": None, "true": True, "false": False,
            "short-short": 7, "short": -300, "long": 70000, "long-long": 2**40,
            "float": 1.5, "decimal": decimal.Decimal("3.14"), "timestamp": stamp,
            "bytes": bytearray(b"\x00\xff"), "long-string": "x" * 300,
            "table": {"nested": {"deep": [1, "a", None]}},
            "array": [1, "two", 3.25, True, None, {"k": "v"}, [2]],
            "eta": None,
        },
        delivery_mode=2, priority=5, correlation_id="corr-1", reply_to="amq.rabbitmq.reply-to",
        expiration="60000", message_id="m-1", timestamp=stamp, message_type="task",
        user_id="guest", app_id="app", cluster_id="",
    )


def test_amqp_typed_headers_and_basic_properties_survive_the_record() -> None:
    props = amqp_properties()
    raw = props.marshal()
    message = message_from_properties("$amqp/x/k", b"body", props, "conn-1", raw)
    again = decode_to_message(encode_message(message), "s", 0, 1)
    assert encoded_properties(again) == raw
    decoded = decode_properties(encoded_properties(again))
    assert decoded.headers == props.headers
    for name in ("content_type", "content_encoding", "delivery_mode", "priority", "correlation_id",
                 "reply_to", "expiration", "message_id", "timestamp", "message_type", "user_id",
                 "app_id"):
        assert getattr(decoded, name) == getattr(props, name), name
    types = {k: type(v) for k, v in decoded.headers.items()}
    assert types == {k: type(v) for k, v in props.headers.items()}


def _field(name: str, tag: bytes, value: bytes) -> bytes:
    return bytes((len(name),)) + name.encode() + tag + value


# A header table written with every field type tag RabbitMQ knows (AMQP 0-9-1 errata), each
# integer in its own width: a re-encoding by value would pick other widths and tags.
WIDTH_TABLE = b"".join([
    _field("void", b"V", b""),
    _field("bool", b"t", b"\x01"),
    _field("i8", b"b", b"\xfe"),
    _field("u8", b"B", b"\x01"),
    _field("i16", b"s", (-2).to_bytes(2, "big", signed=True)),
    _field("u16", b"u", (1).to_bytes(2, "big")),
    _field("i32", b"I", (1).to_bytes(4, "big", signed=True)),
    _field("u32", b"i", (1).to_bytes(4, "big")),
    _field("i64", b"l", (1).to_bytes(8, "big", signed=True)),
    _field("float", b"f", bytes.fromhex("3fc00000")),
    _field("double", b"d", bytes.fromhex("3ff8000000000000")),
    _field("decimal", b"D", b"\x02" + (314).to_bytes(4, "big", signed=True)),
    _field("timestamp", b"T", (1795453525).to_bytes(8, "big")),
    _field("bytes", b"x", (2).to_bytes(4, "big") + b"\x00\xff"),
    _field("text", b"S", (3).to_bytes(4, "big") + b"abc"),
    _field("table", b"F", (4).to_bytes(4, "big") + _field("n", b"b", b"\x01")),
    _field("array", b"A", (4).to_bytes(4, "big") + b"b\x01B\x02"),
])
WIDTH_PROPERTIES = b"\x20\x00" + len(WIDTH_TABLE).to_bytes(4, "big") + WIDTH_TABLE


def test_header_widths_and_tags_survive_byte_for_byte() -> None:
    props = decode_properties(WIDTH_PROPERTIES)  # what the AMQP connection parses
    assert props.headers is not None and props.headers["i8"] == -2
    message = message_from_properties("$amqp/x/k", b"", props, "conn-1", WIDTH_PROPERTIES)
    again = decode_to_message(encode_message(message), "s", 0, 1)
    assert encoded_properties(again) == WIDTH_PROPERTIES


def test_archive_decoder_reads_version_1_records_beside_version_2() -> None:
    current = encode_message(Message("t", b"p", native_properties={"f": b"\0"}))
    columns = decode_batch([VERSION_1_RECORD, current, VERSION_1_RECORD])
    assert columns is not None
    assert columns["headers"].to_pylist()[0] == [("a", "1"), ("b", "x"), ("a", "2")]
    assert columns["native_properties"].to_pylist() == [None, [("f", b"\0")], None]
    # version 1 never carried native properties: a record claiming both is refused
    assert decode_batch([bytes([1]) + current[1:]]) is None


def test_archive_keeps_header_order_native_properties_and_replays_them_exactly() -> None:
    mqtt = Message("m/t", b"1", headers=[("k", "2"), ("a", "1"), ("k", "0")],
                   producer_protocol="mqtt", publish_time_ms=1000)
    props = amqp_properties()
    amqp = message_from_properties("$amqp/x/k", b"2", props, "c", props.marshal())
    amqp.publish_time_ms = 1001
    widths = message_from_properties(
        "$amqp/x/k", b"3", decode_properties(WIDTH_PROPERTIES), "c", WIDTH_PROPERTIES)
    widths.publish_time_ms = 1002
    stored = [StoredRecord(0, 999, VERSION_1_RECORD)] + [
        StoredRecord(i + 1, m.publish_time_ms, encode_message(m))
        for i, m in enumerate((mqtt, amqp, widths))
    ]
    parquet = encode_parquet(build_table("s", 0, "bytes", stored))
    table = pq.read_table(pa.BufferReader(parquet))
    assert table.column("headers").to_pylist()[1] == [("k", "2"), ("a", "1"), ("k", "0")]
    assert table.column("native_properties").to_pylist()[3] == [(NATIVE_FORMAT, WIDTH_PROPERTIES)]
    replayed = [decode_to_message(r.data, "s", 0, r.offset)
                for r in records_from_table(table)]
    assert replayed[1].headers == mqtt.headers
    assert encoded_properties(replayed[2]) == props.marshal()
    assert encoded_properties(replayed[3]) == WIDTH_PROPERTIES
    assert replayed[0].headers == [("a", "1"), ("b", "x"), ("a", "2")]
    # a file of archive format 1 has no native_properties column: it still replays
    old = table.drop_columns(["native_properties"])
    assert [r.offset for r in records_from_table(old)] == [0, 1, 2, 3]


def test_amqp_header_values_as_text_for_other_protocols() -> None:
    from shardgate.protocols.amqp.properties import header_text

    stamp = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    assert [header_text(v) for v in (None, True, False, 7, "s", decimal.Decimal("3.14"))] == [
        "", "true", "false", "7", "s", "3.14"]
    assert header_text({"a": [1, None, b"x", stamp]}) == '{"a":[1,null,"x","2026-01-01T00:00:00+00:00"]}'
    assert header_text(b"ok") == "ok"
    assert header_text(b"\x00\xff") == "base64:AP8="
    assert header_text("a\x00b") == "a\ufffdb"  # an MQTT string must not hold U+0000


def test_encoding_a_read_at_once_gives_each_message_its_own_record() -> None:
    from shardgate.core.records import encode_records

    messages = [
        Message("a/1", b"x", 1, producer_protocol="mqtt", producer_id="p1"),
        Message("a/1", b"yy", 0, True, producer_protocol="mqtt", producer_id="p1"),
        Message("a/2", b"", 2, producer_protocol="mqtt", producer_id="p2"),
        Message("a/2", b"k", key=b"key", headers=[("h", "v")], content_type="text/plain",
                producer_protocol="amqp", producer_id="p2"),
        Message("a/2", b"z", producer_protocol="amqp", producer_id="p2"),
        Message("ü/3", b"z", expires_at_ms=5, native_properties={"amqp-0-9-1": b"\x00"}),
        Message("a/2", b"z", producer_protocol="grpc", producer_id="p3",
                native_properties={"shardgate-producer-id": b"\x01" * 24}),
        Message("a/2", b"z", 1, True, producer_protocol="grpc", producer_id="p3",
                native_properties={"shardgate-producer-id": b"\x02" * 24, "x": b""}),
    ]
    assert encode_records(messages) == [(m.publish_time_ms, encode_message(m)) for m in messages]
