"""Sans-IO MQTT codec: bytes to packets and packets to bytes, for MQTT 3.1 (protocol level 3,
name "MQIsdp"), 3.1.1 (level 4) and 5.0 (level 5).

`PacketParser.feed(bytes)` returns the complete packets found in any chunking of the input;
`encode(packet, version)` returns the bytes of one packet and `encode_publish(...)` is the
hot-path variant that needs no dataclass. Decoding enforces the wire format: fixed-header
flags, lengths, strict UTF-8, which properties each packet may carry, reserved bits, non-zero
packet identifiers. It does not judge meaning (topic wildcards, session state, what a client
may send when); that is the connection state machine's work. No sockets, no clocks, no
logging here.

Spec references: MQTT 3.1.1 (OASIS, 2014) and MQTT 5.0 (OASIS, 2019); statement numbers such
as [MQTT-2.2.2-2] are 3.1.1's unless marked v5.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from operator import attrgetter
from typing import Any

from .packets import (
    Auth,
    Connack,
    Connect,
    Disconnect,
    Packet,
    PacketType,
    Pingreq,
    Pingresp,
    Properties,
    PropertyId,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    ReasonCode,
    Suback,
    Subscribe,
    SubscriptionRequest,
    Unsuback,
    Unsubscribe,
    Will,
)

__all__ = [
    "MAX_PACKET_SIZE",
    "InvalidUTF8",
    "MQTTCodecError",
    "PacketParser",
    "PacketTooLarge",
    "UnsupportedProtocolVersion",
    "encode",
    "encode_publish",
]

MQTT_3_1 = 3
MQTT_3_1_1 = 4
MQTT_5 = 5
#: Largest Remaining Length a 4-byte Variable Byte Integer can hold (§2.2.3 / v5 §1.5.5).
MAX_REMAINING_LENGTH = 268_435_455
#: Largest whole packet: the biggest remaining length plus its 5-byte fixed header.
MAX_PACKET_SIZE = MAX_REMAINING_LENGTH + 5
#: Protocol name and level pairs this codec speaks (§3.1.2.1-2).
PROTOCOLS = frozenset({("MQIsdp", MQTT_3_1), ("MQTT", MQTT_3_1_1), ("MQTT", MQTT_5)})


# --------------------------------------------------------------------------- errors
class MQTTCodecError(Exception):
    """Bytes that are not a valid MQTT packet. `reason_code` is the MQTT 5 reason code the
    receiver closes with: MALFORMED_PACKET unless the spec calls the case a Protocol Error.
    `packets` holds the packets decoded from the same `feed` before the error."""

    def __init__(self, message: str, reason_code: int = ReasonCode.MALFORMED_PACKET) -> None:
        super().__init__(message)
        self.reason_code = int(reason_code)
        self.packets: list[Packet] = []


class PacketTooLarge(MQTTCodecError):
    """A packet declared a size above the parser's maximum (v5 §3.1.2.11.4, reason 0x95)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, ReasonCode.PACKET_TOO_LARGE)


class UnsupportedProtocolVersion(MQTTCodecError):
    """CONNECT named a protocol name or level this broker does not speak. The server answers
    CONNACK 0x01 (3.x) or 0x84 (5.0) and closes [MQTT-3.1.2-2]."""

    def __init__(self, protocol_name: str, protocol_level: int) -> None:
        super().__init__(
            f"unsupported protocol {protocol_name!r} level {protocol_level}",
            ReasonCode.UNSUPPORTED_PROTOCOL_VERSION,
        )
        self.protocol_name = protocol_name
        self.protocol_level = protocol_level


class InvalidUTF8(MQTTCodecError):
    """A UTF-8 string field is ill-formed or contains U+0000 [MQTT-1.5.3-1], [MQTT-1.5.3-2]
    (v5 [MQTT-1.5.4-1], [MQTT-1.5.4-2])."""


def _malformed(message: str) -> MQTTCodecError:
    return MQTTCodecError(message, ReasonCode.MALFORMED_PACKET)


def _protocol_error(message: str) -> MQTTCodecError:
    return MQTTCodecError(message, ReasonCode.PROTOCOL_ERROR)


# --------------------------------------------------------------------------- properties
# Where each property may appear (v5 §2.2.2.2): a bit per packet type, bit 0 for will
# properties (packet type 0 is reserved, so the bit is free).
_WILL = 1
_CONNECT = 1 << PacketType.CONNECT
_CONNACK = 1 << PacketType.CONNACK
_PUBLISH = 1 << PacketType.PUBLISH
_PUBACK = 1 << PacketType.PUBACK
_PUBREC = 1 << PacketType.PUBREC
_PUBREL = 1 << PacketType.PUBREL
_PUBCOMP = 1 << PacketType.PUBCOMP
_SUBSCRIBE = 1 << PacketType.SUBSCRIBE
_SUBACK = 1 << PacketType.SUBACK
_UNSUBSCRIBE = 1 << PacketType.UNSUBSCRIBE
_UNSUBACK = 1 << PacketType.UNSUBACK
_DISCONNECT = 1 << PacketType.DISCONNECT
_AUTH = 1 << PacketType.AUTH
_ACKS = _PUBACK | _PUBREC | _PUBREL | _PUBCOMP
_MASK_NAMES = {
    _WILL: "will properties", _CONNECT: "CONNECT", _CONNACK: "CONNACK", _PUBLISH: "PUBLISH",
    _PUBACK: "PUBACK", _PUBREC: "PUBREC", _PUBREL: "PUBREL", _PUBCOMP: "PUBCOMP",
    _SUBSCRIBE: "SUBSCRIBE", _SUBACK: "SUBACK", _UNSUBSCRIBE: "UNSUBSCRIBE",
    _UNSUBACK: "UNSUBACK", _DISCONNECT: "DISCONNECT", _AUTH: "AUTH",
}

# Data types of property values (v5 §1.5).
_BYTE, _U16, _U32, _VARINT, _STR, _BIN, _PAIR = range(7)

_P = PropertyId
# identifier -> (Properties attribute, data type, packets allowed, smallest valid value,
# largest valid value); the bounds apply to integer properties only.
_PROPERTY_SPECS: dict[int, tuple[str, int, int, int, int]] = {
    _P.PAYLOAD_FORMAT_INDICATOR: ("payload_format_indicator", _BYTE, _PUBLISH | _WILL, 0, 1),
    _P.MESSAGE_EXPIRY_INTERVAL: ("message_expiry_interval", _U32, _PUBLISH | _WILL, 0, 2**32 - 1),
    _P.CONTENT_TYPE: ("content_type", _STR, _PUBLISH | _WILL, 0, 0),
    _P.RESPONSE_TOPIC: ("response_topic", _STR, _PUBLISH | _WILL, 0, 0),
    _P.CORRELATION_DATA: ("correlation_data", _BIN, _PUBLISH | _WILL, 0, 0),
    _P.SUBSCRIPTION_IDENTIFIER: (
        "subscription_identifiers", _VARINT, _PUBLISH | _SUBSCRIBE, 1, MAX_REMAINING_LENGTH
    ),
    _P.SESSION_EXPIRY_INTERVAL: (
        "session_expiry_interval", _U32, _CONNECT | _CONNACK | _DISCONNECT, 0, 2**32 - 1
    ),
    _P.ASSIGNED_CLIENT_IDENTIFIER: ("assigned_client_identifier", _STR, _CONNACK, 0, 0),
    _P.SERVER_KEEP_ALIVE: ("server_keep_alive", _U16, _CONNACK, 0, 0xFFFF),
    _P.AUTHENTICATION_METHOD: ("authentication_method", _STR, _CONNECT | _CONNACK | _AUTH, 0, 0),
    _P.AUTHENTICATION_DATA: ("authentication_data", _BIN, _CONNECT | _CONNACK | _AUTH, 0, 0),
    _P.REQUEST_PROBLEM_INFORMATION: ("request_problem_information", _BYTE, _CONNECT, 0, 1),
    _P.WILL_DELAY_INTERVAL: ("will_delay_interval", _U32, _WILL, 0, 2**32 - 1),
    _P.REQUEST_RESPONSE_INFORMATION: ("request_response_information", _BYTE, _CONNECT, 0, 1),
    _P.RESPONSE_INFORMATION: ("response_information", _STR, _CONNACK, 0, 0),
    _P.SERVER_REFERENCE: ("server_reference", _STR, _CONNACK | _DISCONNECT, 0, 0),
    _P.REASON_STRING: (
        "reason_string", _STR,
        _CONNACK | _ACKS | _SUBACK | _UNSUBACK | _DISCONNECT | _AUTH, 0, 0,
    ),
    _P.RECEIVE_MAXIMUM: ("receive_maximum", _U16, _CONNECT | _CONNACK, 1, 0xFFFF),
    _P.TOPIC_ALIAS_MAXIMUM: ("topic_alias_maximum", _U16, _CONNECT | _CONNACK, 0, 0xFFFF),
    _P.TOPIC_ALIAS: ("topic_alias", _U16, _PUBLISH, 1, 0xFFFF),
    _P.MAXIMUM_QOS: ("maximum_qos", _BYTE, _CONNACK, 0, 1),
    _P.RETAIN_AVAILABLE: ("retain_available", _BYTE, _CONNACK, 0, 1),
    _P.USER_PROPERTY: (
        "user_properties", _PAIR,
        _WILL | _CONNECT | _CONNACK | _PUBLISH | _ACKS | _SUBSCRIBE | _SUBACK | _UNSUBSCRIBE
        | _UNSUBACK | _DISCONNECT | _AUTH, 0, 0,
    ),
    _P.MAXIMUM_PACKET_SIZE: ("maximum_packet_size", _U32, _CONNECT | _CONNACK, 1, 2**32 - 1),
    _P.WILDCARD_SUBSCRIPTION_AVAILABLE: ("wildcard_subscription_available", _BYTE, _CONNACK, 0, 1),
    _P.SUBSCRIPTION_IDENTIFIER_AVAILABLE: (
        "subscription_identifier_available", _BYTE, _CONNACK, 0, 1
    ),
    _P.SHARED_SUBSCRIPTION_AVAILABLE: ("shared_subscription_available", _BYTE, _CONNACK, 0, 1),
}
# Lookup by identifier byte for the decoder (None for identifiers that do not exist).
_SPEC_BY_BYTE: tuple[tuple[str, int, int, int, int] | None, ...] = tuple(
    _PROPERTY_SPECS.get(i) for i in range(256)
)
_ENCODE_ORDER = sorted(_PROPERTY_SPECS.items())

# Reason codes each MQTT 5 packet may carry (v5 §3.2.2.2, 3.4.2.1, 3.5.2.1, 3.6.2.1, 3.7.2.1,
# 3.9.3, 3.11.3, 3.14.2.1, 3.15.2.1).
_R = ReasonCode
_CONNACK_CODES = frozenset({
    _R.SUCCESS, _R.UNSPECIFIED_ERROR, _R.MALFORMED_PACKET, _R.PROTOCOL_ERROR,
    _R.IMPLEMENTATION_SPECIFIC_ERROR, _R.UNSUPPORTED_PROTOCOL_VERSION,
    _R.CLIENT_IDENTIFIER_NOT_VALID, _R.BAD_USER_NAME_OR_PASSWORD, _R.NOT_AUTHORIZED,
    _R.SERVER_UNAVAILABLE, _R.SERVER_BUSY, _R.BANNED, _R.BAD_AUTHENTICATION_METHOD,
    _R.TOPIC_NAME_INVALID, _R.PACKET_TOO_LARGE, _R.QUOTA_EXCEEDED, _R.PAYLOAD_FORMAT_INVALID,
    _R.RETAIN_NOT_SUPPORTED, _R.QOS_NOT_SUPPORTED, _R.USE_ANOTHER_SERVER, _R.SERVER_MOVED,
    _R.CONNECTION_RATE_EXCEEDED,
})
_PUBACK_CODES = frozenset({
    _R.SUCCESS, _R.NO_MATCHING_SUBSCRIBERS, _R.UNSPECIFIED_ERROR,
    _R.IMPLEMENTATION_SPECIFIC_ERROR, _R.NOT_AUTHORIZED, _R.TOPIC_NAME_INVALID,
    _R.PACKET_IDENTIFIER_IN_USE, _R.QUOTA_EXCEEDED, _R.PAYLOAD_FORMAT_INVALID,
})
_PUBREL_CODES = frozenset({_R.SUCCESS, _R.PACKET_IDENTIFIER_NOT_FOUND})
_SUBACK_CODES: frozenset[int] = frozenset({
    _R.GRANTED_QOS_0, _R.GRANTED_QOS_1, _R.GRANTED_QOS_2, _R.UNSPECIFIED_ERROR,
    _R.IMPLEMENTATION_SPECIFIC_ERROR, _R.NOT_AUTHORIZED, _R.TOPIC_FILTER_INVALID,
    _R.PACKET_IDENTIFIER_IN_USE, _R.QUOTA_EXCEEDED, _R.SHARED_SUBSCRIPTIONS_NOT_SUPPORTED,
    _R.SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED, _R.WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED,
})
_UNSUBACK_CODES = frozenset({
    _R.SUCCESS, _R.NO_SUBSCRIPTION_EXISTED, _R.UNSPECIFIED_ERROR,
    _R.IMPLEMENTATION_SPECIFIC_ERROR, _R.NOT_AUTHORIZED, _R.TOPIC_FILTER_INVALID,
    _R.PACKET_IDENTIFIER_IN_USE,
})
_DISCONNECT_CODES = frozenset({
    _R.NORMAL_DISCONNECTION, _R.DISCONNECT_WITH_WILL, _R.UNSPECIFIED_ERROR,
    _R.MALFORMED_PACKET, _R.PROTOCOL_ERROR, _R.IMPLEMENTATION_SPECIFIC_ERROR,
    _R.NOT_AUTHORIZED, _R.SERVER_BUSY, _R.SERVER_SHUTTING_DOWN, _R.KEEP_ALIVE_TIMEOUT,
    _R.SESSION_TAKEN_OVER, _R.TOPIC_FILTER_INVALID, _R.TOPIC_NAME_INVALID,
    _R.RECEIVE_MAXIMUM_EXCEEDED, _R.TOPIC_ALIAS_INVALID, _R.PACKET_TOO_LARGE,
    _R.MESSAGE_RATE_TOO_HIGH, _R.QUOTA_EXCEEDED, _R.ADMINISTRATIVE_ACTION,
    _R.PAYLOAD_FORMAT_INVALID, _R.RETAIN_NOT_SUPPORTED, _R.QOS_NOT_SUPPORTED,
    _R.USE_ANOTHER_SERVER, _R.SERVER_MOVED, _R.SHARED_SUBSCRIPTIONS_NOT_SUPPORTED,
    _R.CONNECTION_RATE_EXCEEDED, _R.MAXIMUM_CONNECT_TIME,
    _R.SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED, _R.WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED,
})
_AUTH_CODES = frozenset({_R.SUCCESS, _R.CONTINUE_AUTHENTICATION, _R.REAUTHENTICATE})
# MQTT 3.1.1 SUBACK return codes [MQTT-3.9.3-2] and CONNACK return codes (§3.2.2.3).
_SUBACK_CODES_311 = frozenset({0x00, 0x01, 0x02, 0x80})
_CONNACK_CODES_311 = frozenset(range(6))


# --------------------------------------------------------------------------- decoding
def _read_varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """A Variable Byte Integer of at most 4 bytes, minimally encoded (v5 [MQTT-1.5.5-1])."""
    value = 0
    shift = 0
    start = pos
    while True:
        if pos >= end:
            raise _malformed("truncated variable byte integer")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if byte == 0 and pos - start > 1:
                raise _malformed("variable byte integer not minimally encoded")
            return value, pos
        shift += 7
        if shift == 28:
            raise _malformed("variable byte integer longer than 4 bytes")


def _read_u16(data: bytes, pos: int, end: int, what: str) -> tuple[int, int]:
    if pos + 2 > end:
        raise _malformed(f"truncated {what}")
    return (data[pos] << 8) | data[pos + 1], pos + 2


def _read_str(data: bytes, pos: int, end: int, what: str) -> tuple[str, int]:
    """A UTF-8 Encoded String (§1.5.3): 2-byte length, strict UTF-8, no U+0000."""
    if pos + 2 > end:
        raise _malformed(f"truncated {what}")
    stop = pos + 2 + ((data[pos] << 8) | data[pos + 1])
    if stop > end:
        raise _malformed(f"{what} runs past the end of the packet")
    try:
        text = data[pos + 2 : stop].decode()
    except UnicodeDecodeError:
        raise InvalidUTF8(f"{what} is not well-formed UTF-8 [MQTT-1.5.3-1]") from None
    if "\x00" in text:
        raise InvalidUTF8(f"{what} contains U+0000 [MQTT-1.5.3-2]")
    return text, stop


def _read_bin(data: bytes, pos: int, end: int, what: str) -> tuple[bytes, int]:
    """Binary Data (v5 §1.5.6): 2-byte length then the bytes."""
    if pos + 2 > end:
        raise _malformed(f"truncated {what}")
    stop = pos + 2 + ((data[pos] << 8) | data[pos + 1])
    if stop > end:
        raise _malformed(f"{what} runs past the end of the packet")
    return data[pos + 2 : stop], stop


def _read_properties(data: bytes, pos: int, end: int, mask: int) -> tuple[Properties, int]:
    """The Property Length and the properties after it (v5 §2.2.2)."""
    if pos < end and data[pos] < 0x80:
        length = data[pos]
        pos += 1
    else:
        length, pos = _read_varint(data, pos, end)
    stop = pos + length
    if stop > end:
        raise _malformed("property length runs past the end of the packet")
    props = Properties()
    if not length:
        return props, pos
    seen = 0
    while pos < stop:
        identifier = data[pos]
        pos += 1
        spec = _SPEC_BY_BYTE[identifier]
        if spec is None:
            raise _malformed(f"unknown property identifier {identifier:#04x}")
        attr, kind, allowed, low, high = spec
        if not allowed & mask:
            raise _malformed(f"property {attr} is not allowed in {_MASK_NAMES[mask]}")
        value: Any
        if kind == _STR:
            value, pos = _read_str(data, pos, stop, attr)
        elif kind == _BYTE:
            if pos >= stop:
                raise _malformed(f"truncated {attr}")
            value = data[pos]
            pos += 1
        elif kind == _U32:
            if pos + 4 > stop:
                raise _malformed(f"truncated {attr}")
            value = int.from_bytes(data[pos : pos + 4], "big")
            pos += 4
        elif kind == _U16:
            value, pos = _read_u16(data, pos, stop, attr)
        elif kind == _BIN:
            value, pos = _read_bin(data, pos, stop, attr)
        elif kind == _VARINT:
            value, pos = _read_varint(data, pos, stop)
        else:  # _PAIR
            key, pos = _read_str(data, pos, stop, "user property name")
            text, pos = _read_str(data, pos, stop, "user property value")
            props.user_properties.append((key, text))
            continue
        if identifier == PropertyId.SUBSCRIPTION_IDENTIFIER:
            # Repeats only in PUBLISH (v5 §3.3.2.3.8); once in SUBSCRIBE (§3.8.2.1.2).
            if mask != _PUBLISH and props.subscription_identifiers:
                raise _protocol_error("subscription identifier included more than once")
            if value < low:
                raise _protocol_error("subscription identifier of 0 (v5 §3.8.2.1.2)")
            props.subscription_identifiers.append(value)
            continue
        bit = 1 << identifier
        if seen & bit:
            raise _protocol_error(f"property {attr} included more than once (v5 §2.2.2.2)")
        seen |= bit
        if kind <= _U32 and not low <= value <= high:
            if identifier == PropertyId.TOPIC_ALIAS:
                raise MQTTCodecError("topic alias of 0 [MQTT-3.3.2-8]", ReasonCode.TOPIC_ALIAS_INVALID)
            raise _protocol_error(f"property {attr} has invalid value {value}")
        setattr(props, attr, value)
    return props, stop


def _check_packet_id(packet_id: int, what: str) -> None:
    if not packet_id:
        raise _protocol_error(f"{what} with packet identifier 0 [MQTT-2.3.1-1]")


def _decode_connect(data: bytes, pos: int, end: int, version: int) -> Connect:
    name, pos = _read_str(data, pos, end, "protocol name")
    if pos >= end:
        raise _malformed("CONNECT truncated before the protocol level")
    level = data[pos]
    if (name, level) not in PROTOCOLS:
        raise UnsupportedProtocolVersion(name, level)
    if pos + 4 > end:
        raise _malformed("CONNECT truncated in the variable header")
    flags = data[pos + 1]
    keep_alive = (data[pos + 2] << 8) | data[pos + 3]
    pos += 4
    if flags & 0x01:
        raise _malformed("CONNECT reserved flag is set [MQTT-3.1.2-3]")
    will_flag = flags & 0x04
    will_qos = (flags >> 3) & 0x03
    will_retain = flags & 0x20
    if not will_flag and (will_qos or will_retain):
        raise _malformed("will QoS or will retain set without the will flag [MQTT-3.1.2-11]")
    if will_qos == 3:
        raise _malformed("will QoS 3 [MQTT-3.1.2-14]")
    has_password = flags & 0x40
    has_username = flags & 0x80
    if has_password and not has_username and level < MQTT_5:
        raise _malformed("password without user name [MQTT-3.1.2-22]")
    if level == MQTT_5:
        props, pos = _read_properties(data, pos, end, _CONNECT)
    else:
        props = Properties()
    client_id, pos = _read_str(data, pos, end, "client identifier")
    will = None
    if will_flag:
        if level == MQTT_5:
            will_props, pos = _read_properties(data, pos, end, _WILL)
        else:
            will_props = Properties()
        will_topic, pos = _read_str(data, pos, end, "will topic")
        will_payload, pos = _read_bin(data, pos, end, "will payload")
        will = Will(will_topic, will_payload, will_qos, bool(will_retain), will_props)
    username = password = None
    if has_username:
        username, pos = _read_str(data, pos, end, "user name")
    if has_password:
        password, pos = _read_bin(data, pos, end, "password")
    if pos != end:
        raise _malformed("trailing bytes after CONNECT payload")
    return Connect(
        name, level, bool(flags & 0x02), keep_alive, client_id, will, username, password, props
    )


def _decode_connack(data: bytes, pos: int, end: int, version: int) -> Connack:
    if pos + 2 > end:
        raise _malformed("truncated CONNACK")
    ack_flags = data[pos]
    code = data[pos + 1]
    pos += 2
    if version == MQTT_3_1:
        ack_flags = 0  # a reserved, unused byte in MQTT 3.1
    elif ack_flags & 0xFE:
        raise _malformed("CONNACK acknowledge flags bits 7-1 are reserved (§3.2.2.1)")
    if version == MQTT_5:
        if code not in _CONNACK_CODES:
            raise _malformed(f"invalid CONNACK reason code {code:#04x}")
        props, pos = _read_properties(data, pos, end, _CONNACK)
    else:
        if code not in _CONNACK_CODES_311:
            raise _malformed(f"invalid CONNACK return code {code}")
        props = Properties()
    if pos != end:
        raise _malformed("trailing bytes after CONNACK")
    return Connack(bool(ack_flags), code, props)


def _decode_publish(data: bytes, pos: int, end: int, flags: int, version: int) -> Publish:
    qos = (flags >> 1) & 0x03
    if qos == 3:
        raise _malformed("PUBLISH with QoS 3 [MQTT-3.3.1-4]")
    if pos + 2 > end:
        raise _malformed("truncated PUBLISH topic")
    stop = pos + 2 + ((data[pos] << 8) | data[pos + 1])
    if stop > end:
        raise _malformed("PUBLISH topic runs past the end of the packet")
    try:
        topic = data[pos + 2 : stop].decode()
    except UnicodeDecodeError:
        raise InvalidUTF8("PUBLISH topic is not well-formed UTF-8 [MQTT-1.5.3-1]") from None
    if "\x00" in topic:
        raise InvalidUTF8("PUBLISH topic contains U+0000 [MQTT-1.5.3-2]")
    pos = stop
    packet_id = None
    if qos:
        if pos + 2 > end:
            raise _malformed("truncated PUBLISH packet identifier")
        packet_id = (data[pos] << 8) | data[pos + 1]
        if not packet_id:
            raise _protocol_error("PUBLISH QoS > 0 with packet identifier 0 [MQTT-2.3.1-1]")
        pos += 2
    if version == MQTT_5 and (pos >= end or data[pos]):
        props, pos = _read_properties(data, pos, end, _PUBLISH)
    else:
        props = Properties()
        pos += version == MQTT_5  # an empty property block: one zero byte
    return Publish(topic, data[pos:end], qos, flags & 0x01 != 0, flags & 0x08 != 0, packet_id, props)


def _ack_decoder(
    cls: type[Puback | Pubrec | Pubrel | Pubcomp], mask: int, codes: frozenset[int]
) -> Callable[[bytes, int, int, int], Puback | Pubrec | Pubrel | Pubcomp]:
    name = cls.__name__.upper()

    def decode(data: bytes, pos: int, end: int, version: int) -> Puback | Pubrec | Pubrel | Pubcomp:
        packet_id, pos = _read_u16(data, pos, end, f"{name} packet identifier")
        _check_packet_id(packet_id, name)
        code = 0
        if version == MQTT_5 and pos < end:
            # Reason code and properties may be left out (v5 §3.4.2.1, §3.4.2.2.1).
            code = data[pos]
            pos += 1
            if code not in codes:
                raise _malformed(f"invalid {name} reason code {code:#04x}")
            if pos < end:
                props, pos = _read_properties(data, pos, end, mask)
                if pos != end:
                    raise _malformed(f"trailing bytes after {name}")
                return cls(packet_id, code, props)
        if pos != end:
            raise _malformed(f"trailing bytes after {name}")
        return cls(packet_id, code)

    return decode


def _decode_subscribe(data: bytes, pos: int, end: int, version: int) -> Subscribe:
    packet_id, pos = _read_u16(data, pos, end, "SUBSCRIBE packet identifier")
    _check_packet_id(packet_id, "SUBSCRIBE")
    if version == MQTT_5:
        props, pos = _read_properties(data, pos, end, _SUBSCRIBE)
    else:
        props = Properties()
    subscriptions = []
    while pos < end:
        topic_filter, pos = _read_str(data, pos, end, "SUBSCRIBE topic filter")
        if pos >= end:
            raise _malformed("SUBSCRIBE topic filter without subscription options")
        options = data[pos]
        pos += 1
        qos = options & 0x03
        if version == MQTT_5:
            if options & 0xC0:
                raise _malformed("SUBSCRIBE options reserved bits are set (v5 [MQTT-3.8.3-5])")
            if qos == 3:
                raise _protocol_error("SUBSCRIBE maximum QoS 3 (v5 §3.8.3.1)")
            retain_handling = (options >> 4) & 0x03
            if retain_handling == 3:
                raise _protocol_error("SUBSCRIBE retain handling 3 (v5 §3.8.3.1)")
            subscriptions.append(SubscriptionRequest(
                topic_filter, qos, bool(options & 0x04), bool(options & 0x08), retain_handling
            ))
        else:
            if options & 0xFC or qos == 3:
                raise _malformed("SUBSCRIBE reserved bits set or QoS 3 [MQTT-3.8.3-4]")
            subscriptions.append(SubscriptionRequest(topic_filter, qos))
    if not subscriptions:
        raise _protocol_error("SUBSCRIBE without topic filters [MQTT-3.8.3-3]")
    return Subscribe(packet_id, subscriptions, props)


def _decode_suback(data: bytes, pos: int, end: int, version: int) -> Suback:
    packet_id, pos = _read_u16(data, pos, end, "SUBACK packet identifier")
    _check_packet_id(packet_id, "SUBACK")
    if version == MQTT_5:
        props, pos = _read_properties(data, pos, end, _SUBACK)
        valid = _SUBACK_CODES
    else:
        props = Properties()
        valid = _SUBACK_CODES_311
    codes = list(data[pos:end])
    for code in codes:
        if code not in valid:
            raise _malformed(f"invalid SUBACK reason code {code:#04x}")
    return Suback(packet_id, codes, props)


def _decode_unsubscribe(data: bytes, pos: int, end: int, version: int) -> Unsubscribe:
    packet_id, pos = _read_u16(data, pos, end, "UNSUBSCRIBE packet identifier")
    _check_packet_id(packet_id, "UNSUBSCRIBE")
    if version == MQTT_5:
        props, pos = _read_properties(data, pos, end, _UNSUBSCRIBE)
    else:
        props = Properties()
    topic_filters = []
    while pos < end:
        topic_filter, pos = _read_str(data, pos, end, "UNSUBSCRIBE topic filter")
        topic_filters.append(topic_filter)
    if not topic_filters:
        raise _protocol_error("UNSUBSCRIBE without topic filters [MQTT-3.10.3-2]")
    return Unsubscribe(packet_id, topic_filters, props)


def _decode_unsuback(data: bytes, pos: int, end: int, version: int) -> Unsuback:
    packet_id, pos = _read_u16(data, pos, end, "UNSUBACK packet identifier")
    _check_packet_id(packet_id, "UNSUBACK")
    if version != MQTT_5:
        if pos != end:
            raise _malformed("trailing bytes after UNSUBACK")
        return Unsuback(packet_id, [])
    props, pos = _read_properties(data, pos, end, _UNSUBACK)
    codes = list(data[pos:end])
    for code in codes:
        if code not in _UNSUBACK_CODES:
            raise _malformed(f"invalid UNSUBACK reason code {code:#04x}")
    return Unsuback(packet_id, codes, props)


def _decode_pingreq(data: bytes, pos: int, end: int, version: int) -> Pingreq:
    if pos != end:
        raise _malformed("PINGREQ with a body")
    return Pingreq()


def _decode_pingresp(data: bytes, pos: int, end: int, version: int) -> Pingresp:
    if pos != end:
        raise _malformed("PINGRESP with a body")
    return Pingresp()


def _decode_disconnect(data: bytes, pos: int, end: int, version: int) -> Disconnect:
    if version != MQTT_5:
        if pos != end:
            raise _malformed("DISCONNECT with a body")
        return Disconnect()
    return _decode_reason_and_properties(Disconnect, data, pos, end, _DISCONNECT, _DISCONNECT_CODES)


def _decode_auth(data: bytes, pos: int, end: int, version: int) -> Auth:
    if version != MQTT_5:
        raise _malformed("packet type 15 is reserved before MQTT 5.0")
    return _decode_reason_and_properties(Auth, data, pos, end, _AUTH, _AUTH_CODES)


def _decode_reason_and_properties(
    cls: type[Any], data: bytes, pos: int, end: int, mask: int, codes: frozenset[int]
) -> Any:
    """DISCONNECT and AUTH: both fields may be left out when the code is 0 (v5 §3.14.2.1)."""
    name = cls.__name__.upper()
    if pos == end:
        return cls()
    code = data[pos]
    pos += 1
    if code not in codes:
        raise _malformed(f"invalid {name} reason code {code:#04x}")
    if pos == end:
        return cls(code)
    props, pos = _read_properties(data, pos, end, mask)
    if pos != end:
        raise _malformed(f"trailing bytes after {name}")
    return cls(code, props)


_Decoder = Callable[[bytes, int, int, int], Any]
# By packet type; PUBLISH (3) is decoded inline by the parser, type 0 is reserved.
_DECODERS: tuple[_Decoder | None, ...] = (
    None,
    _decode_connect,
    _decode_connack,
    None,
    _ack_decoder(Puback, _PUBACK, _PUBACK_CODES),
    _ack_decoder(Pubrec, _PUBREC, _PUBACK_CODES),
    _ack_decoder(Pubrel, _PUBREL, _PUBREL_CODES),
    _ack_decoder(Pubcomp, _PUBCOMP, _PUBREL_CODES),
    _decode_subscribe,
    _decode_suback,
    _decode_unsubscribe,
    _decode_unsuback,
    _decode_pingreq,
    _decode_pingresp,
    _decode_disconnect,
    _decode_auth,
)
# The fixed-header flags each packet type must carry [MQTT-2.2.2-1]; PUBLISH has its own.
_FIXED_FLAGS = (-1, 0, 0, -1, 0, 0, 0b0010, 0, 0b0010, 0, 0b0010, 0, 0, 0, 0, 0)


def _frame(data: bytes | bytearray, pos: int, end: int) -> tuple[int, int] | None:
    """(fixed header length, remaining length) of the packet at `pos`, None if the fixed
    header is not complete yet. The remaining length is at most 4 bytes (§2.2.3)."""
    value = 0
    shift = 0
    index = pos + 1
    while True:
        if index >= end:
            return None
        byte = data[index]
        index += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if byte == 0 and shift:
                raise _malformed("remaining length not minimally encoded")
            return index - pos, value
        shift += 7
        if shift == 28:
            raise _malformed("remaining length longer than 4 bytes [MQTT-2.2.3]")


class PacketParser:
    """Incremental decoder: feed it bytes in any chunking, get back complete packets.

    `version` is None until a CONNECT is decoded, then the CONNECT's protocol level; a
    client-side user sets it before feeding server packets. Until it is known, packets
    decode with the 3.1.1 layout. After `feed` raises, the parser refuses further input.
    Unconsumed input waits in a bytearray; a packet's bytes are gathered only once it is
    complete, so a slow trickle costs O(1) per chunk, and the size limit is enforced as soon
    as a fixed header arrives, before the body is buffered.
    """

    __slots__ = ("version", "max_packet_size", "_pending", "_need", "_failed")

    def __init__(self, max_packet_size: int = MAX_REMAINING_LENGTH) -> None:
        self.version: int | None = None
        self.max_packet_size = max_packet_size
        self._pending = bytearray()
        self._need = 0  # bytes _pending must hold before parsing is worth trying again
        self._failed = False

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as packets."""
        return len(self._pending)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Packet]:
        """All packets completed by `data`, in order. Raises MQTTCodecError (with the packets
        decoded before the bad one in `.packets`); the parser is unusable afterwards."""
        if self._failed:
            raise _malformed("the parser already failed")
        pending = self._pending
        if pending:
            pending += data
            size = len(pending)
            if size < self._need:
                return []
            try:
                frame = _frame(pending, 0, size)
            except MQTTCodecError:
                self._failed = True
                raise
            if frame is None:
                self._need = size + 1
                return []
            total = frame[0] + frame[1]
            if total > self.max_packet_size:
                self._failed = True
                raise PacketTooLarge(
                    f"packet of {total} bytes exceeds the maximum of {self.max_packet_size}"
                )
            if size < total:
                self._need = total
                return []
            data = bytes(pending)
            pending.clear()
        elif type(data) is not bytes:
            data = bytes(data)
        return self._parse(data)  # type: ignore[arg-type]

    def _parse(self, data: bytes) -> list[Packet]:
        packets: list[Packet] = []
        pos = 0
        size = len(data)
        limit = self.max_packet_size
        version = self.version or MQTT_3_1_1
        decoders = _DECODERS
        fixed_flags = _FIXED_FLAGS
        try:
            while size - pos >= 2:
                first = data[pos]
                remaining = data[pos + 1]
                if remaining < 0x80:
                    start = pos + 2
                else:
                    frame = _frame(data, pos, size)
                    if frame is None:
                        self._need = size - pos + 1
                        break
                    start = pos + frame[0]
                    remaining = frame[1]
                end = start + remaining
                if end - pos > limit:
                    raise PacketTooLarge(
                        f"packet of {end - pos} bytes exceeds the maximum of {limit}"
                    )
                if end > size:
                    self._need = end - pos
                    break
                kind = first >> 4
                if kind == 3:
                    packets.append(_decode_publish(data, start, end, first & 0x0F, version))
                else:
                    flags = first & 0x0F
                    if flags != fixed_flags[kind] and not (
                        version == MQTT_3_1 and flags == 0b1010 and fixed_flags[kind] == 0b0010
                    ):
                        if kind == 0:
                            raise _malformed("packet type 0 is reserved")
                        raise _malformed(
                            f"{PacketType(kind).name} with fixed-header flags {flags:#06b}"
                            " [MQTT-2.2.2-2]"
                        )
                    packet = decoders[kind](data, start, end, version)  # type: ignore[misc]
                    if kind == 1:
                        self.version = version = packet.protocol_level
                    packets.append(packet)
                pos = end
            else:
                self._need = 2
        except MQTTCodecError as exc:
            self._failed = True
            exc.packets = packets
            raise
        if pos < size:
            self._pending += memoryview(data)[pos:]
        return packets


# --------------------------------------------------------------------------- encoding
_pack_u16 = struct.Struct(">H").pack
_pack_u32 = struct.Struct(">I").pack


def _varint(value: int) -> bytes:
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


def _str(text: str) -> bytes:
    raw = text.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise ValueError("string longer than 65535 bytes")
    return _pack_u16(len(raw)) + raw


def _bin(raw: bytes) -> bytes:
    if len(raw) > 0xFFFF:
        raise ValueError("binary data longer than 65535 bytes")
    return _pack_u16(len(raw)) + bytes(raw)


def _fixed(first: int, body: bytes) -> bytes:
    return bytes((first,)) + _varint(len(body)) + body


def _values_of(names: list[str]) -> Callable[[Properties], tuple[Any, ...]]:
    """A C-speed reader of several Properties attributes, always returning a tuple."""
    if not names:
        return lambda props: ()
    if len(names) == 1:
        getter = attrgetter(names[0])
        return lambda props: (getter(props),)
    return attrgetter(*names)


def _encode_plan(mask: int) -> tuple[Any, ...]:
    allowed = [(i, spec) for i, spec in _ENCODE_ORDER if spec[2] & mask]
    refused = [spec for _, spec in _ENCODE_ORDER if not spec[2] & mask]
    refused_scalars = [spec[0] for spec in refused if spec[1] not in (_VARINT, _PAIR)]
    return (
        _values_of([spec[0] for _, spec in allowed]),
        tuple((i, spec[1]) for i, spec in allowed),
        _values_of(refused_scalars),
        tuple(spec[0] for spec in refused if spec[1] in (_VARINT, _PAIR)),
    )


# packet mask -> (allowed values reader, (identifier, kind) per allowed property,
# refused single-valued properties reader, refused list property names)
_ENCODE_PLANS = {mask: _encode_plan(mask) for mask in _MASK_NAMES}


def _check_allowed(props: Properties, mask: int) -> None:
    """ValueError if `props` sets a property the packet `mask` names may not carry."""
    _, _, read_refused, refused_lists = _ENCODE_PLANS[mask]
    refused = read_refused(props)
    if refused.count(None) != len(refused) or any(getattr(props, n) for n in refused_lists):
        names = [
            attr for attr, _kind, allowed, _low, _high in _PROPERTY_SPECS.values()
            if not allowed & mask and getattr(props, attr) not in (None, [])
        ]
        raise ValueError(f"{', '.join(names)} not allowed in {_MASK_NAMES[mask]}")


def _encode_properties(props: Properties | None, mask: int) -> bytes:
    """The Property Length and properties allowed in the packet `mask` names; a property
    the packet may not carry is a ValueError."""
    if props is None:
        return b"\x00"
    _check_allowed(props, mask)
    read_allowed, entries = _ENCODE_PLANS[mask][:2]
    out = bytearray()
    for (identifier, kind), value in zip(entries, read_allowed(props), strict=True):
        if value is None:
            continue  # an empty list (user properties, subscription ids) writes nothing
        if kind == _PAIR:
            for key, text in value:
                out.append(identifier)
                out += _str(key)
                out += _str(text)
        elif kind == _VARINT:
            for number in value:
                out.append(identifier)
                out += _varint(number)
        else:
            out.append(identifier)
            if kind == _STR:
                out += _str(value)
            elif kind == _BYTE:
                out.append(value)
            elif kind == _U16:
                out += _pack_u16(value)
            elif kind == _U32:
                out += _pack_u32(value)
            else:  # _BIN
                out += _bin(value)
    if not out:
        return b"\x00"
    return _varint(len(out)) + out


def _publish_properties(props: Properties) -> bytes:
    """PUBLISH properties only, without the allowed-property check: the hot path."""
    out = bytearray()
    if props.payload_format_indicator is not None:
        out.append(PropertyId.PAYLOAD_FORMAT_INDICATOR)
        out.append(props.payload_format_indicator)
    if props.message_expiry_interval is not None:
        out.append(PropertyId.MESSAGE_EXPIRY_INTERVAL)
        out += _pack_u32(props.message_expiry_interval)
    if props.content_type is not None:
        out.append(PropertyId.CONTENT_TYPE)
        out += _str(props.content_type)
    if props.response_topic is not None:
        out.append(PropertyId.RESPONSE_TOPIC)
        out += _str(props.response_topic)
    if props.correlation_data is not None:
        out.append(PropertyId.CORRELATION_DATA)
        out += _bin(props.correlation_data)
    for number in props.subscription_identifiers:
        out.append(PropertyId.SUBSCRIPTION_IDENTIFIER)
        out += _varint(number)
    if props.topic_alias is not None:
        out.append(PropertyId.TOPIC_ALIAS)
        out += _pack_u16(props.topic_alias)
    for key, text in props.user_properties:
        out.append(PropertyId.USER_PROPERTY)
        out += _str(key)
        out += _str(text)
    if not out:
        return b"\x00"
    return _varint(len(out)) + out


def _publish_bytes(
    topic: str, payload: bytes, qos: int, retain: bool, dup: bool, packet_id: int | None,
    props: bytes | None,
) -> bytes:
    raw = topic.encode("utf-8")
    length = len(raw)
    if length > 0xFFFF:
        raise ValueError("topic longer than 65535 bytes")
    if qos:
        if qos not in (1, 2):
            raise ValueError(f"invalid QoS {qos}")
        if not packet_id:
            raise ValueError("PUBLISH with QoS > 0 needs a non-zero packet identifier")
        head = _pack_u16(length) + raw + _pack_u16(packet_id)
    else:
        head = _pack_u16(length) + raw
    first = 0x30 | (qos << 1) | (0x01 if retain else 0) | (0x08 if dup else 0)
    if props is not None:
        head += props
    remaining = len(head) + len(payload)
    if remaining < 0x80:
        fixed = bytes((first, remaining))
    elif remaining < 0x4000:
        fixed = bytes((first, (remaining & 0x7F) | 0x80, remaining >> 7))
    else:
        fixed = bytes((first,)) + _varint(remaining)
    return b"".join((fixed, head, payload))


def encode_publish(
    topic: str,
    payload: bytes,
    qos: int,
    retain: bool,
    dup: bool,
    packet_id: int | None,
    properties: Properties | None,
    version: int,
) -> bytes:
    """One PUBLISH without building a `Publish`. On 5.0 only the PUBLISH properties of
    `properties` are written (others are ignored); before 5.0 `properties` is ignored."""
    if version == MQTT_5:
        props = b"\x00" if properties is None else _publish_properties(properties)
        return _publish_bytes(topic, payload, qos, retain, dup, packet_id, props)
    return _publish_bytes(topic, payload, qos, retain, dup, packet_id, None)


def _encode_connect(packet: Connect, version: int) -> bytes:
    will = packet.will
    flags = 0x02 if packet.clean_start else 0
    if will is not None:
        if will.qos not in (0, 1, 2):
            raise ValueError(f"invalid will QoS {will.qos}")
        flags |= 0x04 | (will.qos << 3) | (0x20 if will.retain else 0)
    if packet.username is not None:
        flags |= 0x80
    if packet.password is not None:
        flags |= 0x40
    parts = [
        _str(packet.protocol_name),
        bytes((packet.protocol_level, flags)),
        _pack_u16(packet.keep_alive),
    ]
    v5 = version == MQTT_5
    if v5:
        parts.append(_encode_properties(packet.properties, _CONNECT))
    parts.append(_str(packet.client_id))
    if will is not None:
        if v5:
            parts.append(_encode_properties(will.properties, _WILL))
        parts.append(_str(will.topic))
        parts.append(_bin(will.payload))
    if packet.username is not None:
        parts.append(_str(packet.username))
    if packet.password is not None:
        parts.append(_bin(packet.password))
    return _fixed(0x10, b"".join(parts))


def _encode_connack(packet: Connack, version: int) -> bytes:
    ack_flags = 1 if packet.session_present and version != MQTT_3_1 else 0
    body = bytes((ack_flags, packet.reason_code))
    if version == MQTT_5:
        body += _encode_properties(packet.properties, _CONNACK)
    return _fixed(0x20, body)


def _encode_publish_packet(packet: Publish, version: int) -> bytes:
    props = None
    if version == MQTT_5:
        _check_allowed(packet.properties, _PUBLISH)
        props = _publish_properties(packet.properties)
    return _publish_bytes(
        packet.topic, packet.payload, packet.qos, packet.retain, packet.dup, packet.packet_id,
        props,
    )


def _ack_encoder(first: int, mask: int) -> Callable[[Any, int], bytes]:
    def encode_ack(packet: Puback | Pubrec | Pubrel | Pubcomp, version: int) -> bytes:
        body = _pack_u16(packet.packet_id)
        if version == MQTT_5:
            props = _encode_properties(packet.properties, mask)
            if props != b"\x00":
                body += bytes((packet.reason_code,)) + props
            elif packet.reason_code:
                body += bytes((packet.reason_code,))
        return _fixed(first, body)

    return encode_ack


def _encode_subscribe(packet: Subscribe, version: int) -> bytes:
    parts = [_pack_u16(packet.packet_id)]
    v5 = version == MQTT_5
    if v5:
        parts.append(_encode_properties(packet.properties, _SUBSCRIBE))
    for sub in packet.subscriptions:
        parts.append(_str(sub.topic_filter))
        options = sub.qos
        if v5:
            options |= (
                (0x04 if sub.no_local else 0)
                | (0x08 if sub.retain_as_published else 0)
                | (sub.retain_handling << 4)
            )
        parts.append(bytes((options,)))
    return _fixed(0x82, b"".join(parts))


def _encode_suback(packet: Suback, version: int) -> bytes:
    body = _pack_u16(packet.packet_id)
    if version == MQTT_5:
        body += _encode_properties(packet.properties, _SUBACK)
    return _fixed(0x90, body + bytes(packet.reason_codes))


def _encode_unsubscribe(packet: Unsubscribe, version: int) -> bytes:
    parts = [_pack_u16(packet.packet_id)]
    if version == MQTT_5:
        parts.append(_encode_properties(packet.properties, _UNSUBSCRIBE))
    parts.extend(_str(topic_filter) for topic_filter in packet.topic_filters)
    return _fixed(0xA2, b"".join(parts))


def _encode_unsuback(packet: Unsuback, version: int) -> bytes:
    body = _pack_u16(packet.packet_id)
    if version == MQTT_5:
        body += _encode_properties(packet.properties, _UNSUBACK) + bytes(packet.reason_codes)
    return _fixed(0xB0, body)


def _encode_pingreq(packet: Pingreq, version: int) -> bytes:
    return b"\xc0\x00"


def _encode_pingresp(packet: Pingresp, version: int) -> bytes:
    return b"\xd0\x00"


def _encode_reason_and_properties(first: int, mask: int) -> Callable[[Any, int], bytes]:
    def encode_packet(packet: Disconnect | Auth, version: int) -> bytes:
        if version != MQTT_5:
            if first == 0xF0:
                raise ValueError("AUTH exists in MQTT 5.0 only")
            return bytes((first, 0))
        props = _encode_properties(packet.properties, mask)
        if props != b"\x00":
            return _fixed(first, bytes((packet.reason_code,)) + props)
        if packet.reason_code:
            return bytes((first, 1, packet.reason_code))
        return bytes((first, 0))

    return encode_packet


_ENCODERS: dict[type, Callable[[Any, int], bytes]] = {
    Connect: _encode_connect,
    Connack: _encode_connack,
    Publish: _encode_publish_packet,
    Puback: _ack_encoder(0x40, _PUBACK),
    Pubrec: _ack_encoder(0x50, _PUBREC),
    Pubrel: _ack_encoder(0x62, _PUBREL),
    Pubcomp: _ack_encoder(0x70, _PUBCOMP),
    Subscribe: _encode_subscribe,
    Suback: _encode_suback,
    Unsubscribe: _encode_unsubscribe,
    Unsuback: _encode_unsuback,
    Pingreq: _encode_pingreq,
    Pingresp: _encode_pingresp,
    Disconnect: _encode_reason_and_properties(0xE0, _DISCONNECT),
    Auth: _encode_reason_and_properties(0xF0, _AUTH),
}


def encode(packet: Packet, version: int) -> bytes:
    """The bytes of `packet` for protocol level `version` (3, 4 or 5). Raises ValueError for
    a packet that cannot be put on the wire (a value out of range, a property the packet may
    not carry, AUTH before 5.0)."""
    if version not in (MQTT_3_1, MQTT_3_1_1, MQTT_5):
        raise ValueError(f"unknown MQTT protocol level {version}")
    encoder = _ENCODERS.get(type(packet))
    if encoder is None:
        raise TypeError(f"not an MQTT packet: {packet!r}")
    try:
        return encoder(packet, version)
    except (OverflowError, struct.error) as exc:
        raise ValueError(f"cannot encode {type(packet).__name__}: {exc}") from exc
