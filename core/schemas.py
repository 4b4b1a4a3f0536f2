"""Payload schemas per stream (Danube's): a publish whose payload does not fit is refused.

- bytes: anything.
- string: valid UTF-8.
- int64: exactly 8 bytes, a big-endian two's complement signed integer (what
  `int.to_bytes(8, "big", signed=True)` writes; the SDK's `encode_int64` does it). Decimal text is
  refused so that a payload has one meaning only.
- json: one JSON document in UTF-8.

The one check every protocol's publish goes through (`Broker.publish` calls it); each protocol
turns a `SchemaMismatch` into its own reply (gRPC INVALID_ARGUMENT, MQTT 5 reason 0x99).
"""

from __future__ import annotations

import json

from .errors import SchemaMismatch
from .streams import Schema


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
