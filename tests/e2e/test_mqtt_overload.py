"""Overload and faults: connection limits, publish-rate back-pressure, slow and dead
subscribers, and a bounded outbound buffer."""

from __future__ import annotations

import socket
import time

from shardgate.protocols.mqtt import packets as p
from shardgate.protocols.mqtt.codec import encode

from tests.conftest import wait_for
from tests.mqtt_clients import V5, V311, Paho, RawClient


def test_connection_limit_answers_server_busy(broker_factory):
    broker = broker_factory(mqtt={"max_connections": 2})
    first = Paho(broker.mqtt_port, "one", V5)
    second = Paho(broker.mqtt_port, "two", V311)
    raw = RawClient(broker.mqtt_port, 5)
    assert raw.connect("three").reason_code == 0x89  # server busy
    raw3 = RawClient(broker.mqtt_port, 4)
    assert raw3.connect("four").reason_code == 3  # server unavailable
    second.disconnect()
    wait_for(lambda: broker.call(lambda: len(broker.app.mqtt.connections)) == 1)
    assert RawClient(broker.mqtt_port, 5).connect("five").reason_code == 0
    first.disconnect()


def test_publish_rate_limit_slows_the_publisher_and_loses_nothing(broker_factory):
    broker = broker_factory(mqtt={"max_publish_rate": 100})
    sub = Paho(broker.mqtt_port, "sub", V311)
    sub.subscribe("rate", 0)
    raw = RawClient(broker.mqtt_port, 4)
    raw.connect("flood")
    started = time.monotonic()
    raw.send(b"".join(encode(p.Publish("rate", str(i).encode(), 0), 4) for i in range(300)))
    received = [sub.expect().payload for _ in range(300)]
    assert received == [str(i).encode() for i in range(300)]
    assert time.monotonic() - started >= 1.5  # 300 messages at 100/s with a burst of 100


def test_slow_subscriber_memory_stays_bounded_and_others_keep_up(broker_factory):
    import threading

    from shardgate.protocols.mqtt.codec import PacketParser

    limit = 1024 * 1024
    broker = broker_factory(mqtt={"max_outbound_buffer": limit})
    slow = socket.create_connection(("127.0.0.1", broker.mqtt_port))
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.sendall(encode(p.Connect("MQTT", 4, True, 0, "slow", properties=p.Properties()), 4))
    slow.recv(4)
    slow.sendall(encode(p.Subscribe(1, [p.SubscriptionRequest("firehose", 0)]), 4))
    slow.recv(5)
    fast = RawClient(broker.mqtt_port, 4)
    fast.connect("fast")
    fast.send(p.Subscribe(1, [p.SubscriptionRequest("firehose", 1)]))
    assert isinstance(fast.receive(), p.Suback)
    counted = {"messages": 0}
    done = threading.Event()

    def read_fast() -> None:
        parser = PacketParser()
        parser.version = 4
        fast.sock.settimeout(60)
        while True:
            data = fast.sock.recv(1 << 20)
            if not data:
                return
            for packet in parser.feed(data):
                if isinstance(packet, p.Publish):
                    counted["messages"] += 1
                    if packet.packet_id:
                        fast.sock.sendall(encode(p.Puback(packet.packet_id), 4))
                    if packet.payload == b"end":
                        done.set()

    threading.Thread(target=read_fast, daemon=True).start()
    publisher = RawClient(broker.mqtt_port, 4)
    publisher.connect("pub")
    batch = b"".join(encode(p.Publish("firehose", b"x" * 1024, 0), 4) for _ in range(500))
    for index in range(40):
        publisher.send(batch)
        # Paced to what a reading subscriber takes: it must get every message.
        wait_for(lambda index=index: counted["messages"] >= (index + 1) * 500, timeout=30)
    publisher.send(p.Publish("firehose", b"end", 1, packet_id=1))
    assert done.wait(60)
    assert counted["messages"] == 20_001, counted  # the reading subscriber lost nothing

    def slow_state() -> tuple[int, int]:
        connection = next(c for c in broker.app.mqtt.connections if c.client_id == "slow")
        return connection.link.buffered(), broker.app.broker.stats.messages_dropped

    buffered, dropped = broker.call(slow_state)
    # 20 MB went to a subscriber that reads nothing: the broker holds at most its limit.
    assert buffered <= limit + 600 * 1024
    assert dropped > 0
    slow.close()


def test_dead_subscriber_is_disconnected_and_shared_messages_move_on(broker_factory):
    broker = broker_factory(mqtt={"dead_subscriber_timeout": 1.0})
    dead = RawClient(broker.mqtt_port, 5)
    dead.connect("dead")
    dead.send(p.Subscribe(1, [p.SubscriptionRequest("$share/g/work", 1)]))
    assert isinstance(dead.receive(), p.Suback)
    pub = Paho(broker.mqtt_port, "pub", V5)
    pub.publish("work", "job", 1)
    assert dead.receive().payload == b"job"  # received, never acknowledged
    packets = dead.receive_until_closed(timeout=10)
    assert packets and isinstance(packets[-1], p.Disconnect)


def test_qos1_publisher_is_held_for_a_slow_subscriber_and_nothing_is_lost(broker_factory):
    # A memory stream acknowledges at once: without back-pressure the publisher would outrun
    # the subscriber's window (2) and queue (10), and the queue limit would drop QoS 1 messages.
    broker = broker_factory(
        mqtt={"max_inflight": 2, "max_queued_messages": 10}, default_stream_mode="non-reliable"
    )
    sub = RawClient(broker.mqtt_port, 4)
    sub.connect("slow")
    sub.send(p.Subscribe(1, [p.SubscriptionRequest("work", 1)]))
    assert isinstance(sub.receive(), p.Suback)
    publisher = RawClient(broker.mqtt_port, 4)
    publisher.connect("pub")
    publisher.send(b"".join(encode(p.Publish("work", str(i).encode(), 1, packet_id=i + 1), 4)
                            for i in range(200)))

    def held() -> bool:
        return any(c.held for c in broker.app.mqtt.connections if c.client_id == "pub")

    wait_for(lambda: broker.call(held))  # the subscriber has not acknowledged anything yet
    received = []
    while len(received) < 200:
        packet = sub.receive()
        assert isinstance(packet, p.Publish)
        received.append(packet.payload)
        sub.send(p.Puback(packet.packet_id))
    assert received == [str(i).encode() for i in range(200)]
    acks = [publisher.receive() for _ in range(200)]
    assert sorted(a.packet_id for a in acks) == list(range(1, 201))
    assert broker.call(lambda: broker.app.broker.stats.messages_dropped) == 0


def test_a_subscriber_that_stops_reading_holds_its_publishers_only_for_a_while(broker_factory, monkeypatch):
    from shardgate.protocols.mqtt import service

    monkeypatch.setattr(service, "CONGESTION_GIVE_UP_S", 0.2)
    broker = broker_factory(
        mqtt={"max_inflight": 2, "max_queued_messages": 10}, default_stream_mode="non-reliable"
    )
    dead = RawClient(broker.mqtt_port, 4)
    dead.connect("dead")
    dead.send(p.Subscribe(1, [p.SubscriptionRequest("work", 1)]))
    assert isinstance(dead.receive(), p.Suback)
    publisher = RawClient(broker.mqtt_port, 4)
    publisher.connect("pub")
    publisher.send(b"".join(encode(p.Publish("work", b"x", 1, packet_id=i + 1), 4) for i in range(100)))
    # Every publish is acknowledged in the end; what the dead subscriber's queue could not hold
    # is counted as dropped, as it was before back-pressure existed.
    acks = [publisher.receive() for _ in range(100)]
    assert sorted(a.packet_id for a in acks) == list(range(1, 101))
    assert broker.call(lambda: broker.app.broker.stats.messages_dropped) > 0
