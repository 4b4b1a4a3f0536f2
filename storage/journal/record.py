"""Record framing of journal segment files: how one record is laid out on disk and checked.

A record is a 24-byte little-endian header followed by the data:

    length u32 | crc u32 | offset u64 | timestamp_ms i64 | data (length bytes)

`crc` covers everything after it (offset, timestamp and data: contiguous bytes, one checksum
call). It is a CRC-32C (Castagnoli), computed by the `crc32c` package (hardware accelerated
where the CPU allows). Without that package a new journal uses zlib's CRC-32 instead; each
journal names its checksum in its version file and keeps it for life, so a journal stays
readable whichever package is installed later, as long as its own checksum is available.

This module knows bytes only: no files, no offset policy, no indexes.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from typing import Final

Checksum = Callable[[bytes | bytearray | memoryview], int]

_crc32c: Checksum | None
try:  # pragma: no cover - which branch runs depends on the environment
    from crc32c import crc32c as _crc32c
except ImportError:  # pragma: no cover
    _crc32c = None

_CHECKSUMS: Final[dict[str, Checksum | None]] = {"crc32c": _crc32c, "crc32": zlib.crc32}
DEFAULT_CHECKSUM: Final = "crc32c" if _crc32c is not None else "crc32"
"""The checksum of new journals: CRC-32C when the `crc32c` package is installed."""

HEADER: Final = struct.Struct("<IIqq")
"""length, crc, offset, timestamp_ms."""
HEADER_SIZE: Final = HEADER.size
CRC_START: Final = 8
"""Where the checksummed bytes of a record start (after length and crc)."""
OFFSET_TS: Final = struct.Struct("<qq")
LENGTH_CRC: Final = struct.Struct("<II")


def checksum_function(name: str) -> Checksum:
    """The function computing checksum `name`; LookupError if unknown or not installed."""
    if name not in _CHECKSUMS:
        raise LookupError(f"unknown record checksum {name!r}")
    function = _CHECKSUMS[name]
    if function is None:
        raise LookupError(f"record checksum {name!r} needs the `{name}` package, not installed")
    return function


checksum: Final[Checksum] = checksum_function(DEFAULT_CHECKSUM)
"""The default checksum function."""


def encode_into(
    buf: bytearray, offset: int, timestamp_ms: int, data: bytes, crc: Checksum = checksum
) -> int:
    """Append one framed record to `buf`; returns its size in bytes."""
    framed = OFFSET_TS.pack(offset, timestamp_ms) + data
    buf += LENGTH_CRC.pack(len(data), crc(framed))
    buf += framed
    return HEADER_SIZE + len(data)


def encode(offset: int, timestamp_ms: int, data: bytes, crc: Checksum = checksum) -> bytes:
    """One framed record as bytes."""
    buf = bytearray()
    encode_into(buf, offset, timestamp_ms, data, crc)
    return bytes(buf)
