"""Decoding a batch of message records (the layout of `core.records`, versions 1 and 2)
straight into Arrow arrays, without a Python loop over the records' fields.

The records are joined into one buffer; every field's position is then computed for all
records at once with Arrow compute kernels (a gather of the length bytes, a shift, an add),
one step per field of the layout, so that the cost per record is a few C++ loop iterations
instead of a dozen Python calls. The variable-length fields become Arrow binary/string arrays
by a single `take` over the joined buffer: the spans of a field, in record order, are
increasing and disjoint, so the buffer viewed as a binary array with offsets
`0, start0, stop0, start1, stop1, ...` holds field i at index 2i + 1.

Integers inside the records (lengths, counts) are read with numpy: one gather, at every
record's position, from an unaligned view of the buffer as integers of that width (a strided
view, stride 1 byte); the result becomes an Arrow array without a copy. The four head bytes
(version, flags, qos, retain) are one 32-bit gather, split with shifts.

`decode_batch` vouches only for well-formed records: it returns None when a record is of
another version, overruns its end, or holds invalid UTF-8 (or a QoS outside int8), and the
caller then decodes record by record, which names the bad record in its error. Records are
never changed: this is a reader of the existing byte format.

`decode_blocks` is the same decoding in C (records_native.c, GIL released) straight from the
journal's record blocks, without joining them; None when the C build is not there (then
`decode_spans` runs) or when it does not vouch for every record.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ...core.native import load_c_extension
from ...core.records import (
    F_CONTENT_TYPE,
    F_CORRELATION,
    F_EXPIRY,
    F_FORMAT,
    F_HEADERS,
    F_KEY,
    F_NATIVE,
    F_REPLY_TO,
    RecordFormatError,
    native_properties_at,
)

_I64 = pa.int64()
_U64 = pa.uint64()
_HEAD_SIZE = 12
"""u8 version | u8 flags | u8 qos | u8 retain | i64 publish time."""
PAD_BYTES = 8

_PAD = bytes(PAD_BYTES)
"""Appended to the joined buffer so that a fixed-size read at any position up to the end of
the last record stays inside the buffer (the value read there is then rejected)."""
_INT32_LIMIT = 2**31 - 1

NULLS_KEPT_ROWS = 1 << 20
"""Rows up to which `nulls` slices an array kept per type."""
_NULLS: dict[pa.DataType, pa.Array] = {}


def nulls(rows: int, type_: pa.DataType) -> pa.Array:
    """`pa.nulls(rows, type_)`, sliced from an array of nulls kept per type (arrays are
    immutable: row groups and files share it), instead of allocating and zeroing its buffers
    again for each of a row group's unused columns (a dozen, about 3 MiB for 64 Ki rows)."""
    if rows > NULLS_KEPT_ROWS:
        return pa.nulls(rows, type_)
    kept = _NULLS.get(type_)
    if kept is None or len(kept) < rows:
        kept = _NULLS[type_] = pa.nulls(rows, type_)
    return kept if len(kept) == rows else kept.slice(0, rows)


COLUMNS = (
    "topic", "key", "payload", "headers", "content_type", "producer_protocol", "producer_id",
    "qos", "retain", "correlation_data", "reply_to", "payload_format", "expires_at",
    "native_properties",
)
"""The arrays `decode_batch` returns (expires_at as int64 milliseconds)."""


class _Malformed(Exception):
    """Some record is not one the vectorised path vouches for."""


class _Batch:
    """The joined records as one buffer, and readers of little-endian integers at an array of
    positions (int64 in, int64 out)."""

    def __init__(
        self, buffer: bytes, starts: pa.Array, ends: pa.Array, padded: bool = False
    ) -> None:
        """Record i is `buffer[starts[i]:ends[i]]` (int64 arrays; spans increasing and
        disjoint; the buffer may hold other bytes between them). `padded`: the buffer already
        ends with `len(_PAD)` bytes after the last record (else a padded copy is made)."""
        self.count = len(starts)
        self.starts = starts
        self.ends = ends
        raw = buffer if padded else buffer + _PAD
        self.size = len(raw) - len(_PAD)
        self.raw = raw
        self.buffer = pa.py_buffer(raw)
        self._views = {
            width: np.ndarray((len(raw) - width + 1,), dtype, raw, 0, (1,))
            for width, dtype in ((1, "u1"), (2, "<u2"), (4, "<u4"), (8, "<i8"))
        }
        if self.count and pc.min(pc.subtract(ends, starts)).as_py() < _HEAD_SIZE:
            raise _Malformed

    @classmethod
    def of(cls, datas: Sequence[bytes]) -> _Batch:
        lengths = pa.array([len(data) for data in datas], _I64)
        ends = pc.cumulative_sum(lengths)
        return cls(b"".join([*datas, _PAD]), pc.subtract(ends, lengths), ends, padded=True)

    def data(self, index: int, starts: list[int], ends: list[int]) -> bytes:
        return self.raw[starts[index] : ends[index]]

    def _read(self, pos: pa.Array, width: int) -> pa.Array:
        """The little-endian integers of `width` bytes (1, 2, 4: unsigned; 8: signed) at the
        byte positions `pos`, as an int64 Arrow array (one numpy gather)."""
        at = pos.to_numpy(zero_copy_only=False)
        try:
            return pa.array(self._views[width][at].astype(np.int64), _I64)
        except IndexError as exc:
            raise _Malformed from exc

    def head(self) -> tuple[pa.Array, pa.Array, pa.Array, pa.Array]:
        """Every record's first four bytes (version, flags, qos, retain) as int64 arrays."""
        at = self.starts.to_numpy(zero_copy_only=False)
        try:
            word = self._views[4][at].astype(np.int64)
        except IndexError as exc:
            raise _Malformed from exc
        return tuple(  # type: ignore[return-value]
            pa.array((word >> shift) & 0xFF, _I64) for shift in (0, 8, 16, 24)
        )

    def u8(self, pos: pa.Array) -> pa.Array:
        return self._read(pos, 1)

    def uint(self, pos: pa.Array, width: int) -> pa.Array:
        """The little-endian unsigned integers of `width` (2 or 4) bytes at `pos`."""
        return self._read(pos, width)

    def i64(self, pos: pa.Array) -> pa.Array:
        return self._read(pos, 8)

    def check(self, pos: pa.Array) -> None:
        """Every position still lies inside its own record."""
        if self.count and pc.any(pc.greater(pos, self.ends)).as_py():
            raise _Malformed

    def spans(
        self, starts: pa.Array, stops: pa.Array, valid: pa.Array | None, type_: pa.DataType
    ) -> pa.Array:
        """The bytes [starts[i], stops[i]) of every record as an array of `type_` (binary or
        string), null where `valid` is false. Spans must be increasing and disjoint."""
        out = self._gather(starts, stops, valid)
        if type_ == pa.string():
            try:
                out = out.cast(pa.string())
            except pa.ArrowInvalid as exc:
                raise _Malformed from exc
        return out

    def _gather(self, starts: pa.Array, stops: pa.Array, valid: pa.Array | None) -> pa.Array:
        """A binary array of the spans (see the module docstring); its values are contiguous
        and start at 0."""
        n = len(starts)
        large = self.size > _INT32_LIMIT
        both = np.empty(2 * n + 1, np.int64 if large else np.int32)
        both[0] = 0
        both[1::2] = starts.to_numpy(zero_copy_only=False)
        both[2::2] = stops.to_numpy(zero_copy_only=False)
        base = pa.large_binary() if large else pa.binary()
        whole = pa.Array.from_buffers(base, 2 * n, [None, pa.py_buffer(both), self.buffer])
        odd = _odd(n)
        if valid is not None:
            odd = pc.if_else(valid, odd, pa.scalar(None, _I64))
        out = pc.take(whole, odd)
        return out.cast(pa.binary()) if large else out


def _odd(n: int) -> pa.Array:
    """1, 3, ... 2n - 1: the indices of the spans in the interleaved array."""
    return pa.array(np.arange(1, 2 * n, 2, dtype=np.int64), _I64)




def decode_batch(datas: Sequence[bytes]) -> dict[str, pa.Array] | None:
    """The message records `datas` as Arrow arrays named by `COLUMNS` (the same values as
    `decode_message` per record), or None if some record is not well-formed."""
    try:
        return _decode(_Batch.of(datas))
    except _Malformed:
        return None


def decode_spans(
    buffer: bytes, starts: pa.Array, ends: pa.Array, padded: bool = False
) -> dict[str, pa.Array] | None:
    """`decode_batch` of the records `buffer[starts[i]:ends[i]]` (int64 arrays, spans in
    increasing order): a bulk journal read decodes without a bytes object per record.
    `padded`: `buffer` ends with `PAD_BYTES` bytes after the last record (saves a copy)."""
    try:
        return _decode(_Batch(buffer, starts, ends, padded))
    except _Malformed:
        return None


def _decode(batch: _Batch) -> dict[str, pa.Array]:
    n = batch.count
    starts = batch.starts
    versions, flags, qos, retain_byte = batch.head()
    if n and not pc.all(pc.is_in(versions, _VERSIONS)).as_py():
        raise _Malformed
    if n and pc.any(pc.and_(
        pc.equal(versions, 1), pc.not_equal(pc.bit_wise_and(flags, F_NATIVE), 0)
    )).as_py():
        raise _Malformed
    if n and pc.max(qos).as_py() > 127:
        raise _Malformed
    retain = pc.not_equal(retain_byte, 0)
    pos = pc.add(starts, _HEAD_SIZE)
    zero = pa.scalar(0, _I64)
    any_flags = bool(n) and pc.max(flags).as_py() != 0

    def field(width: int, flag: int | None, type_: pa.DataType) -> pa.Array:
        """A length-prefixed field at `pos` (present in every record, or where `flag` is set)."""
        nonlocal pos
        present = None if flag is None else pc.not_equal(pc.bit_wise_and(flags, flag), 0)
        if present is not None and not pc.any(present).as_py():
            return nulls(n, type_)
        length = batch.uint(pos, width)
        start = pc.add(pos, width)
        stop = pc.add(start, length)
        if present is not None:
            start = pc.if_else(present, start, pos)
            stop = pc.if_else(present, stop, pos)
        batch.check(stop)
        pos = stop
        return batch.spans(start, stop, present, type_)

    topic = field(4, None, pa.string())
    payload = field(4, None, pa.binary())
    key = headers = content_type = correlation = reply_to = fmt = expiry = None
    if any_flags:
        key = field(4, F_KEY, pa.binary())
        headers = _headers(batch, flags, pos)
        if headers is not None:
            headers, pos = headers
        content_type = field(2, F_CONTENT_TYPE, pa.string())
        correlation = field(4, F_CORRELATION, pa.binary())
        reply_to = field(2, F_REPLY_TO, pa.string())
        present = pc.not_equal(pc.bit_wise_and(flags, F_FORMAT), 0)
        if pc.any(present).as_py():
            fmt = pc.if_else(present, batch.u8(pos), pa.scalar(None, _I64))
            pos = pc.add(pos, pc.if_else(present, 1, zero))
            batch.check(pos)
            if pc.max(fmt).as_py() > 127:
                raise _Malformed
        present = pc.not_equal(pc.bit_wise_and(flags, F_EXPIRY), 0)
        if pc.any(present).as_py():
            expiry = pc.if_else(present, batch.i64(pos), pa.scalar(None, _I64))
            pos = pc.add(pos, pc.if_else(present, 8, zero))
            batch.check(pos)
    protocol = field(2, None, pa.string())
    producer = field(2, None, pa.string())
    native = _native(batch, flags, pos) if any_flags else None
    return {
        "topic": topic,
        "key": key if key is not None else nulls(n, pa.binary()),
        "payload": payload,
        "headers": headers if headers is not None else nulls(n, _HEADERS),
        "content_type": content_type if content_type is not None else nulls(n, pa.string()),
        "producer_protocol": protocol,
        "producer_id": producer,
        "qos": qos.cast(pa.int8()),
        "retain": retain,
        "correlation_data": correlation if correlation is not None else nulls(n, pa.binary()),
        "reply_to": reply_to if reply_to is not None else nulls(n, pa.string()),
        "payload_format": (fmt if fmt is not None else nulls(n, _I64)).cast(pa.int8()),
        "expires_at": expiry if expiry is not None else nulls(n, _I64),
        "native_properties": native if native is not None else nulls(n, NATIVE_PROPERTIES),
    }


_HEADERS = pa.map_(pa.string(), pa.string())
NATIVE_PROPERTIES = pa.map_(pa.string(), pa.binary())
_VERSIONS = pa.array([1, 2], _I64)


def _native(batch: _Batch, flags: pa.Array, pos: pa.Array) -> pa.Array | None:
    """The native properties map (null where the flag is unset), None if no record has any.
    Only the records that carry them (AMQP's, typically) are read, one by one."""
    present = pc.not_equal(pc.bit_wise_and(flags, F_NATIVE), 0)
    if not pc.any(present).as_py():
        return None
    relative = pc.subtract(pos, batch.starts).to_pylist()
    starts, ends = batch.starts.to_pylist(), batch.ends.to_pylist()
    values: list[list[tuple[str, bytes]] | None] = [None] * batch.count
    for index in pc.indices_nonzero(present).to_pylist():
        data = batch.data(index, starts, ends)
        try:
            native, end = native_properties_at(memoryview(data), relative[index])
        except RecordFormatError as exc:
            raise _Malformed from exc
        if end > len(data):
            raise _Malformed
        values[index] = list(native.items()) or None  # an empty section: none, as a message reads it
    return pa.array(values, NATIVE_PROPERTIES)


def _headers(batch: _Batch, flags: pa.Array, pos: pa.Array) -> tuple[pa.Array, pa.Array] | None:
    """The headers map (null where the flag is unset) and the positions after it; None if
    no record has headers."""
    present = pc.not_equal(pc.bit_wise_and(flags, F_HEADERS), 0)
    if not pc.any(present).as_py():
        return None
    zero = pa.scalar(0, _I64)
    counts = pc.if_else(present, batch.uint(pos, 2), zero)
    pos = pc.add(pos, pc.if_else(present, 2, zero))
    batch.check(pos)
    # each entry takes at least 6 bytes: refuse counts its record cannot hold before looping
    batch.check(pc.add(pos, pc.multiply(counts, 6)))
    name_starts, name_stops, value_starts, value_stops = [], [], [], []
    for j in range(pc.max(counts).as_py()):
        here = pc.greater(counts, j)
        name_start = pc.add(pos, 2)
        name_stop = pc.if_else(here, pc.add(name_start, batch.uint(pos, 2)), pos)
        value_start = pc.add(name_stop, 4)
        batch.check(pc.if_else(here, value_start, pos))
        value_stop = pc.add(value_start, batch.uint(name_stop, 4))
        pos = pc.if_else(here, value_stop, pos)
        batch.check(pos)
        name_starts.append(pc.filter(name_start, here))
        name_stops.append(pc.filter(name_stop, here))
        value_starts.append(pc.filter(value_start, here))
        value_stops.append(pc.filter(value_stop, here))
    total = pc.sum(counts).as_py() or 0
    if total:
        # entry by entry (header slot j of every record) -> record order: by position
        order = pc.sort_indices(pa.concat_arrays(name_starts))
        entries = [pc.take(pa.concat_arrays(part), order)
                   for part in (name_starts, name_stops, value_starts, value_stops)]
        names = batch.spans(entries[0], entries[1], None, pa.string())
        values = batch.spans(entries[2], entries[3], None, pa.string())
    else:
        names = values = pa.array([], pa.string())
    offsets = pa.concat_arrays([pa.array([0], _I64), pc.cumulative_sum(counts)]).cast(pa.int32())
    mask = pc.invert(present)
    mapped = pa.MapArray.from_arrays(offsets, names, values, type=_HEADERS, mask=mask)
    return mapped, pos


NATIVE: Any = load_c_extension("shardgate.storage.archive.records_native", os.path.dirname(__file__))
"""The C decoder (records_native.c), or None: not built, stale, or `SHARDGATE_PURE=1`."""

_BLOCK_COLUMNS: tuple[tuple[str, pa.DataType], ...] = (
    ("topic", pa.string()), ("key", pa.binary()), ("payload", pa.binary()),
    ("headers", _HEADERS), ("content_type", pa.string()), ("producer_protocol", pa.string()),
    ("producer_id", pa.string()), ("qos", pa.int8()), ("retain", pa.bool_()),
    ("correlation_data", pa.binary()), ("reply_to", pa.string()), ("payload_format", pa.int8()),
    ("expires_at", _I64), ("native_properties", NATIVE_PROPERTIES), ("offset", _I64),
    ("timestamp", _I64),
)
"""The columns of `records_native.decode_blocks`' result, in order (then the maps' keys and
values: header names and values, native property names and values)."""


def decode_blocks(
    blocks: Sequence[tuple[Any, Any, Any, Any, int]], native: Any = None,
    allocate: Any = pa.allocate_buffer,
) -> tuple[dict[str, pa.Array], pa.Array, pa.Array] | None:
    """`decode_spans` of the records of journal blocks given as (buffer, starts, ends,
    timestamps, first_offset) (`RecordBuffer.parts`), in C without the GIL and without
    joining the blocks: (the columns, the rows' offsets, their timestamps), the empty records
    left out as `build_table` leaves them out. None when the C decoder is not built (`native`:
    that module, by default `NATIVE`) or does not vouch for every record; `decode_spans` then
    decides. The arrays' buffers come from `allocate(size)` (Arrow's memory pool: it reuses
    its pages, where fresh memory for each batch would fault on every page; None: bytes)."""
    module = native if native is not None else NATIVE
    if module is None:
        return None
    raw = module.decode_blocks(blocks, allocate)
    if raw is None:
        return None
    rows = raw[0]
    arrays: dict[str, pa.Array] = {}
    for (name, type_), parts in zip(_BLOCK_COLUMNS, raw[1:], strict=False):
        arrays[name] = _array(type_, rows, parts, raw)
    offsets, stamps = arrays.pop("offset"), arrays.pop("timestamp")
    return arrays, offsets, stamps


def _array(type_: pa.DataType, rows: int, parts: Any, raw: tuple[Any, ...]) -> pa.Array:
    """An Arrow array of `decode_blocks`' (validity, offsets, data) buffers (None: nulls)."""
    if parts is None:
        return nulls(rows, type_)
    valid, offsets, data = (
        part if part is None or isinstance(part, pa.Buffer) else pa.py_buffer(part)
        for part in parts
    )
    if pa.types.is_map(type_):
        first = 17 if type_ == _HEADERS else 19  # the maps' keys and values in `raw`
        count = len(raw[first][1]) // 4 - 1
        keys = _array(type_.key_type, count, raw[first], raw)
        items = _array(type_.item_type, count, raw[first + 1], raw)
        children = pa.StructArray.from_arrays([keys, items],
                                              fields=[type_.key_field, type_.item_field])
        return pa.Array.from_buffers(type_, rows, [valid, offsets], children=[children])
    if offsets is not None:
        return pa.Array.from_buffers(type_, rows, [valid, offsets, data])
    return pa.Array.from_buffers(type_, rows, [valid, data])
