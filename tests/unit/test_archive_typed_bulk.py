"""JSON payloads decoded into typed columns in bulk (Arrow's JSON reader, `typed_json.py`, and
for flat scalar fields their byte layout, `typed_layout.py`) give the very columns and decoded
flags of the per-row path (`json.loads`, then `pa.array`), for valid payloads and for every kind
of payload the paths read differently, alone or mixed into a file of good rows in any order
(for the layout path: any value, key, separator or end of a row changed from its layout); and the 8-byte payloads of an `int64` stream are read as
before, without a loop per row. Every test runs twice: with the C parser of flat payloads
(`typed_native.c`) where it is built, and with the Python paths alone."""

from __future__ import annotations

import json
import os
import random
from typing import Any

import pyarrow as pa
import pytest
from shardgate.core.native import PURE_ENV
from shardgate.core.records import MessageRecord, encode_message
from shardgate.storage.archive import build_table, typed, typed_layout
from shardgate.storage.archive.columns import RESERVED
from shardgate.storage.archive.typed import TypedSchema
from shardgate.storage.interfaces import StoredRecord

SCHEMA = {"type": "object", "properties": {
    "device": {"type": "string"}, "temp": {"type": "number"}, "n": {"type": "integer"},
    "ok": {"type": "boolean"}, "offset": {"type": "integer"},
    "loc": {"type": "object", "properties": {
        "lat": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}}}}}}
FLAT = {"type": "object", "properties": {
    "device": {"type": "string"}, "temp": {"type": "number"}, "n": {"type": "integer"}}}

ODD_PAYLOADS = [
    b'{"n":1.0}', b'{"n":1e2}', b'{"n":true}', b'{"temp":true}', b'{"n":9223372036854775808}',
    b'{"n":-9223372036854775808}', b'{"n":-9223372036854775809}', b'{"temp":9007199254740993}',
    b'{"temp":-9007199254740993}', b'{"temp":9007199254740992}', b'{"temp":1e300}',
    b'{"temp":123456789012345678901234567890}', b'{"temp":1e400}', b'{"temp":NaN}',
    b'{"device":"a","device":"b"}', b'{"device":"\\ud800"}', b'{"device":5}', b'{"device":"\xff"}',
    b'{"device":"a\x01"}', b'{"device":"\\u0000"}', b'{"dev\\u0069ce":"escaped key"}',
    b'{"loc":{"lat":1,"extra":2}}', b'{"loc":{"tags":["a",1]}}', b'{"loc":{"tags":[null]}}',
    b'{"loc":{"tags":"a"}}', b'{"loc":[]}', b'{"loc":5}', b'{"loc":{"lat":12345678901234567}}',
    b'{}', b'{} ', b'{}x', b'{}{}', b'{"n":01}', b"{'n':1}", b'{"n":1,}', b'{"ok":1}',
    b'{"offset":7}', b'{"a":1}\n{"b":2}', b'{"device":"x\ny"}', b'{"n":\n1}', b'{"n":1}\n\n',
    b'{"n":1}\r\n', b'', b' {"n":1}', b'\xef\xbb\xbf{"n":1}', b'5', b'[1]', b'null',
    '{"device":"é"}'.encode("utf-16"), b'{"x":{"y":[1,2,{}]}}', b'{"device":"a"} \t',
]


@pytest.fixture(autouse=True, params=["c-parser", "python"])
def parser(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which flat-payload path runs: the C parser (required where the package is built, as
    CI builds it) or the Python paths alone."""
    if request.param == "python":
        monkeypatch.setattr(typed, "_NATIVE", None)
    elif os.environ.get(PURE_ENV) == "1":
        pytest.skip(f"{PURE_ENV}=1: the C parser is not used")
    else:
        assert typed._NATIVE is not None, "typed_native is not built: `pip install -e .`"
    return str(request.param)


def good(i: int) -> bytes:
    return json.dumps({"device": f"d{i % 7}", "temp": i / 4, "n": i, "ok": i % 2 == 0,
                       "offset": i, "loc": {"lat": 1.5, "tags": ["a", str(i)]}}).encode()


def same(slow: list[Any], fast: list[Any]) -> bool:
    """Equal values, and -0.0 is not 0.0 (repr tells them apart), NaN is NaN."""
    return all((a == b and repr(a) == repr(b)) or (a != a and b != b)
               for a, b in zip(slow, fast, strict=True))


def check(typed: TypedSchema, payloads: list[bytes]) -> None:
    slow_arrays, slow_decoded = typed.columns(list(payloads))
    fast_arrays, fast_decoded = typed.columns_of(pa.array(payloads, pa.binary()))
    assert fast_decoded.to_pylist() == slow_decoded
    assert [a.type for a in fast_arrays] == [a.type for a in slow_arrays]
    for slow, fast in zip(slow_arrays, fast_arrays, strict=True):
        assert same(slow.to_pylist(), fast.to_pylist()), (slow, fast)


@pytest.mark.parametrize("schema", [SCHEMA, FLAT], ids=["nested", "flat"])
def test_each_odd_payload_alone_decodes_as_row_by_row(schema: dict[str, Any]) -> None:
    typed = TypedSchema("json", schema, 1, RESERVED)
    assert typed.bulk_readable
    for payload in ODD_PAYLOADS:
        check(typed, [payload])


@pytest.mark.parametrize("seed", range(12))
def test_odd_payloads_mixed_into_good_rows_decode_as_row_by_row(seed: int) -> None:
    rng = random.Random(seed)
    typed = TypedSchema("json", SCHEMA if seed % 2 else FLAT, 1, RESERVED)
    payloads = [good(i) for i in range(rng.randint(0, 400))]
    payloads += rng.sample(ODD_PAYLOADS, rng.randint(1, len(ODD_PAYLOADS)))
    rng.shuffle(payloads)
    check(typed, payloads)


def test_a_file_of_good_rows_is_read_in_one_bulk_read() -> None:
    typed = TypedSchema("json", SCHEMA, 1, RESERVED)
    payloads = [good(i) for i in range(1000)]
    check(typed, payloads)
    arrays, decoded = typed.columns_of(pa.array(payloads, pa.binary()))
    assert decoded.to_pylist() == [True] * 1000
    assert arrays[[f.name for f in typed.fields].index("value_offset")].to_pylist() == list(
        range(1000))


def test_a_schema_with_a_field_kept_as_text_is_decoded_row_by_row() -> None:
    typed = TypedSchema("json", {"type": "object", "properties": {
        "any": {"type": ["string", "number"]}, "n": {"type": "integer"}}}, 1, RESERVED)
    assert not typed.bulk_readable
    check(typed, [b'{"any":"a","n":1}', b'{"any":2}', b'{"n":"x"}'])


def test_int64_payloads_are_read_big_endian_and_other_lengths_are_null() -> None:
    payloads = [(5).to_bytes(8, "big", signed=True), b"abc", (-2**63).to_bytes(8, "big", signed=True),
                b"", (2**63 - 1).to_bytes(8, "big", signed=True), b"123456789"]
    records = [StoredRecord(i, 1000 + i, encode_message(MessageRecord("t", p, 1, False, 1000 + i)))
               for i, p in enumerate(payloads)]
    table = build_table("s", 0, "int64", records)
    assert table.column("payload_int64").to_pylist() == [5, None, -2**63, None, 2**63 - 1, None]


def test_a_row_pa_array_reads_only_alone_does_not_fail_the_whole_file() -> None:
    """`{"loc": []}` passes for a struct alone, not after a dict: the per-row path used to raise
    for the whole file (an upload retried for ever) when such a row sat beside a refused one."""
    typed = TypedSchema("json", SCHEMA, 1, RESERVED)
    arrays, decoded = typed.columns([b'{"ok":"true"}', b'{"loc":{"lat":1}}', b'{"loc":[]}'])
    assert decoded == [False, True, True]
    assert arrays[[f.name for f in typed.fields].index("loc")].to_pylist() == [
        None, {"lat": 1.0, "tags": None}, {"lat": None, "tags": None}]


SCALARS = {"type": "object", "properties": {
    "device": {"type": "string"}, "temp": {"type": "number"}, "n": {"type": "integer"},
    "ok": {"type": "boolean"}, "offset": {"type": "integer"}}}
NUMBER_TEXTS = ["0", "-0", "-0.0", "1", "-12", "3.25", "1e3", "1E+3", "2.5e-3", "01", "1.",
                ".5", "+1", "1e", "9007199254740992", "9007199254740993", "-9007199254740993",
                "123456789012345678", "1234567890123456789", "9223372036854775808", "1e400",
                "-1e400", "NaN", "Infinity", "0.1", "1.7976931348623157e308", "5e-324", "1.0",
                "true", "null", '"1"', "0x10", "1_000", "١"]
STRING_TEXTS = ['"dev-1"', '""', '"é"', '"\\u00e9"', '"a\\"b"', '"tab\there"', '"\\n"', '"😀"',
                '"a/b"', '"\\/"', "5", "null", '"x\\u0000"', '"\x7f"', '"ʼ"']


def layout_payload(rng: random.Random, spaced: bool) -> bytes:
    """A flat payload of one of two serializers' layouts, most of them well formed, some with
    a value, a key, a separator or the end of the row changed."""
    comma, colon = (", ", ": ") if spaced else (",", ":")
    fields = [("device", json.dumps(f"d{rng.randint(0, 9)}")),
              ("temp", repr(rng.randint(-500, 500) / 8)), ("n", str(rng.randint(-5, 5))),
              ("ok", rng.choice(["true", "false"])), ("offset", str(rng.randint(0, 99)))]
    change = rng.random()
    if change < 0.3:
        index = rng.randrange(len(fields))
        name = fields[index][0]
        texts = STRING_TEXTS if name == "device" else NUMBER_TEXTS
        fields[index] = (name, rng.choice(texts + ["true", "false", "TRUE", "null"]))
    elif change < 0.35:
        fields.pop(rng.randrange(len(fields)))
    elif change < 0.4:
        fields.insert(rng.randrange(len(fields)), ("extra", "1"))
    elif change < 0.45:
        fields.insert(rng.randrange(len(fields)), fields[rng.randrange(len(fields))])
    elif change < 0.5:
        rng.shuffle(fields)
    body = comma.join(f'"{name}"{colon}{value}' for name, value in fields)
    text = "{" + body + "}"
    if change > 0.97:
        text = rng.choice([" " + text, text + " ", text + "\n", text[:-1], text + "}",
                           text.replace('"', "'", 2), text.replace(colon, colon + " ", 1)])
    return text.encode()


@pytest.mark.parametrize("seed", range(16))
def test_payloads_of_a_byte_layout_decode_as_row_by_row(seed: int) -> None:
    """The layout path (`typed_layout.py`) takes exactly the rows it reads as the per-row
    path does, whatever a row changes in the layout of the others (a value, a key, the end)."""
    rng = random.Random(seed)
    typed = TypedSchema("json", SCALARS, 1, RESERVED)
    assert typed.layout_readable
    spaced = seed % 2 == 0
    payloads = [layout_payload(rng, spaced) for _ in range(rng.randint(1, 600))]
    if seed % 4 == 1:  # a second serializer's layout mixed in
        payloads += [layout_payload(rng, not spaced) for _ in range(rng.randint(1, 200))]
        rng.shuffle(payloads)
    if seed % 4 == 3:
        payloads += rng.sample(ODD_PAYLOADS, 8)
        rng.shuffle(payloads)
    check(typed, payloads)


def test_each_value_text_in_a_layout_row_decodes_as_row_by_row() -> None:
    typed = TypedSchema("json", SCALARS, 1, RESERVED)
    values = {"device": '"a"', "temp": "1.5", "n": "2", "ok": "true"}

    def row(changed: dict[str, str]) -> bytes:
        fields = {**values, **changed}
        return ("{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}").encode()

    for name, texts in (("temp", NUMBER_TEXTS), ("n", NUMBER_TEXTS), ("device", STRING_TEXTS),
                        ("ok", ["true", "false", "True", "1", "null", '"true"'])):
        for text in texts:
            check(typed, [row({}), row({name: text})])
            check(typed, [row({name: text}), row({}), row({name: text})])


def test_a_file_of_one_layout_is_read_by_its_layout() -> None:
    typed = TypedSchema("json", SCALARS, 1, RESERVED)
    payloads = [json.dumps({"device": f"d{i}", "temp": i / 3, "n": i, "ok": i % 2 == 0,
                            "offset": -i}).encode() for i in range(500)]
    schema = pa.schema([pa.field(name, f.type) for name, f in zip(typed.names, typed.fields, strict=True)])
    layout = typed_layout.layout_of(payloads[0], list(typed.names),
                                    [typed_layout.KINDS[f.type] for f in typed.fields])
    assert layout is not None
    read = typed_layout.read_layout(pa.array(payloads, pa.binary()), layout, schema)
    assert read is not None and read[1].all()
    check(typed, payloads)
    sliced = typed.columns_of(pa.array(payloads, pa.binary()).slice(123, 200))
    assert sliced[0][0].to_pylist() == [f"d{i}" for i in range(123, 323)]
    assert sliced[1].to_pylist() == [True] * 200


def test_payloads_of_no_common_layout_decode_as_row_by_row() -> None:
    """Keys in a different order in each row: no layout fits the first rows, so the file goes
    to Arrow's reader (and the layout is not tried on the whole file)."""
    rng = random.Random(7)
    typed = TypedSchema("json", SCALARS, 1, RESERVED)
    payloads = []
    for i in range(300):
        fields = [("device", f"d{i}"), ("temp", i / 2), ("n", i), ("ok", i % 3 == 0)]
        rng.shuffle(fields)
        payloads.append(json.dumps(dict(fields)).encode())
    check(typed, payloads)
