"""AMQP bridges against a second Shardgate on loopback (it speaks AMQP 0-9-1): topics forwarded
out to a remote exchange, a remote queue consumed in, and a restart of either side in the middle
of the flow with nothing lost."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pika

from shardgate.bridges.amqp_bridge import AmqpBridgeSettings
from tests.conftest import BrokerProcess, ThreadedBroker, free_port, make_config, wait_for
from tests.mqtt_clients import V5, Paho


def remote_channel(port: int) -> tuple[pika.BlockingConnection, pika.adapters.blocking_connection.BlockingChannel]:
    connection = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port, heartbeat=0))
    channel = connection.channel()
    channel.confirm_delivery()
    return connection, channel


def drain(port: int, queue: str) -> list[bytes]:
    connection, channel = remote_channel(port)
    with connection:
        bodies = []
        while True:
            method, _, body = channel.basic_get(queue)
            if method is None:
                return bodies
            bodies.append(body)
            channel.basic_ack(method.delivery_tag)


def queue_depth(port: int, queue: str) -> int:
    connection, channel = remote_channel(port)
    with connection:
        return channel.queue_declare(queue, durable=True, passive=True).method.message_count


def start_remote(broker_process: Callable[..., BrokerProcess], tmp_path: Path) -> tuple[BrokerProcess, int]:
    port = free_port()
    remote = broker_process(tmp_path / "remote", extra_args=[
        "--amqp-port", str(port), "--http-port", str(free_port())]).start()
    return remote, port


def all_acknowledged(remote: BrokerProcess, queue: str) -> bool:
    """Nothing of `queue` on the remote is left unacknowledged (a ready message count of 0
    still counts deliveries the bridge has not acked yet)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{remote.ports['http']}/api/subscriptions",
                                timeout=10) as response:
        subscriptions = {sub["name"]: sub for sub in json.loads(response.read())}
    sub = subscriptions[f"amqp:/:{queue}"]
    return sub["lag"] == 0 and sub["inflight"] == 0


def test_out_bridge_forwards_topics_and_keeps_them_while_the_remote_restarts(
    broker_factory: Callable[..., ThreadedBroker], broker_process: Callable[..., BrokerProcess], tmp_path: Path,
) -> None:
    remote, port = start_remote(broker_process, tmp_path)
    connection, channel = remote_channel(port)
    with connection:
        channel.queue_declare("from-edge", durable=True)
        channel.queue_bind("from-edge", "amq.topic", "plant.#")
    edge = broker_factory(amqp_bridges=[AmqpBridgeSettings(
        name="up", remote=f"amqp://guest:guest@127.0.0.1:{port}/", out=["plant/#"], reconnect_max_s=0.5,
    )])
    publisher = Paho(edge.mqtt_port, "sensor", V5)
    sent = [f"reading-{index}".encode() for index in range(60)]
    for payload in sent[:20]:
        publisher.publish("plant/line1/temp", payload, 1)
    wait_for(lambda: queue_depth(port, "from-edge") == 20, timeout=20)

    assert remote.terminate() == 0
    for payload in sent[20:40]:  # the remote is away: the bridge's cursor waits
        publisher.publish("plant/line2/temp", payload, 1)
    remote.start()
    for payload in sent[40:]:
        publisher.publish("plant/line3/temp", payload, 1)
    wait_for(lambda: queue_depth(port, "from-edge") >= 60, timeout=30)

    received = drain(port, "from-edge")
    assert set(received) == set(sent)  # nothing lost (a resend after the restart may repeat one)
    status = edge.call(lambda: edge.app.bridges[0].status())
    assert status["connected"] and status["connects"] >= 2


def test_in_bridge_acks_the_remote_only_after_the_local_side_took_the_message(
    broker_process: Callable[..., BrokerProcess], tmp_path: Path,
) -> None:
    remote, port = start_remote(broker_process, tmp_path)
    connection, channel = remote_channel(port)
    with connection:
        channel.queue_declare("to-edge", durable=True)

    config = make_config(tmp_path / "edge", amqp_bridges=[AmqpBridgeSettings(
        name="down", remote=f"amqp://guest:guest@127.0.0.1:{port}/", queue="to-edge",
        topic="edge/commands", reconnect_max_s=0.5,
    )])
    edge = ThreadedBroker(config)
    edge_mqtt_port = config.listeners.mqtt_port
    try:
        edge.start()
        listener = Paho(edge_mqtt_port, "actuator", V5, clean=False, session_expiry=3600)
        listener.subscribe("edge/#", 1)
        connection, channel = remote_channel(port)
        with connection:
            for index in range(10):
                channel.basic_publish("", "to-edge", f"command-{index}".encode(),
                                      pika.BasicProperties(delivery_mode=2, headers={"origin": "hq"}))
        first = listener.expect_n(10)
        assert sorted(m.payload for m in first) == sorted(f"command-{i}".encode() for i in range(10))
        assert all(("origin", "hq") in m.properties.UserProperty for m in first)
        wait_for(lambda: queue_depth(port, "to-edge") == 0, timeout=20)
        # the bridge acks each one after its local commit: stopping the edge before the last
        # ack would rightly give that message back to the queue
        wait_for(lambda: all_acknowledged(remote, "to-edge"), timeout=20)
        listener.disconnect()
    finally:
        edge.stop()

    # The edge is down: the remote queue holds what arrives meanwhile; afterwards the bridge
    # brings it in while the persistent session is still away.
    connection, channel = remote_channel(port)
    with connection:
        for index in range(10, 25):
            channel.basic_publish("", "to-edge", f"command-{index}".encode(),
                                  pika.BasicProperties(delivery_mode=2))
    assert queue_depth(port, "to-edge") == 15

    edge = ThreadedBroker(make_config(tmp_path / "edge", amqp_bridges=config.amqp_bridges))
    edge.config.listeners.mqtt_port = edge_mqtt_port
    try:
        edge.start()
        listener = Paho(edge_mqtt_port, "actuator", V5, clean=False, session_expiry=3600)
        later = listener.expect_n(15)
        assert sorted(m.payload for m in later) == sorted(f"command-{i}".encode() for i in range(10, 25))
        wait_for(lambda: queue_depth(port, "to-edge") == 0, timeout=20)
    finally:
        edge.stop()


def test_out_bridge_forwards_a_non_reliable_stream_too(
    broker_factory: Callable[..., ThreadedBroker], broker_process: Callable[..., BrokerProcess], tmp_path: Path,
) -> None:
    from shardgate.config import StreamEntry

    remote, port = start_remote(broker_process, tmp_path)
    connection, channel = remote_channel(port)
    with connection:
        channel.queue_declare("metrics", durable=True)
        channel.queue_bind("metrics", "amq.topic", "telemetry.#")
    edge = broker_factory(
        streams=[StreamEntry("telemetry", mode="non-reliable", partitions=2)],
        amqp_bridges=[AmqpBridgeSettings(
            name="fast", remote=f"amqp://guest:guest@127.0.0.1:{port}/", out=["telemetry/#"],
        )],
    )
    assert edge.call(lambda: edge.app.broker.stream_for_topic("telemetry/meter0").reliable) is False
    wait_for(lambda: edge.call(lambda: edge.app.bridges[0].status()["connected"]), timeout=20)
    publisher = Paho(edge.mqtt_port, "meter", V5)
    sent = [f"m-{index}".encode() for index in range(30)]
    for index, payload in enumerate(sent):
        publisher.publish(f"telemetry/meter{index % 4}", payload, 1)
    wait_for(lambda: queue_depth(port, "metrics") == 30, timeout=20)
    assert sorted(drain(port, "metrics")) == sorted(sent)
