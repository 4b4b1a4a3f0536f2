"""The archive's Arrow schema and the conversion between journal records and Arrow tables.

Every file has the same columns, so `spark.read.parquet` over many streams needs no schema
merging. The stream's name is not a column: it is the `stream=` directory (a Hive partition),
and a column of the same name made pyarrow and pandas refuse the archive root (`string` vs the
partition's `dictionary`) and Spark warn `COLUMN_ALREADY_EXISTS`. The three decoded payload columns are filled only for a stream with that schema
(`string`, `int64` as 8-byte big-endian, `json` as its text) and null elsewhere. Every message
field is kept, so that `records_from_table` rebuilds the journal's record bytes exactly (tiered
replay serves them as if the journal still held them). Columns are built as one list per
column and converted with `pa.array`, never from per-row dicts. No file or network I/O here.
"""

from __future__ import annotations

import base64
import logging
import struct
import threading
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ...core.records import (
    F_CONTENT_TYPE,
    F_CORRELATION,
    F_EXPIRY,
    F_FORMAT,
    F_HEADERS,
    F_KEY,
    F_NATIVE,
    F_REPLY_TO,
    READABLE_VERSIONS,
    MessageRecord,
    RecordFormatError,
    encode_message,
    native_properties_at,
)
from ..interfaces import StoredRecord
from ..journal import RecordBlock
from . import footer
from .buffer import RecordBuffer
from .decode import NATIVE_PROPERTIES, PAD_BYTES, decode_blocks, decode_spans, nulls
from .typed import TypedSchema

log = logging.getLogger(__name__)

FORMAT_VERSION = "3"
"""2 added the `native_properties` column (files of format 1 lack it); 3 dropped the `stream`
column (the `stream=` partition carries it). `upgrade_table` turns an older file's table into
this format."""
TIMESTAMP = pa.timestamp("ms", tz="UTC")
HEADERS = pa.map_(pa.string(), pa.string())

ARROW_SCHEMA = pa.schema([
    pa.field("shard", pa.int32()),
    pa.field("offset", pa.int64()),
    pa.field("publish_time", TIMESTAMP),
    pa.field("topic", pa.string()),
    pa.field("key", pa.binary()),
    pa.field("payload", pa.binary()),
    pa.field("headers", HEADERS),
    pa.field("content_type", pa.string()),
    pa.field("producer_protocol", pa.string()),
    pa.field("producer_id", pa.string()),
    pa.field("qos", pa.int8()),
    pa.field("retain", pa.bool_()),
    pa.field("correlation_data", pa.binary()),
    pa.field("reply_to", pa.string()),
    pa.field("payload_format", pa.int8()),
    pa.field("expires_at", TIMESTAMP),
    pa.field("payload_string", pa.string()),
    pa.field("payload_int64", pa.int64()),
    pa.field("payload_json", pa.string()),
    pa.field("native_properties", NATIVE_PROPERTIES),
])

DECODED_COLUMN = {"string": "payload_string", "int64": "payload_int64", "json": "payload_json"}
RESERVED = frozenset([*ARROW_SCHEMA.names, "stream", "date", "hour"])
"""Column names a typed field cannot take (the archive's own and its partitions)."""


def _as_text(payloads: pa.Array) -> pa.Array:
    try:
        return payloads.cast(pa.string())
    except (pa.ArrowInvalid, UnicodeDecodeError):
        texts: list[str | None] = []
        for payload in payloads.to_pylist():
            try:
                texts.append(payload.decode("utf-8"))
            except UnicodeDecodeError:
                texts.append(None)
        return pa.array(texts, pa.string())


def _as_int64(payloads: pa.Array) -> pa.Array:
    """The 8-byte payloads as big-endian int64, null for other lengths (one numpy gather)."""
    count = len(payloads)
    if count == 0:
        return pa.array([], pa.int64())
    binary = payloads.cast(pa.binary())
    eight = pc.fill_null(pc.equal(pc.binary_length(binary), 8), False).to_numpy(
        zero_copy_only=False)
    values = np.zeros(count, ">i8")
    if eight.any():
        offsets = np.frombuffer(binary.buffers()[1], np.int32)[binary.offset:binary.offset + count]
        data = np.frombuffer(binary.buffers()[2], np.uint8)
        at = offsets[eight].astype(np.int64)[:, None] + np.arange(8)
        values[eight] = data[at].view(">i8").ravel()
    return pa.array(values.astype(np.int64), pa.int64(), mask=~eight)


_HEAD = struct.Struct("<BBBBq")
_HEAD_SIZE = _HEAD.size
_U32 = struct.Struct("<I").unpack_from
_U16 = struct.Struct("<H").unpack_from
_I64 = struct.Struct("<q").unpack_from


def _decode_columns(
    records: Sequence[StoredRecord], topics: list, keys: list, payloads: list, headers: list,
    content_types: list, protocols: list, producers: list, qoses: list, retains: list,
    correlations: list, reply_tos: list, formats: list, expiries: list, natives: list,
) -> None:
    """Decode message records (the layout of `core.records`) straight into
    column lists: the same result as `decode_message` per record, without building a
    `MessageRecord` each time (this loop is most of the archiver's CPU time)."""
    head = _HEAD.unpack_from
    u32, u16, i64 = _U32, _U16, _I64
    add_topic, add_payload, add_key = topics.append, payloads.append, keys.append
    add_headers, add_content_type = headers.append, content_types.append
    add_protocol, add_producer = protocols.append, producers.append
    add_qos, add_retain, add_correlation = qoses.append, retains.append, correlations.append
    add_reply_to, add_format, add_expiry = reply_tos.append, formats.append, expiries.append
    add_native = natives.append
    for record in records:
        data = record.data
        try:
            version, flags, qos, retain, _time = head(data, 0)
            if version not in READABLE_VERSIONS or (version == 1 and flags & F_NATIVE):
                raise RecordFormatError(
                    f"message record version {version} at offset {record.offset} is not supported"
                )
            pos = _HEAD_SIZE
            (size,) = u32(data, pos)
            pos += 4
            add_topic(data[pos:pos + size].decode())
            pos += size
            (size,) = u32(data, pos)
            pos += 4
            add_payload(data[pos:pos + size])
            pos += size
            key = header_list = content_type = correlation = reply_to = fmt = expiry = None
            if flags:
                if flags & F_KEY:
                    (size,) = u32(data, pos)
                    key = data[pos + 4:pos + 4 + size]
                    pos += 4 + size
                if flags & F_HEADERS:
                    (count,) = u16(data, pos)
                    pos += 2
                    header_list = []
                    for _ in range(count):
                        (size,) = u16(data, pos)
                        name = data[pos + 2:pos + 2 + size].decode()
                        pos += 2 + size
                        (size,) = u32(data, pos)
                        header_list.append((name, data[pos + 4:pos + 4 + size].decode()))
                        pos += 4 + size
                if flags & F_CONTENT_TYPE:
                    (size,) = u16(data, pos)
                    content_type = data[pos + 2:pos + 2 + size].decode()
                    pos += 2 + size
                if flags & F_CORRELATION:
                    (size,) = u32(data, pos)
                    correlation = data[pos + 4:pos + 4 + size]
                    pos += 4 + size
                if flags & F_REPLY_TO:
                    (size,) = u16(data, pos)
                    reply_to = data[pos + 2:pos + 2 + size].decode()
                    pos += 2 + size
                if flags & F_FORMAT:
                    fmt = data[pos]
                    pos += 1
                if flags & F_EXPIRY:
                    (expiry,) = i64(data, pos)
                    pos += 8
            (size,) = u16(data, pos)
            add_protocol(data[pos + 2:pos + 2 + size].decode())
            pos += 2 + size
            (size,) = u16(data, pos)
            add_producer(data[pos + 2:pos + 2 + size].decode())
            pos += 2 + size
            if pos > len(data):
                raise RecordFormatError(f"truncated message record at offset {record.offset}")
            native = None
            if flags & F_NATIVE:
                entries, pos = native_properties_at(memoryview(data), pos)
                native = list(entries.items())
        except (struct.error, UnicodeDecodeError, IndexError) as exc:
            raise RecordFormatError(
                f"malformed message record at offset {record.offset}: {exc}"
            ) from exc
        add_key(key)
        add_headers(header_list)
        add_content_type(content_type)
        add_correlation(correlation)
        add_reply_to(reply_to)
        add_format(fmt)
        add_expiry(expiry)
        add_native(native)
        add_qos(qos)
        add_retain(bool(retain))


def build_table(
    stream: str, shard: int, schema: str, records: Sequence[StoredRecord] | RecordBuffer,
    typed: TypedSchema | None = None, keep_payload: bool = False,
) -> pa.Table:
    """The archive table of `records` (one shard, offset order): a `RecordBuffer` of journal
    blocks is decoded in bulk, with no Python object per record. The publish_time column is
    the journal record's timestamp, which is the message's publish time, so that the
    `date=/hour=` partition of a file and its rows always agree. Empty records (offsets
    the journal skipped) have no row.

    With `typed` (the stream's registered schema), the payloads' fields are columns after the
    archive's own, and the payload bytes of the rows they decoded from are not kept (unless
    `keep_payload`): tiered replay rebuilds them (`records_from_table`)."""
    in_c = decode_blocks(records.parts()) if isinstance(records, RecordBuffer) else None
    if in_c is not None:  # the C decoder, reading the blocks in place without the GIL
        columns, offsets, stamps = in_c
        count = len(offsets)
    else:
        columns, offsets, stamps, count = _decode_in_python(records)
    payloads = columns["payload"]
    decoded = {name: nulls(count, ARROW_SCHEMA.field(name).type) for name in DECODED_COLUMN.values()}
    if schema == "string" or (schema == "json" and typed is None):  # else typed columns
        decoded[DECODED_COLUMN[schema]] = _as_text(payloads)
    elif schema == "int64":
        decoded["payload_int64"] = _as_int64(payloads)
    typed_arrays: list[pa.Array] = []
    if typed is not None:
        typed_arrays, decodable = typed.columns_of(payloads)
        decoded["payload_json"] = nulls(count, pa.string())  # the typed columns hold it
        if not keep_payload:
            payloads = (nulls(count, pa.binary()) if pc.all(decodable).as_py() is not False
                        else pc.if_else(decodable, nulls(count, pa.binary()), payloads))
    arrays = [
        pa.repeat(pa.scalar(shard, pa.int32()), count),
        offsets,
        stamps.cast(TIMESTAMP),
        columns["topic"],
        columns["key"],
        payloads,
        columns["headers"],
        columns["content_type"],
        columns["producer_protocol"],
        columns["producer_id"],
        columns["qos"],
        columns["retain"],
        columns["correlation_data"],
        columns["reply_to"],
        columns["payload_format"],
        columns["expires_at"].cast(TIMESTAMP),
        decoded["payload_string"],
        decoded["payload_int64"],
        decoded["payload_json"],
        columns["native_properties"],
    ]
    if typed is None:
        return pa.Table.from_arrays(arrays, schema=ARROW_SCHEMA)
    table_schema = pa.schema([*ARROW_SCHEMA, *typed.fields], metadata=typed.metadata())
    return pa.Table.from_arrays([*arrays, *typed_arrays], schema=table_schema)


def _decode_in_python(
    records: Sequence[StoredRecord] | RecordBuffer,
) -> tuple[dict[str, pa.Array], pa.Array, pa.Array, int]:
    """(columns, offsets, timestamps, rows) of `records` without the C decoder: `decode_spans`
    in bulk, or record by record when it refuses some record (which names the bad one)."""
    if isinstance(records, RecordBuffer):
        buffer, starts, ends, offsets, stamps = records.joined(pad=PAD_BYTES)
    else:
        datas = [record.data for record in records]
        lengths = pa.array([len(data) for data in datas], pa.int64())
        ends = pc.cumulative_sum(lengths)
        starts = pc.subtract(ends, lengths)
        buffer = b"".join([*datas, bytes(PAD_BYTES)])
        offsets = pa.array([record.offset for record in records], pa.int64())
        stamps = pa.array([record.timestamp_ms for record in records], pa.int64())
    present = pc.greater(ends, starts)
    if len(starts) and not pc.all(present).as_py():
        starts, ends, offsets, stamps = (
            pc.filter(array, present) for array in (starts, ends, offsets, stamps)
        )
    count = len(starts)
    columns = decode_spans(buffer, starts, ends, padded=True)
    if columns is None:  # a malformed record: decode one by one, which names it
        columns = _decode_lists([
            StoredRecord(offset, stamp, buffer[start:end]) for offset, stamp, start, end in zip(
                offsets.to_pylist(), stamps.to_pylist(), starts.to_pylist(), ends.to_pylist(),
                strict=True,
            )
        ])
    return columns, offsets, stamps, count


def _decode_lists(records: Sequence[StoredRecord]) -> dict[str, pa.Array]:
    """`decode_batch`'s result, record by record (raises RecordFormatError on a bad one)."""
    lists: dict[str, list] = {name: [] for name in _LIST_COLUMNS}
    _decode_columns(records, *lists.values())
    return {name: pa.array(values, _LIST_COLUMNS[name]) for name, values in lists.items()}


_LIST_COLUMNS = {
    "topic": pa.string(), "key": pa.binary(), "payload": pa.binary(), "headers": HEADERS,
    "content_type": pa.string(), "producer_protocol": pa.string(),
    "producer_id": pa.string(), "qos": pa.int8(), "retain": pa.bool_(),
    "correlation_data": pa.binary(), "reply_to": pa.string(), "payload_format": pa.int8(),
    "expires_at": pa.int64(),
    "native_properties": NATIVE_PROPERTIES,
}
"""The order of `_decode_columns`' list arguments, with the type of each."""


PARQUET_OPTIONS: dict[str, Any] = {
    "compression": "zstd",
    # Dictionary pages only where values repeat (names, topics): a payload never does, and
    # trying costs an encoding that Parquet then throws away.
    "use_dictionary": ["topic", "content_type", "producer_protocol", "producer_id"],
    "write_statistics": True,
}
"""The `pq.write_table` options of every archive file besides the compression level and row
group size (the benchmark writes its pyarrow baseline with the same ones)."""


def _file_schema(schema: pa.Schema, metadata: dict[str, str] | None) -> pa.Schema:
    """The schema a file is written with: with `metadata`, its footer entries (the typed
    schema's kept, the archive format, then `metadata`)."""
    if not metadata:
        return schema
    kept = {key.decode(): value.decode() for key, value in (schema.metadata or {}).items()
            if key.startswith(b"shardgate.schema.")}
    return schema.with_metadata({**kept, "shardgate.archive.format": FORMAT_VERSION, **metadata})


def encode_parquet(
    table: pa.Table, *, compression_level: int = 3, row_group_rows: int = 64 * 1024,
    metadata: dict[str, str] | None = None,
) -> bytes:
    """The whole Parquet file (zstd) as bytes, ready for one atomic upload."""
    if metadata:
        table = table.replace_schema_metadata(_file_schema(table.schema, metadata).metadata)
    sink = pa.BufferOutputStream()  # an Arrow sink: no Python call (and GIL) per page written
    pq.write_table(
        table, sink, compression_level=compression_level, row_group_size=row_group_rows,
        **PARQUET_OPTIONS,
    )
    return sink.getvalue().to_pybytes()


class FileEncoder:
    """One Parquet file encoded a part at a time (the tables of consecutive rows, all of one
    schema), with `encode_parquet`'s options and footer: the archiver encodes a file's first
    row groups while its last records are still being read, two parts at once. Each part is
    encoded as a Parquet file of its own (`write`, safe to call from several threads at once,
    in any order), and `finish` stitches them into one (`footer.stitch`): the file is byte for
    byte the one `encode_parquet` writes of the whole table. A part's columns of one value in
    every row (nulls: a message's unused fields, the payload once typed; or one value: the
    shard, a QoS, a protocol) are not encoded for each part: their column chunks come from a
    part of them alone, encoded once for as many rows (`_with_cached_columns`). The footer
    entries known when the file begins (`metadata`: stream, shard, first offset) are given
    here, the others (the last offset) to `finish`."""

    def __init__(self, *, compression_level: int = 3, row_group_rows: int = 64 * 1024,
                 metadata: dict[str, str] | None = None) -> None:
        self._options = {"compression_level": compression_level, **PARQUET_OPTIONS}
        self._row_group_rows = row_group_rows
        self._metadata = dict(metadata or {})
        self._lock = threading.Lock()
        self._parts: dict[int, bytes] = {}
        self._next = 0
        self._schema: pa.Schema | None = None
        self._empty: pa.Table | None = None

    def write(self, table: pa.Table, index: int | None = None) -> None:
        """Encode the rows of part `index` (the file's parts are its rows in the order of their
        indices; None: the part after the last one given so far). A table without rows adds no
        row group. Raises ValueError for a table of another schema than the parts before."""
        with self._lock:
            if index is None:
                index = self._next
            self._next = max(self._next, index + 1)
            if self._schema is None:
                self._schema = table.schema
            elif not table.schema.equals(self._schema, check_metadata=False):
                raise ValueError("a part of a Parquet file has another schema than the file")
            if not table.num_rows:
                if self._empty is None:
                    self._empty = table
                return
        cached = _cacheable_columns(table) if (
            CACHED_NULLS_FROM <= table.num_rows <= self._row_group_rows) else {}
        if cached and len(cached) < table.num_columns:
            data = self._with_cached_columns(table, cached)
        else:
            data = self._encode(table)
        with self._lock:
            self._parts[index] = data

    def _encode(self, table: pa.Table) -> bytes:
        sink = pa.BufferOutputStream()  # an Arrow sink: no Python call (and GIL) per page
        writer = pq.ParquetWriter(sink, _file_schema(table.schema, self._metadata), **self._options)
        writer.write_table(table, row_group_size=self._row_group_rows)
        writer.close()
        return sink.getvalue().to_pybytes()

    def _with_cached_columns(self, table: pa.Table, cached: dict[int, pa.Scalar | None]) -> bytes:
        """The part of `table` (one row group) with the column chunks of its columns of one
        value in every row (`cached`: index -> the value, None for nulls: a message's unused
        fields, the payload once typed, the shard, the QoS) taken from a part of those columns
        alone encoded once for this many rows (`_repeated_part`), the others encoded: a
        column's chunk depends on its own values only, so the chunks are the same bytes,
        without encoding them again for each part."""
        kept = [i for i in range(table.num_columns) if i not in cached]
        encoded = self._encode(table.select(kept))
        repeated = _repeated_part(table.schema, tuple(cached.items()), table.num_rows,
                                  self._options["compression_level"], self._row_group_rows)
        layout = [(1 if i in cached else 0, _leaves(table.schema.field(i).type))
                  for i in range(table.num_columns)]
        try:
            return footer.merge_columns([encoded, repeated], layout)
        except footer.FooterError as exc:  # a footer this build does not know: encode it all
            log.warning("a Parquet part is encoded whole (%s)", exc)
            return self._encode(table)

    def finish(self, metadata: dict[str, str] | None = None) -> bytes:
        """The whole file's bytes, its footer entries `metadata` added to those given at the
        start (a file of no rows, as `encode_parquet` writes one, if every part was empty)."""
        entries = {**self._metadata, **(metadata or {})}
        with self._lock:
            parts = [self._parts[index] for index in sorted(self._parts)]
            schema, empty = self._schema, self._empty
        if not parts:
            if empty is None:
                raise ValueError("a file encoder was given no table")
            return encode_parquet(empty, compression_level=self._options[
                "compression_level"], row_group_rows=self._row_group_rows, metadata=entries)
        assert schema is not None
        # The footer the whole file's writer ends with: its schema and entries, no row group.
        sink = pa.BufferOutputStream()
        writer = pq.ParquetWriter(sink, _file_schema(schema, self._metadata), **self._options)
        if entries != self._metadata:
            writer.add_key_value_metadata(_footer_entries(_file_schema(schema, entries)))
        writer.close()
        try:
            return footer.stitch(parts, sink.getvalue().to_pybytes())
        except footer.FooterError as exc:  # a footer this build does not know: one writer
            log.warning("a Parquet file is encoded again at once (%s)", exc)
            whole = pa.concat_tables([pq.read_table(pa.BufferReader(part)) for part in parts])
            # one chunk, and the nested fields' names as built (a list's `item`, not `element`)
            return encode_parquet(whole.combine_chunks().cast(schema),
                                  compression_level=self._options["compression_level"],
                                  row_group_rows=self._row_group_rows, metadata=entries)


CACHED_NULLS_FROM = 4096
"""Rows from which a part's columns of one value (nulls, or one value repeated) are not
encoded again (`FileEncoder`): below, encoding them is cheaper than merging the chunks."""
_REPEATED_PARTS: dict[tuple[Any, ...], bytes] = {}
_REPEATED_PARTS_KEPT = 16
_REPEATED_PARTS_LOCK = threading.Lock()


def _cacheable_columns(table: pa.Table) -> dict[int, pa.Scalar | None]:
    """The columns of `table` whose every row holds one value: index -> that value (None:
    null in every row). Values are checked for integers, booleans, timestamps, strings and
    binaries only (not floats: 0.0 and -0.0, or NaNs, compare equal but are other bytes)."""
    found: dict[int, pa.Scalar | None] = {}
    rows = table.num_rows
    for i, column in enumerate(table.columns):
        if column.null_count == rows:
            found[i] = None
        elif not column.null_count and (value := _one_value(column)) is not None:
            found[i] = value
    return found


def _one_value(column: pa.ChunkedArray) -> pa.Scalar | None:
    """The value of every row of `column` (no nulls), if there is one. Most columns that vary
    differ at the first, middle or last row, seen without a compute call (each one lets the
    GIL go and waits to take it back, behind the other threads' Python)."""
    kind = column.type
    exact = pa.types.is_integer(kind) or pa.types.is_boolean(kind) or pa.types.is_timestamp(kind)
    if not (exact or pa.types.is_string(kind) or pa.types.is_binary(kind)):
        return None
    first = column[0]
    if column[len(column) // 2] != first or column[-1] != first:
        return None
    if exact:
        low, high = pc.min_max(column).values()
        return first if low == high else None
    return first if pc.all(pc.equal(column, first)).as_py() else None


def _repeated_part(schema: pa.Schema, columns: tuple[tuple[int, pa.Scalar | None], ...],
                   rows: int, compression_level: int, row_group_rows: int) -> bytes:
    """A Parquet file of one row group of `rows` rows of the columns of `schema` in `columns`
    (index, value: None for nulls), each holding its value in every row, encoded with the
    archive's options (kept for the next part of as many rows and the same values: at most
    `_REPEATED_PARTS_KEPT` of them, the oldest dropped)."""
    fields = [schema.field(i) for i, _ in columns]
    values = [None if value is None else value.as_py() for _, value in columns]
    key = (tuple((field.name, str(field.type), field.nullable) for field in fields),
           tuple(values), rows, compression_level, row_group_rows)
    with _REPEATED_PARTS_LOCK:
        found = _REPEATED_PARTS.get(key)
    if found is not None:
        return found
    only_these = pa.schema(fields)
    table = pa.Table.from_arrays(
        [pa.nulls(rows, field.type) if value is None else pa.repeat(value, rows)
         for field, (_, value) in zip(fields, columns, strict=True)], schema=only_these)
    sink = pa.BufferOutputStream()
    writer = pq.ParquetWriter(sink, only_these, compression_level=compression_level,
                              **PARQUET_OPTIONS)
    writer.write_table(table, row_group_size=row_group_rows)
    writer.close()
    data = sink.getvalue().to_pybytes()
    with _REPEATED_PARTS_LOCK:
        if len(_REPEATED_PARTS) >= _REPEATED_PARTS_KEPT:
            del _REPEATED_PARTS[next(iter(_REPEATED_PARTS))]
        _REPEATED_PARTS[key] = data
    return data


def _leaves(arrow_type: pa.DataType) -> int:
    """The Parquet leaf columns (column chunks per row group) of a column of `arrow_type`."""
    if pa.types.is_struct(arrow_type):
        return sum(_leaves(arrow_type.field(i).type) for i in range(arrow_type.num_fields))
    if pa.types.is_map(arrow_type):
        return _leaves(arrow_type.key_type) + _leaves(arrow_type.item_type)
    if (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)
            or pa.types.is_fixed_size_list(arrow_type)):
        return _leaves(arrow_type.value_type)
    return 1


def _footer_entries(schema: pa.Schema) -> dict[str, str]:
    """The key-value entries of the footer of a file written with `schema`: its metadata and
    the serialized Arrow schema (`ARROW:schema`, which carries that metadata too). Added at the
    close of a writer opened with fewer entries, they replace its own (later entries win), so
    that readers find every entry in both places, as in a file written at once: the footer's
    entries (`pq.read_metadata(...).metadata`) and the Arrow schema's
    (`pq.read_schema(...).metadata`, `pq.read_table(...).schema.metadata`)."""
    entries = {key.decode(): value.decode() for key, value in (schema.metadata or {}).items()}
    entries["ARROW:schema"] = base64.b64encode(schema.serialize().to_pybytes()).decode("ascii")
    return entries


def records_from_table(table: pa.Table) -> list[StoredRecord]:
    """Rebuild the journal records (offset, timestamp, message bytes) of an archive table."""
    columns = {
        name: table.column(name).to_pylist()
        for name in ("offset", "topic", "key", "payload", "headers", "content_type",
                     "producer_protocol", "producer_id", "qos", "retain", "correlation_data",
                     "reply_to", "payload_format")
    }
    natives: list[list[tuple[str, bytes]] | None] = (
        table.column("native_properties").to_pylist()
        if "native_properties" in table.column_names else [None] * table.num_rows
    )
    times = table.column("publish_time").cast(pa.int64()).to_pylist()
    expiries = table.column("expires_at").cast(pa.int64()).to_pylist()
    typed = TypedSchema.from_metadata(table.schema.metadata or {}, RESERVED)
    if typed is not None and None in columns["payload"]:
        typed_rows = table.select([f.name for f in typed.fields]).to_pylist()
        columns["payload"] = [
            payload if payload is not None else typed.encode(typed_rows[i])
            for i, payload in enumerate(columns["payload"])
        ]
    out: list[StoredRecord] = []
    for i, offset in enumerate(columns["offset"]):
        message = MessageRecord(
            topic=columns["topic"][i],
            payload=columns["payload"][i],
            qos=columns["qos"][i],
            retain=bool(columns["retain"][i]),
            publish_time_ms=times[i],
            key=columns["key"][i],
            headers=columns["headers"][i] or None,
            content_type=columns["content_type"][i],
            correlation_data=columns["correlation_data"][i],
            reply_to=columns["reply_to"][i],
            payload_format=columns["payload_format"][i],
            expires_at_ms=expiries[i],
            producer_protocol=columns["producer_protocol"][i] or "",
            producer_id=columns["producer_id"][i] or "",
            native_properties=dict(native) if (native := natives[i]) else None,
        )
        out.append(StoredRecord(offset, times[i], encode_message(message)))
    return out


def warm_up() -> None:
    """Build a one-row archive table and drop it. pyarrow and numpy import modules and build
    lookup tables the first time a table is built (`numpy.ma`, `dateutil`, compute function
    wrappers): done here at start, those long-lived objects are not allocated in the middle of
    the first file under load, where each would keep a page of the heap from being returned
    once the load is gone. (Encoding a Parquet file too would only touch more library pages.)"""
    data = encode_message(MessageRecord(
        "warm-up", b"", 0, False, 0, key=b"k", headers=[("h", "v")], content_type="text/plain",
    ))
    block = RecordBlock(
        data, 0, array("q", [0]), array("q", [len(data)]), array("q", [0]),
    )
    build_table("warm-up", 0, "bytes", RecordBuffer([block]))


def upgrade_table(table: pa.Table) -> pa.Table:
    """An archive table of an older format (1 or 2) in this format: the `stream` column
    dropped, `native_properties` added as nulls where missing. None of the rows change."""
    if "stream" in table.column_names:
        table = table.drop_columns(["stream"])
    arrays = [
        table.column(field.name) if field.name in table.column_names
        else pa.nulls(table.num_rows, field.type)
        for field in ARROW_SCHEMA
    ]
    return pa.Table.from_arrays(arrays, schema=ARROW_SCHEMA)
