"""The C readers of flat JSON payloads and Avro datums (`storage/archive/typed_native.c`) give
the columns and decoded flags of the per-row path (`json.loads` or fastavro, then `pa.array`) on
generated payloads: many serializers' spellings, every scalar type in every field, escapes and
astral characters, keys outside the schema holding nested values, every Avro scalar, enum and
nullable union at its limits, and random byte damage of all of these. A row it
cannot vouch for goes to the Python paths, so the result is the per-row one either way; these
tests also check that it vouches for the ordinary rows (else it would only be slower). The
parser must be built wherever the package is (CI builds it): the tests fail without it."""

from __future__ import annotations

import json
import math
import os
import random
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from shardgate.core.native import PURE_ENV
from shardgate.storage.archive import typed
from shardgate.storage.archive.columns import RESERVED
from shardgate.storage.archive.typed import TypedSchema

SCHEMA = {"type": "object", "properties": {
    "device": {"type": "string"}, "temp": {"type": "number"}, "count": {"type": "integer"},
    "on": {"type": "boolean"}, "note": {"type": "string"}, "offset": {"type": "integer"}}}


@pytest.fixture
def native() -> Any:
    if os.environ.get(PURE_ENV) == "1":
        pytest.skip(f"{PURE_ENV}=1: the C parser is not used")
    assert typed._NATIVE is not None, "typed_native is not built: `pip install -e .`"
    return typed._NATIVE


def same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b and repr(a) == repr(b)


def check(schema: TypedSchema, payloads: pa.Array, avro: bool = False) -> np.ndarray:
    """Compare with the per-row path; returns which rows the C reader itself took."""
    slow_arrays, slow_decoded = schema.columns(payloads.to_pylist())
    fast_arrays, fast_decoded = schema.columns_of(payloads)
    assert fast_decoded.to_pylist() == slow_decoded
    for field, slow, fast in zip(schema.fields, slow_arrays, fast_arrays, strict=True):
        assert fast.type == slow.type
        for row, (a, b) in enumerate(zip(slow.to_pylist(), fast.to_pylist(), strict=True)):
            assert same(a, b), (field.name, row, payloads[row], a, b)
    binary = payloads.cast(pa.binary()) if pa.types.is_string(payloads.type) else payloads
    validity, offsets, data = binary.buffers()
    assert typed._NATIVE is not None
    buffers = (validity, offsets, data, binary.offset, len(binary),
               pa.types.is_large_binary(binary.type))
    if avro:
        assert schema._avro_plan is not None
        taken, _ = typed._NATIVE.parse_avro(*buffers, *schema._avro_plan)
    else:
        taken, _ = typed._NATIVE.parse_flat(
            *buffers, b"".join(typed.typed_layout.KINDS[f.type].encode() for f in schema.fields),
            tuple(name.encode() for name in schema.names))
    return np.frombuffer(taken, np.bool_)


def random_text(rng: random.Random) -> str:
    pools = ["abc", "dev-1", "é", "ü", "日本", "😀", "\u2028", "\x00", "\x1f", "\"", "\\", "/",
             "\ud800", "\udc00", "\uffff", "\U0010ffff", " ", "\t"]
    return "".join(rng.choice(pools) for _ in range(rng.randint(0, 6)))


def random_number(rng: random.Random) -> Any:
    return rng.choice([
        0, -0, 1, -1, 7, 2**53, 2**53 + 1, -(2**53) - 1, 10**15 - 1, 10**15, 10**18 - 1, 10**18,
        2**63 - 1, -(2**63), 2**63, 10**30, 0.0, -0.0, 0.1, 0.5, 1.5, -2.25, 1e22, 1e23, 1e-22,
        1e-23, 1e300, 5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, 123.456,
        0.30000000000000004, 9007199254740991.0, 9007199254740992.0, 4503599627370497.5,
        float("inf"), float("-inf"), float("nan"),
        rng.uniform(-1000, 1000), rng.uniform(-1e-5, 1e-5), rng.random() * 10 ** rng.randint(-30, 30),
        rng.randint(-10**6, 10**6), rng.randint(-10**17, 10**17),
    ])


def random_value(rng: random.Random, depth: int = 0) -> Any:
    choice = rng.random()
    if choice < 0.3:
        return random_text(rng)
    if choice < 0.6:
        return random_number(rng)
    if choice < 0.7:
        return rng.choice([True, False, None])
    if depth > 3:
        return None
    if choice < 0.85:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {random_text(rng): random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def typed_value(rng: random.Random, kind: str, odd: float) -> Any:
    """A value for a field of `kind`: of another type or an extreme one with about `odd`
    probability."""
    if rng.random() < odd:
        return random_value(rng)
    if kind == "string":
        return random_text(rng) if rng.random() < 0.5 else f"dev-{rng.randint(0, 999)}"
    if kind == "number":
        return random_number(rng) if rng.random() < 2 * odd else rng.uniform(-1e4, 1e4)
    if kind == "integer":
        return rng.randint(-10**12, 10**12) if rng.random() > odd else random_number(rng)
    return rng.choice([True, False, None])


def random_payload(rng: random.Random, odd: float = 0.1) -> bytes:
    document: dict[str, Any] = {}
    names = list(SCHEMA["properties"])
    rng.shuffle(names)
    for name in names:
        if rng.random() < 0.85:
            document[name] = typed_value(rng, SCHEMA["properties"][name]["type"], odd)
        if rng.random() < 0.1:
            document[random_text(rng) or "extra"] = random_value(rng)
    text = json.dumps(
        document, ensure_ascii=rng.random() < 0.5, allow_nan=True,
        separators=rng.choice([(",", ":"), (", ", ": "), (" ,", " : ")]),
        indent=rng.choice([None, None, None, 2, "\t"]),
    )
    if rng.random() < 0.1:
        text = rng.choice([" ", "\n", "\r\n", "\t"]) + text + rng.choice(["", " ", "\n"])
    if rng.random() < 0.05 and len(document) > 0:  # a key given twice
        key = next(iter(document))
        text = text[:-1] + f', {json.dumps(key)}: {json.dumps(document[key])}' + "}" \
            if text.endswith("}") else text
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate written raw (ensure_ascii=False)
        return text.encode("utf-8", "surrogatepass")


def damaged(rng: random.Random, payload: bytes) -> bytes:
    data = bytearray(payload)
    for _ in range(rng.randint(1, 3)):
        action = rng.random()
        where = rng.randint(0, len(data))
        if action < 0.4 and data:
            data[min(where, len(data) - 1)] = rng.randrange(256)
        elif action < 0.7:
            data[where:where] = bytes([rng.choice(b'{}[]",:\\ 0123456789-+.eEtfnul\x00\x80\xff')])
        elif data:
            del data[min(where, len(data) - 1)]
    return bytes(data)


@pytest.mark.parametrize("seed", range(20))
def test_generated_payloads_decode_as_row_by_row(native: Any, seed: int) -> None:
    rng = random.Random(seed)
    schema = TypedSchema("json", SCHEMA, 1, RESERVED)
    payloads = [random_payload(rng, odd=0.01 if seed % 2 else 0.15) for _ in range(400)]
    taken = check(schema, pa.array(payloads, pa.binary()))
    if seed % 2:
        assert taken.mean() > 0.5  # mostly ordinary rows: the C parser reads most


@pytest.mark.parametrize("seed", range(20))
def test_damaged_payloads_decode_as_row_by_row(native: Any, seed: int) -> None:
    rng = random.Random(1000 + seed)
    schema = TypedSchema("json", SCHEMA, 1, RESERVED)
    payloads = [damaged(rng, random_payload(rng)) if rng.random() < 0.6 else random_payload(rng)
                for _ in range(400)]
    check(schema, pa.array(payloads, pa.binary()))


def test_ordinary_payloads_are_all_taken_by_the_c_parser(native: Any) -> None:
    """Every serializer's spelling of ordinary values (spacing, key order, escapes, non-ASCII
    text, integers in a number field, a null, a key outside the schema) is read in C."""
    rng = random.Random(5)
    schema = TypedSchema("json", SCHEMA, 1, RESERVED)
    payloads = []
    for i in range(500):
        document = {"device": f"dev-{i}", "temp": rng.choice([i / 8, i, -i / 3, 1e-7 * i]),
                    "count": i * 1000, "on": i % 2 == 0, "note": rng.choice(["é😀", "a\"b\\c\n", None])}
        if i % 5 == 0:
            document["extra"] = {"nested": [1, {"x": None}], "s": "t"}
        items = list(document.items())
        rng.shuffle(items)
        payloads.append(json.dumps(dict(items), ensure_ascii=i % 2 == 0,
                                   indent=2 if i % 7 == 0 else None).encode())
    taken = check(schema, pa.array(payloads, pa.binary()))
    assert taken.all()


def test_rows_the_c_parser_leaves_are_the_ones_it_cannot_vouch_for(native: Any) -> None:
    schema = TypedSchema("json", SCHEMA, 1, RESERVED)
    left = [b'{"temp": 12345678901234567}', b'{"count": 1.0}', b'{"count": 1e2}',
            b'{"device": "\\ud800"}', b'{"device": "a", "device": "b"}', b'{"temp": NaN}',
            b'{"temp": 1e400}', b'{"temp": 9007199254740992}', b'{"x": ' + b"[" * 70 + b"]" * 70 + b"}",
            b'\xef\xbb\xbf{}', b'{"device": "\xed\xa0\x80"}', b'{"device": "\xc0\xaf"}',
            b'{"device": 5}', b'{"on": 1}', b'{"count": "1"}', b'', b'[]', b'{"a":1}x']
    taken = check(schema, pa.array(left + [b'{"device": "ok"}'], pa.binary()))
    assert taken.tolist() == [False] * len(left) + [True]


def test_sliced_large_and_null_payloads(native: Any) -> None:
    schema = TypedSchema("json", SCHEMA, 1, RESERVED)
    payloads = [json.dumps({"device": f"d{i}", "temp": i / 2, "count": i}).encode()
                if i % 9 else None for i in range(300)]
    array = pa.array(payloads, pa.binary())
    check(schema, array.slice(17, 200))
    check(schema, array.slice(299, 1))
    check(schema, array.slice(5, 0))
    check(schema, pa.array(payloads, pa.large_binary()).slice(3, 250))
    check(schema, pa.array([p.decode() if p else None for p in payloads], pa.string()))


def test_bad_arguments_are_errors_not_crashes(native: Any) -> None:
    array = pa.array([b'{"a": 1}', b'{"a": 2}'], pa.binary())
    validity, offsets, data = array.buffers()
    with pytest.raises(ValueError):  # more rows than the offsets hold
        native.parse_flat(validity, offsets, data, 0, 5, False, b"i", (b"a",))
    with pytest.raises(ValueError):  # a kind it does not know
        native.parse_flat(validity, offsets, data, 0, 2, False, b"x", (b"a",))
    with pytest.raises(ValueError):  # kinds and names of different lengths
        native.parse_flat(validity, offsets, data, 0, 2, False, b"ii", (b"a",))
    with pytest.raises(ValueError):  # offsets pointing past the data
        native.parse_flat(validity, pa.py_buffer(np.array([0, 99], np.int32).tobytes()), data,
                          0, 1, False, b"i", (b"a",))


AVRO = {"type": "record", "name": "Reading", "fields": [
    {"name": "device", "type": "string"}, {"name": "raw", "type": "bytes"},
    {"name": "count", "type": "long"}, {"name": "small", "type": "int"},
    {"name": "temp", "type": "double"}, {"name": "ratio", "type": "float"},
    {"name": "on", "type": "boolean"},
    {"name": "level", "type": {"type": "enum", "name": "Level", "symbols": ["LOW", "HIGH", "VERY_HIGH_LEVEL"]}},
    {"name": "site", "type": ["null", "string"]}, {"name": "seen", "type": ["long", "null"]},
    {"name": "offset", "type": ["null", {"type": "enum", "name": "Side", "symbols": ["L", "R"]}]},
]}


def avro_datum(rng: random.Random) -> dict[str, Any]:
    return {
        "device": random_text(rng).encode("utf-8", "surrogatepass").decode("utf-8", "replace"),
        "raw": rng.randbytes(rng.randint(0, 12)),
        "count": rng.choice([0, -1, 2**63 - 1, -(2**63), rng.randint(-10**12, 10**12)]),
        "small": rng.choice([0, -1, 2**31 - 1, -(2**31), rng.randint(-1000, 1000)]),
        "temp": rng.choice([0.0, -0.0, 1e308, -5e-324, float("inf"), float("nan"), rng.uniform(-99, 99)]),
        "ratio": rng.choice([0.0, -0.0, 3.4e38, float("-inf"), float("nan"), rng.uniform(-9, 9)]),
        "on": rng.random() < 0.5, "level": rng.choice(["LOW", "HIGH", "VERY_HIGH_LEVEL"]),
        "site": rng.choice([None, "s1", "é"]), "seen": rng.choice([None, 5, -7]),
        "offset": rng.choice([None, "L", "R"]),
    }


def avro_payload(rng: random.Random, schema: Any) -> bytes:
    import io

    import fastavro

    out = io.BytesIO()
    fastavro.schemaless_writer(out, schema, avro_datum(rng))
    return out.getvalue()


@pytest.mark.parametrize("seed", range(10))
def test_avro_datums_decode_as_row_by_row(native: Any, seed: int) -> None:
    import fastavro

    rng = random.Random(seed)
    schema = TypedSchema("avro", AVRO, 1, RESERVED)
    assert schema._avro_plan is not None
    parsed = fastavro.parse_schema(AVRO)
    payloads = [avro_payload(rng, parsed) for _ in range(300)]
    if seed % 2:
        payloads = [damaged(rng, p) if rng.random() < 0.5 else p for p in payloads]
        payloads += [b"", b"\x00", rng.randbytes(40), payloads[0] + b"\x00", payloads[1][:-1]]
    taken = check(schema, pa.array(payloads, pa.binary()), avro=True)
    if not seed % 2:  # only NaN is left to the per-row path among intact datums
        assert taken.mean() > 0.5


def test_avro_varints_and_branches_at_their_limits(native: Any) -> None:
    schema = TypedSchema("avro", {"type": "record", "name": "R", "fields": [
        {"name": "n", "type": "long"}, {"name": "i", "type": ["null", "int"]}]}, 1, RESERVED)
    payloads = [
        b"\xfe\xff\xff\xff\xff\xff\xff\xff\xff\x01\x00",  # 2**63 - 1, null
        b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01\x00",  # -2**63
        b"\xfe\xff\xff\xff\xff\xff\xff\xff\xff\x7f\x00",  # a 10th byte beyond 64 bits
        b"\xfe\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01\x00",  # 11 bytes
        b"\x80\x00\x00",  # a long written in two bytes
        b"\x00\x02\xfe\xff\xff\xff\x0f",  # int 2**31 - 1
        b"\x00\x02\x80\x80\x80\x80\x10",  # int 2**31: not an int32
        b"\x00\x04\x00", b"\x00\x01\x00", b"\x00\x02", b"\x00\x00\x00",
    ]
    check(schema, pa.array(payloads, pa.binary()), avro=True)


def test_avro_schemas_the_c_reader_does_not_take(native: Any) -> None:
    for document in (
        {"type": "record", "name": "R", "fields": [{"name": "t", "type": {
            "type": "long", "logicalType": "timestamp-millis"}}]},
        {"type": "record", "name": "R", "fields": [{"name": "s", "type": {
            "type": "record", "name": "S", "fields": [{"name": "x", "type": "int"}]}}]},
        {"type": "record", "name": "R", "fields": [{"name": "u", "type": ["int", "string"]}]},
        {"type": "record", "name": "R", "fields": [{"name": "a", "type": {
            "type": "array", "items": "int"}}]},
        {"type": "fixed", "name": "F", "size": 4},
    ):
        assert TypedSchema("avro", document, 1, RESERVED)._avro_plan is None
    whole = TypedSchema("avro", ["null", "string"], 1, RESERVED)
    assert whole._avro_plan is not None
    check(whole, pa.array([b"\x00", b"\x02\x04ab", b"\x02\x02\xff", b"\x04"], pa.binary()),
          avro=True)


NUMBER_SPELLINGS = [
    "0", "-0", "0.0", "-0.0", "0.000", "-0.000", "00", "01", "-01", "1.", ".5", "-", "-.5",
    "1.5e3", "1.5E-3", "2e0", "7.0", "1.50", "-12.75", "1.5.3", "1-2", "1+2", "3 ", "4\n",
    "123456789012345", "-123456789012345", "1234567890123456", "12345678901234.5",
    "123456789012345.6", "99999999999999.9", "0.30000000000000004", "2.500000000000000",
    "2.50000000000000", "0.1234567890123456789012", "0.12345678901234567890123",
    "0.0000000000000000000001", "0.00000000000000000000001", "0.000000000000001234567890123",
    "9007199254740991", "9007199254740993.0", "1e-400", "5e-324",
]


@pytest.mark.parametrize("layout", [False, True])
def test_number_spellings_decode_as_row_by_row(native: Any, layout: bool) -> None:
    """Each spelling of a number field's value, at the limits of the one-pass reading of short
    decimals (15 significant digits, 22 fraction digits, signs, zeros, exponents, a number
    followed by what cannot follow it), read by the full parser and by a row layout learned
    from the row before (`layout`)."""
    schema = TypedSchema("json", SCHEMA, 1, RESERVED)
    payloads = []
    for text in NUMBER_SPELLINGS:
        if layout:
            payloads.append(b'{"device": "d", "temp": 1.5}')
        payloads.append(b'{"device": "d", "temp": ' + text.encode() + b"}")
    taken = check(schema, pa.array(payloads, pa.binary()))
    assert taken[payloads.index(b'{"device": "d", "temp": 12345678901234.5}')]


def test_strings_around_sixteen_byte_runs_decode_as_row_by_row(native: Any) -> None:
    """A string field's text read sixteen bytes at a time: a quote, backslash escape, control
    character, non-ASCII or invalid byte at every position of the first 40, and strings that
    end (or are cut off) at the payloads' very end."""
    schema = TypedSchema("json", SCHEMA, 1, RESERVED)
    specials = [b'\\"', b"\\\\", b"\\n", b"\\u00e9", b"\xc3\xa9", b"\x01", b"\xff", b"\xed\xa0\x80",
                b"\xf0\x9f\x98\x80", b"/"]
    payloads = []
    for length in (0, 1, 7, 8, 15, 16, 17, 31, 32, 33, 40):
        payloads.append(b'{"device": "' + b"a" * length + b'"}')
        for position in range(length):
            for special in specials:
                text = b"a" * position + special + b"a" * (length - position)
                payloads.append(b'{"device": "' + text + b'", "temp": 2.5}')
    cut = [b'{"device": "' + b"b" * n for n in (0, 5, 15, 16, 17, 40)]
    for tail in cut:
        check(schema, pa.array(payloads + [tail], pa.binary()))
    plain = [b'{"device": "' + b"a" * length + b'"}' for length in (0, 7, 16, 17, 33, 40)]
    assert check(schema, pa.array(plain, pa.binary())).all()
