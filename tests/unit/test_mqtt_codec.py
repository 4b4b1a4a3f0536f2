"""The sans-IO MQTT codec: round trips for every packet and protocol level, incremental
parsing in any chunking, the spec's malformed and protocol-error cases, and fuzzing that
proves bad bytes only ever raise MQTTCodecError."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shardgate.protocols.mqtt import packets as p
from shardgate.protocols.mqtt.codec import (
    InvalidUTF8,
    MQTTCodecError,
    PacketParser,
    PacketTooLarge,
    UnsupportedProtocolVersion,
    encode,
    encode_publish,
)

RC = p.ReasonCode
VERSIONS = [3, 4, 5]
MALFORMED = RC.MALFORMED_PACKET
PROTOCOL_ERROR = RC.PROTOCOL_ERROR


# ----------------------------------------------------------------------------- helpers
def frame(first: int, body: bytes) -> bytes:
    """A packet from its first byte and body, with a correctly encoded remaining length."""
    length = len(body)
    out = bytearray([first])
    while True:
        byte = length & 0x7F
        length >>= 7
        out.append(byte | 0x80 if length else byte)
        if not length:
            return bytes(out + body)


def s(text: str) -> bytes:
    raw = text.encode()
    return len(raw).to_bytes(2, "big") + raw


def parser(version: int | None) -> PacketParser:
    result = PacketParser()
    result.version = version
    return result


def decode(data: bytes, version: int | None = 4) -> list[p.Packet]:
    return parser(version).feed(data)


def decode_error(data: bytes, version: int | None = 4) -> MQTTCodecError:
    with pytest.raises(MQTTCodecError) as info:
        decode(data, version)
    return info.value


def connect_bytes(level: int = 4, flags: int = 0x02, rest: bytes = b"", name: str = "MQTT") -> bytes:
    props = b"\x00" if level == 5 else b""
    return frame(0x10, s(name) + bytes([level, flags]) + b"\x00\x3c" + props + s("cid") + rest)


def full_props() -> dict[str, p.Properties]:
    """For each packet kind, Properties with every property that kind may carry."""
    return {
        "connect": p.Properties(
            session_expiry_interval=3600, authentication_method="SCRAM",
            authentication_data=b"\x01\x02", request_problem_information=1,
            request_response_information=1, receive_maximum=20, topic_alias_maximum=5,
            user_properties=[("a", "1"), ("a", "2"), ("b", "")], maximum_packet_size=65536,
        ),
        "will": p.Properties(
            payload_format_indicator=1, message_expiry_interval=60, content_type="text/plain",
            response_topic="reply/here", correlation_data=b"corr", will_delay_interval=10,
            user_properties=[("k", "v")],
        ),
        "connack": p.Properties(
            session_expiry_interval=0, assigned_client_identifier="auto-1", server_keep_alive=30,
            authentication_method="SCRAM", authentication_data=b"\x00", response_information="ri",
            server_reference="other:1883", reason_string="welcome", receive_maximum=100,
            topic_alias_maximum=10, maximum_qos=1, retain_available=0,
            user_properties=[("x", "y")], maximum_packet_size=1 << 20,
            wildcard_subscription_available=1, subscription_identifier_available=1,
            shared_subscription_available=0,
        ),
        "publish": p.Properties(
            payload_format_indicator=0, message_expiry_interval=2**32 - 1,
            content_type="application/json", response_topic="r/t", correlation_data=b"\xff\x00",
            subscription_identifiers=[1, 268435455, 7], topic_alias=3,
            user_properties=[("h1", "v1"), ("h1", "v2"), ("\u00e9", "\u2603")],
        ),
        "ack": p.Properties(reason_string="because", user_properties=[("k", "v")]),
        "subscribe": p.Properties(subscription_identifiers=[42], user_properties=[("k", "v")]),
        "unsubscribe": p.Properties(user_properties=[("k", "v")]),
        "disconnect": p.Properties(
            session_expiry_interval=5, server_reference="s", reason_string="bye",
            user_properties=[("k", "v")],
        ),
        "auth": p.Properties(
            authentication_method="SCRAM", authentication_data=b"abc", reason_string="more",
            user_properties=[("k", "v")],
        ),
    }


def sample_packets(version: int) -> list[p.Packet]:
    """One or more instances of every packet type valid at `version`, with every field that
    version carries set to something other than its default."""
    name = "MQIsdp" if version == 3 else "MQTT"
    v5 = version == 5
    props = full_props() if v5 else dict.fromkeys(full_props(), None)

    def pr(kind: str) -> p.Properties:
        return props[kind] or p.Properties()

    packets: list[p.Packet] = [
        p.Connect(name, version, True, 60, "client-1", properties=pr("connect")),
        p.Connect(
            name, version, False, 0, "",
            p.Will("will/topic", b"\x00gone\xff", 2, True, pr("will")), "user", b"\x00secret",
            properties=pr("connect"),
        ),
        p.Connect(name, version, True, 65535, "\u00e9t\u00e9", p.Will("w", b"", 1, False, pr("will"))),
        p.Connect(name, version, True, 10, "u-only", username="\u2603"),
        p.Connack(False, 0, pr("connack")),
        p.Connack(version != 3, 0, pr("connack")),
        p.Connack(False, RC.NOT_AUTHORIZED if v5 else p.ConnackCode311.NOT_AUTHORIZED),
        p.Publish("a/b/c", b"payload", 0, properties=pr("publish")),
        p.Publish("a/b", b"", 1, True, False, 1, pr("publish")),
        p.Publish("\u00fcber/\U0001f600", bytes(range(256)) * 3, 2, False, True, 65535),
        p.Publish("big", b"x" * 20000, 1, packet_id=9),
        p.Puback(1),
        p.Pubrec(2),
        p.Pubrel(3),
        p.Pubcomp(65535),
        p.Subscribe(10, [p.SubscriptionRequest("a/+", 0), p.SubscriptionRequest("#", 2)],
                    pr("subscribe")),
        p.Suback(10, [0, 1, 2, 0x80], pr("ack")),
        p.Unsubscribe(11, ["a/+", "b/#", ""], pr("unsubscribe")),
        p.Unsuback(11, [0, 0x11] if v5 else [], pr("ack")),
        p.Pingreq(),
        p.Pingresp(),
        p.Disconnect(),
    ]
    if v5:
        packets += [
            p.Connect(name, 5, True, 1, "pw-only", password=b"pw"),
            p.Puback(1, RC.NO_MATCHING_SUBSCRIBERS),
            p.Puback(1, RC.QUOTA_EXCEEDED, pr("ack")),
            p.Puback(1, 0, pr("ack")),
            p.Pubrec(2, RC.PAYLOAD_FORMAT_INVALID, pr("ack")),
            p.Pubrel(3, RC.PACKET_IDENTIFIER_NOT_FOUND),
            p.Pubcomp(4, RC.PACKET_IDENTIFIER_NOT_FOUND, pr("ack")),
            p.Subscribe(12, [
                p.SubscriptionRequest("$share/g/t", 1, False, True, 2),
                p.SubscriptionRequest("x", 0, True, False, 1),
            ]),
            p.Suback(12, [RC.SHARED_SUBSCRIPTIONS_NOT_SUPPORTED, RC.GRANTED_QOS_1]),
            p.Disconnect(RC.DISCONNECT_WITH_WILL),
            p.Disconnect(RC.SERVER_SHUTTING_DOWN, pr("disconnect")),
            p.Disconnect(0, pr("disconnect")),
            p.Auth(),
            p.Auth(RC.CONTINUE_AUTHENTICATION, pr("auth")),
            p.Auth(RC.REAUTHENTICATE),
            p.Publish("", b"aliased", 0, properties=p.Properties(topic_alias=1)),
        ]
    return packets


# ----------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("version", VERSIONS)
def test_every_packet_round_trips(version):
    for packet in sample_packets(version):
        data = encode(packet, version)
        assert decode(data, version) == [packet], packet


@pytest.mark.parametrize("version", VERSIONS)
def test_many_packets_in_one_chunk(version):
    packets = sample_packets(version)
    data = b"".join(encode(packet, version) for packet in packets)
    assert decode(data, version) == packets


@pytest.mark.parametrize("version", VERSIONS)
def test_byte_at_a_time(version):
    packets = sample_packets(version)
    data = b"".join(encode(packet, version) for packet in packets)
    reader = parser(version)
    decoded = []
    for index in range(len(data)):
        decoded += reader.feed(data[index : index + 1])
    assert decoded == packets
    assert reader.buffered == 0


@pytest.mark.parametrize("version", VERSIONS)
def test_random_chunking(version):
    packets = sample_packets(version)
    data = b"".join(encode(packet, version) for packet in packets)
    rng = random.Random(version)
    for _ in range(20):
        reader = parser(version)
        decoded = []
        pos = 0
        while pos < len(data):
            step = rng.choice([1, 2, 3, 7, 100, 5000])
            decoded += reader.feed(bytearray(data[pos : pos + step]))
            pos += step
        assert decoded == packets


def test_feed_accepts_any_bytes_like():
    data = encode(p.Publish("t", b"x"), 4)
    assert parser(4).feed(bytearray(data)) == [p.Publish("t", b"x")]
    assert parser(4).feed(memoryview(data)) == [p.Publish("t", b"x")]
    reader = parser(4)
    assert reader.feed(memoryview(data)[:2]) == []
    assert reader.feed(memoryview(data)[2:]) == [p.Publish("t", b"x")]


def test_empty_feed_returns_nothing():
    reader = parser(4)
    assert reader.feed(b"") == []
    assert reader.feed(b"\xc0") == []
    assert reader.feed(b"") == []
    assert reader.feed(b"\x00") == [p.Pingreq()]


def test_publish_payload_is_bytes():
    reader = parser(4)
    data = encode(p.Publish("t", b"abc", 1, packet_id=1), 4)
    reader.feed(data[:3])
    (packet,) = reader.feed(data[3:])
    assert type(packet.payload) is bytes
    (packet,) = decode(data)
    assert type(packet.payload) is bytes


@pytest.mark.parametrize("version", VERSIONS)
def test_encode_publish_matches_encode(version):
    props = full_props()["publish"] if version == 5 else None
    for qos, packet_id in ((0, None), (1, 5), (2, 65535)):
        for payload in (b"", b"x" * 200, b"y" * 70000):
            expected = encode(
                p.Publish("a/b", payload, qos, True, qos == 1, packet_id, props or p.Properties()),
                version,
            )
            fast = encode_publish("a/b", payload, qos, True, qos == 1, packet_id, props, version)
            assert fast == expected


def test_encode_publish_v5_without_properties_writes_empty_property_length():
    data = encode_publish("t", b"x", 0, False, False, None, None, 5)
    assert data == b"\x30\x05\x00\x01t\x00x"
    assert decode(data, 5) == [p.Publish("t", b"x")]


def test_version_follows_connect_within_one_chunk():
    props = p.Properties(content_type="text/plain", user_properties=[("a", "b")])
    data = encode(p.Connect("MQTT", 5, True, 30, "c"), 5) + encode(
        p.Publish("t", b"x", 1, packet_id=2, properties=props), 5
    )
    reader = PacketParser()
    assert reader.version is None
    connect, publish = reader.feed(data)
    assert reader.version == 5
    assert publish.properties == props


def test_version_3_1_connect_sets_level_3():
    reader = PacketParser()
    reader.feed(encode(p.Connect("MQIsdp", 3, True, 30, "c"), 3))
    assert reader.version == 3


def test_short_forms_of_v5_acks_decode():
    """v5 §3.4.2.1: reason code and property length may be left out."""
    assert decode(b"\x40\x02\x00\x01", 5) == [p.Puback(1)]
    assert decode(b"\x40\x03\x00\x01\x10", 5) == [p.Puback(1, RC.NO_MATCHING_SUBSCRIBERS)]
    assert decode(b"\x40\x04\x00\x01\x10\x00", 5) == [p.Puback(1, RC.NO_MATCHING_SUBSCRIBERS)]
    assert decode(b"\xe0\x00", 5) == [p.Disconnect()]
    assert decode(b"\xe0\x01\x04", 5) == [p.Disconnect(RC.DISCONNECT_WITH_WILL)]
    assert decode(b"\xf0\x00", 5) == [p.Auth()]


def test_encoded_short_forms():
    assert encode(p.Puback(1), 5) == b"\x40\x02\x00\x01"
    assert encode(p.Puback(1, 0x10), 5) == b"\x40\x03\x00\x01\x10"
    assert encode(p.Disconnect(), 5) == b"\xe0\x00"
    assert encode(p.Disconnect(0x8B), 4) == b"\xe0\x00"
    assert encode(p.Unsuback(5, [0x11]), 4) == b"\xb0\x02\x00\x05"


def test_mqtt_3_1_connack_has_no_session_present():
    assert encode(p.Connack(True, 0), 3) == b"\x20\x02\x00\x00"
    assert encode(p.Connack(True, 0), 4) == b"\x20\x02\x01\x00"


def test_subscription_identifier_repeats_in_publish():
    props = p.Properties(subscription_identifiers=[3, 1, 3])
    data = encode(p.Publish("t", b"", properties=props), 5)
    assert decode(data, 5)[0].properties.subscription_identifiers == [3, 1, 3]


def test_user_properties_keep_order_and_duplicates():
    pairs = [("b", "1"), ("a", "2"), ("b", "1")]
    data = encode(p.Disconnect(0, p.Properties(user_properties=pairs)), 5)
    assert decode(data, 5)[0].properties.user_properties == pairs


def test_encode_refuses_property_not_allowed_in_packet():
    with pytest.raises(ValueError):
        encode(p.Puback(1, 0, p.Properties(topic_alias=1)), 5)
    with pytest.raises(ValueError, match="reason_string"):
        encode(p.Publish("t", b"", properties=p.Properties(reason_string="no")), 5)
    with pytest.raises(ValueError, match="subscription_identifiers"):
        encode(p.Connack(False, 0, p.Properties(subscription_identifiers=[1])), 5)
    with pytest.raises(ValueError):
        encode(p.Auth(), 4)
    with pytest.raises(ValueError):
        encode(p.Publish("t", b"", 1), 4)  # QoS 1 needs a packet id


def test_properties_are_not_encoded_before_v5():
    data = encode(p.Publish("t", b"x", properties=p.Properties(content_type="c")), 4)
    assert data == b"\x30\x04\x00\x01tx"


# ----------------------------------------------------------------------------- fixed header
@pytest.mark.parametrize(
    ("first", "body"),
    [
        (0x11, s("MQTT") + b"\x04\x02\x00\x3c" + s("c")),  # CONNECT flags 0001
        (0x21, b"\x00\x00"),  # CONNACK
        (0x42, b"\x00\x01"),  # PUBACK
        (0x51, b"\x00\x01"),  # PUBREC
        (0x60, b"\x00\x01"),  # PUBREL must be 0010 [MQTT-3.6.1-1]
        (0x72, b"\x00\x01"),  # PUBCOMP
        (0x80, b"\x00\x01" + s("a") + b"\x00"),  # SUBSCRIBE must be 0010 [MQTT-3.8.1-1]
        (0x92, b"\x00\x01\x00"),  # SUBACK
        (0xA0, b"\x00\x01" + s("a")),  # UNSUBSCRIBE must be 0010 [MQTT-3.10.1-1]
        (0xB2, b"\x00\x01"),  # UNSUBACK
        (0xC8, b""),  # PINGREQ
        (0xD1, b""),  # PINGRESP
        (0xE2, b""),  # DISCONNECT
    ],
)
def test_wrong_fixed_header_flags_are_malformed(first, body):
    """[MQTT-2.2.2-1], [MQTT-2.2.2-2]: reserved flags must have their listed values."""
    assert decode_error(frame(first, body)).reason_code == MALFORMED


def test_packet_type_0_is_malformed():
    assert decode_error(b"\x00\x00").reason_code == MALFORMED


def test_auth_before_v5_is_malformed():
    """Packet type 15 is reserved in MQTT 3.1.1 (§2.2.1)."""
    assert decode_error(b"\xf0\x00", 4).reason_code == MALFORMED
    assert decode(b"\xf0\x00", 5) == [p.Auth()]


@pytest.mark.parametrize("version", [4, 5])
def test_publish_qos_3_is_malformed(version):
    """[MQTT-3.3.1-4]: a PUBLISH must not have both QoS bits set."""
    assert decode_error(b"\x36\x05\x00\x01t\x00\x01", version).reason_code == MALFORMED


def test_remaining_length_longer_than_4_bytes_is_malformed():
    """§2.2.3: the Remaining Length uses at most four bytes."""
    error = decode_error(b"\x30\xff\xff\xff\xff\x01")
    assert error.reason_code == MALFORMED and not isinstance(error, PacketTooLarge)


def test_remaining_length_not_minimal_is_malformed():
    """v5 [MQTT-1.5.5-1]: a Variable Byte Integer uses the fewest bytes."""
    assert decode_error(b"\xc0\x80\x00").reason_code == MALFORMED


def test_mqtt_3_1_allows_dup_on_pubrel():
    assert decode(b"\x6a\x02\x00\x01", 3) == [p.Pubrel(1)]
    assert decode_error(b"\x6a\x02\x00\x01", 4).reason_code == MALFORMED


# ----------------------------------------------------------------------------- sizes
def test_oversized_packet_refused_from_the_fixed_header_alone():
    reader = PacketParser(max_packet_size=1000)
    reader.version = 4
    header = encode(p.Publish("t", b"x" * 5000), 4)[:3]
    with pytest.raises(PacketTooLarge) as info:
        reader.feed(header)
    assert info.value.reason_code == RC.PACKET_TOO_LARGE
    assert reader.buffered <= len(header)


def test_oversized_packet_refused_when_header_arrives_in_pieces():
    reader = PacketParser(max_packet_size=1000)
    reader.version = 4
    data = encode(p.Publish("t", b"x" * 5000), 4)
    assert reader.feed(data[:1]) == []
    assert reader.feed(data[1:2]) == []
    with pytest.raises(PacketTooLarge):
        reader.feed(data[2:3])


def test_packet_at_the_size_limit_is_accepted():
    data = encode(p.Publish("t", b"x" * 100), 4)
    reader = PacketParser(max_packet_size=len(data))
    assert len(reader.feed(data)) == 1
    reader = PacketParser(max_packet_size=len(data) - 1)
    with pytest.raises(PacketTooLarge):
        reader.feed(data)


def test_parser_unusable_after_error():
    reader = parser(4)
    with pytest.raises(MQTTCodecError):
        reader.feed(b"\x00\x00")
    with pytest.raises(MQTTCodecError):
        reader.feed(b"\xc0\x00")


def test_error_carries_packets_decoded_before_it():
    with pytest.raises(MQTTCodecError) as info:
        decode(b"\xc0\x00\xc0\x00\x00\x00")
    assert info.value.packets == [p.Pingreq(), p.Pingreq()]


# ----------------------------------------------------------------------------- CONNECT
@pytest.mark.parametrize(
    ("name", "level"), [("MQTT", 2), ("MQTT", 3), ("MQTT", 6), ("MQTT", 255), ("MQIsdp", 4), ("HTTP", 4)]
)
def test_unknown_protocol_raises_unsupported_version(name, level):
    """[MQTT-3.1.2-2]: the server answers CONNACK 0x01 (0x84 on v5) to a level it lacks."""
    with pytest.raises(UnsupportedProtocolVersion) as info:
        decode(connect_bytes(level, name=name), None)
    assert info.value.protocol_level == level
    assert info.value.reason_code == RC.UNSUPPORTED_PROTOCOL_VERSION


@pytest.mark.parametrize("level", VERSIONS)
def test_connect_reserved_flag_is_malformed(level):
    """[MQTT-3.1.2-3]: the CONNECT reserved flag must be 0."""
    name = "MQIsdp" if level == 3 else "MQTT"
    assert decode_error(connect_bytes(level, 0x03, name=name), None).reason_code == MALFORMED


@pytest.mark.parametrize("level", [4, 5])
@pytest.mark.parametrize("flags", [0x0A, 0x12, 0x22])
def test_will_qos_or_retain_without_will_flag_is_malformed(level, flags):
    """[MQTT-3.1.2-11], [MQTT-3.1.2-13], [MQTT-3.1.2-15] (v5 [MQTT-3.1.2-11], [MQTT-3.1.2-13])."""
    assert decode_error(connect_bytes(level, flags), None).reason_code == MALFORMED


@pytest.mark.parametrize("level", [4, 5])
def test_will_qos_3_is_malformed(level):
    """[MQTT-3.1.2-14] (v5 [MQTT-3.1.2-12]): will QoS must not be 3."""
    will = (b"\x00" if level == 5 else b"") + s("w") + s("x")
    assert decode_error(connect_bytes(level, 0x1E, will), None).reason_code == MALFORMED


def test_password_without_username_is_malformed_in_3_1_1():
    """[MQTT-3.1.2-22]; MQTT 5.0 allows a password alone (v5 §3.1.2.9)."""
    assert decode_error(connect_bytes(4, 0x42, s("pw")), None).reason_code == MALFORMED
    (connect,) = decode(connect_bytes(5, 0x42, s("pw")), None)
    assert connect.password == b"pw" and connect.username is None


def test_connect_trailing_bytes_are_malformed():
    assert decode_error(connect_bytes(4, 0x02, b"\x00"), None).reason_code == MALFORMED


def test_connect_truncated_payload_is_malformed():
    """The username flag promises a field the packet does not hold."""
    assert decode_error(connect_bytes(4, 0x82), None).reason_code == MALFORMED


def test_invalid_utf8_client_id_is_malformed():
    """[MQTT-1.5.3-1]."""
    data = frame(0x10, s("MQTT") + b"\x04\x02\x00\x3c" + b"\x00\x02\xc3\x28")
    error = decode_error(data, None)
    assert isinstance(error, InvalidUTF8) and error.reason_code == MALFORMED


def test_connack_reserved_flags_are_malformed():
    """§3.2.2.1: CONNACK acknowledge flags bits 7-1 are reserved; in MQTT 3.1 the whole
    byte is reserved and unused."""
    assert decode_error(b"\x20\x02\x02\x00", 4).reason_code == MALFORMED
    assert decode(b"\x20\x02\xff\x00", 3) == [p.Connack(False, 0)]


def test_connack_unknown_return_code_is_malformed():
    assert decode_error(b"\x20\x02\x00\x06", 4).reason_code == MALFORMED
    assert decode_error(b"\x20\x03\x00\x01\x00", 5).reason_code == MALFORMED


# ----------------------------------------------------------------------------- strings
@pytest.mark.parametrize(
    "raw",
    [
        b"\xff\xfe",  # never valid in UTF-8
        b"\xc0\xaf",  # overlong encoding of '/'
        b"\xed\xa0\x80",  # a surrogate, U+D800 [MQTT-1.5.3-1]
        b"a\x00b",  # U+0000 [MQTT-1.5.3-2]
        b"\xe2\x82",  # truncated sequence
    ],
)
def test_invalid_utf8_topic_is_malformed(raw):
    """[MQTT-1.5.3-1], [MQTT-1.5.3-2] (v5 [MQTT-1.5.4-1], [MQTT-1.5.4-2])."""
    data = frame(0x30, len(raw).to_bytes(2, "big") + raw + b"payload")
    error = decode_error(data)
    assert isinstance(error, InvalidUTF8) and error.reason_code == MALFORMED


def test_bom_in_a_string_is_kept():
    """[MQTT-1.5.3-3]: U+FEFF is never stripped."""
    (packet,) = decode(frame(0x30, s("\ufeffa") + b"x"))
    assert packet.topic == "\ufeffa"


def test_topic_semantics_are_not_judged():
    (packet,) = decode(frame(0x30, s("a/+/#") + b"x"))
    assert packet.topic == "a/+/#"


def test_topic_length_beyond_packet_is_malformed():
    assert decode_error(frame(0x30, b"\x00\x09abc")).reason_code == MALFORMED


# ----------------------------------------------------------------------------- packet ids
@pytest.mark.parametrize(
    "data",
    [
        frame(0x32, s("t") + b"\x00\x00"),  # PUBLISH QoS 1
        frame(0x34, s("t") + b"\x00\x00"),  # PUBLISH QoS 2
        frame(0x82, b"\x00\x00" + s("t") + b"\x00"),  # SUBSCRIBE
        frame(0xA2, b"\x00\x00" + s("t")),  # UNSUBSCRIBE
        b"\x40\x02\x00\x00",  # PUBACK
        b"\x50\x02\x00\x00",  # PUBREC
        b"\x62\x02\x00\x00",  # PUBREL
        b"\x70\x02\x00\x00",  # PUBCOMP
        b"\x90\x03\x00\x00\x00",  # SUBACK
        b"\xb0\x02\x00\x00",  # UNSUBACK
    ],
)
def test_packet_identifier_zero_is_refused(data):
    """[MQTT-2.3.1-1] (v5 [MQTT-2.2.1-3]): packet identifiers are non-zero."""
    assert decode_error(data).reason_code == PROTOCOL_ERROR


def test_qos_0_publish_has_no_packet_identifier():
    (packet,) = decode(frame(0x30, s("t") + b"\x00\x00"))
    assert packet.packet_id is None and packet.payload == b"\x00\x00"


def test_ack_with_trailing_bytes_is_malformed_before_v5():
    assert decode_error(b"\x40\x03\x00\x01\x00", 4).reason_code == MALFORMED


def test_v5_ack_invalid_reason_code_is_malformed():
    """v5 [MQTT-3.4.2-1]: PUBACK carries one of the PUBACK reason codes."""
    assert decode_error(b"\x40\x03\x00\x01\x92", 5).reason_code == MALFORMED
    assert decode_error(b"\x62\x03\x00\x01\x10", 5).reason_code == MALFORMED


# ----------------------------------------------------------------------------- SUBSCRIBE
@pytest.mark.parametrize("version", [4, 5])
def test_subscribe_without_filters_is_protocol_error(version):
    """[MQTT-3.8.3-3] (v5 [MQTT-3.8.3-2])."""
    body = b"\x00\x01" + (b"\x00" if version == 5 else b"")
    assert decode_error(frame(0x82, body), version).reason_code == PROTOCOL_ERROR


@pytest.mark.parametrize("version", [4, 5])
def test_unsubscribe_without_filters_is_protocol_error(version):
    """[MQTT-3.10.3-2] (v5 [MQTT-3.10.3-2])."""
    body = b"\x00\x01" + (b"\x00" if version == 5 else b"")
    assert decode_error(frame(0xA2, body), version).reason_code == PROTOCOL_ERROR


@pytest.mark.parametrize("options", [0x04, 0x40, 0x80, 0x03])
def test_subscribe_reserved_option_bits_or_qos_3_malformed_in_3_1_1(options):
    """[MQTT-3.8.3-4]: upper six bits reserved, QoS 3 invalid."""
    data = frame(0x82, b"\x00\x01" + s("t") + bytes([options]))
    assert decode_error(data, 4).reason_code == MALFORMED


@pytest.mark.parametrize("options", [0x40, 0x80, 0xC1])
def test_subscribe_reserved_option_bits_malformed_in_5(options):
    """v5 [MQTT-3.8.3-5]: reserved bits 6-7 of the subscription options are zero."""
    data = frame(0x82, b"\x00\x01\x00" + s("t") + bytes([options]))
    assert decode_error(data, 5).reason_code == MALFORMED


def test_subscribe_retain_handling_3_is_protocol_error():
    """v5 §3.8.3.1: Retain Handling 3 is a Protocol Error."""
    data = frame(0x82, b"\x00\x01\x00" + s("t") + b"\x30")
    assert decode_error(data, 5).reason_code == PROTOCOL_ERROR


def test_subscribe_qos_3_is_protocol_error_in_5():
    """v5 §3.8.3.1: Maximum QoS 3 is a Protocol Error."""
    data = frame(0x82, b"\x00\x01\x00" + s("t") + b"\x03")
    assert decode_error(data, 5).reason_code == PROTOCOL_ERROR


def test_subscribe_filter_without_options_is_malformed():
    assert decode_error(frame(0x82, b"\x00\x01" + s("t")), 4).reason_code == MALFORMED


def test_suback_invalid_code_is_malformed():
    """[MQTT-3.9.3-2]: 3.1.1 SUBACK return codes are 0, 1, 2 and 0x80."""
    assert decode_error(b"\x90\x03\x00\x01\x03", 4).reason_code == MALFORMED


# ----------------------------------------------------------------------------- properties
def props_publish(props: bytes) -> bytes:
    return frame(0x30, s("t") + bytes([len(props)]) + props + b"payload")


@pytest.mark.parametrize(
    "props",
    [
        b"\x01\x01\x01\x00",  # payload format indicator twice
        b"\x02\x00\x00\x00\x01\x02\x00\x00\x00\x01",  # message expiry twice
        b"\x03" + s("a") + b"\x03" + s("b"),  # content type twice
        b"\x23\x00\x01\x23\x00\x02",  # topic alias twice
    ],
)
def test_duplicate_property_is_protocol_error(props):
    """v5 §2.2.2.2: a single-valued property may appear once."""
    assert decode_error(props_publish(props), 5).reason_code == PROTOCOL_ERROR


@pytest.mark.parametrize(
    "props",
    [
        b"\x11\x00\x00\x00\x01",  # session expiry interval: not in PUBLISH
        b"\x1f" + s("r"),  # reason string: not in PUBLISH
        b"\x05\x00",  # identifier 5 does not exist
        b"\x80\x01\x00",  # no identifier needs two bytes
    ],
)
def test_property_not_allowed_in_packet_is_malformed(props):
    """v5 §2.2.2.2: a property not valid for the packet type makes it malformed."""
    assert decode_error(props_publish(props), 5).reason_code == MALFORMED


def test_will_properties_are_checked_against_the_will_set():
    will = b"\x01\x17\x01" + s("w") + s("x")  # request problem information: CONNECT only
    assert decode_error(connect_bytes(5, 0x06, will), None).reason_code == MALFORMED


@pytest.mark.parametrize(
    ("data", "version"),
    [
        (props_publish(b"\x01\x02"), 5),  # payload format indicator 2
        (props_publish(b"\x0b\x00"), 5),  # subscription identifier 0
        (frame(0x10, s("MQTT") + b"\x05\x02\x00\x3c" + b"\x03\x21\x00\x00" + s("c")), None),  # receive maximum 0
        (frame(0x10, s("MQTT") + b"\x05\x02\x00\x3c" + b"\x05\x27\x00\x00\x00\x00" + s("c")), None),  # max packet size 0
        (frame(0x10, s("MQTT") + b"\x05\x02\x00\x3c" + b"\x02\x17\x02" + s("c")), None),  # request problem info 2
        (frame(0x20, b"\x00\x00\x02\x24\x02"), 5),  # maximum QoS 2
        (frame(0x20, b"\x00\x00\x02\x25\x07"), 5),  # retain available 7
    ],
)
def test_property_value_out_of_range_is_protocol_error(data, version):
    assert decode_error(data, version).reason_code == PROTOCOL_ERROR


def test_topic_alias_zero_is_topic_alias_invalid():
    """[MQTT-3.3.2-8]: a Topic Alias of 0 is not permitted."""
    assert decode_error(props_publish(b"\x23\x00\x00"), 5).reason_code == RC.TOPIC_ALIAS_INVALID


def test_subscription_identifier_twice_in_subscribe_is_protocol_error():
    data = frame(0x82, b"\x00\x01\x04\x0b\x01\x0b\x02" + s("t") + b"\x00")
    assert decode_error(data, 5).reason_code == PROTOCOL_ERROR


def test_property_length_beyond_packet_is_malformed():
    assert decode_error(frame(0x30, s("t") + b"\x09\x01"), 5).reason_code == MALFORMED


def test_property_value_beyond_property_length_is_malformed():
    """A string that runs past the property block (but not past the packet)."""
    data = frame(0x30, s("t") + b"\x02\x03\x00\x05abcde")
    assert decode_error(data, 5).reason_code == MALFORMED


def test_invalid_utf8_user_property_is_malformed():
    data = props_publish(b"\x26\x00\x01\xff\x00\x01a")
    assert isinstance(decode_error(data, 5), InvalidUTF8)


# ----------------------------------------------------------------------------- fuzzing
def _valid_stream(version: int) -> bytes:
    return b"".join(encode(packet, version) for packet in sample_packets(version))


_STREAMS = {version: _valid_stream(version) for version in VERSIONS}


def _feed_all(reader: PacketParser, data: bytes, cuts: list[int]) -> None:
    pos = 0
    for cut in sorted(cuts):
        reader.feed(data[pos:cut])
        pos = cut
    reader.feed(data[pos:])


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.binary(max_size=300),
    version=st.sampled_from([None, 3, 4, 5]),
    cuts=st.lists(st.integers(0, 300), max_size=5),
)
def test_random_bytes_only_raise_codec_errors(data, version, cuts):
    reader = PacketParser(max_packet_size=1 << 16)
    reader.version = version
    try:
        _feed_all(reader, data, cuts)
    except MQTTCodecError:
        pass


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    version=st.sampled_from(VERSIONS),
    edits=st.lists(
        st.tuples(st.sampled_from(["flip", "set", "insert", "delete"]), st.integers(0, 10**6),
                  st.integers(0, 255)),
        min_size=1, max_size=4,
    ),
    cuts=st.lists(st.integers(0, 100_000), max_size=4),
)
def test_mutated_packets_only_raise_codec_errors(version, edits, cuts):
    data = bytearray(_STREAMS[version])
    for action, where, value in edits:
        index = where % len(data)
        if action == "flip":
            data[index] ^= 1 << (value % 8)
        elif action == "set":
            data[index] = value
        elif action == "insert":
            data.insert(index, value)
        elif len(data) > 1:
            del data[index]
    reader = PacketParser()
    reader.version = version
    try:
        _feed_all(reader, bytes(data), [c % (len(data) + 1) for c in cuts])
    except MQTTCodecError:
        pass


_text = st.text(max_size=20).filter(lambda t: "\x00" not in t)


@settings(max_examples=300, deadline=None)
@given(
    topic=_text,
    payload=st.binary(max_size=200),
    qos=st.integers(0, 2),
    retain=st.booleans(),
    dup=st.booleans(),
    packet_id=st.integers(1, 65535),
    content_type=st.none() | _text,
    user_properties=st.lists(st.tuples(_text, _text), max_size=3),
    subscription_identifiers=st.lists(st.integers(1, 268435455), max_size=3),
    version=st.sampled_from(VERSIONS),
)
def test_publish_round_trip_property(
    topic, payload, qos, retain, dup, packet_id, content_type, user_properties,
    subscription_identifiers, version,
):
    props = p.Properties(
        content_type=content_type, user_properties=user_properties,
        subscription_identifiers=subscription_identifiers,
    ) if version == 5 else p.Properties()
    packet = p.Publish(topic, payload, qos, retain, dup, packet_id if qos else None, props)
    data = encode_publish(topic, payload, qos, retain, dup, packet.packet_id, props, version)
    assert data == encode(packet, version)
    assert decode(data, version) == [packet]


# ----------------------------------------------------------------------------- generated packets
_u16 = st.integers(0, 0xFFFF)
_u32 = st.integers(0, 2**32 - 1)
_flag = st.integers(0, 1)
_bin = st.binary(max_size=12)
_PROPERTY_VALUES = {
    "payload_format_indicator": _flag,
    "message_expiry_interval": _u32,
    "content_type": _text,
    "response_topic": _text,
    "correlation_data": _bin,
    "subscription_identifiers": st.lists(st.integers(1, 268435455), min_size=1, max_size=3),
    "session_expiry_interval": _u32,
    "assigned_client_identifier": _text,
    "server_keep_alive": _u16,
    "authentication_method": _text,
    "authentication_data": _bin,
    "request_problem_information": _flag,
    "will_delay_interval": _u32,
    "request_response_information": _flag,
    "response_information": _text,
    "server_reference": _text,
    "reason_string": _text,
    "receive_maximum": st.integers(1, 0xFFFF),
    "topic_alias_maximum": _u16,
    "topic_alias": st.integers(1, 0xFFFF),
    "maximum_qos": _flag,
    "retain_available": _flag,
    "user_properties": st.lists(st.tuples(_text, _text), min_size=1, max_size=3),
    "maximum_packet_size": st.integers(1, 2**32 - 1),
    "wildcard_subscription_available": _flag,
    "subscription_identifier_available": _flag,
    "shared_subscription_available": _flag,
}
# Which properties each packet may carry: MQTT 5.0 §2.2.2.2, table 2-4.
_ALLOWED = {
    "connect": ["session_expiry_interval", "authentication_method", "authentication_data",
                "request_problem_information", "request_response_information", "receive_maximum",
                "topic_alias_maximum", "user_properties", "maximum_packet_size"],
    "will": ["payload_format_indicator", "message_expiry_interval", "content_type",
             "response_topic", "correlation_data", "will_delay_interval", "user_properties"],
    "connack": ["session_expiry_interval", "assigned_client_identifier", "server_keep_alive",
                "authentication_method", "authentication_data", "response_information",
                "server_reference", "reason_string", "receive_maximum", "topic_alias_maximum",
                "maximum_qos", "retain_available", "user_properties", "maximum_packet_size",
                "wildcard_subscription_available", "subscription_identifier_available",
                "shared_subscription_available"],
    "publish": ["payload_format_indicator", "message_expiry_interval", "content_type",
                "response_topic", "correlation_data", "subscription_identifiers", "topic_alias",
                "user_properties"],
    "ack": ["reason_string", "user_properties"],
    "subscribe": ["subscription_identifiers", "user_properties"],
    "unsubscribe": ["user_properties"],
    "disconnect": ["session_expiry_interval", "server_reference", "reason_string",
                   "user_properties"],
    "auth": ["authentication_method", "authentication_data", "reason_string", "user_properties"],
}
# Reason codes each MQTT 5.0 packet may carry (§3.2.2.2, 3.4.2.1, 3.6.2.1, 3.9.3, 3.11.3,
# 3.14.2.1, 3.15.2.1).
_CODES = {
    "connack": [0x00, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x8C,
                0x90, 0x95, 0x97, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F],
    "puback": [0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99],
    "pubrel": [0x00, 0x92],
    "suback": [0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2],
    "unsuback": [0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91],
    "disconnect": [0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E, 0x8F, 0x90,
                   0x93, 0x94, 0x95, 0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9E, 0x9F,
                   0xA0, 0xA1, 0xA2],
    "auth": [0x00, 0x18, 0x19],
}


@st.composite
def packets(draw: st.DrawFn, version: int) -> p.Packet:
    v5 = version == 5

    def props(kind: str) -> p.Properties:
        if not v5:
            return p.Properties()
        names = _ALLOWED[kind]
        if kind == "subscribe":
            values = draw(st.fixed_dictionaries({}, optional={
                "subscription_identifiers": st.lists(st.integers(1, 268435455), min_size=1, max_size=1),
                "user_properties": _PROPERTY_VALUES["user_properties"],
            }))
        else:
            values = draw(st.fixed_dictionaries({}, optional={n: _PROPERTY_VALUES[n] for n in names}))
        return p.Properties(**values)

    def code(kind: str, default: list[int]) -> int:
        return draw(st.sampled_from(_CODES[kind] if v5 else default))

    packet_id = draw(st.integers(1, 0xFFFF))
    kind = draw(st.sampled_from(
        ["connect", "connack", "publish", "puback", "pubrec", "pubrel", "pubcomp", "subscribe",
         "suback", "unsubscribe", "unsuback", "pingreq", "pingresp", "disconnect"]
        + (["auth"] if v5 else [])
    ))
    if kind == "connect":
        will = None
        if draw(st.booleans()):
            will = p.Will(draw(_text), draw(_bin), draw(st.integers(0, 2)), draw(st.booleans()),
                          props("will"))
        username = draw(st.none() | _text)
        password = draw(st.none() | _bin) if (v5 or username is not None) else None
        return p.Connect("MQIsdp" if version == 3 else "MQTT", version, draw(st.booleans()),
                         draw(_u16), draw(_text), will, username, password, props("connect"))
    if kind == "connack":
        return p.Connack(draw(st.booleans()) and version != 3, code("connack", list(range(6))),
                         props("connack"))
    if kind == "publish":
        qos = draw(st.integers(0, 2))
        return p.Publish(draw(_text), draw(st.binary(max_size=50)), qos, draw(st.booleans()),
                         draw(st.booleans()), packet_id if qos else None, props("publish"))
    if kind in ("puback", "pubrec", "pubrel", "pubcomp"):
        cls = {"puback": p.Puback, "pubrec": p.Pubrec, "pubrel": p.Pubrel, "pubcomp": p.Pubcomp}[kind]
        codes = "puback" if kind in ("puback", "pubrec") else "pubrel"
        return cls(packet_id, code(codes, [0]), props("ack"))
    if kind == "subscribe":
        requests = draw(st.lists(
            st.builds(p.SubscriptionRequest, _text, st.integers(0, 2),
                      st.booleans() if v5 else st.just(False),
                      st.booleans() if v5 else st.just(False),
                      st.integers(0, 2) if v5 else st.just(0)),
            min_size=1, max_size=4,
        ))
        return p.Subscribe(packet_id, requests, props("subscribe"))
    if kind == "suback":
        codes = draw(st.lists(st.sampled_from(_CODES["suback"] if v5 else [0, 1, 2, 0x80]), max_size=4))
        return p.Suback(packet_id, codes, props("ack"))
    if kind == "unsubscribe":
        return p.Unsubscribe(packet_id, draw(st.lists(_text, min_size=1, max_size=4)),
                             props("unsubscribe"))
    if kind == "unsuback":
        codes = draw(st.lists(st.sampled_from(_CODES["unsuback"]), max_size=4)) if v5 else []
        return p.Unsuback(packet_id, codes, props("ack"))
    if kind == "pingreq":
        return p.Pingreq()
    if kind == "pingresp":
        return p.Pingresp()
    if kind == "disconnect":
        return p.Disconnect(code("disconnect", [0]), props("disconnect"))
    return p.Auth(code("auth", [0]), props("auth"))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), version=st.sampled_from(VERSIONS))
def test_generated_packets_round_trip(data, version):
    sequence = data.draw(st.lists(packets(version), min_size=1, max_size=5))
    stream = b"".join(encode(packet, version) for packet in sequence)
    assert decode(stream, version) == sequence
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=4)))
    reader = parser(version)
    decoded = []
    for start, stop in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        decoded += reader.feed(stream[start:stop])
    assert decoded == sequence
