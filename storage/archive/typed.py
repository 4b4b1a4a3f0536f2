"""Typed columns: the archive of a stream with a registered schema (a JSON Schema or an Avro
schema) holds one column per field of its payloads, so that queries filter on them with
Parquet statistics and pushdown instead of parsing a payload per row.

`TypedSchema` maps the registered schema onto Arrow: objects and records become structs,
arrays lists, Avro maps maps; JSON `integer` is int64, `number` float64; a field that may hold
several types (other than null) is kept as its JSON text. Every typed column is nullable, so a
later schema version that adds fields only adds columns (Spark `mergeSchema`, pyarrow
`unify_schemas`). A field whose name is an archive column (`offset`, `topic`, ...) is stored
as `value_<name>`.

`TypedSchema.columns` decodes the payloads of a file into those columns, row by row; a payload
that does not decode (published before the schema was registered) has nulls there and keeps
its bytes. `TypedSchema.columns_of` gives the same columns from an Arrow array of payloads, JSON
ones read in bulk: those of a schema of flat scalar fields by their byte layout
(`typed_layout.py`), the others by Arrow's JSON reader (`typed_json.py`), only the rows neither
can vouch for going row by row.
`TypedSchema.encode` turns a row's typed values back into a payload for tiered replay when the
bytes were not kept: byte for byte for Avro (its binary encoding has one form per datum), the
same document in compact JSON for JSON Schema. This module knows no broker type.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ...core.native import load_c_extension
from . import typed_json, typed_layout

_NATIVE = load_c_extension("shardgate.storage.archive.typed_native", os.path.dirname(__file__))
"""The C parser of flat JSON payloads (`typed_native.c`), or None: the layout path then."""

_JSON_SCALARS = {"string": pa.string(), "integer": pa.int64(), "number": pa.float64(),
                 "boolean": pa.bool_()}
_AVRO_SCALARS = {"string": pa.string(), "int": pa.int32(), "long": pa.int64(),
                 "float": pa.float32(), "double": pa.float64(), "boolean": pa.bool_(),
                 "bytes": pa.binary(), "enum": pa.string()}
LAYOUTS = 3
"""Byte layouts of payloads that `TypedSchema.columns_of` tries in one file (one per
serializer writing to the stream, typically one)."""
LAYOUT_SAMPLE = 64
"""Payloads a layout is first tried on: it reads the whole file only if it fits half of them."""
NATIVE_FIELDS = 256
"""The most fields `typed_native.c` reads (a wider schema goes by layout)."""
_TEXT = pa.string()
"""A value of several types, kept as its JSON text."""


def json_arrow_type(schema: Any) -> tuple[pa.DataType, bool]:
    """(Arrow type, whether values are kept as JSON text) of a JSON Schema."""
    if not isinstance(schema, dict):
        return _TEXT, True
    declared = schema.get("type")
    kinds = [declared] if isinstance(declared, str) else list(declared or ())
    kinds = [kind for kind in kinds if kind != "null"]
    if not kinds:
        if "properties" in schema:
            kinds = ["object"]
        elif "items" in schema:
            kinds = ["array"]
    if kinds == ["integer", "number"] or kinds == ["number", "integer"]:
        kinds = ["number"]
    if len(kinds) != 1:
        return _TEXT, True
    kind = kinds[0]
    if kind in _JSON_SCALARS:
        return _JSON_SCALARS[kind], False
    if kind == "object" and schema.get("properties"):
        fields = []
        for name, sub in schema["properties"].items():
            sub_type, text = json_arrow_type(sub)
            if text:
                return _TEXT, True  # nested free-form values: the object as text
            fields.append(pa.field(name, sub_type))
        return pa.struct(fields), False
    if kind == "array" and isinstance(schema.get("items"), dict):
        item, text = json_arrow_type(schema["items"])
        return (pa.list_(item), False) if not text else (_TEXT, True)
    return _TEXT, True


def _holds_float(arrow_type: pa.DataType) -> bool:
    """Whether a type is or holds a float64 (inside structs, lists and maps)."""
    if arrow_type == pa.float64():
        return True
    if pa.types.is_struct(arrow_type):
        return any(_holds_float(arrow_type.field(i).type) for i in range(arrow_type.num_fields))
    if pa.types.is_list(arrow_type):
        return _holds_float(arrow_type.value_type)
    if pa.types.is_map(arrow_type):
        return _holds_float(arrow_type.item_type)
    return False


AvroPlan = tuple[bytes, tuple[int, ...], tuple[tuple[bytes, ...] | None, ...]]
"""`typed_native.parse_avro`'s (kinds, null branches, enum symbols)."""
_AVRO_KINDS = {"string": "s", "bytes": "y", "long": "i", "int": "I", "double": "n", "float": "f",
               "boolean": "b"}


def avro_flat_plan(types: list[Any]) -> AvroPlan | None:
    """How `typed_native.parse_avro` reads datums whose fields have these (expanded) Avro types,
    or None unless each is a scalar, an enum, or a union of null and one of those (no logical
    type: fastavro turns those into other Python values)."""
    kinds: list[str] = []
    nulls: list[int] = []
    symbols: list[tuple[bytes, ...] | None] = []
    for avro_type in types:
        null = -1
        if isinstance(avro_type, list):
            if len(avro_type) != 2 or "null" not in avro_type:
                return None
            null = avro_type.index("null")
            avro_type = avro_type[1 - null]
        if isinstance(avro_type, dict) and "logicalType" not in avro_type:
            if avro_type.get("type") == "enum":
                kinds.append("e")
                nulls.append(null)
                symbols.append(tuple(str(symbol).encode() for symbol in avro_type["symbols"]))
                continue
            avro_type = avro_type.get("type")
        if not isinstance(avro_type, str) or avro_type not in _AVRO_KINDS:
            return None
        kinds.append(_AVRO_KINDS[avro_type])
        nulls.append(null)
        symbols.append(None)
    return "".join(kinds).encode(), tuple(nulls), tuple(symbols)


def avro_arrow_type(schema: Any) -> tuple[pa.DataType, bool]:
    """(Arrow type, whether values are kept as JSON text) of a parsed Avro schema."""
    if isinstance(schema, list):
        branches = [b for b in schema if b != "null"]
        return avro_arrow_type(branches[0]) if len(branches) == 1 else (_TEXT, True)
    if isinstance(schema, str):
        return (_AVRO_SCALARS[schema], False) if schema in _AVRO_SCALARS else (_TEXT, True)
    kind = schema.get("type")
    logical = schema.get("logicalType")
    if logical == "timestamp-millis":
        return pa.timestamp("ms", tz="UTC"), False
    if logical == "timestamp-micros":
        return pa.timestamp("us", tz="UTC"), False
    if isinstance(kind, dict | list):
        return avro_arrow_type(kind)
    if kind == "record":
        fields = []
        for entry in schema["fields"]:
            sub_type, text = avro_arrow_type(entry["type"])
            if text:
                return _TEXT, True
            fields.append(pa.field(entry["name"], sub_type))
        return pa.struct(fields), False
    if kind == "array":
        item, text = avro_arrow_type(schema["items"])
        return (pa.list_(item), False) if not text else (_TEXT, True)
    if kind == "map":
        value, text = avro_arrow_type(schema["values"])
        return (pa.map_(pa.string(), value), False) if not text else (_TEXT, True)
    if kind == "fixed":
        return pa.binary(), False
    if kind in _AVRO_SCALARS:
        return _AVRO_SCALARS[kind], False
    return _TEXT, True


@dataclass(slots=True)
class TypedSchema:
    """The typed columns of one stream's registered schema (see the module docstring)."""

    kind: str
    """`json` or `avro`."""
    document: Any
    version: int
    reserved: frozenset[str] = frozenset()
    """Names of the archive's own columns (a field of that name gets the `value_` prefix)."""
    fields: list[pa.Field] = field(default_factory=list)
    text_fields: set[str] = field(default_factory=set)
    """Fields kept as JSON text (several types allowed)."""
    names: dict[str, str] = field(default_factory=dict)
    """Field name → column name."""
    _parsed: Any = None
    _avro_plan: AvroPlan | None = None
    """How `typed_native.parse_avro` reads these datums, for an Avro schema of scalar fields."""

    def __post_init__(self) -> None:
        if self.kind == "avro":
            import fastavro

            self._parsed = fastavro.parse_schema(self.document)
            expanded = fastavro.parse_schema(self.document, expand=True, _write_hint=False)
            if isinstance(expanded, dict) and expanded.get("type") == "record":
                top = [(f["name"], avro_arrow_type(f["type"])) for f in expanded["fields"]]
                self._avro_plan = avro_flat_plan([f["type"] for f in expanded["fields"]])
            else:
                top = [("value", avro_arrow_type(expanded))]
                self._avro_plan = avro_flat_plan([expanded])
        else:
            properties = self.document.get("properties") if isinstance(self.document, dict) else None
            if properties:
                top = [(name, json_arrow_type(sub)) for name, sub in properties.items()]
            else:
                top = [("value", json_arrow_type(self.document))]
        for name, (arrow_type, text) in top:
            column = f"value_{name}" if name in self.reserved else name
            self.names[name] = column
            self.fields.append(pa.field(column, arrow_type, nullable=True))
            if text:
                self.text_fields.add(name)

    @property
    def whole_value(self) -> bool:
        """The payload is not an object or record: one `value` column holds it."""
        return list(self.names) == ["value"] and not self._has_top_fields()

    def _has_top_fields(self) -> bool:
        if self.kind == "avro":
            return isinstance(self.document, dict) and self.document.get("type") == "record"
        return isinstance(self.document, dict) and bool(self.document.get("properties"))

    def decode(self, payload: bytes) -> Any:
        if self.kind == "avro":
            import fastavro

            source = io.BytesIO(payload)
            value = fastavro.schemaless_reader(source, self._parsed, None)
            if source.tell() != len(payload):
                raise ValueError("bytes after the Avro datum")
            return value
        return json.loads(payload)

    def _row(self, value: Any) -> dict[str, Any]:
        if self.whole_value:
            value = {"value": value}
        if not isinstance(value, dict):
            raise ValueError("not an object")
        row = {}
        for name, column in self.names.items():
            item = value.get(name)
            if name in self.text_fields and item is not None:
                item = json.dumps(item, separators=(",", ":"), sort_keys=True)
            row[column] = item
        return row

    def columns(self, payloads: list[bytes | None]) -> tuple[list[pa.Array], list[bool]]:
        """The typed columns of `payloads`, and per payload whether it decoded (a payload that
        did not has nulls in every typed column)."""
        struct = pa.struct(self.fields)
        rows: list[dict[str, Any] | None] = []
        decoded: list[bool] = []
        for payload in payloads:
            try:
                rows.append(self._row(self.decode(payload)) if payload is not None else None)
                decoded.append(payload is not None)
            except Exception:  # noqa: BLE001 - any payload the schema does not read
                rows.append(None)
                decoded.append(False)
        try:
            array = pa.array(rows, struct)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, ValueError):
            # Row by row: how pa.array reads a value can depend on the rows beside it (an
            # empty list passes for a struct alone, not after a dict), so each row stands alone.
            pieces = []
            for index, row in enumerate(rows):
                try:
                    pieces.append(pa.array([row], struct))
                except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, ValueError):
                    pieces.append(pa.nulls(1, struct))
                    decoded[index] = False
            array = pa.concat_arrays(pieces)
        return array.flatten(), decoded  # a null row is null in every column

    @property
    def bulk_readable(self) -> bool:
        """Whether Arrow's JSON reader decodes these payloads in bulk (`typed_json.py`)."""
        return self.kind == "json" and not self.text_fields and not self.whole_value

    def columns_of(self, payloads: pa.Array) -> tuple[list[pa.Array], pa.Array]:
        """`columns` of a binary array of payloads, the decoded flags as a boolean array: in
        bulk where the schema allows it (the payloads of a known byte layout first,
        `typed_layout.py`, then Arrow's JSON reader, `typed_json.py`), else row by row."""
        if self._avro_plan is not None and _NATIVE is not None and len(payloads):
            return self._columns_avro(payloads)
        if not self.bulk_readable:
            arrays, flags = self.columns(payloads.to_pylist())
            return arrays, pa.array(flags, pa.bool_())
        if self.layout_readable and len(payloads):
            if _NATIVE is not None and len(self.fields) <= NATIVE_FIELDS:
                return self._columns_parsed(payloads)
            return self._columns_by_layout(payloads)
        return self._columns_read(payloads)

    @property
    def layout_readable(self) -> bool:
        """Whether every field is a flat scalar that `typed_layout.py` reads."""
        return self.bulk_readable and all(f.type in typed_layout.KINDS for f in self.fields)

    def _columns_by_layout(self, payloads: pa.Array) -> tuple[list[pa.Array], pa.Array]:
        """`columns_of` for a schema of flat scalar fields: the payloads laid out as the
        first one not yet read (up to `LAYOUTS` layouts, while each reads at least half of
        the rows left) are read by `typed_layout.read_layout`, the others by `_columns_read`."""
        schema = pa.schema([pa.field(name, column.type)
                            for name, column in zip(self.names, self.fields, strict=True)])
        names = list(self.names)
        kinds = [typed_layout.KINDS[f.type] for f in self.fields]
        count = len(payloads)
        left = np.arange(count, dtype=np.int64)
        pieces: list[tuple[np.ndarray, list[pa.Array]]] = []
        for _ in range(LAYOUTS):
            subset = payloads if len(left) == count else pc.take(payloads, left)
            first = subset[0].as_py()
            layout = None if first is None else typed_layout.layout_of(first, names, kinds)
            if layout is None or not self._layout_fits(subset, layout, schema):
                break
            read = typed_layout.read_layout(subset, layout, schema)
            if read is None:
                break
            arrays, taken = read
            pieces.append((left[taken], arrays))
            left = left[~taken]
            if not len(left) or 2 * int(taken.sum()) < len(taken):
                break
        if not pieces:
            return self._columns_read(payloads)
        if len(pieces) == 1 and not len(left):
            return pieces[0][1], pa.repeat(pa.scalar(True), count)
        decoded = np.ones(count, np.bool_)
        if len(left):
            rest, rest_decoded = self._columns_read(pc.take(payloads, left))
            pieces.append((left, rest))
            decoded[left] = rest_decoded.to_numpy(zero_copy_only=False)
        return self._in_row_order(count, pieces), pa.array(decoded)

    def _in_row_order(self, count: int, pieces: list[tuple[np.ndarray, list[pa.Array]]]
                      ) -> list[pa.Array]:
        """The typed columns of `count` rows from pieces of them, (the indices of the rows a
        piece holds, its columns), each row in one piece."""
        schema = pa.schema(self.fields)
        where = np.empty(count, np.int64)
        where[np.concatenate([rows for rows, _ in pieces])] = np.arange(count, dtype=np.int64)
        picked = pa.concat_tables([pa.Table.from_arrays(arrays, schema=schema)
                                   for _, arrays in pieces]).take(pa.array(where))
        return [column.combine_chunks() for column in picked.columns]

    def _columns_parsed(self, payloads: pa.Array) -> tuple[list[pa.Array], pa.Array]:
        """`columns_of` for a schema of flat scalar fields by the C parser (`typed_native.c`,
        the GIL released), and the rows it leaves by `_columns_read`."""
        assert _NATIVE is not None
        kinds = "".join(typed_layout.KINDS[f.type] for f in self.fields).encode()
        names = tuple(name.encode() for name in self.names)
        return self._columns_native(
            payloads,
            lambda *buffers: _NATIVE.parse_flat(*buffers, kinds, names, pa.allocate_buffer),
            self._columns_read)

    def _columns_avro(self, payloads: pa.Array) -> tuple[list[pa.Array], pa.Array]:
        """`columns_of` for an Avro schema of scalar fields by the C reader (`typed_native.c`),
        and the rows it leaves (not one writer's datum of this schema) row by row."""
        assert _NATIVE is not None and self._avro_plan is not None
        kinds, nulls, symbols = self._avro_plan

        def rest(left: pa.Array) -> tuple[list[pa.Array], pa.Array]:
            arrays, decoded = self.columns(left.to_pylist())
            return arrays, pa.array(decoded, pa.bool_())

        return self._columns_native(
            payloads,
            lambda *buffers: _NATIVE.parse_avro(*buffers, kinds, nulls, symbols,
                                                pa.allocate_buffer),
            rest)

    def _columns_native(self, payloads: pa.Array, parse: Any, rest_of: Any
                        ) -> tuple[list[pa.Array], pa.Array]:
        """The columns `parse` (a `typed_native` reader, given the payloads' buffers) fills,
        with the rows it leaves decoded by `rest_of` and put in their places."""
        count = len(payloads)
        binary = payloads if payloads.type in (pa.binary(), pa.large_binary()) \
            else payloads.cast(pa.binary())
        validity, offsets, data = binary.buffers()
        taken, parsed = parse(validity, offsets, data, binary.offset, count,
                              pa.types.is_large_binary(binary.type))
        arrays = [  # the buffers come from Arrow's pool (see `typed_native.c`)
            pa.Array.from_buffers(field.type, count, [
                valid, values, *([] if text is None else [text])])
            for field, (valid, values, text) in zip(self.fields, parsed, strict=True)
        ]
        ok = np.frombuffer(taken, np.bool_)
        if ok.all():
            return arrays, pa.repeat(pa.scalar(True), count)
        left = np.flatnonzero(~ok)
        rest, rest_decoded = rest_of(pc.take(payloads, pa.array(left)))
        chosen = pa.array(ok)
        decoded = ok.copy()
        decoded[left] = rest_decoded.to_numpy(zero_copy_only=False)
        pieces = [(np.flatnonzero(ok), [array.filter(chosen) for array in arrays]), (left, rest)]
        return self._in_row_order(count, pieces), pa.array(decoded)

    @staticmethod
    def _layout_fits(payloads: pa.Array, layout: typed_layout.Layout, schema: pa.Schema) -> bool:
        """Whether most of the first `LAYOUT_SAMPLE` payloads have `layout` (a stream whose
        rows differ in their key order or spacing is not read twice)."""
        if len(payloads) <= LAYOUT_SAMPLE:
            return True
        read = typed_layout.read_layout(payloads.slice(0, LAYOUT_SAMPLE), layout, schema)
        return read is not None and 2 * int(read[1].sum()) >= LAYOUT_SAMPLE

    def _columns_read(self, payloads: pa.Array) -> tuple[list[pa.Array], pa.Array]:
        """`columns_of` by Arrow's JSON reader, and row by row for what it cannot vouch for."""
        count = len(payloads)
        nested_number = any(_holds_float(f.type) for f in self.fields if f.type != pa.float64())
        candidates = typed_json.bulk_candidates(payloads, nested_number)
        every = pc.all(candidates).as_py() or count == 0
        chosen = (np.arange(count, dtype=np.int64) if every
                  else pc.indices_nonzero(candidates).to_numpy().astype(np.int64))
        json_schema = pa.schema([pa.field(name, column.type)
                                 for name, column in zip(self.names, self.fields, strict=True)])
        parts, left = typed_json.read_parts(payloads if every else pc.take(payloads, chosen),
                                            json_schema)
        slow_parts = [chosen[np.array(left, np.int64)]]
        if not every:
            others = pc.and_(pc.invert(candidates), pc.is_valid(payloads))
            slow_parts.append(pc.indices_nonzero(others).to_numpy().astype(np.int64))
        for start, table in parts:
            rounded = typed_json.rounded_rows(table)
            if rounded is not None:
                slow_parts.append(chosen[start + rounded.to_numpy().astype(np.int64)])
        slow = np.sort(np.concatenate(slow_parts))
        schema = pa.schema(self.fields)
        tables = [table.rename_columns(schema.names).cast(schema) for _start, table in parts]
        if every and not len(slow) and len(tables) == 1:  # the usual file: one bulk read
            return ([column.combine_chunks() for column in tables[0].columns],
                    pa.repeat(pa.scalar(True), count))
        slow_arrays, slow_decoded = self.columns(pc.take(payloads, slow).to_pylist())
        tables.append(pa.Table.from_arrays(slow_arrays, schema=schema))
        where = np.full(count, -1, np.int64)
        decoded = np.zeros(count, np.bool_)
        base = 0
        for start, table in parts:
            rows = chosen[start:start + table.num_rows]
            where[rows] = np.arange(base, base + table.num_rows)
            decoded[rows] = True
            base += table.num_rows
        where[slow] = np.arange(base, base + len(slow))  # rounded rows: the per-row result
        decoded[slow] = slow_decoded
        picked = pa.concat_tables(tables).take(pa.array(where, mask=where < 0))
        return [column.combine_chunks() for column in picked.columns], pa.array(decoded)

    def encode(self, row: dict[str, Any]) -> bytes:
        """A payload from a row's typed values (tiered replay of a file without payloads)."""
        value: dict[str, Any] = {}
        for name, column in self.names.items():
            item = row.get(column)
            if name in self.text_fields and item is not None:
                item = json.loads(item)
            value[name] = item
        datum: Any = value["value"] if self.whole_value else value
        if self.kind == "avro":
            import fastavro

            out = io.BytesIO()
            fastavro.schemaless_writer(out, self._parsed, datum)
            return out.getvalue()
        if isinstance(datum, dict):
            datum = {k: v for k, v in datum.items() if v is not None}
        return json.dumps(datum, separators=(",", ":")).encode()

    def metadata(self) -> dict[str, str]:
        """The file footer entries that let a reader rebuild payloads from this file."""
        return {"shardgate.schema.type": self.kind,
                "shardgate.schema.version": str(self.version),
                "shardgate.schema.definition": json.dumps(self.document, sort_keys=True)}

    @classmethod
    def from_metadata(cls, metadata: dict[bytes, bytes], reserved: frozenset[str]
                      ) -> TypedSchema | None:
        kind = metadata.get(b"shardgate.schema.type")
        if kind is None:
            return None
        return cls(kind.decode(), json.loads(metadata[b"shardgate.schema.definition"]),
                   int(metadata[b"shardgate.schema.version"]), reserved)
