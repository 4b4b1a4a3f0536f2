"""Encoders: packets to bytes for MQTT 3.1, 3.1.1 and 5.0. `encode(packet, version)` takes a
packet dataclass; `encode_publish(...)` is the hot-path variant that needs none, so a message
delivered to many subscribers is encoded once per distinct encoding."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from .packets import (
    Auth,
    Connack,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    Pingresp,
    Properties,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    Unsuback,
    Unsubscribe,
)
from .properties import (
    IN_AUTH,
    IN_CONNACK,
    IN_CONNECT,
    IN_DISCONNECT,
    IN_PUBACK,
    IN_PUBCOMP,
    IN_PUBLISH,
    IN_PUBREC,
    IN_PUBREL,
    IN_SUBACK,
    IN_SUBSCRIBE,
    IN_UNSUBACK,
    IN_UNSUBSCRIBE,
    IN_WILL,
    check_allowed,
    encode_properties,
    publish_properties,
)
from .wire import (
    MQTT_3_1,
    MQTT_3_1_1,
    MQTT_5,
    encode_bin,
    encode_str,
    encode_varint,
    pack_u16,
    with_fixed_header,
)

#: How many topics keep their encoded topic name field (cleared when full): a broker delivers
#: the same few topics over and over, so encoding a topic name is mostly a dictionary look-up.
TOPIC_FIELDS_KEPT = 4096
_TOPIC_FIELDS: dict[str, bytes] = {}


def forget_topic_fields() -> None:
    """Empty the topic name cache: an idle broker keeps no topic of the last load (each entry
    made under load would hold its page of the small-object heap)."""
    _TOPIC_FIELDS.clear()


def encode_str_field(text: str) -> bytes:
    """A topic name as its PUBLISH field: two-byte length, then UTF-8 (§1.5.3)."""
    raw = text.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise ValueError("topic longer than 65535 bytes")
    return pack_u16(len(raw)) + raw


def _publish_bytes(
    topic: str, payload: bytes, qos: int, retain: bool, dup: bool, packet_id: int | None,
    props: bytes | None,
) -> bytes:
    head = _TOPIC_FIELDS.get(topic)
    if head is None:
        head = encode_str_field(topic)
        if len(_TOPIC_FIELDS) >= TOPIC_FIELDS_KEPT:
            _TOPIC_FIELDS.clear()
        _TOPIC_FIELDS[topic] = head
    if qos:
        if qos not in (1, 2):
            raise ValueError(f"invalid QoS {qos}")
        if not packet_id:
            raise ValueError("PUBLISH with QoS > 0 needs a non-zero packet identifier")
        head += pack_u16(packet_id)
    first = 0x30 | (qos << 1) | (0x01 if retain else 0) | (0x08 if dup else 0)
    if props is not None:
        head += props
    remaining = len(head) + len(payload)
    if remaining < 0x80:
        fixed = bytes((first, remaining))
    elif remaining < 0x4000:
        fixed = bytes((first, (remaining & 0x7F) | 0x80, remaining >> 7))
    else:
        fixed = bytes((first,)) + encode_varint(remaining)
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
        props = b"\x00" if properties is None else publish_properties(properties)
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
        encode_str(packet.protocol_name),
        bytes((packet.protocol_level, flags)),
        pack_u16(packet.keep_alive),
    ]
    v5 = version == MQTT_5
    if v5:
        parts.append(encode_properties(packet.properties, IN_CONNECT))
    parts.append(encode_str(packet.client_id))
    if will is not None:
        if v5:
            parts.append(encode_properties(will.properties, IN_WILL))
        parts.append(encode_str(will.topic))
        parts.append(encode_bin(will.payload))
    if packet.username is not None:
        parts.append(encode_str(packet.username))
    if packet.password is not None:
        parts.append(encode_bin(packet.password))
    return with_fixed_header(0x10, b"".join(parts))


def _encode_connack(packet: Connack, version: int) -> bytes:
    ack_flags = 1 if packet.session_present and version != MQTT_3_1 else 0
    body = bytes((ack_flags, packet.reason_code))
    if version == MQTT_5:
        body += encode_properties(packet.properties, IN_CONNACK)
    return with_fixed_header(0x20, body)


def _encode_publish_packet(packet: Publish, version: int) -> bytes:
    props = None
    if version == MQTT_5:
        check_allowed(packet.properties, IN_PUBLISH)
        props = publish_properties(packet.properties)
    return _publish_bytes(
        packet.topic, packet.payload, packet.qos, packet.retain, packet.dup, packet.packet_id,
        props,
    )


def _ack_encoder(first: int, mask: int) -> Callable[[Any, int], bytes]:
    def encode_ack(packet: Puback | Pubrec | Pubrel | Pubcomp, version: int) -> bytes:
        body = pack_u16(packet.packet_id)
        if version == MQTT_5:
            props = encode_properties(packet.properties, mask)
            if props != b"\x00":
                body += bytes((packet.reason_code,)) + props
            elif packet.reason_code:
                body += bytes((packet.reason_code,))
        return with_fixed_header(first, body)

    return encode_ack


def _encode_subscribe(packet: Subscribe, version: int) -> bytes:
    parts = [pack_u16(packet.packet_id)]
    v5 = version == MQTT_5
    if v5:
        parts.append(encode_properties(packet.properties, IN_SUBSCRIBE))
    for sub in packet.subscriptions:
        parts.append(encode_str(sub.topic_filter))
        options = sub.qos
        if v5:
            options |= (
                (0x04 if sub.no_local else 0)
                | (0x08 if sub.retain_as_published else 0)
                | (sub.retain_handling << 4)
            )
        parts.append(bytes((options,)))
    return with_fixed_header(0x82, b"".join(parts))


def _encode_suback(packet: Suback, version: int) -> bytes:
    body = pack_u16(packet.packet_id)
    if version == MQTT_5:
        body += encode_properties(packet.properties, IN_SUBACK)
    return with_fixed_header(0x90, body + bytes(packet.reason_codes))


def _encode_unsubscribe(packet: Unsubscribe, version: int) -> bytes:
    parts = [pack_u16(packet.packet_id)]
    if version == MQTT_5:
        parts.append(encode_properties(packet.properties, IN_UNSUBSCRIBE))
    parts.extend(encode_str(topic_filter) for topic_filter in packet.topic_filters)
    return with_fixed_header(0xA2, b"".join(parts))


def _encode_unsuback(packet: Unsuback, version: int) -> bytes:
    body = pack_u16(packet.packet_id)
    if version == MQTT_5:
        body += encode_properties(packet.properties, IN_UNSUBACK) + bytes(packet.reason_codes)
    return with_fixed_header(0xB0, body)


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
        props = encode_properties(packet.properties, mask)
        if props != b"\x00":
            return with_fixed_header(first, bytes((packet.reason_code,)) + props)
        if packet.reason_code:
            return bytes((first, 1, packet.reason_code))
        return bytes((first, 0))

    return encode_packet


_ENCODERS: dict[type, Callable[[Any, int], bytes]] = {
    Connect: _encode_connect,
    Connack: _encode_connack,
    Publish: _encode_publish_packet,
    Puback: _ack_encoder(0x40, IN_PUBACK),
    Pubrec: _ack_encoder(0x50, IN_PUBREC),
    Pubrel: _ack_encoder(0x62, IN_PUBREL),
    Pubcomp: _ack_encoder(0x70, IN_PUBCOMP),
    Subscribe: _encode_subscribe,
    Suback: _encode_suback,
    Unsubscribe: _encode_unsubscribe,
    Unsuback: _encode_unsuback,
    Pingreq: _encode_pingreq,
    Pingresp: _encode_pingresp,
    Disconnect: _encode_reason_and_properties(0xE0, IN_DISCONNECT),
    Auth: _encode_reason_and_properties(0xF0, IN_AUTH),
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
