"""Payload checks against stream schemas, and the SDK's typed helpers that produce them."""

from __future__ import annotations

import pytest
from shardgate.client import schemas
from shardgate.core.errors import SchemaMismatch
from shardgate.core.schemas import check_payload
from shardgate.core.streams import Schema


@pytest.mark.parametrize(("schema", "payload"), [
    (Schema.BYTES, b"\xff\x00"),
    (Schema.STRING, "température".encode()),
    (Schema.INT64, schemas.encode_int64(-(2**63))),
    (Schema.JSON, schemas.encode_json({"a": [1, 2.5, None]})),
    (Schema.JSON, b"42"),
])
def test_fitting_payloads_pass(schema: Schema, payload: bytes) -> None:
    check_payload(schema, payload, "s")


@pytest.mark.parametrize(("schema", "payload", "reason"), [
    (Schema.STRING, b"\xc3\x28", "not valid UTF-8"),
    (Schema.INT64, b"1234", "must be 8 bytes"),
    (Schema.INT64, b"", "got 0 bytes"),
    (Schema.JSON, b"{'single': 'quotes'}", "not valid JSON"),
    (Schema.JSON, b"\xff", "not valid UTF-8"),
])
def test_mismatches_say_why(schema: Schema, payload: bytes, reason: str) -> None:
    with pytest.raises(SchemaMismatch, match=reason):
        check_payload(schema, payload, "s")


def test_int64_round_trip_is_big_endian_signed() -> None:
    assert schemas.encode_int64(1) == b"\x00" * 7 + b"\x01"
    assert schemas.decode_int64(schemas.encode_int64(-5)) == -5
