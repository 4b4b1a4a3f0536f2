"""A SUBACK on a node whose link to another node is still opening (that node has just joined
or restarted) waits, bounded, until that node has applied the subscription too: it may own a
shard and store for the subscription, and an owner that does not know a node's routes holds
nothing for it. Before, the SUBACK waited only for links already up, so a publish on the
joining node right after the SUBACK could miss the subscriber.

Reuses the three whole nodes of `test_cluster_data_path_join.py` (node c owns every shard; a
does not know c at first); a then learns of c at an address that holds the connection back
until the test lets it through, so a's link to c stays dialing as long as the test wants.
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Iterator

import pytest
from shardgate.protocols.mqtt import packets as p

import shardgate.cluster.route_sync as route_sync
from shardgate.cluster.membership import NodeInfo
from tests.conftest import wait_for
from tests.e2e.test_cluster_data_path_join import Node, publish_acknowledged, trio  # noqa: F401
from tests.mqtt_clients import RawClient


class HeldLink:
    """A loopback port that accepts a connection and holds it back (nothing passes) until
    `release`, then joins it to `target_port` both ways."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.accepted = threading.Event()
        self.released = threading.Event()
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            held, _ = self.listener.accept()
        except OSError:
            return
        self.sockets.append(held)
        self.accepted.set()
        self.released.wait()
        target = socket.create_connection(("127.0.0.1", self.target_port))
        self.sockets.append(target)
        for source, sink in ((held, target), (target, held)):
            threading.Thread(target=_pipe, args=(source, sink), daemon=True).start()

    def release(self) -> None:
        self.released.set()

    def close(self) -> None:
        self.released.set()
        for sock in self.sockets:
            sock.close()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.fixture
def held_link(trio: dict[str, Node]) -> Iterator[HeldLink]:  # noqa: F811
    link = HeldLink(trio["c"].plane.port)
    try:
        yield link
    finally:
        link.close()


def test_a_suback_waits_for_a_node_whose_link_is_still_dialing(
    trio: dict[str, Node], held_link: HeldLink, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    # long bounds, so only c applying the routes can release the SUBACK within the test
    monkeypatch.setattr(route_sync, "ROUTE_WAIT_S", 30.0)
    a, c = trio["a"], trio["c"]
    a.server.call(lambda: setattr(a.plane, "link_timeout_s", 30.0))
    a.view.node_infos["c"] = NodeInfo("c", f"127.0.0.1:{held_link.port}")
    a.server.call(a.view.changed)
    assert held_link.accepted.wait(10), "a never dialed c"
    subscriber = RawClient(a.server.mqtt_port, version=5)
    subscriber.connect("steady")
    subscriber.send(p.Subscribe(1, [p.SubscriptionRequest("orders/#", 1)]))
    wait_for(lambda: a.server.call(lambda: a.server.app.broker.subscription_count) >= 1)
    a.server.call(lambda: None)  # the SUBSCRIBE's handling has ended
    readable, _, _ = select.select([subscriber.sock], [], [], 0)
    assert not readable, "SUBACK sent while the link to c, which owns the shards, was dialing"
    assert c.knows_routes_of("a") == 0
    held_link.release()
    suback = subscriber.receive()
    assert isinstance(suback, p.Suback) and suback.packet_id == 1, suback
    assert c.knows_routes_of("a") >= 1, "SUBACK came before c applied a's routes"
    # so a publish on the owner right after the SUBACK reaches the subscriber
    publisher = RawClient(c.server.mqtt_port, version=5)
    publisher.connect("on-the-owner")
    publish_acknowledged(publisher, "orders/1", ["first"], 1)
    message = subscriber.receive()
    assert isinstance(message, p.Publish) and message.payload == b"first", message
    publisher.close()
    subscriber.close()


def test_a_suback_does_not_wait_for_a_node_that_cannot_be_dialed(
    trio: dict[str, Node], monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    """A node in the view that is down: once its link gives up dialing, the SUBACK goes (it
    gets the route set when its link comes back), well before the per-peer time limit."""
    monkeypatch.setattr(route_sync, "ROUTE_WAIT_S", 60.0)
    a = trio["a"]
    with socket.create_server(("127.0.0.1", 0)) as closed:
        down_port = closed.getsockname()[1]
    a.view.node_infos["d"] = NodeInfo("d", f"127.0.0.1:{down_port}")
    a.server.call(a.view.changed)
    subscriber = RawClient(a.server.mqtt_port, version=5)
    subscriber.connect("steady")
    subscriber.send(p.Subscribe(1, [p.SubscriptionRequest("orders/#", 1)]))
    suback = subscriber.receive()  # within the client's timeout, far below ROUTE_WAIT_S
    assert isinstance(suback, p.Suback) and suback.packet_id == 1, suback
    assert not a.server.call(lambda: a.plane.links["d"].reachable)
    subscriber.close()
