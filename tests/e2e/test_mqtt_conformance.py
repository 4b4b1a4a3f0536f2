"""Conformance checks against the OASIS MQTT 3.1.1 and 5.0 normative statements, over real
sockets, for the behaviours an interoperability suite exercises on a default-config broker:
retained messages with properties, wills, zero-length client ids, overlapping subscriptions,
$-topics, session expiry, will delay, shared subscriptions, topic aliases, flow control,
server keep alive, redelivery, authentication methods and DISCONNECT reason codes."""

from __future__ import annotations

import time

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from shardgate.protocols.mqtt import packets as p
from shardgate.protocols.mqtt.codec import encode

from tests.conftest import wait_for
from tests.mqtt_clients import V5, V311, Paho, RawClient, publish_props

VERSIONS = [pytest.param(V311, id="3.1.1"), pytest.param(V5, id="5.0")]


def _subscribe(raw: RawClient, topic_filter: str, qos: int, packet_id: int = 1, **options) -> p.Suback:
    raw.send(p.Subscribe(packet_id, [p.SubscriptionRequest(topic_filter, qos, **options)]))
    suback = raw.receive()
    assert isinstance(suback, p.Suback), suback
    return suback


# ---------------------------------------------------------------- retained messages
def test_retained_messages_keep_qos_and_user_properties_mqtt_3_3_2_17(broker):
    """[MQTT-3.3.1-5] the server stores the retained message; [MQTT-3.3.2-17]/[MQTT-3.3.2-18]
    user properties are forwarded unaltered and in order, also for retained messages."""
    pub = Paho(broker.mqtt_port, "pub")
    props = publish_props(UserProperty=[("a", "2"), ("c", "3")])
    for qos in range(3):
        pub.publish(f"ret/{qos}", f"qos {qos}", qos, retain=True, properties=props)
    sub = Paho(broker.mqtt_port, "late")
    sub.subscribe("ret/+", 2)
    messages = sorted(sub.expect_n(3), key=lambda m: m.topic)
    assert [m.qos for m in messages] == [0, 1, 2]
    assert all(m.retain for m in messages)
    assert all(m.properties.UserProperty == [("a", "2"), ("c", "3")] for m in messages)


def test_retained_message_expires_mqtt_3_3_2_5(broker):
    """[MQTT-3.3.2-5] a retained message whose expiry interval passed is not sent to a new
    subscriber."""
    pub = Paho(broker.mqtt_port, "pub")
    pub.publish("rexp/a", "short", 1, retain=True, properties=publish_props(MessageExpiryInterval=1))
    pub.publish("rexp/b", "long", 1, retain=True, properties=publish_props(MessageExpiryInterval=100))
    time.sleep(1.5)  # the expiry interval itself is under test
    sub = Paho(broker.mqtt_port, "late")
    sub.subscribe("rexp/+", 1)
    message = sub.expect()
    assert message.payload == b"long"
    assert message.properties.MessageExpiryInterval <= 100
    sub.expect_none()


def test_shared_subscription_gets_no_retained_messages_mqtt_3_8_4(broker):
    """[MQTT-3.8.4] retained messages are not sent when a session subscribes to a shared
    subscription."""
    pub = Paho(broker.mqtt_port, "pub")
    pub.publish("sret/a", "kept", 1, retain=True)
    sub = Paho(broker.mqtt_port, "member")
    sub.subscribe("$share/g/sret/+", 1)
    pub.publish("sret/a", "live", 1)
    assert sub.expect().payload == b"live"
    sub.expect_none()


# ---------------------------------------------------------------- will
def test_will_carries_its_properties_mqtt_3_1_3_10(broker):
    """[MQTT-3.1.3-10] the server keeps the order of the will's user properties; the will's
    content type and payload format go with it (§3.1.3.2)."""
    watcher = Paho(broker.mqtt_port, "watcher")
    watcher.subscribe("wp/#", 2)
    will_props = Properties(PacketTypes.WILLMESSAGE)
    will_props.UserProperty = [("a", "2"), ("c", "3")]
    will_props.ContentType = "text/plain"
    will_props.PayloadFormatIndicator = 1
    client = Paho(broker.mqtt_port, "dying", will={"topic": "wp/x", "payload": "gone", "qos": 2,
                                                    "properties": will_props})
    client.drop()
    message = watcher.expect()
    assert (message.topic, message.payload, message.qos) == ("wp/x", b"gone", 2)
    assert message.properties.UserProperty == [("a", "2"), ("c", "3")]
    assert message.properties.ContentType == "text/plain"
    assert message.properties.PayloadFormatIndicator == 1


@pytest.mark.parametrize("version", VERSIONS)
def test_retained_will_mqtt_3_1_2_17(broker, version):
    """[MQTT-3.1.2-17] a will with Will Retain 1 is published as a retained message."""
    client = Paho(broker.mqtt_port, "rw", version, will={"topic": "rwill/x", "payload": "dead", "qos": 1,
                                                        "retain": True})
    client.drop()
    wait_for(lambda: broker.call(lambda: "rw" not in {c.client_id for c in broker.app.mqtt.connections}))
    late = Paho(broker.mqtt_port, "late", version)

    def retained_will() -> bool:
        late.subscribe("rwill/x", 1)
        try:
            message = late.expect(timeout=0.5)
        except Exception:
            return False
        return message.payload == b"dead" and message.retain

    wait_for(retained_will)


def test_will_delay_shortened_by_session_expiry_mqtt_3_1_3_9(broker):
    """[MQTT-3.1.3-9] the will is published when the will delay elapses or the session ends,
    whichever is first: with session expiry 0 at once, with expiry 1 after about 1 s."""
    watcher = Paho(broker.mqtt_port, "watcher")
    watcher.subscribe("wd/#", 1)
    will_props = Properties(PacketTypes.WILLMESSAGE)
    will_props.WillDelayInterval = 30
    at_once = Paho(broker.mqtt_port, "wd0", session_expiry=0,
                   will={"topic": "wd/0", "payload": "now", "qos": 1, "properties": will_props})
    started = time.monotonic()
    at_once.drop()
    assert watcher.expect(timeout=15).payload == b"now"
    assert time.monotonic() - started < 15  # at once, not after the 30 s will delay
    soon = Paho(broker.mqtt_port, "wd1", session_expiry=1,
                will={"topic": "wd/1", "payload": "soon", "qos": 1, "properties": will_props})
    started = time.monotonic()
    soon.drop()
    assert watcher.expect(timeout=15).payload == b"soon"
    assert 0.8 <= time.monotonic() - started < 15  # the session's end, not the will delay


# ---------------------------------------------------------------- client identifiers
def test_v5_empty_client_id_accepted_without_clean_start_mqtt_3_1_3_6(broker):
    """[MQTT-3.1.3-6]/[MQTT-3.2.2-16] on 5.0 a zero-length client id is accepted with Clean
    Start 0 too, and the CONNACK carries the Assigned Client Identifier."""
    raw = RawClient(broker.mqtt_port, 5)
    connack = raw.connect("", clean=False)
    assert connack.reason_code == 0
    assert connack.properties.assigned_client_identifier
    assert not connack.session_present


# ---------------------------------------------------------------- subscriptions
@pytest.mark.parametrize("version", VERSIONS)
def test_overlapping_subscriptions_deliver_once_at_highest_qos_mqtt_3_3_4_2(broker, version):
    """[MQTT-3.3.4-2] (3.1.1: [MQTT-3.3.5-1]) with overlapping subscriptions the server
    delivers the message respecting the maximum QoS of all matching subscriptions."""
    client = Paho(broker.mqtt_port, "overlap", version)
    client.subscribe([("ov/#", 2), ("ov/+", 1)])
    client.publish("ov/c", "overlapping topic filters", 2)
    message = client.expect()
    assert message.qos == 2
    client.expect_none()


@pytest.mark.parametrize("version", VERSIONS)
def test_wildcards_never_match_dollar_topics_mqtt_4_7_2_1(broker, version):
    """[MQTT-4.7.2-1] filters starting with a wildcard do not match topics starting with $;
    an explicit $-filter does."""
    wild = Paho(broker.mqtt_port, "wild", version)
    wild.subscribe([("+/+", 1), ("#", 1)])
    explicit = Paho(broker.mqtt_port, "explicit", version)
    explicit.subscribe("$dollar/+", 1)
    pub = Paho(broker.mqtt_port, "pub", version)
    pub.publish("$dollar/b", "hidden", 1)
    assert explicit.expect().topic == "$dollar/b"
    pub.publish("plain/b", "seen", 1)
    message = wild.expect()
    assert message.topic == "plain/b"
    wild.expect_none()


@pytest.mark.parametrize("version", VERSIONS)
def test_resubscribe_replaces_subscription_mqtt_3_8_4_3(broker, version):
    """[MQTT-3.8.4-3] a SUBSCRIBE with an existing filter replaces the subscription (new QoS)
    and re-sends matching retained messages; no message is lost or duplicated."""
    pub = Paho(broker.mqtt_port, "pub", version)
    pub.publish("rs/a", "retained", 1, retain=True)
    sub = Paho(broker.mqtt_port, "sub", version)
    sub.subscribe("rs/+", 0)
    assert sub.expect().qos == 0
    sub.subscribe("rs/+", 2)
    again = sub.expect()
    assert (again.payload, again.retain, again.qos) == (b"retained", True, 1)
    pub.publish("rs/b", "live", 2)
    live = sub.expect()
    assert (live.payload, live.qos) == (b"live", 2)
    sub.expect_none()


def test_unsubscribe_unknown_filter_reports_no_subscription_mqtt_3_11_3(broker):
    """§3.11.3: UNSUBACK has one reason code per filter, 0x11 when no subscription existed."""
    raw = RawClient(broker.mqtt_port, 5)
    raw.connect("unsub")
    _subscribe(raw, "us/a", 1)
    raw.send(p.Unsubscribe(2, ["us/a", "us/none"]))
    unsuback = raw.receive()
    assert isinstance(unsuback, p.Unsuback) and unsuback.packet_id == 2
    assert unsuback.reason_codes == [0x00, 0x11]


def test_shared_and_plain_subscriptions_together_mqtt_4_8_2(broker):
    """§4.8.2: each message goes to one member of a shared subscription, while a plain
    subscription of the same sessions still gets its own copy."""
    a = Paho(broker.mqtt_port, "a")
    b = Paho(broker.mqtt_port, "b")
    for client in (a, b):
        client.client.subscribe([("$share/sharename/sp/x", mqtt.SubscribeOptions(qos=2)),
                                 ("sp/plain", mqtt.SubscribeOptions(qos=2))])
    wait_for(lambda: broker.call(lambda: broker.app.broker.subscription_count) >= 3)
    b.publish("sp/plain", "to both", 0)
    assert a.expect().payload == b"to both"
    assert b.expect().payload == b"to both"
    b.publish("sp/x", "to one", 0)
    b.publish("sp/plain", "after", 0)  # same shard, same publisher: delivered after "to one"
    got = []
    for client in (a, b):
        while (message := client.expect()).payload != b"after":
            got.append(message)
    assert [m.payload for m in got] == [b"to one"]


def test_subscription_identifiers_per_client_mqtt_3_3_4_3(broker):
    """[MQTT-3.3.4-3]/[MQTT-3.3.4-4]/[MQTT-3.3.4-5]: each client gets the identifiers of its
    own matching subscriptions only; a large identifier (variable byte integer) survives."""
    a = Paho(broker.mqtt_port, "a")
    props = Properties(PacketTypes.SUBSCRIBE)
    props.SubscriptionIdentifier = 456789
    a.subscribe("si/t", options=mqtt.SubscribeOptions(qos=2), properties=props)
    b = Paho(broker.mqtt_port, "b")
    props2 = Properties(PacketTypes.SUBSCRIBE)
    props2.SubscriptionIdentifier = 2
    b.subscribe("si/t", options=mqtt.SubscribeOptions(qos=2), properties=props2)
    props3 = Properties(PacketTypes.SUBSCRIBE)
    props3.SubscriptionIdentifier = 3
    b.subscribe("si/t/#", options=mqtt.SubscribeOptions(qos=2), properties=props3)
    b.publish("si/t", "sub identifier test", 1)
    assert a.expect().properties.SubscriptionIdentifier == [456789]
    assert sorted(b.expect().properties.SubscriptionIdentifier) == [2, 3]
    a.expect_none()
    b.expect_none()


# ---------------------------------------------------------------- sessions
def test_session_expiry_zero_and_disconnect_override_mqtt_3_1_2_23(broker):
    """[MQTT-3.1.2-23] the session lasts Session Expiry Interval after the connection ends;
    absent or 0 it ends with the connection; the DISCONNECT may set a new interval (§3.14.2.2.2)
    and 0 there ends the session at once."""
    def connect(expiry: int | None, clean: bool) -> bool:
        client = Paho(broker.mqtt_port, "exp", clean=clean, session_expiry=expiry, connect=False)
        flags, rc, _ = client.connect()
        assert rc == 0
        connect.client = client  # type: ignore[attr-defined]
        return bool(flags.session_present)

    def disconnect(expiry: int | None = None) -> None:
        props = None
        if expiry is not None:
            props = Properties(PacketTypes.DISCONNECT)
            props.SessionExpiryInterval = expiry
        connect.client.disconnect(properties=props)  # type: ignore[attr-defined]

    assert not connect(0, True)
    connect.client.subscribe("se", 1)  # type: ignore[attr-defined]
    disconnect()
    assert not connect(0, False)  # ended with the connection
    disconnect()
    assert not connect(1, True)
    connect.client.subscribe("se", 1)  # type: ignore[attr-defined]
    disconnect(60)  # longer than the 1 s of CONNECT
    time.sleep(1.5)  # the interval itself is under test
    assert connect(1, False)
    disconnect(0)
    assert not connect(1, False)  # ended at once
    disconnect()


def test_disconnect_cannot_set_expiry_after_zero_mqtt_3_14_2_2(broker):
    """§3.14.2.2.2: a non-zero Session Expiry Interval on DISCONNECT after 0 on CONNECT is a
    protocol error: the server answers with DISCONNECT 0x82."""
    raw = RawClient(broker.mqtt_port, 5)
    raw.connect("zero-then")
    raw.send(p.Disconnect(0, p.Properties(session_expiry_interval=30)))
    packets = raw.receive_until_closed()
    assert isinstance(packets[-1], p.Disconnect) and packets[-1].reason_code == 0x82


@pytest.mark.parametrize("version", [4, 5])
def test_qos2_pubrel_resent_on_reconnect_mqtt_4_4_0_1(broker, version):
    """[MQTT-4.4.0-1] on a resumed session the server resends unacknowledged PUBLISH (DUP=1)
    and PUBREL packets; [MQTT-4.3.3] QoS 2 completes exactly once."""
    props = p.Properties(session_expiry_interval=300) if version == 5 else None
    raw = RawClient(broker.mqtt_port, version)
    raw.connect("redeliver", clean=False, properties=props)
    _subscribe(raw, "rd/#", 2)
    pub = Paho(broker.mqtt_port, "pub")
    pub.publish("rd/1", "one", 1)
    pub.publish("rd/2", "two", 2)
    first = {raw.receive().topic: None for _ in range(2)}
    assert set(first) == {"rd/1", "rd/2"}
    raw.close()  # neither acknowledged
    back = RawClient(broker.mqtt_port, version)
    assert back.connect("redeliver", clean=False, properties=props).session_present
    resent = {}
    for _ in range(2):
        packet = back.receive()
        assert isinstance(packet, p.Publish) and packet.dup
        resent[packet.topic] = packet
    back.send(p.Puback(resent["rd/1"].packet_id))
    back.send(p.Pubrec(resent["rd/2"].packet_id))
    pubrel = back.receive()
    assert isinstance(pubrel, p.Pubrel) and pubrel.packet_id == resent["rd/2"].packet_id
    back.close()  # PUBREL not completed
    last = RawClient(broker.mqtt_port, version)
    assert last.connect("redeliver", clean=False, properties=props).session_present
    again = last.receive()
    assert isinstance(again, p.Pubrel) and again.packet_id == pubrel.packet_id
    last.send(p.Pubcomp(again.packet_id))
    pub.publish("rd/3", "three", 1)
    after = last.receive()
    assert after.topic == "rd/3" and not after.dup


# ---------------------------------------------------------------- topic aliases
def test_topic_aliases_end_with_the_connection_mqtt_3_3_2_7(broker):
    """[MQTT-3.3.2-7] topic alias mappings exist only for one network connection; alias 0 is a
    protocol error answered with DISCONNECT 0x94 Topic Alias invalid [MQTT-3.3.2-8]."""
    raw = RawClient(broker.mqtt_port, 5)
    raw.connect("alias", clean=False, properties=p.Properties(session_expiry_interval=60))
    raw.send(p.Publish("al/t", b"1", 1, packet_id=1, properties=p.Properties(topic_alias=1)))
    assert isinstance(raw.receive(), p.Puback)
    raw.send(p.Disconnect())
    assert raw.receive_until_closed() == []
    back = RawClient(broker.mqtt_port, 5)
    back.connect("alias", clean=False, properties=p.Properties(session_expiry_interval=60))
    back.send(p.Publish("", b"2", 1, packet_id=2, properties=p.Properties(topic_alias=1)))
    packets = back.receive_until_closed()
    assert isinstance(packets[-1], p.Disconnect) and packets[-1].reason_code in (0x82, 0x94)
    zero = RawClient(broker.mqtt_port, 5)
    zero.connect("alias0")
    zero.send(p.Publish("al/t", b"0", 1, packet_id=1, properties=p.Properties(topic_alias=0)))
    packets = zero.receive_until_closed()
    assert isinstance(packets[-1], p.Disconnect) and packets[-1].reason_code == 0x94


def test_no_topic_alias_to_client_without_maximum_mqtt_3_2_2_17(broker):
    """[MQTT-3.1.2-27]: without a Topic Alias Maximum (0) the server sends no topic alias."""
    sub = Paho(broker.mqtt_port, "noalias")
    sub.subscribe("na/t", 2)
    for qos in range(3):
        sub.publish("na/t", "x", qos)
    for message in sub.expect_n(3):
        assert message.topic == "na/t"
        assert not hasattr(message.properties, "TopicAlias")


# ---------------------------------------------------------------- payload format, expiry
def test_invalid_utf8_with_payload_format_1_refused_mqtt_3_3_2_4(broker):
    """§3.3.2.3.2: a receiver that validates may answer PUBACK 0x99 Payload format invalid;
    the message is not delivered."""
    sub = Paho(broker.mqtt_port, "sub")
    sub.subscribe("pf", 1)
    raw = RawClient(broker.mqtt_port, 5)
    raw.connect("pf")
    raw.send(p.Publish("pf", b"\xff\xfe", 1, packet_id=1, properties=p.Properties(payload_format_indicator=1)))
    ack = raw.receive()
    assert isinstance(ack, p.Puback) and ack.reason_code == 0x99
    raw.send(p.Publish("pf", "ünïcode".encode(), 1, packet_id=2,
                       properties=p.Properties(payload_format_indicator=1, content_type="My name")))
    assert raw.receive().reason_code == 0
    message = sub.expect()
    assert message.payload == "ünïcode".encode()
    assert message.properties.PayloadFormatIndicator == 1 and message.properties.ContentType == "My name"


def test_queued_messages_expire_at_qos2_too_mqtt_3_3_2_5(broker):
    """[MQTT-3.3.2-5]/[MQTT-3.3.2-6] expired messages are not delivered to a returning session,
    the others carry their remaining lifetime, at QoS 1 and QoS 2."""
    sub = Paho(broker.mqtt_port, "exp2", clean=False, session_expiry=300)
    sub.subscribe("ex2", 2)
    props = Properties(PacketTypes.DISCONNECT)
    props.SessionExpiryInterval = 999999999
    sub.disconnect(properties=props)
    pub = Paho(broker.mqtt_port, "pub")
    for qos in (1, 2):
        pub.publish("ex2", f"expire {qos}", qos, properties=publish_props(MessageExpiryInterval=1))
    for qos in (1, 2):
        pub.publish("ex2", f"keep {qos}", qos, properties=publish_props(MessageExpiryInterval=6))
    time.sleep(2)  # the expiry interval itself is under test
    back = Paho(broker.mqtt_port, "exp2", clean=False)
    messages = back.expect_n(2)
    assert sorted(m.payload for m in messages) == [b"keep 1", b"keep 2"]
    assert all(m.properties.MessageExpiryInterval < 6 for m in messages)
    back.expect_none()


# ---------------------------------------------------------------- flow control and limits
def test_inbound_receive_maximum_counts_unreleased_qos2_mqtt_3_3_4_9(broker):
    """[MQTT-3.3.4-9]: a client with Receive Maximum unacknowledged QoS 2 messages (no PUBREL
    yet) that sends one more gets DISCONNECT 0x93 Receive Maximum exceeded."""
    raw = RawClient(broker.mqtt_port, 5)
    connack = raw.connect("flood")
    maximum = connack.properties.receive_maximum or 65535
    for packet_id in range(1, maximum + 1):
        raw.send(p.Publish("flood", b"m", 2, packet_id=packet_id))
        assert isinstance(raw.receive(), p.Pubrec)  # accepted, not yet released
    raw.send(p.Publish("flood", b"m", 2, packet_id=maximum + 1))
    packets = raw.receive_until_closed()
    assert isinstance(packets[-1], p.Disconnect) and packets[-1].reason_code == 0x93


def test_inbound_receive_maximum_burst_mqtt_3_3_4_9(broker):
    """[MQTT-3.3.4-9] the same when the publishes arrive in one burst."""
    raw = RawClient(broker.mqtt_port, 5)
    maximum = raw.connect("burst").properties.receive_maximum or 65535
    raw.send(b"".join(encode(p.Publish("burst", b"m", 2, packet_id=i), 5) for i in range(1, maximum + 2)))
    packets = raw.receive_until_closed()
    assert isinstance(packets[-1], p.Disconnect) and packets[-1].reason_code == 0x93


def test_receive_maximum_is_per_connection_qos2_released_frees_quota(broker):
    """§4.9: the quota comes back with each PUBCOMP the server sends; completed QoS 2
    exchanges never count against Receive Maximum."""
    raw = RawClient(broker.mqtt_port, 5)
    connack = raw.connect("steady")
    maximum = connack.properties.receive_maximum or 65535
    for index in range(maximum + 5):
        packet_id = index % 65535 + 1
        raw.send(p.Publish("steady", b"m", 2, packet_id=packet_id))
        assert isinstance(raw.receive(), p.Pubrec)
        raw.send(p.Pubrel(packet_id))
        assert isinstance(raw.receive(), p.Pubcomp)


def test_client_receive_maximum_qos2_window_mqtt_4_9_0_2(broker):
    """[MQTT-3.3.4-7]/§4.9: the server sends at most Receive Maximum unacknowledged QoS 1/2
    publishes; the window opens on PUBACK."""
    raw = RawClient(broker.mqtt_port, 5)
    raw.connect("rm2", properties=p.Properties(receive_maximum=2))
    _subscribe(raw, "rm/t", 1)
    for index in range(3):
        raw.send(p.Publish("rm/t", f"message {index}".encode(), 1, packet_id=100 + index))
    publishes, acks = [], 0
    while len(publishes) < 2 or acks < 3:
        packet = raw.receive()
        if isinstance(packet, p.Puback):
            acks += 1
        else:
            publishes.append(packet)
    assert len(publishes) == 2
    with pytest.raises(AssertionError):
        raw.receive(timeout=0.5)
    raw.send(p.Puback(publishes[0].packet_id))
    assert raw.receive().payload == b"message 2"


def test_client_maximum_packet_size_at_qos0_and_qos1_mqtt_3_1_2_24(broker):
    """[MQTT-3.1.2-24]/[MQTT-3.1.2-25] the server never sends a packet larger than the client's
    Maximum Packet Size; it discards such a message (and keeps the connection)."""
    sub = Paho(broker.mqtt_port, "mps", connect_properties={"MaximumPacketSize": 64})
    sub.subscribe("mps/t", 2)
    sub.publish("mps/t", b"." * 32, 0)
    assert sub.expect().payload == b"." * 32
    sub.publish("mps/t", b"." * 64, 1)
    sub.publish("mps/t", b"small", 1)
    assert sub.expect().payload == b"small"


def test_server_keep_alive_mqtt_3_2_2_21(broker):
    """[MQTT-3.2.2-21]/[MQTT-3.2.2-22] when the server imposes a keep alive it says so with
    Server Keep Alive, and then applies that value."""
    client = Paho(broker.mqtt_port, "ka", keepalive=120, connect=False)
    _, rc, props = client.connect()
    assert rc == 0
    if hasattr(props, "ServerKeepAlive"):
        assert 0 < props.ServerKeepAlive <= 120
        value = props.ServerKeepAlive
    else:
        value = 120
    connection = broker.call(lambda: next(c for c in broker.app.mqtt.connections if c.client_id == "ka"))
    assert connection.keep_alive == value


def test_v311_keep_alive_never_overridden_mqtt_3_1_2_24(broker_factory):
    """3.1.1 §3.1.2.10 has no Server Keep Alive: a 3.1.1 client's keep alive (0 = off) is
    applied as sent, even when the server caps keep alive for 5.0 clients."""
    broker = broker_factory(mqtt={"max_keepalive": 30})
    raw = RawClient(broker.mqtt_port, 4)
    assert raw.connect("old", keep_alive=0).reason_code == 0
    connection = broker.call(lambda: next(c for c in broker.app.mqtt.connections if c.client_id == "old"))
    assert connection.keep_alive == 0
    v5 = RawClient(broker.mqtt_port, 5)
    connack = v5.connect("new", keep_alive=120)
    assert connack.properties.server_keep_alive == 30


# ---------------------------------------------------------------- AUTH and DISCONNECT
def test_unsupported_authentication_method_mqtt_4_12_0_1(broker):
    """[MQTT-4.12.0-1]: an Authentication Method the server does not support gets CONNACK
    0x8C Bad authentication method and the connection closes."""
    raw = RawClient(broker.mqtt_port, 5)
    raw.send(p.Connect("MQTT", 5, True, 60, "authy", properties=p.Properties(authentication_method="SCRAM-X")))
    packets = raw.receive_until_closed()
    assert len(packets) == 1 and isinstance(packets[0], p.Connack)
    assert packets[0].reason_code == 0x8C


def test_auth_packet_without_method_is_protocol_error_mqtt_4_12_0_2(broker):
    """§4.12: AUTH from a client that did not start enhanced authentication is a protocol
    error: DISCONNECT 0x82."""
    raw = RawClient(broker.mqtt_port, 5)
    raw.connect("noauth")
    raw.send(p.Auth(0x19, p.Properties(authentication_method="SCRAM-X")))
    packets = raw.receive_until_closed()
    assert isinstance(packets[-1], p.Disconnect) and packets[-1].reason_code == 0x82


def test_client_disconnect_with_reason_code_is_normal_mqtt_3_14_4(broker):
    """§3.14.4: after a client's DISCONNECT (any reason code but 0x04) no will is published
    [MQTT-3.14.4-3]; the server sends nothing back [MQTT-3.14.0-1]."""
    watcher = Paho(broker.mqtt_port, "watcher")
    watcher.subscribe("dr/#", 1)
    raw = RawClient(broker.mqtt_port, 5)
    raw.connect("leaving", will=p.Will("dr/will", b"no", 1, False, p.Properties()))
    raw.send(p.Disconnect(0x80))
    assert raw.receive_until_closed() == []
    watcher.publish("dr/marker", "m", 1)
    assert watcher.expect().topic == "dr/marker"
    watcher.expect_none()


@pytest.mark.parametrize("version", [4, 5])
def test_takeover_resumes_only_a_session_that_outlives_its_connection_mqtt_3_1_4_3(broker, version):
    """[MQTT-3.1.4-3] a second connection with the same client id takes the session over;
    with Clean Start 0 it resumes the session [MQTT-3.1.2-4]/[MQTT-3.2.2-2] if that session
    outlives its connection (3.1.1 clean session 0, 5.0 expiry > 0); a session bound to the
    old connection (clean session 1 / expiry 0) ended with it: session present 0, and the new
    session works."""
    persistent = p.Properties(session_expiry_interval=60) if version == 5 else None
    pub = Paho(broker.mqtt_port, "pub")
    first = RawClient(broker.mqtt_port, version)
    first.connect("owner", clean=False, properties=persistent)
    _subscribe(first, "to/kept", 1)
    second = RawClient(broker.mqtt_port, version)
    assert second.connect("owner", clean=False, properties=persistent).session_present
    pub.publish("to/kept", "resumed", 1)
    assert second.receive().payload == b"resumed"

    transient = RawClient(broker.mqtt_port, version)
    transient.connect("passing", clean=True)
    _subscribe(transient, "to/gone", 1)
    newcomer = RawClient(broker.mqtt_port, version)
    assert not newcomer.connect("passing", clean=False, properties=persistent).session_present
    _subscribe(newcomer, "to/new", 1)
    pub.publish("to/gone", "old subscription", 1)
    pub.publish("to/new", "new subscription", 1)
    assert newcomer.receive().payload == b"new subscription"


def test_client_publish_with_subscription_identifier_is_protocol_error_mqtt_3_3_4_6(broker):
    """[MQTT-3.3.4-6] a PUBLISH from a client must not carry a Subscription Identifier: the
    server ends the connection with DISCONNECT 0x82 and delivers nothing."""
    sub = Paho(broker.mqtt_port, "sub")
    sub.subscribe("sid/#", 1)
    raw = RawClient(broker.mqtt_port, 5)
    raw.connect("sid")
    raw.send(p.Publish("sid/x", b"bad", 1, packet_id=1, properties=p.Properties(subscription_identifiers=[3])))
    packets = raw.receive_until_closed()
    assert isinstance(packets[-1], p.Disconnect) and packets[-1].reason_code == 0x82
    sub.publish("sid/marker", "m", 1)
    assert sub.expect().topic == "sid/marker"
    sub.expect_none()


def test_topic_alias_not_used_before_client_got_it_mqtt_3_3_2_10(broker):
    """A topic alias mapping exists once the client received the PUBLISH that set it
    ([MQTT-3.3.2-10]/§3.3.2.3.4): a message dropped for the client's Maximum Packet Size
    [MQTT-3.1.2-25] sets no alias, so the next one still carries the topic name."""
    raw = RawClient(broker.mqtt_port, 5)
    raw.connect("alias-mps", properties=p.Properties(topic_alias_maximum=5, maximum_packet_size=64))
    _subscribe(raw, "am/#", 1)
    pub = Paho(broker.mqtt_port, "pub")
    pub.publish("am/t", b"x" * 100, 1)  # too large for the client
    pub.publish("am/t", b"small", 1)
    first = raw.receive()
    assert (first.topic, first.payload) == ("am/t", b"small")
    assert first.properties.topic_alias is not None
    raw.send(p.Puback(first.packet_id))
    pub.publish("am/t", b"again", 1)
    second = raw.receive()
    assert (second.topic, second.properties.topic_alias) == ("", first.properties.topic_alias)


def test_will_of_taken_over_connection_mqtt_3_1_3_9(broker):
    """§3.1.2.5/[MQTT-3.1.4-3]: when a connection is taken over the old connection's will is
    published, unless the new connection resumes the session (Clean Start 0) and the will
    has a delay."""
    watcher = Paho(broker.mqtt_port, "watcher")
    watcher.subscribe("tow/#", 1)
    will = p.Will("tow/clean", b"bye", 1, False, p.Properties(will_delay_interval=30))
    old = RawClient(broker.mqtt_port, 5)
    old.connect("tow", properties=p.Properties(session_expiry_interval=60), will=will)
    new = RawClient(broker.mqtt_port, 5)
    new.connect("tow", clean=True)
    assert watcher.expect().payload == b"bye"

    will = p.Will("tow/resumed", b"not sent", 1, False, p.Properties(will_delay_interval=30))
    old = RawClient(broker.mqtt_port, 5)
    old.connect("tow2", properties=p.Properties(session_expiry_interval=60), will=will)
    new = RawClient(broker.mqtt_port, 5)
    assert new.connect("tow2", clean=False, properties=p.Properties(session_expiry_interval=60)).session_present
    watcher.publish("tow/marker", "m", 1)
    assert watcher.expect().topic == "tow/marker"
    watcher.expect_none()


@pytest.mark.parametrize("version", VERSIONS)
def test_non_retained_publish_keeps_retained_message_mqtt_3_3_1_8(broker, version):
    """[MQTT-3.3.1-8] (3.1.1: [MQTT-3.3.1-12]) a PUBLISH with RETAIN 0 neither stores nor
    replaces nor removes the retained message of its topic."""
    pub = Paho(broker.mqtt_port, "pub", version)
    pub.publish("keep/t", "retained", 1, retain=True)
    pub.publish("keep/t", "not retained", 1)
    pub.publish("keep/t", b"", 1)
    late = Paho(broker.mqtt_port, "late", version)
    late.subscribe("keep/t", 1)
    message = late.expect()
    assert (message.payload, message.retain) == (b"retained", True)
    late.expect_none()


def test_shared_qos2_completed_to_the_same_member_mqtt_4_8_2_4(broker):
    """[MQTT-4.8.2-4]/[MQTT-4.8.2-5] a QoS 2 message of a shared subscription whose delivery
    broke off is completed to the same member when it reconnects, not sent to another."""
    persistent = p.Properties(session_expiry_interval=60)
    a = RawClient(broker.mqtt_port, 5)
    a.connect("member-a", properties=persistent)
    _subscribe(a, "$share/g/sq", 2)
    b = Paho(broker.mqtt_port, "member-b")
    b.subscribe("$share/g/sq", 2)
    pub = Paho(broker.mqtt_port, "pub")
    pub.publish("sq", "0", 2)
    pub.publish("sq", "1", 2)
    first = a.receive()
    other = b.expect()
    assert {first.payload, other.payload} == {b"0", b"1"}
    a.close()  # no PUBREC
    back = RawClient(broker.mqtt_port, 5)
    assert back.connect("member-a", clean=False, properties=persistent).session_present
    again = back.receive()
    assert (again.payload, again.dup, again.packet_id) == (first.payload, True, first.packet_id)
    b.expect_none()


@pytest.mark.parametrize("version", [4, 5])
def test_will_published_when_server_closes_for_protocol_error_mqtt_3_1_2_8(broker, version):
    """[MQTT-3.1.2-8] the will is published when the server closes the connection because of
    a protocol error (here a wildcard in a PUBLISH topic, [MQTT-3.3.2-2])."""
    watcher = Paho(broker.mqtt_port, "watcher")
    watcher.subscribe("pe/#", 1)
    raw = RawClient(broker.mqtt_port, version)
    raw.connect("offender", will=p.Will("pe/will", b"closed by server", 1, False, p.Properties()))
    raw.send(p.Publish("pe/+", b"x", 0))
    raw.receive_until_closed()
    assert watcher.expect().payload == b"closed by server"


def test_inflight_message_resent_even_after_expiry_mqtt_4_4_0_1(broker):
    """[MQTT-4.4.0-1] unacknowledged PUBLISH packets are resent on a resumed session; message
    expiry removes only messages whose onward delivery has not started [MQTT-3.3.2-5]."""
    persistent = p.Properties(session_expiry_interval=60)
    raw = RawClient(broker.mqtt_port, 5)
    raw.connect("slow-acker", properties=persistent)
    _subscribe(raw, "ie", 1)
    pub = Paho(broker.mqtt_port, "pub")
    pub.publish("ie", "short-lived", 1, properties=publish_props(MessageExpiryInterval=1))
    first = raw.receive()
    assert first.payload == b"short-lived"
    raw.close()
    time.sleep(1.5)  # the expiry interval itself is under test
    back = RawClient(broker.mqtt_port, 5)
    assert back.connect("slow-acker", clean=False, properties=persistent).session_present
    again = back.receive()
    assert (again.payload, again.dup, again.packet_id) == (b"short-lived", True, first.packet_id)
