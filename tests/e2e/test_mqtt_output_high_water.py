"""The output high-water mark (`mqtt.output_high_water`): a client that stops reading holds
the clients publishing QoS 1 messages to it until it reads again, and a persistent session's
backlog is replayed only as fast as its client reads; nothing is lost either way."""

from __future__ import annotations

from tests.conftest import wait_for
from tests.mqtt_clients import V5, V311, Paho

HIGH_WATER = 64 * 1024
PAYLOAD = 64 * 1024
MESSAGES = 300  # ~19 MB: more than the kernel's socket buffers on both sides hold


def _connection(broker, client_id):
    return next((c for c in broker.app.mqtt.connections if c.client_id == client_id), None)


def test_a_publisher_is_paused_while_its_subscriber_does_not_read_and_resumes_losing_nothing(broker_factory):
    broker = broker_factory(mqtt={"output_high_water": HIGH_WATER, "max_inflight": 1000,
                                  "max_queued_messages": 10_000})
    subscriber = Paho(broker.mqtt_port, "reader", V311)
    subscriber.subscribe("firehose", 1)
    subscriber.client.loop_stop()  # stops reading its socket (and acknowledging)
    publisher = Paho(broker.mqtt_port, "pub", V5, connect=False)
    # At most 4 unacknowledged: what one loop turn of the broker can take from it is bounded.
    publisher.client.max_inflight_messages_set(4)
    publisher.connect()
    sent = [
        publisher.publish("firehose", index.to_bytes(4, "big") + b"x" * PAYLOAD, 1, wait=False)
        for index in range(MESSAGES)
    ]

    def publisher_held() -> bool:
        connection = _connection(broker, "pub")
        return connection is not None and connection.held

    wait_for(lambda: broker.call(publisher_held), timeout=30)
    # While it is held, the subscriber's output stays near the mark instead of growing.
    buffered = broker.call(lambda: _connection(broker, "reader").link.buffered())
    # (what a turn took from the publisher before the hold is delivered: a few messages more)
    assert buffered <= HIGH_WATER + 6 * PAYLOAD, buffered
    assert not all(info.is_published() for info in sent)

    subscriber.client.loop_start()  # reads again: the publisher is released
    received = [int.from_bytes(m.payload[:4], "big") for m in subscriber.expect_n(MESSAGES, timeout=60)]
    assert received == list(range(MESSAGES))
    for info in sent:
        info.wait_for_publish(30)
        assert info.is_published()  # every one acknowledged (PUBACK)
    assert not broker.call(publisher_held)
    assert broker.call(lambda: broker.app.broker.stats.messages_dropped) == 0
    subscriber.disconnect()
    publisher.disconnect()


def test_a_persistent_session_backlog_is_replayed_as_fast_as_its_client_reads(broker_factory):
    broker = broker_factory(mqtt={"output_high_water": HIGH_WATER, "max_inflight": 1000})
    session = Paho(broker.mqtt_port, "behind", V5, clean=False, session_expiry=300)
    session.subscribe("backlog", 1)
    session.disconnect()
    publisher = Paho(broker.mqtt_port, "pub", V5)
    sent = [publisher.publish("backlog", index.to_bytes(4, "big") + b"y" * PAYLOAD, 1, wait=False)
            for index in range(MESSAGES)]
    for info in sent:
        info.wait_for_publish(30)
    # The client comes back and reads only its CONNACK: the replay fills the sockets' buffers.
    back = Paho(broker.mqtt_port, "behind", V5, clean=False, session_expiry=300, connect=False)
    back.client.connect("127.0.0.1", broker.mqtt_port, clean_start=False,
                        properties=_expiry_properties(300))
    for _ in range(100):
        if not back.connack.empty():
            break
        back.client.loop(timeout=0.1)
    assert not back.connack.empty(), "no CONNACK"

    def replay_waiting() -> int:
        connection = _connection(broker, "behind")
        if connection is None or connection.session is None:
            return 0
        cursors = connection.session.subscription.cursors.values()
        behind = any(not cursor.live for cursor in cursors)
        return connection.link.buffered() if behind else 0

    # The broker had to buffer (the kernel's buffers are full) and the backlog is not all sent:
    buffered = wait_for(lambda: broker.call(replay_waiting), timeout=30)
    # replay waits for the client: what the broker holds for it stays near the mark.
    assert buffered <= HIGH_WATER + 2 * PAYLOAD, buffered
    back.client.loop_start()
    received = [int.from_bytes(m.payload[:4], "big") for m in back.expect_n(MESSAGES, timeout=60)]
    assert received == list(range(MESSAGES))
    back.disconnect()
    publisher.disconnect()


def _expiry_properties(seconds: int):
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = seconds
    return props
