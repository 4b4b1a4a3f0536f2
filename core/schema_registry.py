"""The schema registry: per stream, numbered versions of a JSON Schema or an Avro schema, each
registered under a compatibility mode that is checked against the latest version (as
Confluent's and Danube's registries do), and the check every publish to such a stream passes.

- JSON Schema: a payload is one JSON document that the latest version accepts
  (`fastjsonschema`, drafts 4, 6 and 7).
- Avro: a payload is one datum in Avro's binary encoding, without a header or a schema id
  (`fastavro.schemaless_writer`), that the latest version reads to its last byte.

Compatibility, of a new version N against the latest L: `backward` (N reads what L accepted:
consumers can upgrade first), `forward` (L reads what N accepts: producers can upgrade first),
`full` (both), `none`. For Avro these are Avro's schema resolution rules (a field added
without a default breaks backward; promotions int → long → float → double). For JSON Schema
it is a structural check of what N accepts against L: types (integer within number),
required properties, properties closed by `additionalProperties: false`, array items and
enums; keywords outside those (patterns, bounds, `oneOf`) are not compared.

The registry keeps no files: `on_change` hands each stream's versions to the caller to persist
(the broker keeps them as internal state), and `load` gives them back at start. No protocol,
no I/O. Where registrations must be ordered across processes (a cluster), the caller sets a
`registrar`: `register_ordered` goes through it, and it checks each new version with
`prepare` against the latest version it holds (see `shardgate.cluster.schemas`).
"""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from .errors import CoreError, InvalidStreamConfig, SchemaMismatch

log = logging.getLogger(__name__)


class SchemaType(StrEnum):
    JSON = "json"
    AVRO = "avro"


class Compatibility(StrEnum):
    BACKWARD = "backward"
    FORWARD = "forward"
    FULL = "full"
    NONE = "none"


class SchemaInvalid(InvalidStreamConfig):
    """The schema text is not a schema of its type."""


class SchemaIncompatible(CoreError):
    """A new version breaks the stream's compatibility mode."""


class SchemaRegistryUnavailable(CoreError):
    """The registry that orders registrations (a cluster's, in etcd) cannot take one now:
    the caller may retry."""


@dataclass(slots=True, frozen=True)
class SchemaVersion:
    stream: str
    version: int
    type: SchemaType
    definition: str
    """The schema as canonical JSON text (sorted keys, no spaces)."""
    compatibility: Compatibility
    registered_ms: int

    @property
    def parsed(self) -> Any:
        return json.loads(self.definition)

    def to_dict(self) -> dict[str, Any]:
        return {"stream": self.stream, "version": self.version, "type": self.type.value,
                "definition": self.definition, "compatibility": self.compatibility.value,
                "registered_ms": self.registered_ms}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SchemaVersion:
        return cls(data["stream"], int(data["version"]), SchemaType(data["type"]),
                   data["definition"], Compatibility(data["compatibility"]),
                   int(data["registered_ms"]))


Check = Callable[[bytes], Any]
"""Decodes a payload that fits (the JSON document, the Avro datum); raises SchemaMismatch."""


def canonical(definition: str | dict[str, Any] | list[Any]) -> Any:
    """The schema document of `definition` (text or parsed); SchemaInvalid if not JSON."""
    if isinstance(definition, str | bytes):
        try:
            return json.loads(definition)
        except ValueError as exc:
            raise SchemaInvalid(f"the schema is not JSON: {exc}") from None
    return definition


def compile_check(stream: str, kind: SchemaType, schema: Any) -> Check:
    """The check of payloads against `schema`; SchemaInvalid when it is not a valid schema."""
    if kind is SchemaType.JSON:
        import fastjsonschema

        if not isinstance(schema, dict | bool):
            raise SchemaInvalid("a JSON Schema is an object (or true/false)")
        try:
            validate = fastjsonschema.compile(schema)
        except fastjsonschema.JsonSchemaDefinitionException as exc:
            raise SchemaInvalid(f"invalid JSON Schema: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - fastjsonschema raises plain errors too
            raise SchemaInvalid(f"invalid JSON Schema: {exc}") from None

        def check_json(payload: bytes) -> Any:
            try:
                document = json.loads(payload)
            except ValueError as exc:
                raise SchemaMismatch(
                    f"stream {stream!r}: the payload is not JSON ({exc})") from None
            try:
                return validate(document)
            except fastjsonschema.JsonSchemaValueException as exc:
                raise SchemaMismatch(
                    f"stream {stream!r}: the payload does not match its JSON Schema: "
                    f"{exc.message}") from None

        return check_json

    import fastavro

    try:
        parsed = fastavro.parse_schema(schema)
    except Exception as exc:  # noqa: BLE001 - fastavro's SchemaParseException and others
        raise SchemaInvalid(f"invalid Avro schema: {exc}") from None

    def check_avro(payload: bytes) -> Any:
        source = io.BytesIO(payload)
        try:
            datum = fastavro.schemaless_reader(source, parsed, None)
        except Exception as exc:  # noqa: BLE001 - truncated or malformed binary data
            raise SchemaMismatch(
                f"stream {stream!r}: the payload is not an Avro datum of its schema "
                f"({type(exc).__name__}: {exc})") from None
        if source.tell() != len(payload):
            raise SchemaMismatch(
                f"stream {stream!r}: the payload has {len(payload) - source.tell()} bytes "
                "after its Avro datum")
        return datum

    return check_avro


# -- compatibility ----------------------------------------------------------------------------

_JSON_TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")


def _json_types(schema: Any) -> set[str] | None:
    """The JSON types a schema allows; None: any."""
    if schema is True or schema == {}:
        return None
    if schema is False:
        return set()
    declared = schema.get("type")
    if declared is None:
        if "enum" in schema:
            return {_json_type_of(value) for value in schema["enum"]}
        if "properties" in schema or "required" in schema:
            return {"object"}
        if "items" in schema:
            return {"array"}
        return None
    return {declared} if isinstance(declared, str) else set(declared)


def _json_type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def json_reads(reader: Any, writer: Any, path: str = "$") -> list[str]:
    """Why `reader` may refuse a document `writer` accepts (empty: it accepts them all, as
    far as the compared keywords go)."""
    if reader is True or reader == {}:
        return []
    if writer is False:
        return []
    problems: list[str] = []
    allowed, written = _json_types(reader), _json_types(writer)
    if allowed is not None:
        if written is None:
            return [f"{path}: any type was allowed, now only {sorted(allowed)}"]
        for kind in sorted(written):
            if kind not in allowed and not (kind == "integer" and "number" in allowed):
                problems.append(f"{path}: type {kind} is no longer allowed")
    if not isinstance(reader, dict) or not isinstance(writer, dict):
        return problems
    if "enum" in reader:
        if "enum" not in writer:
            problems.append(f"{path}: values are now limited to an enum")
        else:
            missing = [v for v in writer["enum"] if v not in reader["enum"]]
            if missing:
                problems.append(f"{path}: enum values {missing} are no longer allowed")
    required = set(reader.get("required", ())) - set(writer.get("required", ()))
    for name in sorted(required):
        problems.append(f"{path}.{name}: required now, optional or absent before")
    reader_props = reader.get("properties", {})
    for name, sub in writer.get("properties", {}).items():
        if name in reader_props:
            problems += json_reads(reader_props[name], sub, f"{path}.{name}")
        elif reader.get("additionalProperties") is False:
            problems.append(f"{path}.{name}: no longer allowed (additionalProperties: false)")
    if "items" in reader and "items" in writer:
        problems += json_reads(reader["items"], writer["items"], f"{path}[]")
    return problems


_AVRO_PROMOTIONS = {
    "int": {"long", "float", "double"}, "long": {"float", "double"}, "float": {"double"},
    "string": {"bytes"}, "bytes": {"string"},
}


def _avro_type(schema: Any) -> str:
    if isinstance(schema, list):
        return "union"
    if isinstance(schema, dict):
        kind = schema["type"]
        return kind if isinstance(kind, str) else _avro_type(kind)
    return str(schema)


def avro_reads(reader: Any, writer: Any, path: str = "$") -> list[str]:
    """Why `reader` cannot read data written with `writer` under Avro's schema resolution
    (empty: it can). Both are parsed and expanded schemas (`fastavro.parse_schema(...,
    expand=True)`)."""
    if isinstance(writer, list):
        return [p for branch in writer for p in avro_reads(reader, branch, path)]
    if isinstance(reader, list):
        for branch in reader:
            if not avro_reads(branch, writer, path):
                return []
        return [f"{path}: no branch of the union reads {_avro_type(writer)}"]
    r_type, w_type = _avro_type(reader), _avro_type(writer)
    if r_type != w_type:
        if r_type in _AVRO_PROMOTIONS.get(w_type, ()):
            return []
        return [f"{path}: {w_type} cannot be read as {r_type}"]
    if r_type == "record":
        problems: list[str] = []
        written = {field["name"]: field for field in writer["fields"]}
        for field in reader["fields"]:
            names = [field["name"], *field.get("aliases", ())]
            source = next((written[name] for name in names if name in written), None)
            if source is not None:
                problems += avro_reads(field["type"], source["type"], f"{path}.{field['name']}")
            elif "default" not in field:
                problems.append(f"{path}.{field['name']}: added without a default")
        return problems
    if r_type == "enum":
        missing = [s for s in writer["symbols"] if s not in reader["symbols"]]
        if missing and "default" not in reader:
            return [f"{path}: enum symbols {missing} are unknown to the reader"]
        return []
    if r_type == "array":
        return avro_reads(reader["items"], writer["items"], f"{path}[]")
    if r_type == "map":
        return avro_reads(reader["values"], writer["values"], f"{path}{{}}")
    if r_type == "fixed" and reader.get("size") != writer.get("size"):
        return [f"{path}: fixed size {writer.get('size')} cannot be read as {reader.get('size')}"]
    return []


def incompatibilities(new: SchemaVersion | tuple[SchemaType, Any], latest: SchemaVersion,
                      mode: Compatibility) -> list[str]:
    """Why `new` breaks `mode` against `latest` (empty: it does not)."""
    if mode is Compatibility.NONE:
        return []
    kind, schema = (new.type, new.parsed) if isinstance(new, SchemaVersion) else new
    if kind is not latest.type:
        return [f"the schema type changes from {latest.type.value} to {kind.value}"]
    old = latest.parsed
    if kind is SchemaType.AVRO:
        import fastavro

        schema = fastavro.parse_schema(schema, expand=True, _write_hint=False)
        old = fastavro.parse_schema(old, expand=True, _write_hint=False)
        reads = avro_reads
    else:
        reads = json_reads
    problems = []
    if mode in (Compatibility.BACKWARD, Compatibility.FULL):
        problems += [f"backward: {p}" for p in reads(schema, old)]
    if mode in (Compatibility.FORWARD, Compatibility.FULL):
        problems += [f"forward: {p}" for p in reads(old, schema)]
    return problems


# -- the registry -----------------------------------------------------------------------------


class RejectionLog:
    """Logs refused payloads at most once per `interval_s` per stream, with how many were
    refused meanwhile: a publisher sending thousands of bad payloads gets a few lines, not a
    WARNING each."""

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._next: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def note(self, stream: str, reason: str) -> bool:
        """Count one refusal; True when it was logged."""
        now = self._clock()
        if now < self._next.get(stream, 0.0):
            self._suppressed[stream] = self._suppressed.get(stream, 0) + 1
            return False
        self._next[stream] = now + self.interval_s
        more = self._suppressed.pop(stream, 0)
        log.warning("%s%s", reason,
                    f" (and {more} more refused payloads since the last report)" if more else "")
        return True


Registrar = Callable[[str, "SchemaType | str", "str | dict[str, Any]", "Compatibility | str | None"],
                     Awaitable["SchemaVersion"]]
"""Registers a version elsewhere first (a cluster's etcd), then in this registry."""


class SchemaRegistry:
    """Schema versions per stream (see the module docstring)."""

    def __init__(self, on_change: Callable[[str, list[SchemaVersion]], None] | None = None,
                 clock_ms: Callable[[], int] | None = None) -> None:
        self.on_change = on_change
        self._listeners: list[Callable[[str, list[SchemaVersion]], None]] = []
        self._clock_ms = clock_ms or (lambda: int(time.time() * 1000))
        self._versions: dict[str, list[SchemaVersion]] = {}
        self.checks: dict[str, Check] = {}
        """The check of each stream with a schema (its latest version), by stream name."""
        self.rejected: dict[str, int] = {}
        """Payloads refused, per stream."""
        self.rejections = RejectionLog()
        self.registrar: Registrar | None = None
        """Where `register_ordered` registers (None: here, with `register`)."""

    def load(self, stream: str, versions: list[SchemaVersion]) -> None:
        """Restore a stream's versions (at start); the latest becomes its check."""
        if not versions:
            return
        versions = sorted(versions, key=lambda v: v.version)
        latest = versions[-1]
        self.checks[stream] = compile_check(stream, latest.type, latest.parsed)
        self._versions[stream] = versions

    def add_listener(self, listener: Callable[[str, list[SchemaVersion]], None]) -> None:
        """Also tell `listener` of every change, after `on_change` (a cluster shares them)."""
        self._listeners.append(listener)

    def _changed(self, stream: str) -> None:
        versions = self.versions(stream)
        if self.on_change is not None:
            self.on_change(stream, versions)
        for listener in self._listeners:
            listener(stream, versions)

    def replace(self, stream: str, versions: list[SchemaVersion]) -> None:
        """Take a stream's versions as another registry holds them (a cluster's: every node's
        registry follows etcd's), and hand them to `on_change` as a registration does."""
        if not versions:
            self.delete(stream)
            return
        self.load(stream, versions)
        self._changed(stream)

    def streams(self) -> list[str]:
        return sorted(self._versions)

    def versions(self, stream: str) -> list[SchemaVersion]:
        return list(self._versions.get(stream, ()))

    def latest(self, stream: str) -> SchemaVersion | None:
        versions = self._versions.get(stream)
        return versions[-1] if versions else None

    def prepare(self, stream: str, kind: SchemaType | str, definition: str | dict[str, Any],
                compatibility: Compatibility | str | None = None,
                versions: list[SchemaVersion] | None = None) -> SchemaVersion:
        """The version a registration would add after `versions` (default: this registry's),
        without adding it: the latest itself when the schema and mode are the latest's.
        `compatibility` None keeps the stream's mode (backward for a first version). Raises
        SchemaInvalid or SchemaIncompatible."""
        try:
            kind = SchemaType(kind)
        except ValueError:
            raise SchemaInvalid(f"unknown schema type {kind!r} (json or avro)") from None
        try:
            mode = None if compatibility is None else Compatibility(compatibility)
        except ValueError:
            raise SchemaInvalid(
                f"unknown compatibility {compatibility!r} (backward, forward, full, none)"
            ) from None
        schema = canonical(definition)
        compile_check(stream, kind, schema)
        text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
        held = self._versions.get(stream, []) if versions is None else versions
        latest = held[-1] if held else None
        if mode is None:
            mode = latest.compatibility if latest is not None else Compatibility.BACKWARD
        if latest is not None:
            if latest.type is kind and latest.definition == text:
                if mode is latest.compatibility:
                    return latest
            else:
                problems = incompatibilities((kind, schema), latest, mode)
                if problems:
                    raise SchemaIncompatible(
                        f"stream {stream!r}: the schema breaks {mode.value} compatibility with "
                        f"version {latest.version}: " + "; ".join(problems))
        return SchemaVersion(stream, (latest.version + 1) if latest else 1, kind, text, mode,
                             self._clock_ms())

    def register(self, stream: str, kind: SchemaType | str, definition: str | dict[str, Any],
                 compatibility: Compatibility | str | None = None) -> SchemaVersion:
        """Add a version (`prepare`); the same schema as the latest is not a new version (the
        latest is returned). Raises SchemaInvalid or SchemaIncompatible."""
        version = self.prepare(stream, kind, definition, compatibility)
        if version is self.latest(stream):
            return version
        self._versions.setdefault(stream, []).append(version)
        self.checks[stream] = compile_check(stream, version.type, version.parsed)
        self._changed(stream)
        return version

    async def register_ordered(self, stream: str, kind: SchemaType | str,
                               definition: str | dict[str, Any],
                               compatibility: Compatibility | str | None = None) -> SchemaVersion:
        """`register`, through the `registrar` when one is set (a cluster's, which orders
        registrations made on several nodes at once); raises SchemaRegistryUnavailable too."""
        if self.registrar is None:
            return self.register(stream, kind, definition, compatibility)
        return await self.registrar(stream, kind, definition, compatibility)

    def delete(self, stream: str) -> None:
        """Forget a stream's schemas (the stream was deleted)."""
        if self._versions.pop(stream, None) is not None:
            self.checks.pop(stream, None)
            self._changed(stream)

    def refused(self, stream: str, exc: SchemaMismatch) -> None:
        """Count a refused payload and log it, rate-limited."""
        self.rejected[stream] = self.rejected.get(stream, 0) + 1
        self.rejections.note(stream, str(exc))
