"""The schema registry: versions per stream, compatibility modes checked at registration (JSON
Schema and Avro), payload checks, and the rate-limited log of refused payloads."""

from __future__ import annotations

import io
import json
import logging

import fastavro
import pytest
from shardgate.core.errors import SchemaMismatch
from shardgate.core.schema_registry import (
    Compatibility,
    RejectionLog,
    SchemaIncompatible,
    SchemaInvalid,
    SchemaRegistry,
    SchemaVersion,
)

READING_V1 = {"type": "object", "properties": {"device": {"type": "string"},
                                               "temp": {"type": "number"}},
              "required": ["device", "temp"]}
READING_V2 = {**READING_V1, "properties": {**READING_V1["properties"],
                                           "humidity": {"type": "number"}}}
AVRO_V1 = {"type": "record", "name": "Reading", "fields": [
    {"name": "device", "type": "string"}, {"name": "temp", "type": "double"}]}


def avro(schema: dict, datum: dict) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), datum)
    return out.getvalue()


def test_versions_are_numbered_and_the_same_schema_is_not_a_new_version() -> None:
    saved: list[tuple[str, list[SchemaVersion]]] = []
    registry = SchemaRegistry(on_change=lambda s, v: saved.append((s, v)))
    first = registry.register("sensors", "json", json.dumps(READING_V1))
    assert (first.version, first.compatibility) == (1, Compatibility.BACKWARD)
    assert registry.register("sensors", "json", READING_V1) is first
    second = registry.register("sensors", "json", READING_V2)
    assert second.version == 2 and registry.latest("sensors") == second
    assert [v.version for v in saved[-1][1]] == [1, 2]
    restored = SchemaRegistry()
    restored.load("sensors", [SchemaVersion.from_dict(v.to_dict()) for v in saved[-1][1]])
    assert restored.latest("sensors") == second
    restored.checks["sensors"](b'{"device": "d", "temp": 1, "humidity": 3}')


def test_payloads_are_checked_against_the_latest_version() -> None:
    registry = SchemaRegistry()
    registry.register("sensors", "json", READING_V1)
    check = registry.checks["sensors"]
    assert check(b'{"device": "d1", "temp": 21.5}') == {"device": "d1", "temp": 21.5}
    with pytest.raises(SchemaMismatch, match="temp must be number"):
        check(b'{"device": "d1", "temp": "hot"}')
    with pytest.raises(SchemaMismatch, match="not JSON"):
        check(b"\xff")
    registry.register("readings", "avro", AVRO_V1)
    datum = {"device": "d1", "temp": 21.5}
    assert registry.checks["readings"](avro(AVRO_V1, datum)) == datum
    with pytest.raises(SchemaMismatch, match="Avro"):
        registry.checks["readings"](b"\x05")
    with pytest.raises(SchemaMismatch, match="after its Avro datum"):
        registry.checks["readings"](avro(AVRO_V1, datum) + b"x")


@pytest.mark.parametrize("kind, definition", [
    ("json", '{"type": "object", "properties": 3}'),
    ("json", "not json"),
    ("avro", '{"type": "nosuchtype"}'),
    ("xml", "{}"),
])
def test_invalid_schemas_are_refused(kind: str, definition: str) -> None:
    with pytest.raises(SchemaInvalid):
        SchemaRegistry().register("s", kind, definition)


def test_json_compatibility_modes() -> None:
    registry = SchemaRegistry()
    registry.register("s", "json", READING_V1)
    # A new required property: old data lacks it, so new readers refuse it (not backward).
    required = {**READING_V2, "required": ["device", "temp", "humidity"]}
    with pytest.raises(SchemaIncompatible, match="humidity: required now"):
        registry.register("s", "json", required)
    # A narrower type is not backward either; integer within number is.
    narrower = {**READING_V1, "properties": {**READING_V1["properties"],
                                             "temp": {"type": "integer"}}}
    with pytest.raises(SchemaIncompatible, match="type number is no longer allowed"):
        registry.register("s", "json", narrower)
    assert registry.register("s", "json", narrower, "forward").version == 2
    with pytest.raises(SchemaIncompatible, match="backward"):
        registry.register("s", "json", required, "full")
    assert registry.register("s", "json", required, "none").version == 3
    assert [v.compatibility for v in registry.versions("s")] == [
        Compatibility.BACKWARD, Compatibility.FORWARD, Compatibility.NONE]
    with pytest.raises(SchemaIncompatible, match="type changes"):
        registry.register("s", "avro", AVRO_V1, "backward")


def test_avro_compatibility_follows_schema_resolution() -> None:
    registry = SchemaRegistry()
    registry.register("r", "avro", AVRO_V1)
    no_default = {**AVRO_V1, "fields": [*AVRO_V1["fields"], {"name": "humidity", "type": "double"}]}
    with pytest.raises(SchemaIncompatible, match="humidity: added without a default"):
        registry.register("r", "avro", no_default)
    with_default = {**AVRO_V1, "fields": [
        *AVRO_V1["fields"], {"name": "humidity", "type": ["null", "double"], "default": None}]}
    assert registry.register("r", "avro", with_default, "full").version == 2
    as_float = {**AVRO_V1, "fields": [{"name": "device", "type": "string"},
                                      {"name": "temp", "type": "float"}]}
    with pytest.raises(SchemaIncompatible, match="double cannot be read as float"):
        registry.register("r", "avro", as_float, "backward")


def test_refused_payloads_are_counted_and_logged_at_most_once_per_interval(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = RejectionLog(interval_s=10, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING):
        assert [log.note("s", "bad") for _ in range(1000)].count(True) == 1
        now[0] = 11
        assert log.note("s", "bad again")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["bad", "bad again (and 999 more refused payloads since the last report)"]
