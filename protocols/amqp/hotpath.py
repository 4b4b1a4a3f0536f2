"""Direct codecs for the four methods on the per-message path; pamqp does everything else.

pamqp's generic (un)marshalling walks each method's attribute list with per-field type lookups;
for basic.publish and basic.ack coming in, and basic.deliver and basic.ack going out (once per
message each) that was about half of the broker's CPU. These functions read and write the same
wire layout (AMQP 0-9-1 §4.2.5: shortstr = length octet + bytes, longlong = 8 bytes big-endian,
consecutive bits packed in one octet) and are checked byte for byte against pamqp in the unit
tests. They return pamqp command objects so that the state machine sees one type per method.
Content headers of class basic are read the same way (`decode_content_header`, pamqp's own
decoders for a headers table and a timestamp). Anything they cannot decode (short or malformed
input) returns None and goes through pamqp, which reports the error.
"""

from __future__ import annotations

import datetime
import struct

from pamqp import commands, decode
from pamqp.common import FieldTable

PUBLISH_INDEX = commands.Basic.Publish.index
ACK_INDEX = commands.Basic.Ack.index
DELIVER_INDEX = commands.Basic.Deliver.index

_METHOD_FRAME = struct.Struct(">BHII")  # type, channel, size, class+method index
_TAG_BITS = struct.Struct(">QB")
_ACK_FRAME = struct.Struct(">BHIIQBB")  # whole basic.ack frame incl. end octet
_new_publish = commands.Basic.Publish.__new__
_new_ack = commands.Basic.Ack.__new__


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
    method = _new_publish(commands.Basic.Publish)  # skips pamqp's per-field validation
    method.ticket = 0
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
    method = _new_ack(commands.Basic.Ack)
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
    return encode_deliver_route(
        channel, consumer_tag, delivery_tag, redelivered, _shortstr(exchange) + _shortstr(routing_key)
    )


def encode_deliver_route(
    channel: int, consumer_tag: bytes, delivery_tag: int, redelivered: bool, route: bytes
) -> bytes:
    """basic.deliver with the exchange and routing key already encoded as two shortstrs
    (`route`, cached per message)."""
    args = consumer_tag + _TAG_BITS.pack(delivery_tag, 1 if redelivered else 0) + route
    return _METHOD_FRAME.pack(1, channel, len(args) + 4, DELIVER_INDEX) + args + b"\xce"


def encode_ack(channel: int, delivery_tag: int, multiple: bool) -> bytes:
    """A whole basic.ack frame (publisher confirm)."""
    return _ACK_FRAME.pack(1, channel, 13, ACK_INDEX, delivery_tag, 1 if multiple else 0, 0xCE)


def shortstr(text: str) -> bytes:
    return _shortstr(text)


# --------------------------------------------------------------------------- content header
# Basic property flags, highest bit first (AMQP 0-9-1 §4.2.6.1 and the basic class fields):
# (flag, attribute, kind) with kind "s" shortstr, "t" table, "o" octet, "T" timestamp.
_PROPERTY_FIELDS = (
    (0x8000, "content_type", "s"),
    (0x4000, "content_encoding", "s"),
    (0x2000, "headers", "t"),
    (0x1000, "delivery_mode", "o"),
    (0x0800, "priority", "o"),
    (0x0400, "correlation_id", "s"),
    (0x0200, "reply_to", "s"),
    (0x0100, "expiration", "s"),
    (0x0080, "message_id", "s"),
    (0x0040, "timestamp", "T"),
    (0x0020, "message_type", "s"),
    (0x0010, "user_id", "s"),
    (0x0008, "app_id", "s"),
    (0x0004, "cluster_id", "s"),
)
_CONTENT_HEADER = struct.Struct(">HHQH")  # class id, weight, body size, property flags
_PROPERTY_NAMES = tuple(name for _, name, _ in _PROPERTY_FIELDS)


class Properties:
    """Basic properties as read from a content header: the attributes of pamqp's
    `commands.Basic.Properties` (unset ones None), without its per-field machinery. The
    defaults are class attributes, so a new instance costs nothing per field. The attribute
    types are pamqp's, so code reading properties takes either (`BasicProperties`)."""

    content_type: str | None = None
    content_encoding: str | None = None
    headers: FieldTable | None = None
    delivery_mode: int | None = None
    priority: int | None = None
    correlation_id: str | None = None
    reply_to: str | None = None
    expiration: str | None = None
    message_id: str | None = None
    timestamp: datetime.datetime | None = None
    message_type: str | None = None
    user_id: str | None = None
    app_id: str | None = None
    cluster_id: str = ""  # pamqp's default

    def to_pamqp(self) -> commands.Basic.Properties:
        return commands.Basic.Properties(**{  # cluster-id is deprecated: pamqp refuses it
            name: getattr(self, name) for name in _PROPERTY_NAMES
            if getattr(self, name) is not None and name != "cluster_id"
        })

    def marshal(self) -> bytes:
        return self.to_pamqp().marshal()


# A message's basic properties as decoded by pamqp or by `decode_content_header`.
BasicProperties = commands.Basic.Properties | Properties


def decode_content_header(data: bytes) -> tuple[int, Properties] | None:
    """(body size, properties) of a whole content header frame of class basic; None for
    anything else (another class, property flags continued, malformed or non-UTF-8 input), which
    then goes through pamqp and its error reporting."""
    try:
        class_id, _, body_size, flags = _CONTENT_HEADER.unpack_from(data, 7)
        if class_id != 60 or flags & 1:
            return None
        props = Properties()
        pos = 21
        end = len(data) - 1
        if flags:
            for flag, name, kind in _PROPERTY_FIELDS:
                if not flags & flag:
                    continue
                if kind == "s":
                    n = data[pos]
                    value: object = data[pos + 1:pos + 1 + n].decode()
                    pos += 1 + n
                elif kind == "o":
                    value = data[pos]
                    pos += 1
                elif kind == "t":
                    used, value = decode.field_table(data[pos:end])
                    pos += used
                else:
                    used, value = decode.timestamp(data[pos:pos + 8])
                    pos += used
                setattr(props, name, value)
        if pos != end:
            return None
    except (IndexError, ValueError, struct.error, UnicodeDecodeError):
        return None
    return body_size, props
