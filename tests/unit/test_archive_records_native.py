"""The C decoder of an archive row group's message records (storage/archive/records_native.c)
against the Python path it replaces (`decode.decode_spans` over `RecordBuffer.joined`, and
`build_table`'s record-by-record decoding when that refuses a record).

For every input, generated records of every flag and both record versions, in blocks of the
journal's shape (record headers between records, empty records, blocks sliced by
`RecordBuffer.split`), then corrupted, truncated or replaced by random bytes: the C decoder
vouches for a batch exactly when `decode_spans` does, and then gives the same arrays, and
`build_table` gives the same table or raises the same error either way.

When the extension is not built these tests fail (CI builds it), unless `SHARDGATE_PURE=1`
says the pure-Python build is the one under test.
"""

from __future__ import annotations

import os
import random
import struct
from array import array
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shardgate.core.native import PURE_ENV, load_c_extension
from shardgate.core.records import MessageRecord, RecordFormatError, encode_message
from shardgate.storage.archive import build_table, decode
from shardgate.storage.archive.buffer import RecordBuffer
from shardgate.storage.archive.decode import COLUMNS, PAD_BYTES, decode_blocks, decode_spans
from shardgate.storage.journal import RecordBlock

NAME = "shardgate.storage.archive.records_native"
SLOW = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.large_base_example]


@pytest.fixture(scope="module")
def native() -> Any:
    module = load_c_extension(NAME, os.path.dirname(decode.__file__))
    if module is None:
        if os.environ.get(PURE_ENV) == "1":
            pytest.skip(f"{PURE_ENV}=1: the pure-Python build is under test")
        pytest.fail(f"{NAME} is not built or is stale: `pip install -e .` builds it")
    return module


# ---- inputs ----

text = st.text(max_size=20) | st.sampled_from(["", "\x00", "\U0010ffff", "\ud7ff\ue000", "é€𐍈"])
blob = st.binary(max_size=60)
records = st.builds(
    MessageRecord,
    topic=text,
    payload=blob,
    qos=st.integers(0, 2),
    retain=st.booleans(),
    publish_time_ms=st.integers(-(2**63), 2**63 - 1),
    key=st.none() | blob,
    headers=st.none() | st.lists(st.tuples(text, text), max_size=6),
    content_type=st.none() | text,
    correlation_data=st.none() | blob,
    reply_to=st.none() | text,
    payload_format=st.none() | st.integers(0, 127),
    expires_at_ms=st.none() | st.integers(-(2**63), 2**63 - 1),
    producer_protocol=st.sampled_from(["", "mqtt", "amqp-0-9-1", "grpc"]),
    producer_id=text,
    native_properties=st.none() | st.dictionaries(
        st.text("abcdefghij-0123456789", max_size=12), blob, max_size=3),
)


def version1(data: bytes) -> bytes:
    """The record as version 1 wrote it (the same bytes without native properties)."""
    return bytes([1]) + data[1:]


def blocks_of(datas: list[bytes], rng: random.Random, empty_every: int = 0) -> RecordBuffer:
    """The records in a few journal blocks, each a buffer with bytes before and between the
    records (as a journal's record headers are), some records empty if `empty_every`."""
    out = RecordBuffer()
    offset = 1000
    index = 0
    while index < len(datas) or not out.blocks:
        take = rng.randint(1, max(1, len(datas) - index))
        chunk = datas[index:index + take]
        index += take
        buffer = bytearray(rng.randbytes(rng.randint(0, 20)))
        starts, ends = array("q"), array("q")
        for data in chunk:
            if empty_every and rng.randrange(empty_every) == 0:
                starts.append(len(buffer))
                ends.append(len(buffer))
            buffer += rng.randbytes(rng.randint(0, 24))
            starts.append(len(buffer))
            buffer += data
            ends.append(len(buffer))
        buffer += rng.randbytes(rng.randint(0, 9))
        stamps = array("q", [rng.randint(-(2**40), 2**40) for _ in starts])
        out.extend(RecordBlock(bytes(buffer), offset, starts, ends, stamps))
        offset += len(starts) + rng.randint(0, 3)
    return out


def python_columns(records: RecordBuffer) -> tuple[dict[str, pa.Array], pa.Array, pa.Array] | None:
    """`decode_spans` of the records, as build_table's Python path calls it."""
    buffer, starts, ends, offsets, stamps = records.joined(pad=PAD_BYTES)
    present = pc.greater(ends, starts)
    starts, ends, offsets, stamps = (pc.filter(a, present) for a in (starts, ends, offsets, stamps))
    columns = decode_spans(buffer, starts, ends, padded=True)
    return None if columns is None else (columns, offsets, stamps)


def table_or_error(records: RecordBuffer) -> pa.Table | str:
    try:
        return build_table("s", 3, "bytes", records)
    except (RecordFormatError, pa.ArrowException) as exc:  # (a QoS past int8: ArrowInvalid)
        return f"{type(exc).__name__}: {exc}"


def check_same(native: Any, records: RecordBuffer, monkeypatch: pytest.MonkeyPatch,
               vouched: bool | None = None) -> bool:
    """The C decoder against `decode_spans`, and build_table with it against without it.
    Returns whether the C decoder vouched for the records."""
    from_c = decode_blocks(records.parts(), native=native)
    from_python = python_columns(records)
    assert (from_c is None) == (from_python is None)
    for allocate in (None, bytearray):  # the buffers as bytes, or from another allocator
        other = decode_blocks(records.parts(), native=native, allocate=allocate)
        assert (other is None) == (from_c is None)
        if other is not None and from_c is not None:
            assert all(other[0][name].equals(from_c[0][name]) for name in COLUMNS)
            assert other[1].equals(from_c[1]) and other[2].equals(from_c[2])
    if vouched is not None:
        assert (from_c is not None) == vouched
    if from_c is not None and from_python is not None:
        columns, offsets, stamps = from_c
        wanted, wanted_offsets, wanted_stamps = from_python
        assert list(columns) == list(COLUMNS)
        for name in COLUMNS:
            columns[name].validate(full=True)
            assert columns[name].type == wanted[name].type, name
            assert columns[name].equals(wanted[name]), name
        assert offsets.equals(wanted_offsets)
        assert stamps.equals(wanted_stamps)
    with monkeypatch.context() as patch:
        patch.setattr(decode, "NATIVE", native)
        in_c = table_or_error(records)
        patch.setattr(decode, "NATIVE", None)
        in_python = table_or_error(records)
    if isinstance(in_python, str):
        assert in_c == in_python
    else:
        assert isinstance(in_c, pa.Table)
        assert in_c.schema == in_python.schema
        assert in_c.equals(in_python)
    return from_c is not None


# ---- well-formed records ----

@settings(max_examples=300, deadline=None, suppress_health_check=SLOW)
@given(st.lists(records, max_size=25), st.randoms(use_true_random=False), st.booleans(),
       st.integers(0, 4))
def test_generated_records_decode_as_the_python_path_does(
    native: Any, monkeypatch: pytest.MonkeyPatch, messages: list[MessageRecord],
    rng: random.Random, old: bool, empty_every: int,
) -> None:
    datas = [encode_message(m) for m in messages]
    if old:  # version 1: the same records without native properties
        datas = [version1(encode_message(m)) for m in messages if not m.native_properties]
    records = blocks_of(datas, rng, empty_every)
    check_same(native, records, monkeypatch, vouched=True)


@settings(max_examples=60, deadline=None, suppress_health_check=SLOW)
@given(st.lists(records, min_size=1, max_size=30), st.randoms(use_true_random=False),
       st.integers(1, 7))
def test_blocks_sliced_into_row_groups(
    native: Any, monkeypatch: pytest.MonkeyPatch, messages: list[MessageRecord],
    rng: random.Random, rows: int,
) -> None:
    records = blocks_of([encode_message(m) for m in messages], rng, empty_every=5)
    for part in records.split(rows):
        check_same(native, part, monkeypatch, vouched=True)


def full_message(i: int) -> MessageRecord:
    return MessageRecord(
        f"t/{i}", bytes([i % 256]) * (i % 7), i % 3, i % 2 == 0, i, key=b"k%d" % i,
        headers=[("n", "v"), ("", ""), ("ü", "€")], content_type="text/plain",
        correlation_data=b"", reply_to="", payload_format=i % 2, expires_at_ms=-i,
        producer_protocol="amqp-0-9-1", producer_id="", native_properties={"amqp": b"\x00" * i},
    )


@pytest.mark.parametrize("flag", [None, "key", "headers", "content_type", "correlation_data",
                                  "reply_to", "payload_format", "expires_at_ms",
                                  "native_properties", "all"])
def test_each_flag_alone_and_on_some_records(
    native: Any, monkeypatch: pytest.MonkeyPatch, flag: str | None,
) -> None:
    full = full_message(5)
    messages = []
    for i in range(40):
        message = MessageRecord(f"t/{i}", b"p%d" % i, i % 3, i % 2 == 1, i,
                                producer_protocol="mqtt", producer_id=f"c{i}")
        if flag == "all" and i % 3:
            message = full_message(i)
        elif flag is not None and flag != "all" and i % 3:
            setattr(message, flag, getattr(full, flag))
        messages.append(message)
    records = blocks_of([encode_message(m) for m in messages], random.Random(1))
    check_same(native, records, monkeypatch, vouched=True)


def test_empty_and_many_headers(native: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = encode_message(MessageRecord("t", b"p", 0, False, 1))
    # the headers flag with a count of zero (no encoder writes it, the format allows it)
    empty = bytearray(plain)
    empty[1] = 2
    empty[12 + 4 + 1 + 4 + 1:12 + 4 + 1 + 4 + 1] = struct.pack("<H", 0)
    many = encode_message(MessageRecord(
        "t", b"p", 1, False, 1, headers=[(f"name-{j}", "v" * (j % 50)) for j in range(1000)]))
    datas = [plain, bytes(empty), many, plain, bytes(empty)]
    check_same(native, blocks_of(datas, random.Random(2)), monkeypatch, vouched=True)
    check_same(native, blocks_of([bytes(empty)], random.Random(2)), monkeypatch, vouched=True)


def test_empty_native_properties_section_reads_as_null(
    native: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    with_one = encode_message(MessageRecord("t", b"x", 1, False, 1, native_properties={"a": b"1"}))
    section = with_one.index(b"\x01\x01a")
    empty = with_one[:section] + b"\x00" + with_one[section + 1 + 1 + 1 + 4 + 1:]
    check_same(native, blocks_of([empty, with_one, empty], random.Random(3)), monkeypatch,
               vouched=True)


def test_native_properties_naming_a_format_twice_are_left_to_python(
    native: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A section with a name twice (no encoder writes it) reads as a dict: the first place,
    the last value. The C decoder leaves it to the Python path, which gives that."""
    one = encode_message(MessageRecord("t", b"x", 1, False, 1, native_properties={"a": b"1"}))
    section = one.index(b"\x01\x01a")
    entry = one[section + 1:]
    twice = one[:section] + b"\x03" + entry + b"\x01b\x00\x00\x00\x00" + b"\x01a\x01\x00\x00\x002"
    records = blocks_of([twice], random.Random(4))
    assert decode_blocks(records.parts(), native=native) is None
    with monkeypatch.context() as patch:
        patch.setattr(decode, "NATIVE", native)
        table = build_table("s", 0, "bytes", records)
    assert table.column("native_properties").to_pylist() == [[("a", b"2"), ("b", b"")]]


def test_large_payloads(native: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(5)
    messages = [MessageRecord("big", rng.randbytes(size), 1, False, 1, key=b"k" * (size // 3))
                for size in (0, 1, 65_535, 65_536, 1 << 20, 3 << 20)]
    records = blocks_of([encode_message(m) for m in messages], rng)
    check_same(native, records, monkeypatch, vouched=True)


def test_no_records_and_only_empty_records(native: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    check_same(native, RecordBuffer(), monkeypatch, vouched=True)
    empty = RecordBlock(b"abc", 7, array("q", [1, 2]), array("q", [1, 2]), array("q", [5, 6]))
    check_same(native, RecordBuffer([empty]), monkeypatch, vouched=True)


def test_many_rows_of_the_benchmark_shape(native: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    datas = [encode_message(MessageRecord(
        f"sensors/dev-{i % 500:04d}", b'{"device": "dev-%04d", "temp": 12.5}' % (i % 500), 1,
        False, i, producer_protocol="mqtt", producer_id=f"dev-{i % 500:04d}"))
        for i in range(20_000)]
    records = blocks_of(datas, random.Random(6))
    for part in records.split(7_000):
        check_same(native, part, monkeypatch, vouched=True)


# ---- bad records ----

INVALID_UTF8 = [
    b"\xff", b"\x80", b"\xc3", b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80", b"\xe0\x9f\xbf",
    b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xf0\x80\x80\x80", b"\xf0\x8f\xbf\xbf",
    b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xf8\x88\x80\x80\x80", b"\xe2\x82",
    b"\xf0\x9f\x98", b"\xc3\x28", b"\xe2\x28\xa1", b"ok\xa0", b"abcdefgh\xfe",
]
MARK = "MARK"
STRING_FIELDS = ["topic", "header name", "header value", "content_type", "reply_to",
                 "producer_protocol", "producer_id", "native name"]


def marked(field: str) -> bytes:
    """A record whose `field` holds the text MARK (the only place it occurs)."""
    message = MessageRecord("t", b"p", 1, False, 1, headers=[("h", "v")], content_type="c",
                            reply_to="r", producer_protocol="mqtt", producer_id="id",
                            native_properties={"f": b""})
    if field == "header name":
        message.headers = [("h", "v"), (MARK, "v")]
    elif field == "header value":
        message.headers = [("h", MARK)]
    elif field == "native name":
        message.native_properties = {"f": b"", MARK: b"x"}
    else:
        setattr(message, field, MARK)
    data = encode_message(message)
    assert data.count(MARK.encode()) == 1
    return data


@pytest.mark.parametrize("field", STRING_FIELDS)
@pytest.mark.parametrize("bad", INVALID_UTF8, ids=lambda b: b.hex())
def test_invalid_utf8_in_each_string_field(
    native: Any, monkeypatch: pytest.MonkeyPatch, field: str, bad: bytes,
) -> None:
    data = marked(field)
    at = data.index(MARK.encode())
    replaced = data[:at] + bad + data[at + len(MARK):]
    # the length before the field, fixed for the new size
    width = 1 if field == "native name" else 4 if field in ("topic", "header value") else 2
    length = int.from_bytes(replaced[at - width:at], "little") - len(MARK) + len(bad)
    replaced = replaced[:at - width] + length.to_bytes(width, "little") + replaced[at:]
    good = encode_message(MessageRecord("t", b"p", 0, False, 1))
    check_same(native, blocks_of([good, replaced, good], random.Random(7)), monkeypatch,
               vouched=False)


@pytest.mark.parametrize("field", STRING_FIELDS)
@pytest.mark.parametrize("fine", ["", "\x00", "é", "€", "\U0001f600", "\U0010ffff", "\ud7ff",
                                  "\ue000", "\uffff", "a" * 17])
def test_valid_utf8_edges_in_each_string_field(
    native: Any, monkeypatch: pytest.MonkeyPatch, field: str, fine: str,
) -> None:
    data = marked(field)
    at = data.index(MARK.encode())
    new = fine.encode()
    width = 1 if field == "native name" else 4 if field in ("topic", "header value") else 2
    length = int.from_bytes(data[at - width:at], "little") - len(MARK) + len(new)
    replaced = data[:at - width] + length.to_bytes(width, "little") + new + data[at + len(MARK):]
    # a non-ASCII native property name is refused (the names are ASCII), as in Python
    vouched = field != "native name" or fine.isascii()
    check_same(native, blocks_of([replaced], random.Random(8)), monkeypatch, vouched=vouched)


def test_utf8_check_against_python_exhaustively_for_short_sequences(native: Any) -> None:
    def python(data: bytes) -> bool:
        try:
            data.decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False

    for first in range(256):
        for second in range(256):
            data = bytes((first, second))
            assert native.utf8_valid(data) == python(data), data
    tails = [0x00, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xFF]
    for first in range(0xC0, 0x100):
        for second in range(256):
            for third in tails:
                for fourth in tails:
                    data = bytes((first, second, third, fourth))
                    assert native.utf8_valid(data) == python(data), data
                    assert native.utf8_valid(b"abcdefgh" + data) == python(data), data


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=40) | st.text(max_size=20).map(str.encode))
def test_utf8_check_against_python_and_arrow(native: Any, data: bytes) -> None:
    try:
        data.decode("utf-8")
        python = True
    except UnicodeDecodeError:
        python = False
    try:
        pa.array([data], pa.binary()).cast(pa.string())
        arrow = True
    except pa.ArrowInvalid:
        arrow = False
    assert native.utf8_valid(data) == python == arrow


def malformed_variants() -> list[bytes]:
    good = encode_message(MessageRecord("topic", b"payload", 1, False, 1,
                                        headers=[("k", "v")], producer_id="me"))
    with_native = encode_message(MessageRecord("t", b"p", 1, False, 1, native_properties={"a": b"1"}))
    formatted = encode_message(MessageRecord("t", b"p", 1, False, 1, payload_format=1))
    at = formatted.index(b"\x01\x00\x00", 12 + 4 + 1 + 4 + 1)
    return [
        good[:-1],  # truncated
        good[:5],  # shorter than the fixed head
        good[:12],  # the head only
        bytes([3]) + good[1:],  # another version
        bytes([0]) + good[1:],
        version1(with_native),  # version 1 with native properties
        good[:12] + struct.pack("<I", 10_000) + good[16:],  # topic overruns the record
        good[:2] + bytes([200]) + good[3:],  # QoS outside int8
        good[:2] + bytes([128]) + good[3:],
        formatted[:at] + bytes([128]) + formatted[at + 1:],  # payload format outside int8
        good[:1] + bytes([good[1] | 64]) + good[2:],  # an expiry flag without its bytes
        with_native[:-3],  # truncated native properties
        with_native + b"trailing",  # (accepted: trailing bytes are not checked)
    ]


@pytest.mark.parametrize("index", range(len(malformed_variants())))
def test_malformed_records_as_the_python_path(
    native: Any, monkeypatch: pytest.MonkeyPatch, index: int,
) -> None:
    bad = malformed_variants()[index]
    good = encode_message(MessageRecord("t", b"p", 0, False, 1))
    rng = random.Random(index)
    check_same(native, blocks_of([good, bad, good], rng), monkeypatch)
    check_same(native, blocks_of([bad], rng), monkeypatch)


@settings(max_examples=400, deadline=None, suppress_health_check=SLOW)
@given(st.lists(records, min_size=1, max_size=8), st.data(), st.randoms(use_true_random=False))
def test_corrupt_records_as_the_python_path(
    native: Any, monkeypatch: pytest.MonkeyPatch, messages: list[MessageRecord],
    data: st.DataObject, rng: random.Random,
) -> None:
    """Bytes changed and records cut short: the same arrays, or None from both (then the
    same table or the same error from build_table)."""
    datas = [bytearray(encode_message(m)) for m in messages]
    for _ in range(data.draw(st.integers(1, 3))):
        index = data.draw(st.integers(0, len(datas) - 1))
        target = datas[index]
        if target:
            position = data.draw(st.integers(0, len(target) - 1))
            target[position] = data.draw(st.integers(0, 255))
        cut = data.draw(st.integers(0, len(target)))
        if data.draw(st.booleans()):
            datas[index] = target[:cut]
    check_same(native, blocks_of([bytes(d) for d in datas], rng), monkeypatch)


@settings(max_examples=300, deadline=None, suppress_health_check=SLOW)
@given(st.lists(st.binary(max_size=80), min_size=1, max_size=6),
       st.randoms(use_true_random=False), st.booleans())
def test_random_bytes_as_the_python_path(
    native: Any, monkeypatch: pytest.MonkeyPatch, datas: list[bytes], rng: random.Random,
    headed: bool,
) -> None:
    if headed:  # a plausible head, so that decoding goes further in
        datas = [bytes([rng.choice([1, 2]), rng.randrange(256), rng.randrange(3), 0])
                 + d for d in datas]
    check_same(native, blocks_of(datas, rng), monkeypatch)


def test_positions_outside_the_buffer_are_left_to_python(native: Any) -> None:
    good = encode_message(MessageRecord("t", b"p", 0, False, 1))
    outside = RecordBlock(good, 0, array("q", [0]), array("q", [len(good) + 1]), array("q", [0]))
    negative = RecordBlock(good, 0, array("q", [-1]), array("q", [len(good)]), array("q", [0]))
    for block in (outside, negative):
        assert decode_blocks(RecordBuffer([block]).parts(), native=native) is None


def test_build_table_takes_the_c_path_for_a_record_buffer(
    native: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the C decoder loaded, build_table does not join the blocks."""
    records = blocks_of([encode_message(full_message(i)) for i in range(10)], random.Random(9))
    monkeypatch.setattr(decode, "NATIVE", native)

    def no_join(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the blocks were joined")

    monkeypatch.setattr(RecordBuffer, "joined", no_join)
    assert build_table("s", 0, "bytes", records).num_rows == 10


def test_bad_arguments_raise(native: Any) -> None:
    good = encode_message(MessageRecord("t", b"p", 0, False, 1))
    with pytest.raises(TypeError):
        native.decode_blocks([(good, array("i", [0]), array("i", [1]), array("i", [0]), 0)])
    with pytest.raises(ValueError):
        native.decode_blocks([(good, array("q", [0]), array("q", []), array("q", [0]), 0)])
    with pytest.raises(TypeError):
        native.decode_blocks([(good, array("q", [0]))])
    with pytest.raises(TypeError):
        native.decode_blocks(None)
    parts = RecordBuffer([RecordBlock(good, 0, array("q", [0]), array("q", [len(good)]),
                                      array("q", [0]))]).parts()
    with pytest.raises(BufferError):  # a read-only buffer
        native.decode_blocks(parts, lambda size: bytes(size))
    with pytest.raises(ValueError, match="too small"):
        native.decode_blocks(parts, lambda size: bytearray(max(0, size - 1)) if size else
                             bytearray(0))
    with pytest.raises(ZeroDivisionError):
        native.decode_blocks(parts, lambda size: 1 / 0)


def test_the_loaded_module_is_the_one_build_table_uses(native: Any) -> None:
    assert decode.NATIVE is native
