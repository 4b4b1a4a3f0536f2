"""Under load the broker keeps serving new connections: its listener accepts every pending
connection at once, and a loop turn handles reads for a bounded time only, leaving the rest
of that turn's reads (their sockets paused) for the next turns. Nothing a publisher sent is
lost or reordered by being left for later."""

from __future__ import annotations

import socket
from collections.abc import Callable

from shardgate.protocols.mqtt import packets as p
from shardgate.protocols.mqtt.codec import encode

from tests.conftest import ThreadedBroker
from tests.mqtt_clients import V5, V311, Paho, RawClient


def test_reads_left_for_later_turns_lose_and_reorder_nothing(
    broker_factory: Callable[..., ThreadedBroker],
) -> None:
    # A negative budget leaves every read after a turn's first for a later turn: each
    # publisher's reads go through the deferred path again and again.
    broker = broker_factory(listeners={"read_budget_s": -1.0})
    port = broker.mqtt_port
    subscriber = Paho(port, "fair-sub", V5)
    subscriber.subscribe("fair/#", 1)
    publishers = [Paho(port, f"fair-pub-{n}", V311 if n % 2 else V5) for n in range(4)]
    sent = 150
    infos = [
        publisher.publish(f"fair/{n}", f"{n}:{i}".encode(), 1, wait=False)
        for i in range(sent) for n, publisher in enumerate(publishers)
    ]
    for info in infos:
        info.wait_for_publish(15)
        assert info.is_published()
    received = subscriber.expect_n(sent * len(publishers), timeout=30)
    by_publisher: dict[str, list[int]] = {}
    for message in received:
        name, index = message.payload.decode().split(":")
        by_publisher.setdefault(name, []).append(int(index))
    assert {name: order for name, order in by_publisher.items()} == {
        str(n): list(range(sent)) for n in range(len(publishers))
    }
    # A new client connects and is answered meanwhile.
    late = RawClient(port, version=5)
    late.send(p.Connect("MQTT", 5, True, 60, "late"))
    assert isinstance(late.receive(), p.Connack)
    late.close()
    for client in (subscriber, *publishers):
        client.disconnect()


def test_a_burst_of_connections_is_accepted_and_answered(broker: ThreadedBroker) -> None:
    port = broker.mqtt_port
    clients = []
    for _ in range(300):  # most wait in the listen queue before the broker accepts any
        sock = socket.create_connection(("127.0.0.1", port), timeout=15)
        clients.append(sock)
    for n, sock in enumerate(clients):
        sock.sendall(encode(p.Connect("MQTT", 4, True, 60, f"burst-{n}"), 4))
    connected = 0
    for sock in clients:
        data = b""
        while len(data) < 4:
            chunk = sock.recv(4 - len(data))
            assert chunk, "connection closed before CONNACK"
            data += chunk
        assert data[0] >> 4 == 2 and data[3] == 0  # CONNACK, accepted
        connected += 1
    assert connected == 300
    for sock in clients:
        sock.close()


def test_a_closed_listener_refuses_new_connections(broker: ThreadedBroker) -> None:
    port = broker.mqtt_port
    Paho(port, "before-close", V311).disconnect()
    broker.call(lambda: broker.app.listeners["mqtt"].server.close())
    refused = False
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        refused = True
    assert refused
