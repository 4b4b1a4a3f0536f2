"""Direct codecs for the four methods on the per-message path; pamqp does everything else.

pamqp's generic (un)marshalling walks each method's attribute list with per-field type lookups;
for basic.publish and basic.ack coming in, and basic.deliver and basic.ack going out (once per
message each) that was about half of the broker's CPU. These functions read and write the same
wire layout (AMQP 0-9-1 §4.2.5: shortstr = length octet + bytes, longlong = 8 bytes big-endian,
consecutive bits packed in one octet) and are checked byte for byte against pamqp in the unit
tests. They return pamqp command objects so that the state machine sees one type per method.
Anything they cannot decode (short or malformed input) returns None and goes through pamqp,
which reports the error.
"""

from __future__ import annotations

import struct

from pamqp import commands

PUBLISH_INDEX = commands.Basic.Publish.index
ACK_INDEX = commands.Basic.Ack.index
DELIVER_INDEX = commands.Basic.Deliver.index

_METHOD_FRAME = struct.Struct(">BHII")  # type, channel, size, class+method index
_TAG_BITS = struct.Struct(">QB")
_ACK_FRAME = struct.Struct(">BHIIQBB")  # whole basic.ack frame incl. end octet


def decode_publish(data: bytes) -> commands.Basic.Publish | None:
    """`data` is the whole frame; its method is basic.publish."""
    try:
        pos = 13  # 7 header + 4 method index + 2 ticket
        n = data[pos]
        exchange = data[pos + 1:pos + 1 + n].decode()
        pos += 1 + n
        n = data[pos]
        routing_key = data[pos + 1:pos + 1 + n].decode()
        pos += 1 + n
        bits = data[pos]
        if pos + 2 != len(data):
            return None
    except (IndexError, UnicodeDecodeError):
        return None
    method = commands.Basic.Publish()
    method.exchange = exchange
    method.routing_key = routing_key
    method.mandatory = bool(bits & 1)
    method.immediate = bool(bits & 2)
    return method


def decode_ack(data: bytes) -> commands.Basic.Ack | None:
    """`data` is the whole frame; its method is basic.ack."""
    if len(data) != 21:
        return None
    tag, bits = _TAG_BITS.unpack_from(data, 11)
    method = commands.Basic.Ack()
    method.delivery_tag = tag
    method.multiple = bool(bits & 1)
    return method


def _shortstr(text: str) -> bytes:
    raw = text.encode()
    if len(raw) > 255:
        raise ValueError("shortstr longer than 255 bytes")
    return bytes((len(raw),)) + raw


def encode_deliver(
    channel: int, consumer_tag: bytes, delivery_tag: int, redelivered: bool, exchange: str,
    routing_key: str,
) -> bytes:
    """A whole basic.deliver frame; `consumer_tag` is already a shortstr (cached per consumer)."""
    args = (
        consumer_tag + _TAG_BITS.pack(delivery_tag, 1 if redelivered else 0)
        + _shortstr(exchange) + _shortstr(routing_key)
    )
    return _METHOD_FRAME.pack(1, channel, len(args) + 4, DELIVER_INDEX) + args + b"\xce"


def encode_ack(channel: int, delivery_tag: int, multiple: bool) -> bytes:
    """A whole basic.ack frame (publisher confirm)."""
    return _ACK_FRAME.pack(1, channel, 13, ACK_INDEX, delivery_tag, 1 if multiple else 0, 0xCE)


def shortstr(text: str) -> bytes:
    return _shortstr(text)
