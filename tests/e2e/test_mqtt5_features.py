"""MQTT 5.0 features end to end: properties, aliases, expiry, flow control, subscription
options and shared subscriptions."""

from __future__ import annotations

import time

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from shardgate.protocols.mqtt import packets as p

from tests.conftest import wait_for
from tests.mqtt_clients import Paho, RawClient, publish_props


def test_properties_carried_to_subscriber(broker):
    sub = Paho(broker.mqtt_port, "sub")
    sub.subscribe("req", 1)
    pub = Paho(broker.mqtt_port, "pub")
    props = publish_props(
        UserProperty=[("a", "1"), ("b", "2"), ("a", "3")], ContentType="application/json",
        ResponseTopic="reply/here", CorrelationData=b"\x00\x01", PayloadFormatIndicator=1,
    )
    pub.publish("req", '{"x":1}', 1, properties=props)
    message = sub.expect()
    got = message.properties
    assert got.UserProperty == [("a", "1"), ("b", "2"), ("a", "3")]
    assert got.ContentType == "application/json"
    assert got.ResponseTopic == "reply/here"
    assert got.CorrelationData == b"\x00\x01"
    assert got.PayloadFormatIndicator == 1


def test_subscription_identifiers(broker):
    sub = Paho(broker.mqtt_port, "sub")
    props = Properties(PacketTypes.SUBSCRIBE)
    props.SubscriptionIdentifier = 42
    sub.client.subscribe("ids/#", options=mqtt.SubscribeOptions(qos=1), properties=props)
    props2 = Properties(PacketTypes.SUBSCRIBE)
    props2.SubscriptionIdentifier = 7
    sub.subscribe("ids/+", options=mqtt.SubscribeOptions(qos=1), properties=props2)
    pub = Paho(broker.mqtt_port, "pub")
    pub.publish("ids/x", "both", 1)
    message = sub.expect()
    assert sorted(message.properties.SubscriptionIdentifier) == [7, 42]
    sub.expect_none()  # one message for overlapping subscriptions


def test_no_local(broker):
    client = Paho(broker.mqtt_port, "self")
    client.subscribe("echo", options=mqtt.SubscribeOptions(qos=1, noLocal=True))
    client.subscribe("echo2", options=mqtt.SubscribeOptions(qos=1))
    client.publish("echo", "not to me", 1)
    client.publish("echo2", "to me", 1)
    assert client.expect().topic == "echo2"
    client.expect_none()


def test_retain_as_published(broker):
    pub = Paho(broker.mqtt_port, "pub")
    rap = Paho(broker.mqtt_port, "rap")
    rap.subscribe("r", options=mqtt.SubscribeOptions(qos=1, retainAsPublished=True))
    plain = Paho(broker.mqtt_port, "plain")
    plain.subscribe("r", options=mqtt.SubscribeOptions(qos=1))
    pub.publish("r", "kept", 1, retain=True)
    assert rap.expect().retain is True
    assert plain.expect().retain is False


def test_retain_handling_options(broker):
    pub = Paho(broker.mqtt_port, "pub")
    pub.publish("rh/a", "old", 1, retain=True)
    always = Paho(broker.mqtt_port, "always")
    always.subscribe("rh/#", options=mqtt.SubscribeOptions(qos=1, retainHandling=0))
    assert always.expect().payload == b"old"
    always.subscribe("rh/#", options=mqtt.SubscribeOptions(qos=1, retainHandling=0))
    assert always.expect().payload == b"old"  # sent again on every subscribe
    if_new = Paho(broker.mqtt_port, "ifnew")
    if_new.subscribe("rh/#", options=mqtt.SubscribeOptions(qos=1, retainHandling=1))
    assert if_new.expect().payload == b"old"
    if_new.subscribe("rh/#", options=mqtt.SubscribeOptions(qos=1, retainHandling=1))
    never = Paho(broker.mqtt_port, "never")
    never.subscribe("rh/#", options=mqtt.SubscribeOptions(qos=1, retainHandling=2))
    pub.publish("rh/b", "live", 1)
    assert if_new.expect().payload == b"live"
    assert never.expect().payload == b"live"


def test_shared_subscription_round_robin(broker):
    members = [Paho(broker.mqtt_port, f"m{i}") for i in range(3)]
    for member in members:
        member.subscribe("$share/workers/jobs/+", 1)
    normal = Paho(broker.mqtt_port, "normal")
    normal.subscribe("jobs/+", 1)
    pub = Paho(broker.mqtt_port, "pub")
    for index in range(30):
        pub.publish(f"jobs/{index}", str(index), 1)
    assert len(normal.expect_n(30)) == 30
    wait_for(lambda: sum(member.messages.qsize() for member in members) >= 30)
    counts = [member.messages.qsize() for member in members]
    seen = [member.expect().payload for member, count in zip(members, counts, strict=True) for _ in range(count)]
    for member in members:
        member.expect_none()
    assert sorted(seen) == sorted(str(i).encode() for i in range(30))  # each exactly once
    assert counts == [10, 10, 10]


def test_shared_subscription_member_leaving(broker):
    a = Paho(broker.mqtt_port, "a")
    b = Paho(broker.mqtt_port, "b")
    a.subscribe("$share/g/s", 1)
    b.subscribe("$share/g/s", 1)
    a.disconnect()
    pub = Paho(broker.mqtt_port, "pub")
    for index in range(4):
        pub.publish("s", str(index), 1)
    assert len(b.expect_n(4)) == 4


def test_topic_alias_from_client(broker):
    sub = Paho(broker.mqtt_port, "sub")
    sub.subscribe("long/topic/name", 1)
    raw = RawClient(broker.mqtt_port, 5)
    connack = raw.connect("aliaser")
    assert connack.properties.topic_alias_maximum > 0
    raw.send(p.Publish("long/topic/name", b"first", 1, packet_id=1, properties=p.Properties(topic_alias=3)))
    assert isinstance(raw.receive(), p.Puback)
    raw.send(p.Publish("", b"second", 1, packet_id=2, properties=p.Properties(topic_alias=3)))
    assert isinstance(raw.receive(), p.Puback)
    assert [m.payload for m in sub.expect_n(2)] == [b"first", b"second"]
    # An alias never defined is a protocol error.
    raw.send(p.Publish("", b"x", 0, properties=p.Properties(topic_alias=9)))
    packets = raw.receive_until_closed()
    assert isinstance(packets[-1], p.Disconnect) and packets[-1].reason_code == 0x82


def test_topic_alias_to_client(broker):
    raw = RawClient(broker.mqtt_port, 5)
    raw.connect("aliased", properties=p.Properties(topic_alias_maximum=5))
    raw.send(p.Subscribe(1, [p.SubscriptionRequest("al/#", 0)]))
    assert isinstance(raw.receive(), p.Suback)
    pub = Paho(broker.mqtt_port, "pub")
    pub.publish("al/x", "1", 1)
    pub.publish("al/x", "2", 1)
    first, second = raw.receive(), raw.receive()
    assert first.topic == "al/x" and first.properties.topic_alias == 1
    assert second.topic == "" and second.properties.topic_alias == 1


def test_message_expiry(broker):
    sub = Paho(broker.mqtt_port, "exp", clean=False, session_expiry=300)
    sub.subscribe("e", 1)
    sub.disconnect()
    pub = Paho(broker.mqtt_port, "pub")
    pub.publish("e", "short", 1, properties=publish_props(MessageExpiryInterval=1))
    pub.publish("e", "long", 1, properties=publish_props(MessageExpiryInterval=100))
    time.sleep(1.5)  # the expiry interval itself is what is under test
    back = Paho(broker.mqtt_port, "exp", clean=False, session_expiry=300)
    message = back.expect()
    assert message.payload == b"long"
    assert 90 <= message.properties.MessageExpiryInterval <= 100  # remaining lifetime [MQTT-3.3.2-6]
    back.expect_none()


def test_client_receive_maximum_limits_inflight(broker):
    raw = RawClient(broker.mqtt_port, 5)
    raw.connect("slow", properties=p.Properties(receive_maximum=2))
    raw.send(p.Subscribe(1, [p.SubscriptionRequest("flow", 1)]))
    assert isinstance(raw.receive(), p.Suback)
    pub = Paho(broker.mqtt_port, "pub")
    for index in range(5):
        pub.publish("flow", str(index), 1)
    first = [raw.receive(), raw.receive()]
    assert [x.payload for x in first] == [b"0", b"1"]
    try:
        extra = raw.receive(timeout=0.5)
    except AssertionError:
        extra = None
    assert extra is None  # window full [MQTT-3.3.4-7]
    raw.send(p.Puback(first[0].packet_id))
    assert raw.receive().payload == b"2"


def test_client_maximum_packet_size(broker):
    raw = RawClient(broker.mqtt_port, 5)
    raw.connect("small", properties=p.Properties(maximum_packet_size=64))
    raw.send(p.Subscribe(1, [p.SubscriptionRequest("big/#", 0)]))
    assert isinstance(raw.receive(), p.Suback)
    pub = Paho(broker.mqtt_port, "pub")
    pub.publish("big/a", b"x" * 200, 1)  # too large for the client: not sent [MQTT-3.1.2-25]
    pub.publish("big/b", b"small", 1)
    assert raw.receive().payload == b"small"


def test_server_advertises_limits_in_connack(broker):
    client = Paho(broker.mqtt_port, "limits", connect=False)
    flags, rc, props = client.connect()
    assert props.ReceiveMaximum >= 1
    assert props.MaximumPacketSize >= 1024
    assert props.TopicAliasMaximum >= 1


def test_disconnect_with_will_message_reason(broker):
    watcher = Paho(broker.mqtt_port, "watcher")
    watcher.subscribe("w", 1)
    client = Paho(broker.mqtt_port, "leaver", will={"topic": "w", "payload": "bye", "qos": 1})
    client.disconnect(reasoncode=mqtt.ReasonCode(PacketTypes.DISCONNECT, identifier=4))
    assert watcher.expect().payload == b"bye"


def test_qos2_exactly_once_with_retransmission(broker):
    sub = Paho(broker.mqtt_port, "sub")
    sub.subscribe("q2", 2)
    raw = RawClient(broker.mqtt_port, 5)
    raw.connect("q2pub")
    raw.send(p.Publish("q2", b"once", 2, packet_id=10))
    assert isinstance(raw.receive(), p.Pubrec)
    raw.send(p.Publish("q2", b"once", 2, dup=True, packet_id=10))  # [MQTT-4.3.3-9]
    assert isinstance(raw.receive(), p.Pubrec)
    raw.send(p.Pubrel(10))
    assert isinstance(raw.receive(), p.Pubcomp)
    assert sub.expect().payload == b"once"
    sub.expect_none()


def test_unacknowledged_messages_resent_on_reconnect(broker):
    raw = RawClient(broker.mqtt_port, 4)
    raw.connect("forgetful", clean=False)
    raw.send(p.Subscribe(1, [p.SubscriptionRequest("re", 1)]))
    assert isinstance(raw.receive(), p.Suback)
    pub = Paho(broker.mqtt_port, "pub")
    pub.publish("re", "again", 1)
    first = raw.receive()
    assert first.payload == b"again" and not first.dup
    raw.close()
    back = RawClient(broker.mqtt_port, 4)
    assert back.connect("forgetful", clean=False).session_present
    resent = back.receive()
    assert resent.payload == b"again" and resent.dup and resent.packet_id == first.packet_id
