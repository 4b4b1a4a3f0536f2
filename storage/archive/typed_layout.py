"""JSON payloads of one byte layout into typed columns with Arrow's string kernels: the fast
path of `TypedSchema.columns_of` for a schema of flat scalar fields (string, integer, number,
boolean), ahead of Arrow's JSON reader (`typed_json.py`).

A producer writes its payloads with one serializer, so they differ only in their values:
`{"device": "dev-1", "temp": 21.5}` and `{"device": "dev-2", "temp": 3}` share the bytes
`{"device": "`, `", "temp": ` and `}`. `layout_of` reads those literals off one payload (a small
scan of one row); `read_layout` then checks every payload against them at once (`starts_with`
and `find_substring` over views of the payload buffer, no copy), takes the values between
them, and converts each column with one kernel (a cast; a regular expression checks the
numbers' JSON grammar). Parsing a file's payloads costs a few kernel passes instead of a JSON
parse per row: about 1.7 times as fast as Arrow's reader on the three-field rows of
`bench/bench_archive_table.py`.

A row is taken only when every byte of it is accounted for: the literals match exactly, a
string value holds no quote, backslash or control character (so its bytes are its text, the
UTF-8 checked by the cast), a number has JSON's grammar, a boolean is `true` or `false`, and
the row ends with the last literal. Every other row, and every row whose value the per-row path
(`json.loads`, then `pa.array`) would read differently, is left to the caller (a float column's
`-0`, a magnitude of 2**53 or more, an overflow to infinity, an integer of 19 digits or more):
the columns of the rows taken are exactly the per-row path's. No I/O here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

KINDS = {pa.string(): "s", pa.int64(): "i", pa.float64(): "n", pa.bool_(): "b"}
"""The Arrow types of the fields a layout reads, by the kind of their JSON value."""
_WHITESPACE = b" \t\n\r"
_NUMBER = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_TEXT = r"^-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?$"
_INTEGER_TEXT = r"^-?(?:0|[1-9][0-9]{0,17})$"
"""At most 18 digits: every such integer fits int64 (a longer one goes to the caller)."""
_NOT_PLAIN = r"[\x00-\x1f\\]"
"""What a string value read as its bytes may not hold (an escape or a control character)."""
_EXACT_LIMIT = float(2**53)


@dataclass(frozen=True, slots=True)
class Layout:
    """A payload layout: `literals[k]` precedes the value of field `fields[k]`, and
    `literals[-1]` ends the payload. A string's quotes belong to the literals around it."""

    literals: tuple[bytes, ...]
    fields: tuple[int, ...]


def _skip(data: bytes, pos: int) -> int:
    while pos < len(data) and data[pos] in _WHITESPACE:
        pos += 1
    return pos


def layout_of(payload: bytes, names: list[str], kinds: list[str]) -> Layout | None:
    """The layout of `payload`, a flat JSON object whose keys are distinct plain names among
    `names` each holding a value of its field's kind (`KINDS`), or None for any other payload
    (no null, no nesting, no escape in a key or a string, no key outside the schema)."""
    literals: list[bytes] = []
    fields: list[int] = []
    mark = 0
    pos = _skip(payload, 0)
    if payload[pos:pos + 1] != b"{":
        return None
    pos = _skip(payload, pos + 1)
    while True:
        if payload[pos:pos + 1] != b'"':
            return None
        close = payload.find(b'"', pos + 1)
        if close < 0:
            return None
        key = payload[pos + 1:close]
        if re.search(rb"[\x00-\x1f\\]", key):
            return None
        try:
            index = names.index(key.decode())
        except (UnicodeDecodeError, ValueError):
            return None
        if index in fields:
            return None
        pos = _skip(payload, close + 1)
        if payload[pos:pos + 1] != b":":
            return None
        pos = _skip(payload, pos + 1)
        kind = kinds[index]
        if kind == "s":
            if payload[pos:pos + 1] != b'"':
                return None
            close = payload.find(b'"', pos + 1)
            if close < 0 or re.search(rb"[\x00-\x1f\\]", payload[pos + 1:close]):
                return None
            literals.append(payload[mark:pos + 1])
            mark, pos = close, close + 1
        elif kind == "b":
            word = b"true" if payload.startswith(b"true", pos) else b"false"
            if not payload.startswith(word, pos):
                return None
            literals.append(payload[mark:pos])
            mark = pos = pos + len(word)
        else:
            match = _NUMBER.match(payload, pos)
            if match is None:
                return None
            literals.append(payload[mark:pos])
            mark = pos = match.end()
        fields.append(index)
        pos = _skip(payload, pos)
        if payload[pos:pos + 1] == b",":
            pos = _skip(payload, pos + 1)
            continue
        if payload[pos:pos + 1] != b"}" or _skip(payload, pos + 1) != len(payload):
            return None
        literals.append(payload[mark:])
        return Layout(tuple(literals), tuple(fields))


class _Rows:
    """Views of the payloads' bytes from a position in each row to its end, as one binary
    array over the payload buffer (no copy): the rows' spans interleaved with the bytes
    between them, which the kernels read too and the results skip (even indices)."""

    def __init__(self, payloads: pa.Array) -> None:
        count = len(payloads)
        wide = pa.types.is_large_binary(payloads.type)
        width = np.int64 if wide else np.int32
        offsets = np.frombuffer(payloads.buffers()[1], width, count + 1,
                                payloads.offset * np.dtype(width).itemsize)
        self.count = count
        self.starts = offsets[:-1].astype(np.int64)
        self.ends = offsets[1:].astype(np.int64)
        self.data = payloads.buffers()[2] or pa.py_buffer(b"")
        self.type = pa.large_binary() if wide else pa.binary()
        self.width = width

    def has_escapes(self) -> bool:
        """Whether some payload holds a backslash or a control character (seldom: a string
        value then has to be checked for one, else none of them can hold any)."""
        if not self.count:
            return False
        first, last = int(self.starts[0]), int(self.ends[-1])
        raw = np.frombuffer(self.data, np.uint8, last - first, first)
        return bool(np.any(raw < 0x20) or np.any(raw == 0x5C))

    def spans(self, starts: np.ndarray, stops: np.ndarray) -> pa.Array:
        """The binary array of 2n values whose value 2i is row i's bytes [starts, stops)
        (each within its row)."""
        both = np.empty(2 * self.count + 1, self.width)
        both[0:-1:2] = starts
        both[1::2] = stops
        both[-1] = stops[-1] if self.count else 0
        return pa.Array.from_buffers(self.type, 2 * self.count,
                                     [None, pa.py_buffer(both), self.data])

    def tails(self, starts: np.ndarray) -> pa.Array:
        return self.spans(starts, self.ends)


def _even(array: pa.Array) -> np.ndarray:
    return np.asarray(array.to_numpy(zero_copy_only=False)[0::2])


def read_layout(payloads: pa.Array, layout: Layout, schema: pa.Schema
                ) -> tuple[list[pa.Array], np.ndarray] | None:
    """The typed columns (of `schema`: a field the layout lacks is null) of the payloads that
    match `layout` exactly, in order, and per payload whether it does (numpy booleans); None
    when a column's text does not convert (invalid UTF-8: the caller reads the lot)."""
    rows = _Rows(payloads)
    count = rows.count
    ok = np.asarray(pc.fill_null(pc.is_valid(payloads), False).to_numpy(zero_copy_only=False))
    ok = ok.copy()
    pos = rows.starts.copy()
    spans: list[tuple[np.ndarray, np.ndarray]] = []
    for k, literal in enumerate(layout.literals):
        ok &= _even(pc.starts_with(rows.tails(pos), pattern=_pattern(literal)))
        pos = np.minimum(pos + len(literal), rows.ends)
        if k == len(layout.fields):
            break
        kind = KINDS[schema.field(layout.fields[k]).type]
        following = layout.literals[k + 1]
        found = _even(pc.find_substring(rows.tails(pos), pattern=_pattern(
            b'"' if kind == "s" else following[:1])))
        ok &= found >= 0
        stop = np.where(found >= 0, pos + found, pos)
        spans.append((pos, stop))
        pos = stop
    ok &= pos == rows.ends
    check_plain = rows.has_escapes()
    columns: list[pa.Array | None] = [None] * len(schema)
    for (start, stop), index in zip(spans, layout.fields, strict=True):
        start = np.where(ok, start, rows.starts)
        stop = np.where(ok, stop, rows.starts)
        text = pc.take(rows.spans(start, stop), pa.array(np.arange(0, 2 * count, 2)))
        field = schema.field(index)
        kind = KINDS[field.type]
        try:
            column, good = _convert(text, kind, check_plain)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, UnicodeDecodeError):
            return None
        ok &= good
        columns[index] = column
    if ok.all():
        return [column if column is not None else pa.nulls(count, field.type)
                for column, field in zip(columns, schema, strict=True)], ok
    chosen = pa.array(ok)
    arrays = [
        pc.filter(column, chosen) if column is not None else pa.nulls(int(ok.sum()), field.type)
        for column, field in zip(columns, schema, strict=True)
    ]
    return arrays, ok


def _pattern(literal: bytes) -> str:
    """A literal as the str pattern the kernels take (they compare its UTF-8: a literal is
    ASCII punctuation and whitespace around keys that decoded as UTF-8)."""
    return literal.decode()


def _convert(text: pa.Array, kind: str, check_plain: bool) -> tuple[pa.Array, np.ndarray]:
    """A column from the values' bytes, and per row whether the per-row path reads the same
    (`check_plain`: whether a string value may hold an escape or a control character)."""
    if kind == "s":
        if not check_plain:
            return text.cast(pa.string()), np.ones(len(text), np.bool_)
        plain = pc.invert(pc.match_substring_regex(text, _NOT_PLAIN))
        return text.cast(pa.string()), np.asarray(plain.to_numpy(zero_copy_only=False))
    if kind == "b":
        truth = pc.equal(text, pa.scalar(b"true", text.type))
        good = pc.or_(truth, pc.equal(text, pa.scalar(b"false", text.type)))
        return truth, np.asarray(good.to_numpy(zero_copy_only=False))
    grammar = _INTEGER_TEXT if kind == "i" else _NUMBER_TEXT
    good = np.asarray(pc.match_substring_regex(text, grammar).to_numpy(zero_copy_only=False))
    text = pc.if_else(pa.array(good), text, pa.scalar(b"0", text.type)).cast(pa.string())
    if kind == "i":
        return text.cast(pa.int64()), good
    values = text.cast(pa.float64())
    exact = pc.less(pc.abs(values), _EXACT_LIMIT)  # also refuses an overflow to infinity
    exact = pc.and_(exact, pc.not_equal(text, "-0"))  # json.loads reads it as the integer 0
    return values, good & np.asarray(exact.to_numpy(zero_copy_only=False))
