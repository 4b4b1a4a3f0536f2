"""A rolling restart of a three-node cluster under QoS 1 load loses no acknowledged message of a
persistent session (issue 27, bug 3): each node in turn stops gracefully, handing its offline
persistent sessions to the others, and starts again, while a publisher on another node sends
QoS 1 messages to a non-reliable stream without pause. Every message acknowledged to the
publisher reaches every session when its client comes back, including those published while a
session was being handed over (the leaving node stands in for it until its new node serves
its routes, `sessions.SessionStandIn`). Real etcd, real `shardgate serve` processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import (
    ClusterNodeProcess,
    ContinuousPublisher,
    EtcdServer,
    protocol_node,
    topics_of,
    wait_settled,
)
from tests.mqtt_clients import V5, Paho

# an offline session keeps at most `max_queued_messages` of a non-reliable stream: room for all
FAST = ('[mqtt]\nmax_queued_messages = 200000\n\n'
        '[[streams]]\nname = "fast"\nmode = "non-reliable"\npartitions = 6\n')
SESSIONS = 3


@pytest.fixture
def started(etcd: EtcdServer) -> Iterator[list[ClusterNodeProcess]]:
    nodes: list[ClusterNodeProcess] = []
    yield nodes
    for node in nodes:
        if node.alive():
            node.kill()


@pytest.mark.timeout(900)  # three restarts and ~20,000 messages per session on a loaded machine
def test_a_rolling_restart_loses_no_acknowledged_message_of_persistent_sessions(
    started: list[ClusterNodeProcess], etcd: EtcdServer, tmp_path: Path,
) -> None:
    nodes = [protocol_node(tmp_path, f"n{index}", etcd.url, FAST).start() for index in (1, 2, 3)]
    started += nodes
    wait_settled(nodes)
    topics = topics_of(nodes[0].status(), "fast", "fast/r", per_shard=2)
    for index in range(SESSIONS):  # one offline persistent session on each node
        client = Paho(nodes[index].mqtt_port, f"roller-{index}", V5, clean=False, session_expiry=600)
        client.subscribe("fast/r/#", 1)
        client.disconnect()
    acknowledged: list[str] = []
    publishers: list[ContinuousPublisher] = []

    def publish_from(node: ClusterNodeProcess) -> ContinuousPublisher:
        publisher = ContinuousPublisher(node.mqtt_port, f"from-{node.node_id}", topics)
        publishers.append(publisher)
        wait_for(lambda: publisher.count() >= 50, timeout=60, interval=0.02)
        return publisher

    publisher, publishing_on = publish_from(nodes[0]), 0
    for restarting, publishing in ((2, 0), (1, 0), (0, 1)):
        if publishing != publishing_on:  # the publisher is never on the node that restarts
            publisher.stop()
            acknowledged += list(publisher.acknowledged)
            publisher, publishing_on = publish_from(nodes[publishing]), publishing
        node = nodes[restarting]
        assert node.terminate(60) == 0  # graceful: hands its shards and sessions over
        node.start(node.mqtt_port)
        wait_settled(nodes)
        mark = publisher.count()
        wait_for(lambda mark=mark, publisher=publisher: publisher.count() >= mark + 100, timeout=60,
                 interval=0.02)
    publisher.stop()
    acknowledged += list(publisher.acknowledged)
    for each in publishers:
        assert not each.refused and not each.unanswered, (each.name, each.refused[:5], each.unanswered)
    expected = set(acknowledged)
    for index in range(SESSIONS):
        client = Paho(nodes[index].mqtt_port, f"roller-{index}", V5, clean=False, session_expiry=600,
                      connect=False)
        assert client.connect()[0].session_present
        got: set[str] = set()

        def take(client: Paho = client, got: set[str] = got) -> bool:
            while True:
                try:
                    got.add(client.expect(timeout=0).payload.decode())
                except Exception:  # noqa: BLE001 - queue.Empty: nothing more for now
                    return expected <= got

        try:
            wait_for(take, timeout=120, interval=0.05)
        except AssertionError:
            missing = sorted(expected - got)
            raise AssertionError(f"session roller-{index}: {len(missing)} of {len(expected)} "
                                 f"acknowledged messages never came: {missing[:20]}") from None
        client.disconnect()
