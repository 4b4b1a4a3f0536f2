"""The archive's vectorised decoder of message records (`storage.archive.decode`) against the
record format's own `encode_message` / `decode_message`: every field of every record comes
back identical, and anything malformed is refused (the archiver then decodes record by
record and names the bad record)."""

from __future__ import annotations

import struct

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shardgate.core.records import (
    MessageRecord,
    RecordFormatError,
    decode_message,
    encode_message,
)
from shardgate.storage.archive import build_table
from shardgate.storage.archive.decode import COLUMNS, decode_batch, nulls
from shardgate.storage.interfaces import StoredRecord

text = st.text(max_size=40)
blob = st.binary(max_size=80)
records = st.builds(
    MessageRecord,
    topic=text,
    payload=blob,
    qos=st.integers(0, 2),
    retain=st.booleans(),
    publish_time_ms=st.integers(-(2**63), 2**63 - 1),
    key=st.none() | blob,
    headers=st.none() | st.lists(st.tuples(text, text), max_size=5),
    content_type=st.none() | text,
    correlation_data=st.none() | blob,
    reply_to=st.none() | text,
    payload_format=st.none() | st.integers(0, 1),
    expires_at_ms=st.none() | st.integers(-(2**63), 2**63 - 1),
    producer_protocol=st.sampled_from(["", "mqtt", "amqp", "grpc"]),
    producer_id=text,
    native_properties=st.none() | st.dictionaries(
        st.text("abcdefghij-0123456789", min_size=1, max_size=12), blob, max_size=3),
)


def expected(data: bytes) -> dict:
    m = decode_message(data)
    return {
        "topic": m.topic, "key": m.key, "payload": m.payload, "headers": m.headers,
        "content_type": m.content_type, "producer_protocol": m.producer_protocol,
        "producer_id": m.producer_id, "qos": m.qos, "retain": m.retain,
        "correlation_data": m.correlation_data, "reply_to": m.reply_to,
        "payload_format": m.payload_format, "expires_at": m.expires_at_ms,
        "native_properties": list(m.native_properties.items()) if m.native_properties else None,
    }


def decoded_rows(datas: list[bytes]) -> list[dict]:
    columns = decode_batch(datas)
    assert columns is not None
    assert set(columns) == set(COLUMNS)
    assert all(len(array) == len(datas) for array in columns.values())
    lists = {name: array.to_pylist() for name, array in columns.items()}
    return [{name: lists[name][i] for name in COLUMNS} for i in range(len(datas))]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(records, max_size=30))
def test_round_trip_against_encode_message(messages: list[MessageRecord]) -> None:
    datas = [encode_message(m) for m in messages]
    assert decoded_rows(datas) == [expected(d) for d in datas]


def test_types_match_the_archive_schema() -> None:
    datas = [encode_message(MessageRecord(
        "a/b", b"x", 1, True, 5, key=b"k", headers=[("h", "v")], content_type="c",
        correlation_data=b"c", reply_to="r", payload_format=1, expires_at_ms=9,
        producer_protocol="mqtt", producer_id="p", native_properties={"f": b"x"}))]
    columns = decode_batch(datas)
    assert columns is not None
    table = build_table("s", 0, "bytes", [StoredRecord(0, 5, datas[0])])
    for name in COLUMNS:
        if name not in ("expires_at",):
            assert columns[name].type == table.schema.field(name).type, name
    assert columns["expires_at"].type == pa.int64()


def test_empty_batch() -> None:
    assert decoded_rows([]) == []


def test_headers_only_on_some_records_and_empty_headers() -> None:
    plain = encode_message(MessageRecord("t", b"p", 0, False, 1))
    with_headers = encode_message(MessageRecord("t", b"p", 0, False, 1,
                                                headers=[("a", "1"), ("b", "")]))
    # the flag set with a count of zero (no encoder writes it, the format allows it)
    empty = bytearray(plain)
    empty[1] = 2
    empty[12 + 4 + 1 + 4 + 1:12 + 4 + 1 + 4 + 1] = struct.pack("<H", 0)
    datas = [plain, with_headers, bytes(empty), plain]
    assert decoded_rows(datas) == [expected(d) for d in datas]


def malformed_variants() -> list[bytes]:
    good = encode_message(MessageRecord("topic", b"payload", 1, False, 1,
                                        headers=[("k", "v")], producer_id="me"))
    bad_utf8 = encode_message(MessageRecord("t\u00e9", b"p", 1, False, 1))
    bad_utf8 = bad_utf8.replace(b"t\xc3\xa9", b"t\xff\xfe")
    return [
        good[:-1],  # truncated
        good[:5],  # shorter than the fixed head
        bytes([3]) + good[1:],  # another version
        good[:12] + struct.pack("<I", 10_000) + good[16:],  # topic overruns the record
        bad_utf8,
        good[:2] + bytes([200]) + good[3:],  # QoS outside int8
    ]


@pytest.mark.parametrize("bad", malformed_variants())
def test_malformed_records_are_refused(bad: bytes) -> None:
    good = encode_message(MessageRecord("t", b"p", 0, False, 1))
    assert decode_batch([good, bad, good]) is None


@pytest.mark.parametrize("bad", malformed_variants()[:5])
def test_build_table_names_the_malformed_record(bad: bytes) -> None:
    good = encode_message(MessageRecord("t", b"p", 0, False, 1))
    stored = [StoredRecord(0, 1, good), StoredRecord(1, 1, bad), StoredRecord(2, 1, good)]
    with pytest.raises(RecordFormatError, match="offset 1"):
        build_table("s", 0, "bytes", stored)


@settings(deadline=None)
@given(st.lists(records, min_size=1, max_size=8), st.data())
def test_garbage_never_crashes(messages: list[MessageRecord], data: st.DataObject) -> None:
    """Arbitrary byte damage: either refused, or decoded exactly as `decode_message` does."""
    datas = [bytearray(encode_message(m)) for m in messages]
    index = data.draw(st.integers(0, len(datas) - 1))
    target = datas[index]
    position = data.draw(st.integers(0, len(target) - 1))
    target[position] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(target)))
    datas[index] = target[:cut]
    raw = [bytes(d) for d in datas]
    columns = decode_batch(raw)
    if columns is None:
        return
    try:
        wanted = [expected(d) for d in raw]
    except RecordFormatError:
        pytest.fail("decode_batch accepted a record decode_message refuses")
    assert decoded_rows(raw) == wanted



def test_an_empty_native_properties_section_reads_as_none_as_a_message_does() -> None:
    """A record flagged with native properties whose section holds none (a count of 0): the
    archive column is null, as `decode_message` gives no native properties."""
    with_one = encode_message(MessageRecord(topic="t", payload=b"x", qos=1, retain=False,
                                            publish_time_ms=1, native_properties={"a": b"1"}))
    section = with_one.index(b"\x01\x01a")
    empty = with_one[:section] + b"\x00" + with_one[section + 1 + 1 + 1 + 4 + 1:]
    assert not decode_message(empty).native_properties
    assert decoded_rows([empty]) == [expected(empty)]


def test_columns_of_nulls_share_one_array_per_type_and_are_nulls_of_the_length_asked() -> None:
    headers = pa.map_(pa.string(), pa.string())
    for rows in (65536, 3, 65536, 0, 70000, 12):
        for type_ in (pa.string(), pa.int64(), headers):
            array = nulls(rows, type_)
            assert array.type == type_ and len(array) == rows and array.null_count == rows
            assert array.equals(pa.nulls(rows, type_))
    # a shorter one is a slice of the one kept: no buffer allocated for it
    big, small = nulls(70000, pa.int64()), nulls(100, pa.int64())
    assert small.buffers()[1].address == big.buffers()[1].address
