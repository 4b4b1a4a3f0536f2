"""Typed helpers for the stream schemas: how payloads of String, Int64 and JSON streams look.

Int64 payloads are 8 bytes, big-endian two's complement (what the broker checks); String
payloads are UTF-8; JSON payloads are one UTF-8 JSON document.
"""

from __future__ import annotations

import json
from typing import Any


def encode_int64(value: int) -> bytes:
    return int(value).to_bytes(8, "big", signed=True)


def decode_int64(payload: bytes) -> int:
    if len(payload) != 8:
        raise ValueError(f"an int64 payload is 8 bytes, got {len(payload)}")
    return int.from_bytes(payload, "big", signed=True)


def encode_string(value: str) -> bytes:
    return value.encode("utf-8")


def decode_string(payload: bytes) -> str:
    return payload.decode("utf-8")


def encode_json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode("utf-8")


def decode_json(payload: bytes) -> Any:
    return json.loads(payload)
