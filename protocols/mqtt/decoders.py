"""Decoders of each MQTT packet type's variable header and payload (bytes between `pos` and
`end` of one complete packet), enforcing the wire format: lengths, strict UTF-8, reserved
bits, allowed reason codes and properties, non-zero packet identifiers. Framing is the
parser's work (`parser.py`); meaning (wildcards, session state) is the connection's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import InvalidUTF8, UnsupportedProtocolVersion, malformed, protocol_error
from .packets import (
    Auth,
    Connack,
    Connect,
    Disconnect,
    Pingreq,
    Pingresp,
    Properties,
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
    read_properties,
)
from .wire import MQTT_3_1, MQTT_5, PROTOCOLS, read_bin, read_str, read_u16

#: The properties of every decoded PUBLISH that carries none (all before 5.0): one shared
#: instance, since building 27 empty fields per message costs more than decoding it. Decoded
#: packets are read, never changed; whoever wants to change one replaces its `properties`.
NO_PROPERTIES = Properties()

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




def _check_packet_id(packet_id: int, what: str) -> None:
    if not packet_id:
        raise protocol_error(f"{what} with packet identifier 0 [MQTT-2.3.1-1]")


def _decode_connect(data: bytes, pos: int, end: int, version: int) -> Connect:
    name, pos = read_str(data, pos, end, "protocol name")
    if pos >= end:
        raise malformed("CONNECT truncated before the protocol level")
    level = data[pos]
    if (name, level) not in PROTOCOLS:
        raise UnsupportedProtocolVersion(name, level)
    if pos + 4 > end:
        raise malformed("CONNECT truncated in the variable header")
    flags = data[pos + 1]
    keep_alive = (data[pos + 2] << 8) | data[pos + 3]
    pos += 4
    if flags & 0x01:
        raise malformed("CONNECT reserved flag is set [MQTT-3.1.2-3]")
    will_flag = flags & 0x04
    will_qos = (flags >> 3) & 0x03
    will_retain = flags & 0x20
    if not will_flag and (will_qos or will_retain):
        raise malformed("will QoS or will retain set without the will flag [MQTT-3.1.2-11]")
    if will_qos == 3:
        raise malformed("will QoS 3 [MQTT-3.1.2-14]")
    has_password = flags & 0x40
    has_username = flags & 0x80
    if has_password and not has_username and level < MQTT_5:
        raise malformed("password without user name [MQTT-3.1.2-22]")
    if level == MQTT_5:
        props, pos = read_properties(data, pos, end, IN_CONNECT)
    else:
        props = Properties()
    client_id, pos = read_str(data, pos, end, "client identifier")
    will = None
    if will_flag:
        if level == MQTT_5:
            will_props, pos = read_properties(data, pos, end, IN_WILL)
        else:
            will_props = Properties()
        will_topic, pos = read_str(data, pos, end, "will topic")
        will_payload, pos = read_bin(data, pos, end, "will payload")
        will = Will(will_topic, will_payload, will_qos, bool(will_retain), will_props)
    username = password = None
    if has_username:
        username, pos = read_str(data, pos, end, "user name")
    if has_password:
        password, pos = read_bin(data, pos, end, "password")
    if pos != end:
        raise malformed("trailing bytes after CONNECT payload")
    return Connect(
        name, level, bool(flags & 0x02), keep_alive, client_id, will, username, password, props
    )


def _decode_connack(data: bytes, pos: int, end: int, version: int) -> Connack:
    if pos + 2 > end:
        raise malformed("truncated CONNACK")
    ack_flags = data[pos]
    code = data[pos + 1]
    pos += 2
    if version == MQTT_3_1:
        ack_flags = 0  # a reserved, unused byte in MQTT 3.1
    elif ack_flags & 0xFE:
        raise malformed("CONNACK acknowledge flags bits 7-1 are reserved (§3.2.2.1)")
    if version == MQTT_5:
        if code not in _CONNACK_CODES:
            raise malformed(f"invalid CONNACK reason code {code:#04x}")
        props, pos = read_properties(data, pos, end, IN_CONNACK)
    else:
        if code not in _CONNACK_CODES_311:
            raise malformed(f"invalid CONNACK return code {code}")
        props = Properties()
    if pos != end:
        raise malformed("trailing bytes after CONNACK")
    return Connack(bool(ack_flags), code, props)


def decode_publish(data: bytes, pos: int, end: int, flags: int, version: int) -> Publish:
    qos = (flags >> 1) & 0x03
    if qos == 3:
        raise malformed("PUBLISH with QoS 3 [MQTT-3.3.1-4]")
    if pos + 2 > end:
        raise malformed("truncated PUBLISH topic")
    stop = pos + 2 + ((data[pos] << 8) | data[pos + 1])
    if stop > end:
        raise malformed("PUBLISH topic runs past the end of the packet")
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
            raise malformed("truncated PUBLISH packet identifier")
        packet_id = (data[pos] << 8) | data[pos + 1]
        if not packet_id:
            raise protocol_error("PUBLISH QoS > 0 with packet identifier 0 [MQTT-2.3.1-1]")
        pos += 2
    if version == MQTT_5 and (pos >= end or data[pos]):
        props, pos = read_properties(data, pos, end, IN_PUBLISH)
    else:
        props = NO_PROPERTIES
        pos += version == MQTT_5  # an empty property block: one zero byte
    return Publish(topic, data[pos:end], qos, flags & 0x01 != 0, flags & 0x08 != 0, packet_id, props)


def _ack_decoder(
    cls: type[Puback | Pubrec | Pubrel | Pubcomp], mask: int, codes: frozenset[int]
) -> Callable[[bytes, int, int, int], Puback | Pubrec | Pubrel | Pubcomp]:
    name = cls.__name__.upper()

    def decode(data: bytes, pos: int, end: int, version: int) -> Puback | Pubrec | Pubrel | Pubcomp:
        packet_id, pos = read_u16(data, pos, end, f"{name} packet identifier")
        _check_packet_id(packet_id, name)
        code = 0
        if version == MQTT_5 and pos < end:
            # Reason code and properties may be left out (v5 §3.4.2.1, §3.4.2.2.1).
            code = data[pos]
            pos += 1
            if code not in codes:
                raise malformed(f"invalid {name} reason code {code:#04x}")
            if pos < end:
                props, pos = read_properties(data, pos, end, mask)
                if pos != end:
                    raise malformed(f"trailing bytes after {name}")
                return cls(packet_id, code, props)
        if pos != end:
            raise malformed(f"trailing bytes after {name}")
        return cls(packet_id, code)

    return decode


def _decode_subscribe(data: bytes, pos: int, end: int, version: int) -> Subscribe:
    packet_id, pos = read_u16(data, pos, end, "SUBSCRIBE packet identifier")
    _check_packet_id(packet_id, "SUBSCRIBE")
    if version == MQTT_5:
        props, pos = read_properties(data, pos, end, IN_SUBSCRIBE)
    else:
        props = Properties()
    subscriptions = []
    while pos < end:
        topic_filter, pos = read_str(data, pos, end, "SUBSCRIBE topic filter")
        if pos >= end:
            raise malformed("SUBSCRIBE topic filter without subscription options")
        options = data[pos]
        pos += 1
        qos = options & 0x03
        if version == MQTT_5:
            if options & 0xC0:
                raise malformed("SUBSCRIBE options reserved bits are set (v5 [MQTT-3.8.3-5])")
            if qos == 3:
                raise protocol_error("SUBSCRIBE maximum QoS 3 (v5 §3.8.3.1)")
            retain_handling = (options >> 4) & 0x03
            if retain_handling == 3:
                raise protocol_error("SUBSCRIBE retain handling 3 (v5 §3.8.3.1)")
            subscriptions.append(SubscriptionRequest(
                topic_filter, qos, bool(options & 0x04), bool(options & 0x08), retain_handling
            ))
        else:
            if options & 0xFC or qos == 3:
                raise malformed("SUBSCRIBE reserved bits set or QoS 3 [MQTT-3.8.3-4]")
            subscriptions.append(SubscriptionRequest(topic_filter, qos))
    if not subscriptions:
        raise protocol_error("SUBSCRIBE without topic filters [MQTT-3.8.3-3]")
    return Subscribe(packet_id, subscriptions, props)


def _decode_suback(data: bytes, pos: int, end: int, version: int) -> Suback:
    packet_id, pos = read_u16(data, pos, end, "SUBACK packet identifier")
    _check_packet_id(packet_id, "SUBACK")
    if version == MQTT_5:
        props, pos = read_properties(data, pos, end, IN_SUBACK)
        valid = _SUBACK_CODES
    else:
        props = Properties()
        valid = _SUBACK_CODES_311
    codes = list(data[pos:end])
    for code in codes:
        if code not in valid:
            raise malformed(f"invalid SUBACK reason code {code:#04x}")
    return Suback(packet_id, codes, props)


def _decode_unsubscribe(data: bytes, pos: int, end: int, version: int) -> Unsubscribe:
    packet_id, pos = read_u16(data, pos, end, "UNSUBSCRIBE packet identifier")
    _check_packet_id(packet_id, "UNSUBSCRIBE")
    if version == MQTT_5:
        props, pos = read_properties(data, pos, end, IN_UNSUBSCRIBE)
    else:
        props = Properties()
    topic_filters = []
    while pos < end:
        topic_filter, pos = read_str(data, pos, end, "UNSUBSCRIBE topic filter")
        topic_filters.append(topic_filter)
    if not topic_filters:
        raise protocol_error("UNSUBSCRIBE without topic filters [MQTT-3.10.3-2]")
    return Unsubscribe(packet_id, topic_filters, props)


def _decode_unsuback(data: bytes, pos: int, end: int, version: int) -> Unsuback:
    packet_id, pos = read_u16(data, pos, end, "UNSUBACK packet identifier")
    _check_packet_id(packet_id, "UNSUBACK")
    if version != MQTT_5:
        if pos != end:
            raise malformed("trailing bytes after UNSUBACK")
        return Unsuback(packet_id, [])
    props, pos = read_properties(data, pos, end, IN_UNSUBACK)
    codes = list(data[pos:end])
    for code in codes:
        if code not in _UNSUBACK_CODES:
            raise malformed(f"invalid UNSUBACK reason code {code:#04x}")
    return Unsuback(packet_id, codes, props)


def _decode_pingreq(data: bytes, pos: int, end: int, version: int) -> Pingreq:
    if pos != end:
        raise malformed("PINGREQ with a body")
    return Pingreq()


def _decode_pingresp(data: bytes, pos: int, end: int, version: int) -> Pingresp:
    if pos != end:
        raise malformed("PINGRESP with a body")
    return Pingresp()


def _decode_disconnect(data: bytes, pos: int, end: int, version: int) -> Disconnect:
    if version != MQTT_5:
        if pos != end:
            raise malformed("DISCONNECT with a body")
        return Disconnect()
    return _decode_reason_and_properties(Disconnect, data, pos, end, IN_DISCONNECT, _DISCONNECT_CODES)


def _decode_auth(data: bytes, pos: int, end: int, version: int) -> Auth:
    if version != MQTT_5:
        raise malformed("packet type 15 is reserved before MQTT 5.0")
    return _decode_reason_and_properties(Auth, data, pos, end, IN_AUTH, _AUTH_CODES)


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
        raise malformed(f"invalid {name} reason code {code:#04x}")
    if pos == end:
        return cls(code)
    props, pos = read_properties(data, pos, end, mask)
    if pos != end:
        raise malformed(f"trailing bytes after {name}")
    return cls(code, props)


_Decoder = Callable[[bytes, int, int, int], Any]
# By packet type; PUBLISH (3) is decoded inline by the parser, type 0 is reserved.
DECODERS: tuple[_Decoder | None, ...] = (
    None,
    _decode_connect,
    _decode_connack,
    None,
    _ack_decoder(Puback, IN_PUBACK, _PUBACK_CODES),
    _ack_decoder(Pubrec, IN_PUBREC, _PUBACK_CODES),
    _ack_decoder(Pubrel, IN_PUBREL, _PUBREL_CODES),
    _ack_decoder(Pubcomp, IN_PUBCOMP, _PUBREL_CODES),
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
FIXED_FLAGS = (-1, 0, 0, -1, 0, 0, 0b0010, 0, 0b0010, 0, 0b0010, 0, 0, 0, 0, 0)
