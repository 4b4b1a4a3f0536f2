"""Bad input over real sockets: every case gets the spec's answer and the broker keeps serving
everyone else."""

from __future__ import annotations

import socket

import pytest
from shardgate.protocols.mqtt import packets as p
from shardgate.protocols.mqtt.codec import encode

from tests.mqtt_clients import V311, Paho, RawClient


@pytest.fixture
def bystander(broker):
    """A subscriber that must keep getting messages whatever the others do."""
    sub = Paho(broker.mqtt_port, "bystander", V311)
    sub.subscribe("alive", 1)
    pub = Paho(broker.mqtt_port, "bystander-pub", V311)
    yield lambda payload: (pub.publish("alive", payload, 1), sub.expect().payload == payload.encode())


def test_first_packet_must_be_connect(broker, bystander):
    raw = RawClient(broker.mqtt_port, 4)
    raw.send(p.Pingreq())  # [MQTT-3.1.0-1]
    assert raw.receive_until_closed() == []
    assert bystander("after-ping")[1]


@pytest.mark.parametrize("level", [2, 6, 255])
def test_unknown_protocol_level_refused(broker, bystander, level):
    raw = RawClient(broker.mqtt_port, 4)
    body = b"\x00\x04MQTT" + bytes([level, 0x02, 0x00, 0x3C]) + b"\x00\x01x"
    raw.send(bytes([0x10, len(body)]) + body)
    packets = raw.receive_until_closed()
    assert len(packets) == 1 and isinstance(packets[0], p.Connack)
    assert packets[0].reason_code == 0x01  # unacceptable protocol version [MQTT-3.1.2-2]
    assert bystander("after-level")[1]


def test_second_connect_is_protocol_error(broker, bystander):
    raw = RawClient(broker.mqtt_port, 5)
    raw.connect("twice")
    raw.send(p.Connect("MQTT", 5, True, 60, "twice", properties=p.Properties()))  # [MQTT-3.1.0-2]
    packets = raw.receive_until_closed()
    assert packets and isinstance(packets[-1], p.Disconnect) and packets[-1].reason_code == 0x82
    assert bystander("after-twice")[1]


@pytest.mark.parametrize("version", [4, 5])
def test_wildcard_in_publish_topic_closes(broker, bystander, version):
    raw = RawClient(broker.mqtt_port, version)
    raw.connect("wild")
    raw.send(p.Publish("a/+/b", b"x", 1, packet_id=1))  # [MQTT-3.3.2-2]
    packets = raw.receive_until_closed()
    if version == 5:
        assert isinstance(packets[-1], p.Disconnect) and packets[-1].reason_code >= 0x80
    else:
        assert packets == []
    assert bystander(f"after-wild-{version}")[1]


def test_qos3_publish_is_malformed(broker, bystander):
    raw = RawClient(broker.mqtt_port, 5)
    raw.connect("qos3")
    raw.send(bytes([0x36, 0x05, 0x00, 0x01, ord("t"), 0x00, 0x01]))
    packets = raw.receive_until_closed()
    assert isinstance(packets[-1], p.Disconnect) and packets[-1].reason_code == 0x81
    assert bystander("after-qos3")[1]


def test_invalid_utf8_topic_closes(broker, bystander):
    raw = RawClient(broker.mqtt_port, 4)
    raw.connect("utf8")
    topic = b"\xff\xfe"
    body = len(topic).to_bytes(2, "big") + topic + b"payload"
    raw.send(bytes([0x30, len(body)]) + body)  # [MQTT-1.5.4-1]
    assert raw.receive_until_closed() == []
    assert bystander("after-utf8")[1]


def test_oversized_packet_refused(broker, bystander):
    raw = RawClient(broker.mqtt_port, 5)
    connack = raw.connect("huge")
    limit = connack.properties.maximum_packet_size
    raw.send(encode(p.Publish("big", b"x" * (limit + 10), 0), 5))
    packets = raw.receive_until_closed()
    assert isinstance(packets[-1], p.Disconnect) and packets[-1].reason_code == 0x95
    assert bystander("after-huge")[1]


def test_truncated_packet_then_vanish_leaks_nothing(broker, bystander):
    before = broker.call(lambda: len(broker.app.mqtt.connections))
    for index in range(20):
        sock = socket.create_connection(("127.0.0.1", broker.mqtt_port))
        data = encode(p.Connect("MQTT", 4, True, 60, f"v{index}", properties=p.Properties()), 4)
        sock.sendall(data)
        sock.recv(4)
        sock.sendall(encode(p.Publish("t", b"y" * 1000, 1, packet_id=1), 4)[:300])
        sock.close()
    from tests.conftest import wait_for

    wait_for(lambda: broker.call(lambda: len(broker.app.mqtt.connections)) == before)
    assert broker.call(lambda: len(broker.app.mqtt._handshaking)) == 0
    assert bystander("after-vanish")[1]


def test_garbage_bytes_close_connection(broker, bystander):
    raw = RawClient(broker.mqtt_port, 4)
    raw.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert raw.receive_until_closed() == []
    assert bystander("after-garbage")[1]


def test_shared_subscription_with_no_local_is_protocol_error(broker, bystander):
    raw = RawClient(broker.mqtt_port, 5)
    raw.connect("nl")
    raw.send(p.Subscribe(1, [p.SubscriptionRequest("$share/g/t", 0, no_local=True)]))  # [MQTT-3.8.3-4]
    packets = raw.receive_until_closed()
    assert isinstance(packets[-1], p.Disconnect) and packets[-1].reason_code == 0x82
    assert bystander("after-nl")[1]


@pytest.mark.parametrize("version", [4, 5])
def test_invalid_filter_gets_failure_code(broker, version):
    raw = RawClient(broker.mqtt_port, version)
    raw.connect("badfilter")
    raw.send(p.Subscribe(1, [p.SubscriptionRequest("a/#/b", 0), p.SubscriptionRequest("ok/+", 1),
                             p.SubscriptionRequest("x+/y", 0)]))
    suback = raw.receive()
    failure = 0x80 if version == 4 else 0x8F  # [MQTT-3.9.3-1] / 5.0 Topic Filter invalid
    assert suback.reason_codes == [failure, 1, failure]


def test_publish_to_sys_refused(broker):
    raw = RawClient(broker.mqtt_port, 5)
    raw.connect("sysw")
    raw.send(p.Publish("$SYS/broker/uptime", b"fake", 1, packet_id=1))
    ack = raw.receive()
    assert isinstance(ack, p.Puback) and ack.reason_code == 0x87
