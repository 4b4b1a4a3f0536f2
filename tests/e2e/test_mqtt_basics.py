"""MQTT end to end with paho-mqtt 5.0 and 3.1.1 over real sockets: publish/subscribe at each
QoS, retained messages, wills, sessions, keepalive, takeover."""

from __future__ import annotations

import time

import paho.mqtt.client as mqtt
import pytest

from tests.conftest import wait_for
from tests.mqtt_clients import V5, V311, Paho, RawClient

VERSIONS = [pytest.param(V311, id="3.1.1"), pytest.param(V5, id="5.0")]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("qos", [0, 1, 2])
def test_publish_reaches_subscriber_at_each_qos(broker, version, qos):
    sub = Paho(broker.mqtt_port, "sub", version)
    assert sub.subscribe("a/b", qos)[0] in (qos, mqtt.ReasonCode(mqtt.PacketTypes.SUBACK, identifier=qos))
    pub = Paho(broker.mqtt_port, "pub", version)
    for index in range(20):
        pub.publish("a/b", f"m{index}", qos)
    received = sub.expect_n(20)
    assert [m.payload for m in received] == [f"m{i}".encode() for i in range(20)]
    assert all(m.qos == qos for m in received)
    sub.disconnect()
    pub.disconnect()


@pytest.mark.parametrize("version", VERSIONS)
def test_granted_qos_downgrades_delivery(broker, version):
    sub = Paho(broker.mqtt_port, "sub", version)
    sub.subscribe("t", 1)
    pub = Paho(broker.mqtt_port, "pub", version)
    pub.publish("t", "x", 2)
    assert sub.expect().qos == 1


@pytest.mark.parametrize("version", VERSIONS)
def test_wildcards_and_dollar_topics(broker, version):
    sub = Paho(broker.mqtt_port, "sub", version)
    sub.subscribe("sport/+/player1", 0)
    sub.subscribe("news/#", 0)
    pub = Paho(broker.mqtt_port, "pub", version)
    pub.publish("sport/tennis/player1", "1", 1)
    pub.publish("sport/tennis/player2", "2", 1)
    pub.publish("news", "3", 1)
    pub.publish("news/a/b", "4", 1)
    payloads = sorted(m.payload for m in sub.expect_n(3))
    assert payloads == [b"1", b"3", b"4"]
    # A leading wildcard never matches $-topics [MQTT-4.7.2-1].
    everything = Paho(broker.mqtt_port, "all", version)
    everything.subscribe("#", 0)
    sys_sub = Paho(broker.mqtt_port, "sys", version)
    sys_sub.subscribe("$SYS/broker/uptime", 0)
    assert sys_sub.expect().topic == "$SYS/broker/uptime"
    pub.publish("plain", "p", 1)
    message = everything.expect()
    assert message.topic == "plain"


@pytest.mark.parametrize("version", VERSIONS)
def test_retained_message_set_and_cleared_by_empty_payload(broker, version):
    pub = Paho(broker.mqtt_port, "pub", version)
    pub.publish("status/door", "open", 1, retain=True)
    late = Paho(broker.mqtt_port, "late", version)
    late.subscribe("status/+", 1)
    message = late.expect()
    assert (message.topic, message.payload, message.retain) == ("status/door", b"open", True)
    # Live delivery to an existing subscriber carries RETAIN=0 [MQTT-3.3.1-12 / 5.0 RAP=0].
    pub.publish("status/door", "closed", 1, retain=True)
    live = late.expect()
    assert (live.payload, live.retain) == (b"closed", False)
    pub.publish("status/door", b"", 1, retain=True)  # [MQTT-3.3.1-10] clears it
    assert late.expect().payload == b""
    later = Paho(broker.mqtt_port, "later", version)
    later.subscribe("status/#", 1)
    pub.publish("status/marker", "m", 1)
    assert later.expect().topic == "status/marker"


@pytest.mark.parametrize("version", VERSIONS)
def test_will_published_on_abnormal_disconnect_only(broker, version):
    watcher = Paho(broker.mqtt_port, "watcher", version)
    watcher.subscribe("wills/#", 1)
    clean = Paho(broker.mqtt_port, "polite", version, will={"topic": "wills/polite", "payload": "gone", "qos": 1})
    clean.disconnect()
    rude = Paho(broker.mqtt_port, "rude", version, will={"topic": "wills/rude", "payload": "lost", "qos": 1})
    rude.drop()
    message = watcher.expect()
    assert (message.topic, message.payload) == ("wills/rude", b"lost")
    watcher.expect_none()


def test_will_delay_and_cancel_on_reconnect(broker):
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    watcher = Paho(broker.mqtt_port, "watcher")
    watcher.subscribe("wills/#", 1)
    will_props = Properties(PacketTypes.WILLMESSAGE)
    will_props.WillDelayInterval = 1
    client = Paho(broker.mqtt_port, "delayed", session_expiry=60,
                  will={"topic": "wills/delayed", "payload": "late", "qos": 1, "properties": will_props})
    started = time.monotonic()
    client.drop()
    message = watcher.expect(timeout=5)
    assert message.payload == b"late"
    assert time.monotonic() - started >= 0.9
    # Reconnecting within the delay cancels the will [MQTT-3.1.3-9].
    will_props.WillDelayInterval = 3
    again = Paho(broker.mqtt_port, "delayed2", session_expiry=60,
                 will={"topic": "wills/delayed2", "payload": "never", "qos": 1, "properties": will_props})
    again.drop()
    back = Paho(broker.mqtt_port, "delayed2", clean=False, session_expiry=60)
    watcher.expect_none(within=3.5)
    back.disconnect()


def test_keepalive_timeout_closes_and_sends_will(broker):
    watcher = Paho(broker.mqtt_port, "watcher", V311)
    watcher.subscribe("wills/ka", 1)
    from shardgate.protocols.mqtt import packets as p

    raw = RawClient(broker.mqtt_port, 4)
    raw.connect("silent", keep_alive=1, will=p.Will("wills/ka", b"timeout", 1, False, p.Properties()))
    started = time.monotonic()
    assert raw.receive(timeout=5) is None  # closed by the server after 1.5 x keepalive
    elapsed = time.monotonic() - started
    assert 1.0 <= elapsed < 4
    assert watcher.expect().payload == b"timeout"


@pytest.mark.parametrize("version", VERSIONS)
def test_persistent_session_gets_offline_messages(broker, version):
    expiry = 300 if version == V5 else None
    sub = Paho(broker.mqtt_port, "durable", version, clean=False, session_expiry=expiry)
    sub.subscribe("jobs/#", 1)
    sub.disconnect()
    pub = Paho(broker.mqtt_port, "pub", version)
    for index in range(5):
        pub.publish(f"jobs/{index}", str(index), 1)
    pub.publish("jobs/q0", "kept too", 0)
    back = Paho(broker.mqtt_port, "durable", version, clean=False, session_expiry=expiry, connect=False)
    flags, rc, props = back.connect()
    assert flags.session_present
    received = back.expect_n(6)
    # On a reliable stream the session's cursor replays the journal, QoS 0 messages included
    # (the spec allows storing them); each keeps the QoS it was published with.
    assert [m.payload for m in received] == [b"0", b"1", b"2", b"3", b"4", b"kept too"]
    assert [m.qos for m in received] == [1, 1, 1, 1, 1, 0]
    back.expect_none()


def test_non_reliable_stream_queues_offline_qos1_in_memory(broker_factory):
    broker = broker_factory(mqtt={"max_queued_messages": 3}, default_stream_mode="non-reliable")
    sub = Paho(broker.mqtt_port, "mem", V311, clean=False)
    sub.subscribe("m/#", 1)
    sub.disconnect()
    pub = Paho(broker.mqtt_port, "pub", V311)
    pub.publish("m/q0", "not queued", 0)
    for index in range(5):
        pub.publish(f"m/{index}", str(index), 1)
    back = Paho(broker.mqtt_port, "mem", V311, clean=False)
    assert [m.payload for m in back.expect_n(3)] == [b"0", b"1", b"2"]  # bounded queue
    back.expect_none()


def test_clean_start_discards_session(broker):
    sub = Paho(broker.mqtt_port, "c1", V5, clean=False, session_expiry=300)
    sub.subscribe("x", 1)
    sub.disconnect()
    again = Paho(broker.mqtt_port, "c1", V5, clean=True, connect=False)
    flags, rc, props = again.connect()
    assert not flags.session_present
    pub = Paho(broker.mqtt_port, "pub", V5)
    pub.publish("x", "nobody", 1)
    again.expect_none()


def test_session_expiry_interval_ends_session(broker):
    sub = Paho(broker.mqtt_port, "short", V5, clean=False, session_expiry=1)
    sub.subscribe("x", 1)
    sub.disconnect()
    wait_for(lambda: broker.call(lambda: "short" not in broker.app.mqtt.sessions), timeout=5)
    back = Paho(broker.mqtt_port, "short", V5, clean=False, session_expiry=1, connect=False)
    flags, _, _ = back.connect()
    assert not flags.session_present


@pytest.mark.parametrize("version", VERSIONS)
def test_session_takeover_disconnects_old_client(broker, version):
    first = Paho(broker.mqtt_port, "same", version)
    second = Paho(broker.mqtt_port, "same", version)
    rc, _ = first.disconnects.get(timeout=10)
    if version == V5:
        assert rc.value == 0x8E  # session taken over [MQTT-3.1.4-3]
    second.subscribe("t", 0)
    second.publish("t", "still works", 1)
    assert second.expect().payload == b"still works"


def test_v5_client_id_assigned_when_empty(broker):
    client = Paho(broker.mqtt_port, "", V5, connect=False)
    flags, rc, props = client.connect()
    assert rc == 0
    assert props.AssignedClientIdentifier.startswith("sg-")


def test_v311_empty_client_id_needs_clean_session(broker):
    raw = RawClient(broker.mqtt_port, 4)
    connack = raw.connect("", clean=False)
    assert connack.reason_code == 2  # identifier rejected [MQTT-3.1.3-8]
    assert raw.receive() is None
    ok = RawClient(broker.mqtt_port, 4)
    assert ok.connect("", clean=True).reason_code == 0


def test_mqtt_31_client(broker):
    raw = RawClient(broker.mqtt_port, 3)
    assert raw.connect("old-client").reason_code == 0
    from shardgate.protocols.mqtt import packets as p

    raw.send(p.Subscribe(1, [p.SubscriptionRequest("legacy", 1)]))
    assert isinstance(raw.receive(), p.Suback)
    raw.send(p.Publish("legacy", b"hello", 1, packet_id=2))
    packets = [raw.receive(), raw.receive()]
    kinds = {type(x) for x in packets}
    assert kinds == {p.Puback, p.Publish}


@pytest.mark.parametrize("version", VERSIONS)
def test_unsubscribe_stops_delivery(broker, version):
    sub = Paho(broker.mqtt_port, "sub", version)
    sub.subscribe("u/1", 1)
    sub.unsubscribe("u/1")
    sub.subscribe("u/2", 1)
    pub = Paho(broker.mqtt_port, "pub", version)
    pub.publish("u/1", "gone", 1)
    pub.publish("u/2", "here", 1)
    assert sub.expect().payload == b"here"
    sub.expect_none()


def test_websocket_listener(broker):
    ws = Paho(broker.ws_port, "browser", V5, transport="websockets")
    ws.subscribe("ws/test", 1)
    tcp = Paho(broker.mqtt_port, "tcp", V311)
    tcp.publish("ws/test", "over websocket", 1)
    assert ws.expect().payload == b"over websocket"
    ws.publish("ws/back", "x", 1)
