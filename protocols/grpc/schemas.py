"""Payload validation against a stream's schema (Bytes, String, Int64, JSON), as Danube's.

- bytes: anything.
- string: valid UTF-8.
- int64: exactly 8 bytes, a big-endian two's complement signed integer (what
  `int.to_bytes(8, "big", signed=True)` writes; the SDK's `encode_int64` does it). Decimal text is
  refused so that a payload has one meaning only.
- json: one JSON document in UTF-8.

Pure functions, no I/O: the gRPC servicer calls `check_payload` and turns a `SchemaMismatch` into
INVALID_ARGUMENT with its message.
"""

from __future__ import annotations

import json

from ...core.streams import Schema


class SchemaMismatch(ValueError):
    """The payload does not fit the stream's schema; the message says why."""


def check_payload(schema: Schema, payload: bytes, stream: str) -> None:
    """Raise `SchemaMismatch` when `payload` does not fit `schema` of `stream`."""
    if schema is Schema.BYTES:
        return
    if schema is Schema.INT64:
        if len(payload) != 8:
            raise SchemaMismatch(
                f"stream {stream!r} has schema int64: the payload must be 8 bytes "
                f"(big-endian signed integer), got {len(payload)} bytes"
            )
        return
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SchemaMismatch(
            f"stream {stream!r} has schema {schema.value}: the payload is not valid UTF-8 "
            f"(byte {exc.start}: {exc.reason})"
        ) from None
    if schema is Schema.JSON:
        try:
            json.loads(text)
        except ValueError as exc:
            raise SchemaMismatch(
                f"stream {stream!r} has schema json: the payload is not valid JSON ({exc})"
            ) from None
