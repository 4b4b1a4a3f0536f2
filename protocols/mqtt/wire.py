"""MQTT data representation (3.1.1 §1.5, v5 §1.5): protocol levels and size limits, and the
readers and writers of its primitive types (Variable Byte Integer, Two Byte Integer, UTF-8
string, Binary Data) plus the fixed header. Packets and properties are built on these
elsewhere; nothing here knows a packet type."""

from __future__ import annotations

import struct

from .errors import InvalidUTF8, malformed

MQTT_3_1 = 3
MQTT_3_1_1 = 4
MQTT_5 = 5
#: Largest Remaining Length a 4-byte Variable Byte Integer can hold (§2.2.3 / v5 §1.5.5).
MAX_REMAINING_LENGTH = 268_435_455
#: Largest whole packet: the biggest remaining length plus its 5-byte fixed header.
MAX_PACKET_SIZE = MAX_REMAINING_LENGTH + 5
#: Protocol name and level pairs this codec speaks (§3.1.2.1-2).
PROTOCOLS = frozenset({("MQIsdp", MQTT_3_1), ("MQTT", MQTT_3_1_1), ("MQTT", MQTT_5)})


def read_varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """A Variable Byte Integer of at most 4 bytes, minimally encoded (v5 [MQTT-1.5.5-1])."""
    value = 0
    shift = 0
    start = pos
    while True:
        if pos >= end:
            raise malformed("truncated variable byte integer")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if byte == 0 and pos - start > 1:
                raise malformed("variable byte integer not minimally encoded")
            return value, pos
        shift += 7
        if shift == 28:
            raise malformed("variable byte integer longer than 4 bytes")


def read_u16(data: bytes, pos: int, end: int, what: str) -> tuple[int, int]:
    if pos + 2 > end:
        raise malformed(f"truncated {what}")
    return (data[pos] << 8) | data[pos + 1], pos + 2


def read_str(data: bytes, pos: int, end: int, what: str) -> tuple[str, int]:
    """A UTF-8 Encoded String (§1.5.3): 2-byte length, strict UTF-8, no U+0000."""
    if pos + 2 > end:
        raise malformed(f"truncated {what}")
    stop = pos + 2 + ((data[pos] << 8) | data[pos + 1])
    if stop > end:
        raise malformed(f"{what} runs past the end of the packet")
    try:
        text = data[pos + 2 : stop].decode()
    except UnicodeDecodeError:
        raise InvalidUTF8(f"{what} is not well-formed UTF-8 [MQTT-1.5.3-1]") from None
    if "\x00" in text:
        raise InvalidUTF8(f"{what} contains U+0000 [MQTT-1.5.3-2]")
    return text, stop


def read_bin(data: bytes, pos: int, end: int, what: str) -> tuple[bytes, int]:
    """Binary Data (v5 §1.5.6): 2-byte length then the bytes."""
    if pos + 2 > end:
        raise malformed(f"truncated {what}")
    stop = pos + 2 + ((data[pos] << 8) | data[pos + 1])
    if stop > end:
        raise malformed(f"{what} runs past the end of the packet")
    return data[pos + 2 : stop], stop



pack_u16 = struct.Struct(">H").pack
pack_u32 = struct.Struct(">I").pack


def encode_varint(value: int) -> bytes:
    if value < 0x80:
        return bytes((value,))
    if value > MAX_REMAINING_LENGTH:
        raise ValueError(f"{value} does not fit a variable byte integer")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_str(text: str) -> bytes:
    raw = text.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise ValueError("string longer than 65535 bytes")
    return pack_u16(len(raw)) + raw


def encode_bin(raw: bytes) -> bytes:
    if len(raw) > 0xFFFF:
        raise ValueError("binary data longer than 65535 bytes")
    return pack_u16(len(raw)) + bytes(raw)


def with_fixed_header(first: int, body: bytes) -> bytes:
    return bytes((first,)) + encode_varint(len(body)) + body
