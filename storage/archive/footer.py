"""One Parquet file from Parquet files of consecutive row groups, encoded apart (on two threads):
the row groups' bytes are copied one after the other, and their footer entries follow, with
every file position in them moved by where the row group now lies (`stitch`); and one row group
from files of the same rows and different columns (`merge_columns`: a part whose columns of
nulls only come from a file of them encoded once).

A Parquet file is `PAR1`, the row groups' column chunks, the footer (a Thrift `FileMetaData` in
Thrift's compact protocol), the footer's length (u32, little-endian) and `PAR1`. Nothing in a
column chunk's pages refers to a position in the file: only the footer does (a row group's
`file_offset`, a column chunk's data and dictionary page offsets, and its page index and bloom
filter offsets where there are any). A part encoded on its own has its row groups right after
its `PAR1`, as they would lie in the whole file at the position of the part's first row group;
so the file stitched here is byte for byte the file one writer writes of the whole table (its
tests compare the two), given the footer that writer ends with (`template`: a file of no row
group written with the whole file's schema and footer entries). The footer's fields are copied
as they are read (header bytes included); only the positions, the row count and the row
groups' list are written anew, as Thrift's compact protocol writes them.

Only the standard library: no I/O and no Arrow here.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

_MAGIC = b"PAR1"
_TAIL = struct.Struct("<I")

# Thrift compact protocol types (the low nibble of a field header)
_TRUE = 1
_FALSE = 2
_BYTE = 3
_I16 = 4
_I32 = 5
_I64 = 6
_DOUBLE = 7
_BINARY = 8
_LIST = 9
_SET = 10
_MAP = 11
_STRUCT = 12

# Field ids of parquet.thrift
_FILE_NUM_ROWS = 3
_FILE_ROW_GROUPS = 4
_FILE_ENCRYPTION = (8, 9)
_GROUP_COLUMNS = 1
_GROUP_NUM_ROWS = 3
_GROUP_FILE_OFFSET = 5
_GROUP_ORDINAL = 7
_CHUNK_POSITIONS = (2, 4, 6)
"""ColumnChunk: file_offset, offset_index_offset, column_index_offset."""
_CHUNK_META = 3
_CHUNK_ENCRYPTION = (8, 9)
_META_POSITIONS = (9, 10, 11, 14)
"""ColumnMetaData: data_page_offset, index_page_offset, dictionary_page_offset,
bloom_filter_offset."""


class FooterError(ValueError):
    """A Parquet footer this module does not stitch (damaged, or encrypted)."""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = 0
    shift = 0
    while True:
        if pos >= len(data):
            raise FooterError("a Parquet footer ends inside a number")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _put_varint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _zigzag(value: int) -> int:
    return (value << 1) ^ (value >> 63)


def _unzigzag(value: int) -> int:
    return (value >> 1) ^ -(value & 1)


def _field(data: bytes, pos: int, last: int) -> tuple[int, int, int]:
    """(field id, type, position of its value) of the field header at `pos` (type 0: the
    struct's end)."""
    if pos >= len(data):
        raise FooterError("a Parquet footer ends inside a struct")
    header = data[pos]
    pos += 1
    kind = header & 0x0F
    if kind == 0:
        return 0, 0, pos
    delta = header >> 4
    if delta:
        return last + delta, kind, pos
    value, pos = _varint(data, pos)
    return _unzigzag(value), kind, pos


def _skip(data: bytes, pos: int, kind: int) -> int:
    """The position after the value of type `kind` at `pos`."""
    if kind == _TRUE or kind == _FALSE or kind == _BYTE:
        return pos + 1  # in a container a boolean is a byte (a field's is in its header)
    if kind == _I16 or kind == _I32 or kind == _I64:
        return _varint(data, pos)[1]
    if kind == _DOUBLE:
        return pos + 8
    if kind == _BINARY:
        size, pos = _varint(data, pos)
        return pos + size
    if kind == _LIST or kind == _SET:
        header = data[pos]
        pos += 1
        count = header >> 4
        item = header & 0x0F
        if count == 15:
            count, pos = _varint(data, pos)
        for _ in range(count):
            pos = _skip(data, pos, item)
        return pos
    if kind == _MAP:
        count, pos = _varint(data, pos)
        if count:
            types = data[pos]
            pos += 1
            for _ in range(count):
                pos = _skip(data, pos, types >> 4)
                pos = _skip(data, pos, types & 0x0F)
        return pos
    if kind == _STRUCT:
        last = 0
        while True:
            fid, field_kind, pos = _field(data, pos, last)
            if field_kind == 0:
                return pos
            last = fid
            if field_kind != _TRUE and field_kind != _FALSE:
                pos = _skip(data, pos, field_kind)
    raise FooterError(f"unknown Thrift type {kind} in a Parquet footer")


def _moved(data: bytes, pos: int, out: bytearray, shift: int) -> int:
    """Copy the i64 position at `pos` moved by `shift` (0, meaning none, stays 0)."""
    value, end = _varint(data, pos)
    position = _unzigzag(value)
    _put_varint(out, _zigzag(position + shift if position > 0 else position))
    return end


def _column_meta(data: bytes, pos: int, out: bytearray, shift: int) -> int:
    last = 0
    while True:
        start = pos
        fid, kind, pos = _field(data, pos, last)
        out += data[start:pos]
        if kind == 0:
            return pos
        last = fid
        if kind == _TRUE or kind == _FALSE:
            continue
        if fid in _META_POSITIONS and kind == _I64:
            pos = _moved(data, pos, out, shift)
        else:
            end = _skip(data, pos, kind)
            out += data[pos:end]
            pos = end


def _column_chunk(data: bytes, pos: int, out: bytearray, shift: int) -> int:
    last = 0
    while True:
        start = pos
        fid, kind, pos = _field(data, pos, last)
        out += data[start:pos]
        if kind == 0:
            return pos
        last = fid
        if kind == _TRUE or kind == _FALSE:
            continue
        if fid in _CHUNK_ENCRYPTION:
            raise FooterError("an encrypted Parquet column is not stitched")
        if fid in _CHUNK_POSITIONS and kind == _I64:
            pos = _moved(data, pos, out, shift)
        elif fid == _CHUNK_META and kind == _STRUCT:
            pos = _column_meta(data, pos, out, shift)
        else:
            end = _skip(data, pos, kind)
            out += data[pos:end]
            pos = end


def _row_group(data: bytes, pos: int, out: bytearray, shift: int, ordinal: int
               ) -> tuple[int, int]:
    """Copy the RowGroup struct at `pos` with its positions moved by `shift` and its ordinal
    (where it has one) set; returns (position after it, its row count)."""
    last = 0
    rows = 0
    while True:
        start = pos
        fid, kind, pos = _field(data, pos, last)
        out += data[start:pos]
        if kind == 0:
            return pos, rows
        last = fid
        if kind == _TRUE or kind == _FALSE:
            continue
        if fid == _GROUP_FILE_OFFSET and kind == _I64:
            pos = _moved(data, pos, out, shift)
        elif fid == _GROUP_ORDINAL and kind == _I16:
            pos = _varint(data, pos)[1]
            _put_varint(out, _zigzag(ordinal))
        elif fid == _GROUP_COLUMNS and kind == _LIST:
            header = data[pos]
            out.append(header)
            pos += 1
            count = header >> 4
            if count == 15:
                count, end = _varint(data, pos)
                out += data[pos:end]
                pos = end
            for _ in range(count):
                pos = _column_chunk(data, pos, out, shift)
        else:
            end = _skip(data, pos, kind)
            if fid == _GROUP_NUM_ROWS and kind == _I64:
                rows = _unzigzag(_varint(data, pos)[0])
            out += data[pos:end]
            pos = end


def _footer(data: bytes) -> tuple[int, int]:
    """(start, end) of the footer of the Parquet file `data`."""
    if len(data) < 12 or data[:4] != _MAGIC or data[-4:] != _MAGIC:
        raise FooterError("not a Parquet file")
    (size,) = _TAIL.unpack_from(data, len(data) - 8)
    start = len(data) - 8 - size
    if start < 4:
        raise FooterError("a Parquet footer longer than its file")
    return start, len(data) - 8


def _groups(data: bytes, start: int, end: int) -> tuple[int, int, int]:
    """(position of the row groups' list header, of what follows the list, row group count)
    in the FileMetaData at `start`."""
    pos = start
    last = 0
    while pos < end:
        fid, kind, pos = _field(data, pos, last)
        if kind == 0:
            break
        last = fid
        if fid in _FILE_ENCRYPTION:
            raise FooterError("an encrypted Parquet file is not stitched")
        if fid == _FILE_ROW_GROUPS and kind == _LIST:
            count = data[pos] >> 4
            if count == 15:
                count = _varint(data, pos + 1)[0]
            return pos, _skip(data, pos, kind), count
        if kind != _TRUE and kind != _FALSE:
            pos = _skip(data, pos, kind)
    raise FooterError("a Parquet footer without row groups")


def stitch(parts: Sequence[bytes], template: bytes) -> bytes:
    """The Parquet file holding the row groups of `parts` (Parquet files of one schema, in
    order) in that order, with the footer of `template` (a file of no row group, written as the
    whole file's writer would end it: schema, footer entries) given the row groups and the row
    count. Raises FooterError for a footer it cannot read."""
    try:
        return _stitch(parts, template)
    except (IndexError, struct.error) as exc:
        raise FooterError(f"a damaged Parquet footer: {exc}") from exc


def _stitch(parts: Sequence[bytes], template: bytes) -> bytes:
    body = bytearray(_MAGIC)
    groups = bytearray()
    count = 0
    rows = 0
    for part in parts:
        start, end = _footer(part)
        at, _after, found = _groups(part, start, end)
        header = part[at]
        pos = at + 1
        if header >> 4 == 15:
            pos = _varint(part, pos)[1]
        shift = len(body) - 4
        for _ in range(found):
            pos, group_rows = _row_group(part, pos, groups, shift, count)
            rows += group_rows
            count += 1
        body += memoryview(part)[4:start]
    start, end = _footer(template)
    at, after, found = _groups(template, start, end)
    if found:
        raise FooterError("the footer template holds row groups")
    meta = bytearray(template[start:at])
    meta += _list_header(count)
    meta += groups
    meta += template[after:end]
    footer = _with_num_rows(bytes(meta), rows)
    body += footer
    body += _TAIL.pack(len(footer))
    body += _MAGIC
    return bytes(body)


def _list_header(count: int) -> bytearray:
    out = bytearray()
    if count < 15:
        out.append(count << 4 | _STRUCT)
    else:
        out.append(0xF0 | _STRUCT)
        _put_varint(out, count)
    return out


def _with_num_rows(footer: bytes, rows: int) -> bytes:
    """The FileMetaData `footer` with its row count set to `rows`."""
    pos = 0
    last = 0
    while pos < len(footer):
        fid, kind, value = _field(footer, pos, last)
        if kind == 0:
            break
        last = fid
        if fid == _FILE_NUM_ROWS and kind == _I64:
            end = _varint(footer, value)[1]
            out = bytearray(footer[:value])
            _put_varint(out, _zigzag(rows))
            out += footer[end:]
            return bytes(out)
        pos = value if kind == _TRUE or kind == _FALSE else _skip(footer, value, kind)
    raise FooterError("a Parquet footer without a row count")


def _meta_extent(data: bytes, pos: int) -> tuple[int, int, int, int]:
    """(position after the ColumnMetaData at `pos`, its chunk's first byte, compressed size,
    uncompressed size)."""
    last = 0
    data_page = dictionary_page = compressed = uncompressed = 0
    while True:
        fid, kind, pos = _field(data, pos, last)
        if kind == 0:
            first = dictionary_page if dictionary_page > 0 else data_page
            return pos, first, compressed, uncompressed
        last = fid
        if kind == _TRUE or kind == _FALSE:
            continue
        end = _skip(data, pos, kind)
        if kind == _I64 and fid in (6, 7, 9, 11):
            value = _unzigzag(_varint(data, pos)[0])
            if fid == 6:
                uncompressed = value
            elif fid == 7:
                compressed = value
            elif fid == 9:
                data_page = value
            else:
                dictionary_page = value
        pos = end


def _chunk_extent(data: bytes, pos: int) -> tuple[int, int, int, int]:
    """(position after the ColumnChunk at `pos`, its first byte in the file, compressed size,
    uncompressed size)."""
    last = 0
    first = compressed = uncompressed = -1
    while True:
        fid, kind, pos = _field(data, pos, last)
        if kind == 0:
            if first < 4:
                raise FooterError("a Parquet column chunk without its metadata")
            return pos, first, compressed, uncompressed
        last = fid
        if fid in _CHUNK_ENCRYPTION:
            raise FooterError("an encrypted Parquet column is not stitched")
        if kind == _TRUE or kind == _FALSE:
            continue
        if fid == _CHUNK_META and kind == _STRUCT:
            pos, first, compressed, uncompressed = _meta_extent(data, pos)
        else:
            pos = _skip(data, pos, kind)


def _one_row_group(data: bytes) -> tuple[list[tuple[int, int, int, int, int]],
                                         list[tuple[int, int, int, int]]]:
    """Of a Parquet file of one row group: its column chunks, each as (start and end of its
    ColumnChunk struct in `data`, its first byte, compressed and uncompressed size), and the
    RowGroup's fields, each as (field id, start of its header, start and end of its value)."""
    start, end = _footer(data)
    at, _after, count = _groups(data, start, end)
    if count != 1:
        raise FooterError("a Parquet part of other than one row group")
    pos = at + 1
    if data[at] >> 4 == 15:
        pos = _varint(data, pos)[1]
    chunks: list[tuple[int, int, int, int, int]] = []
    fields: list[tuple[int, int, int, int]] = []
    last = 0
    while True:
        header = pos
        fid, kind, pos = _field(data, pos, last)
        if kind == 0:
            return chunks, fields
        last = fid
        value = pos
        if kind == _TRUE or kind == _FALSE:
            fields.append((fid, header, value, value))
            continue
        if fid == _GROUP_COLUMNS and kind == _LIST:
            chunk_count = data[pos] >> 4
            pos += 1
            if chunk_count == 15:
                chunk_count, pos = _varint(data, pos)
            for _ in range(chunk_count):
                struct_start = pos
                pos, first, compressed, uncompressed = _chunk_extent(data, pos)
                chunks.append((struct_start, pos, first, compressed, uncompressed))
        else:
            pos = _skip(data, pos, kind)
        fields.append((fid, header, value, pos))


def merge_columns(sources: Sequence[bytes], layout: Sequence[tuple[int, int]]) -> bytes:
    """A Parquet part of one row group whose column chunks are those of `sources` (Parquet
    files of one row group each, of the same rows and different columns), in the order
    `layout` gives: per column of the whole schema, (the source holding it, its number of leaf
    chunks), each source's chunks taken in their own order. Its row group's totals and
    positions are those a writer of all the columns writes; its footer holds only the row
    group, which is what `stitch` reads of a part. Raises FooterError for a footer it cannot
    read."""
    try:
        return _merge_columns(sources, layout)
    except (IndexError, struct.error) as exc:
        raise FooterError(f"a damaged Parquet footer: {exc}") from exc


def _merge_columns(sources: Sequence[bytes], layout: Sequence[tuple[int, int]]) -> bytes:
    parsed = [_one_row_group(source) for source in sources]
    taken = [0] * len(sources)
    body = bytearray(_MAGIC)
    chunks = bytearray()
    count = 0
    compressed_total = 0
    uncompressed_total = 0
    for source, leaves in layout:
        data = sources[source]
        source_chunks = parsed[source][0]
        for _ in range(leaves):
            struct_start, _end, first, compressed, uncompressed = source_chunks[taken[source]]
            taken[source] += 1
            _column_chunk(data, struct_start, chunks, len(body) - first)
            body += memoryview(data)[first:first + compressed]
            compressed_total += compressed
            uncompressed_total += uncompressed
            count += 1
    if taken != [len(chunks_of) for chunks_of, _fields in parsed]:
        raise FooterError("the column layout does not match the parts' column chunks")
    rows = {_unzigzag(_varint(data, value)[0])
            for data, (_chunks, fields) in zip(sources, parsed, strict=True)
            for fid, _header, value, _end in fields if fid == _GROUP_NUM_ROWS}
    if len(rows) != 1:
        raise FooterError("parts of one row group with different row counts")
    group = bytearray()
    first_data = sources[0]
    for fid, header, value, end in parsed[0][1]:
        group += first_data[header:value]
        if fid == _GROUP_COLUMNS:
            group += _list_header(count)
            group += chunks
        elif fid == 2:  # total_byte_size: the chunks' uncompressed sizes
            _put_varint(group, _zigzag(uncompressed_total))
        elif fid == 6:  # total_compressed_size
            _put_varint(group, _zigzag(compressed_total))
        elif fid == _GROUP_FILE_OFFSET:
            _put_varint(group, _zigzag(len(_MAGIC)))  # the first chunk's first byte
        else:
            group += first_data[value:end]
    group.append(0)
    meta = bytearray([_FILE_ROW_GROUPS << 4 | _LIST])
    meta += _list_header(1)
    meta += group
    meta.append(0)
    body += meta
    body += _TAIL.pack(len(meta))
    body += _MAGIC
    return bytes(body)
