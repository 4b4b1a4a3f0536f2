"""MQTT 5 properties (v5 §2.2.2): which packets may carry each property, its data type and
valid range, and the reader and writers of a property block. The PUBLISH writer
(`publish_properties`) skips the allowed-property check: it is on the hot path."""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Any

from .errors import MQTTCodecError, malformed, protocol_error
from .packets import PacketType, Properties, PropertyId, ReasonCode
from .wire import (
    MAX_REMAINING_LENGTH,
    encode_bin,
    encode_str,
    encode_varint,
    pack_u16,
    pack_u32,
    read_bin,
    read_str,
    read_u16,
    read_varint,
)

# Where each property may appear (v5 §2.2.2.2): a bit per packet type, bit 0 for will
# properties (packet type 0 is reserved, so the bit is free).
IN_WILL = 1
IN_CONNECT = 1 << PacketType.CONNECT
IN_CONNACK = 1 << PacketType.CONNACK
IN_PUBLISH = 1 << PacketType.PUBLISH
IN_PUBACK = 1 << PacketType.PUBACK
IN_PUBREC = 1 << PacketType.PUBREC
IN_PUBREL = 1 << PacketType.PUBREL
IN_PUBCOMP = 1 << PacketType.PUBCOMP
IN_SUBSCRIBE = 1 << PacketType.SUBSCRIBE
IN_SUBACK = 1 << PacketType.SUBACK
IN_UNSUBSCRIBE = 1 << PacketType.UNSUBSCRIBE
IN_UNSUBACK = 1 << PacketType.UNSUBACK
IN_DISCONNECT = 1 << PacketType.DISCONNECT
IN_AUTH = 1 << PacketType.AUTH
IN_ACKS = IN_PUBACK | IN_PUBREC | IN_PUBREL | IN_PUBCOMP
MASK_NAMES = {
    IN_WILL: "will properties", IN_CONNECT: "CONNECT", IN_CONNACK: "CONNACK", IN_PUBLISH: "PUBLISH",
    IN_PUBACK: "PUBACK", IN_PUBREC: "PUBREC", IN_PUBREL: "PUBREL", IN_PUBCOMP: "PUBCOMP",
    IN_SUBSCRIBE: "SUBSCRIBE", IN_SUBACK: "SUBACK", IN_UNSUBSCRIBE: "UNSUBSCRIBE",
    IN_UNSUBACK: "UNSUBACK", IN_DISCONNECT: "DISCONNECT", IN_AUTH: "AUTH",
}

# Data types of property values (v5 §1.5).
_BYTE, _U16, _U32, _VARINT, _STR, _BIN, _PAIR = range(7)

_P = PropertyId
# identifier -> (Properties attribute, data type, packets allowed, smallest valid value,
# largest valid value); the bounds apply to integer properties only.
_PROPERTY_SPECS: dict[int, tuple[str, int, int, int, int]] = {
    _P.PAYLOAD_FORMAT_INDICATOR: ("payload_format_indicator", _BYTE, IN_PUBLISH | IN_WILL, 0, 1),
    _P.MESSAGE_EXPIRY_INTERVAL: ("message_expiry_interval", _U32, IN_PUBLISH | IN_WILL, 0, 2**32 - 1),
    _P.CONTENT_TYPE: ("content_type", _STR, IN_PUBLISH | IN_WILL, 0, 0),
    _P.RESPONSE_TOPIC: ("response_topic", _STR, IN_PUBLISH | IN_WILL, 0, 0),
    _P.CORRELATION_DATA: ("correlation_data", _BIN, IN_PUBLISH | IN_WILL, 0, 0),
    _P.SUBSCRIPTION_IDENTIFIER: (
        "subscription_identifiers", _VARINT, IN_PUBLISH | IN_SUBSCRIBE, 1, MAX_REMAINING_LENGTH
    ),
    _P.SESSION_EXPIRY_INTERVAL: (
        "session_expiry_interval", _U32, IN_CONNECT | IN_CONNACK | IN_DISCONNECT, 0, 2**32 - 1
    ),
    _P.ASSIGNED_CLIENT_IDENTIFIER: ("assigned_client_identifier", _STR, IN_CONNACK, 0, 0),
    _P.SERVER_KEEP_ALIVE: ("server_keep_alive", _U16, IN_CONNACK, 0, 0xFFFF),
    _P.AUTHENTICATION_METHOD: ("authentication_method", _STR, IN_CONNECT | IN_CONNACK | IN_AUTH, 0, 0),
    _P.AUTHENTICATION_DATA: ("authentication_data", _BIN, IN_CONNECT | IN_CONNACK | IN_AUTH, 0, 0),
    _P.REQUEST_PROBLEM_INFORMATION: ("request_problem_information", _BYTE, IN_CONNECT, 0, 1),
    _P.WILL_DELAY_INTERVAL: ("will_delay_interval", _U32, IN_WILL, 0, 2**32 - 1),
    _P.REQUEST_RESPONSE_INFORMATION: ("request_response_information", _BYTE, IN_CONNECT, 0, 1),
    _P.RESPONSE_INFORMATION: ("response_information", _STR, IN_CONNACK, 0, 0),
    _P.SERVER_REFERENCE: ("server_reference", _STR, IN_CONNACK | IN_DISCONNECT, 0, 0),
    _P.REASON_STRING: (
        "reason_string", _STR,
        IN_CONNACK | IN_ACKS | IN_SUBACK | IN_UNSUBACK | IN_DISCONNECT | IN_AUTH, 0, 0,
    ),
    _P.RECEIVE_MAXIMUM: ("receive_maximum", _U16, IN_CONNECT | IN_CONNACK, 1, 0xFFFF),
    _P.TOPIC_ALIAS_MAXIMUM: ("topic_alias_maximum", _U16, IN_CONNECT | IN_CONNACK, 0, 0xFFFF),
    _P.TOPIC_ALIAS: ("topic_alias", _U16, IN_PUBLISH, 1, 0xFFFF),
    _P.MAXIMUM_QOS: ("maximum_qos", _BYTE, IN_CONNACK, 0, 1),
    _P.RETAIN_AVAILABLE: ("retain_available", _BYTE, IN_CONNACK, 0, 1),
    _P.USER_PROPERTY: (
        "user_properties", _PAIR,
        IN_WILL | IN_CONNECT | IN_CONNACK | IN_PUBLISH | IN_ACKS | IN_SUBSCRIBE | IN_SUBACK | IN_UNSUBSCRIBE
        | IN_UNSUBACK | IN_DISCONNECT | IN_AUTH, 0, 0,
    ),
    _P.MAXIMUM_PACKET_SIZE: ("maximum_packet_size", _U32, IN_CONNECT | IN_CONNACK, 1, 2**32 - 1),
    _P.WILDCARD_SUBSCRIPTION_AVAILABLE: ("wildcard_subscription_available", _BYTE, IN_CONNACK, 0, 1),
    _P.SUBSCRIPTION_IDENTIFIER_AVAILABLE: (
        "subscription_identifier_available", _BYTE, IN_CONNACK, 0, 1
    ),
    _P.SHARED_SUBSCRIPTION_AVAILABLE: ("shared_subscription_available", _BYTE, IN_CONNACK, 0, 1),
}
# Lookup by identifier byte for the decoder (None for identifiers that do not exist).
_SPEC_BY_BYTE: tuple[tuple[str, int, int, int, int] | None, ...] = tuple(
    _PROPERTY_SPECS.get(i) for i in range(256)
)
_ENCODE_ORDER = sorted(_PROPERTY_SPECS.items())



def read_properties(data: bytes, pos: int, end: int, mask: int) -> tuple[Properties, int]:
    """The Property Length and the properties after it (v5 §2.2.2)."""
    if pos < end and data[pos] < 0x80:
        length = data[pos]
        pos += 1
    else:
        length, pos = read_varint(data, pos, end)
    stop = pos + length
    if stop > end:
        raise malformed("property length runs past the end of the packet")
    props = Properties()
    if not length:
        return props, pos
    seen = 0
    while pos < stop:
        identifier = data[pos]
        pos += 1
        spec = _SPEC_BY_BYTE[identifier]
        if spec is None:
            raise malformed(f"unknown property identifier {identifier:#04x}")
        attr, kind, allowed, low, high = spec
        if not allowed & mask:
            raise malformed(f"property {attr} is not allowed in {MASK_NAMES[mask]}")
        value: Any
        if kind == _STR:
            value, pos = read_str(data, pos, stop, attr)
        elif kind == _BYTE:
            if pos >= stop:
                raise malformed(f"truncated {attr}")
            value = data[pos]
            pos += 1
        elif kind == _U32:
            if pos + 4 > stop:
                raise malformed(f"truncated {attr}")
            value = int.from_bytes(data[pos : pos + 4], "big")
            pos += 4
        elif kind == _U16:
            value, pos = read_u16(data, pos, stop, attr)
        elif kind == _BIN:
            value, pos = read_bin(data, pos, stop, attr)
        elif kind == _VARINT:
            value, pos = read_varint(data, pos, stop)
        else:  # _PAIR
            key, pos = read_str(data, pos, stop, "user property name")
            text, pos = read_str(data, pos, stop, "user property value")
            props.user_properties.append((key, text))
            continue
        if identifier == PropertyId.SUBSCRIPTION_IDENTIFIER:
            # Repeats only in PUBLISH (v5 §3.3.2.3.8); once in SUBSCRIBE (§3.8.2.1.2).
            if mask != IN_PUBLISH and props.subscription_identifiers:
                raise protocol_error("subscription identifier included more than once")
            if value < low:
                raise protocol_error("subscription identifier of 0 (v5 §3.8.2.1.2)")
            props.subscription_identifiers.append(value)
            continue
        bit = 1 << identifier
        if seen & bit:
            raise protocol_error(f"property {attr} included more than once (v5 §2.2.2.2)")
        seen |= bit
        if kind <= _U32 and not low <= value <= high:
            if identifier == PropertyId.TOPIC_ALIAS:
                raise MQTTCodecError("topic alias of 0 [MQTT-3.3.2-8]", ReasonCode.TOPIC_ALIAS_INVALID)
            raise protocol_error(f"property {attr} has invalid value {value}")
        setattr(props, attr, value)
    return props, stop



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
_ENCODE_PLANS = {mask: _encode_plan(mask) for mask in MASK_NAMES}


def check_allowed(props: Properties, mask: int) -> None:
    """ValueError if `props` sets a property the packet `mask` names may not carry."""
    _, _, read_refused, refused_lists = _ENCODE_PLANS[mask]
    refused = read_refused(props)
    if refused.count(None) != len(refused) or any(getattr(props, n) for n in refused_lists):
        names = [
            attr for attr, _kind, allowed, _low, _high in _PROPERTY_SPECS.values()
            if not allowed & mask and getattr(props, attr) not in (None, [])
        ]
        raise ValueError(f"{', '.join(names)} not allowed in {MASK_NAMES[mask]}")


def encode_properties(props: Properties | None, mask: int) -> bytes:
    """The Property Length and properties allowed in the packet `mask` names; a property
    the packet may not carry is a ValueError."""
    if props is None:
        return b"\x00"
    check_allowed(props, mask)
    read_allowed, entries = _ENCODE_PLANS[mask][:2]
    out = bytearray()
    for (identifier, kind), value in zip(entries, read_allowed(props), strict=True):
        if value is None:
            continue  # an empty list (user properties, subscription ids) writes nothing
        if kind == _PAIR:
            for key, text in value:
                out.append(identifier)
                out += encode_str(key)
                out += encode_str(text)
        elif kind == _VARINT:
            for number in value:
                out.append(identifier)
                out += encode_varint(number)
        else:
            out.append(identifier)
            if kind == _STR:
                out += encode_str(value)
            elif kind == _BYTE:
                out.append(value)
            elif kind == _U16:
                out += pack_u16(value)
            elif kind == _U32:
                out += pack_u32(value)
            else:  # _BIN
                out += encode_bin(value)
    if not out:
        return b"\x00"
    return encode_varint(len(out)) + out


def publish_properties(props: Properties) -> bytes:
    """PUBLISH properties only, without the allowed-property check: the hot path."""
    out = bytearray()
    if props.payload_format_indicator is not None:
        out.append(PropertyId.PAYLOAD_FORMAT_INDICATOR)
        out.append(props.payload_format_indicator)
    if props.message_expiry_interval is not None:
        out.append(PropertyId.MESSAGE_EXPIRY_INTERVAL)
        out += pack_u32(props.message_expiry_interval)
    if props.content_type is not None:
        out.append(PropertyId.CONTENT_TYPE)
        out += encode_str(props.content_type)
    if props.response_topic is not None:
        out.append(PropertyId.RESPONSE_TOPIC)
        out += encode_str(props.response_topic)
    if props.correlation_data is not None:
        out.append(PropertyId.CORRELATION_DATA)
        out += encode_bin(props.correlation_data)
    for number in props.subscription_identifiers:
        out.append(PropertyId.SUBSCRIPTION_IDENTIFIER)
        out += encode_varint(number)
    if props.topic_alias is not None:
        out.append(PropertyId.TOPIC_ALIAS)
        out += pack_u16(props.topic_alias)
    for key, text in props.user_properties:
        out.append(PropertyId.USER_PROPERTY)
        out += encode_str(key)
        out += encode_str(text)
    if not out:
        return b"\x00"
    return encode_varint(len(out)) + out
