"""JSON payloads into typed columns in bulk: Arrow's own JSON reader (C++, on Arrow's thread
pool) parses a file's payloads joined by newlines against the registered schema's fields, so a
row costs no Python object; only the rows it cannot vouch for go through the per-row path of
`TypedSchema.columns`, which decides what they hold, exactly as before. (A schema of flat
scalar fields first has its payloads read by their byte layout, `typed_layout.py`, faster
still: this reader gets the rows of no common layout.)

The reader and the per-row path (`json.loads`, then `pa.array`) agree on every payload the
reader accepts, except where the reader is more lenient, and those payloads never reach it:
- a payload that does not start with `{` (an empty one would be a skipped line, a BOM or
  UTF-16 text is decoded by `json.loads`). One that holds a line break reads as several lines:
  only whitespace after the first line leaves the row count right and the row the same, else
  the part fails or its row count comes out wrong (below);
- invalid UTF-8 anywhere in it (the reader does not check every string: a part holding such a
  payload is refused before it is read, and split);
- an integer that a double cannot hold exactly (beyond 2**53), which `pa.array` refuses where
  the reader rounds it: a row whose top-level number is that large goes row by row
  (`rounded_rows`), and for a number inside a struct or a list, any payload with a run of 16
  digits or more.
Where the reader is stricter (a duplicate key, `1.0` for an integer, `true` for a number, an
object where the per-row path gets by), it fails, and the rows of a failed part are split in
halves and read again, down to `PER_ROW_BELOW` rows, which go row by row. A part whose row count
comes out wrong (two documents on a line) is split the same way.

Only schemas whose every field has one Arrow type are read this way (no field kept as JSON
text), and only object payloads (not a schema whose payload is one `value`). No I/O here.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

PER_ROW_BELOW = 16
"""A failing part of fewer rows than this is decoded row by row."""
BLOCK_BYTES = 1 << 20
"""The reader's block; a block holds whole lines, so it grows to fit the longest payload. The
reader runs on the calling thread (`use_threads=False`): the archiver builds a file's row
groups in parallel already, and Arrow's thread pool only added CPU time on top."""
_NEWLINE = pa.scalar(b"\n", pa.binary())
_EMPTY = pa.scalar(b"", pa.binary())
_LONG_NUMBER = rb"[0-9]{16,}"
_EXACT_LIMIT = pa.scalar(float(2**53))


def bulk_candidates(payloads: pa.Array, long_numbers: bool) -> pa.Array:
    """Per payload, whether Arrow's reader may decode it (see the module docstring); null
    payloads are not candidates. `long_numbers`: refuse runs of 16 digits or more (a schema
    with a number inside a struct or a list; a top-level number column is checked after the
    read instead, by `rounded_rows`)."""
    binary = payloads.cast(pa.binary())
    ok = pc.starts_with(binary, b"{")
    if long_numbers:
        ok = pc.and_(ok, pc.invert(pc.match_substring_regex(binary, _LONG_NUMBER)))
    return pc.fill_null(ok, False)


def rounded_rows(table: pa.Table) -> pa.Array | None:
    """The rows of a read table where a top-level number may have been rounded: a magnitude of
    2**53 or more (the per-row path refuses an integer beyond it, and decides these rows), or
    None if there are none."""
    suspect = None
    for column in table.columns:
        if column.type != pa.float64():
            continue
        big = pc.fill_null(pc.greater_equal(pc.abs(column), _EXACT_LIMIT), False)
        suspect = big if suspect is None else pc.or_(suspect, big)
    if suspect is None or not pc.any(suspect).as_py():
        return None
    return pc.indices_nonzero(suspect)


def read_lines(payloads: pa.Array, schema: pa.Schema) -> pa.Table | None:
    """`payloads` (each a candidate) parsed against `schema` (JSON names), one row each, or
    None if the reader refuses some payload or the rows do not line up."""
    count = len(payloads)
    if count == 0:
        return schema.empty_table()
    try:  # the reader does not check the UTF-8 of every string it reads
        payloads.cast(pa.string())
    except (pa.ArrowInvalid, UnicodeDecodeError):
        return None
    lines = pc.binary_join_element_wise(payloads.cast(pa.binary()), _EMPTY, _NEWLINE)
    offsets = lines.buffers()[1]
    data = lines.buffers()[2]
    widths = pc.binary_length(lines)
    first = pa.Array.from_buffers(pa.int32(), 1, [None, offsets], offset=lines.offset)[0].as_py()
    size = pc.sum(widths).as_py()
    block = max(BLOCK_BYTES, pc.max(widths).as_py() + 1)
    try:
        table = pj.read_json(
            pa.BufferReader(data.slice(first, size)),
            read_options=pj.ReadOptions(block_size=block, use_threads=False),
            parse_options=pj.ParseOptions(explicit_schema=schema,
                                          unexpected_field_behavior="ignore"),
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, UnicodeDecodeError):
        return None
    if table.num_rows != count:
        return None
    return table.select(schema.names)


def read_parts(payloads: pa.Array, schema: pa.Schema) -> tuple[list[tuple[int, pa.Table]],
                                                               list[int]]:
    """The payloads (all candidates) read in bulk where the reader accepts them: (start index,
    table) of the parts it read, in order, and the indices of the payloads left to the per-row
    path (a failing part is split in halves; see the module docstring)."""
    parts: list[tuple[int, pa.Table]] = []
    left: list[int] = []
    pending = [(0, len(payloads))]
    while pending:
        start, stop = pending.pop()
        if stop - start < PER_ROW_BELOW:
            left.extend(range(start, stop))
            continue
        table = read_lines(payloads.slice(start, stop - start), schema)
        if table is not None:
            parts.append((start, table))
            continue
        middle = (start + stop) // 2
        pending += [(middle, stop), (start, middle)]  # the first half is taken next
    parts.sort(key=lambda part: part[0])
    left.sort()
    return parts, left
