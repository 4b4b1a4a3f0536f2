"""Payload schemas per stream (Danube's): Bytes, String (UTF-8), Int64 (8 bytes, big-endian,
signed) and JSON (any JSON document). A publish whose payload does not fit is refused."""

from __future__ import annotations

import json

from .errors import SchemaMismatch
from .streams import Schema


def check_payload(schema: Schema, payload: bytes, stream: str) -> None:
    if schema is Schema.BYTES:
        return
    if schema is Schema.STRING:
        try:
            payload.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SchemaMismatch(f"stream {stream!r} takes UTF-8 strings: {exc.reason} at byte {exc.start}") from None
    elif schema is Schema.INT64:
        if len(payload) != 8:
            raise SchemaMismatch(
                f"stream {stream!r} takes int64 payloads (8 bytes, big-endian); got {len(payload)} bytes"
            )
    elif schema is Schema.JSON:
        try:
            json.loads(payload)
        except (ValueError, UnicodeDecodeError) as exc:
            raise SchemaMismatch(f"stream {stream!r} takes JSON documents: {exc}") from None
