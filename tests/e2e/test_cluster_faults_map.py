"""The shard map changes while clients publish QoS 1 continuously (issue 14: "a shard map change
while clients publish"): a node joins and takes its share, then a node leaves with SIGTERM and
hands its shards over. A steady subscriber on a node that stays receives every acknowledged
message exactly once, in order per topic.

Why no duplicates are possible here: a publish is acknowledged by the shard's owner once, and
the owner pushes each stored message once to each node that wants it. A forward that reaches
a node which no longer owns the shard is refused there and re-routed by the sender to the new
owner (epochs only grow), not stored twice; a refused publish is answered with a retryable
error and is this test's to send again, as a new message. Duplicates are possible only for a
client that publishes again after losing a PUBACK (MQTT DUP) and for persistent sessions that
resume from an etcd snapshot after their node died (at least once, see docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from shardgate.client import Client

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

RETRYABLE = {0x80, 0x97}
FAST = '[[streams]]\nname = "fast"\nmode = "non-reliable"\npartitions = 6\n'


@pytest.fixture
def started(etcd: EtcdServer, tmp_path: Path) -> Iterator[list[ClusterNodeProcess]]:
    nodes: list[ClusterNodeProcess] = []
    yield nodes
    for node in nodes:
        if node.alive():
            node.kill()


def shards_of(status: dict[str, Any], node_id: str) -> int:
    return next((entry["shards"] for entry in status["nodes"] if entry["node_id"] == node_id), 0)


@pytest.mark.timeout(300)
def test_a_join_and_a_sigterm_leave_while_publishing_lose_and_duplicate_nothing(
    started: list[ClusterNodeProcess], etcd: EtcdServer, tmp_path: Path,
) -> None:
    n1 = protocol_node(tmp_path, "n1", etcd.url, FAST).start()
    n2 = protocol_node(tmp_path, "n2", etcd.url, FAST).start()
    started += [n1, n2]
    wait_settled(started)

    async def create() -> None:
        async with Client(n1.grpc_url) as client:
            await client.admin.create_stream("safe", partitions=4, mode="reliable")

    asyncio.run(create())
    wait_for(lambda: "safe" in n1.status()["placement"] and "safe" in n2.status()["placement"], timeout=30)
    status = n1.status()
    topics = topics_of(status, "fast", "fast/m", per_shard=2) + topics_of(status, "safe", "safe/m")
    subscriber = Paho(n1.mqtt_port, "steady", V5)
    subscriber.subscribe("fast/m/#", 1)
    subscriber.subscribe("safe/m/#", 1)
    publishers = [ContinuousPublisher(n1.mqtt_port, "via-n1", topics),
                  ContinuousPublisher(n2.mqtt_port, "via-n2", topics)]
    received: list[str] = []

    def take_all() -> None:
        while True:
            try:
                received.append(subscriber.expect(timeout=0).payload.decode())
            except queue.Empty:
                return

    def published_more(count: int) -> None:
        marks = [publisher.count() for publisher in publishers]
        wait_for(lambda: all(p.count() >= mark + count for p, mark in zip(publishers, marks, strict=True))
                 and (take_all() or True), timeout=60, interval=0.05)

    published_more(100)
    # a node joins: it takes a fair share of the non-reliable shards while both publish
    n3 = protocol_node(tmp_path, "n3", etcd.url, FAST).start()
    started.append(n3)
    wait_settled(started)
    wait_for(lambda: shards_of(n1.status(), "n3") >= 2, timeout=30)
    published_more(100)
    # n2 leaves with SIGTERM: it hands its shards over before it exits (its publisher's
    # connection ends with it; a reliable shard holding messages stays with n2, unavailable)
    # (the messages n2 stored while it stopped are pushed to n1's subscriber before n2 exits)
    assert n2.terminate() == 0
    assert publishers[1].dropped.wait(10)
    wait_settled(started)
    published_more_than = publishers[0].count()
    wait_for(lambda: publishers[0].count() >= published_more_than + 100 and (take_all() or True),
             timeout=60, interval=0.05)
    for publisher in publishers:
        publisher.stop()
    acknowledged = {payload for publisher in publishers for payload in publisher.acknowledged}
    with contextlib.suppress(AssertionError):  # (what is missing is reported below)
        wait_for(lambda: (take_all() or True) and acknowledged <= set(received), timeout=30)
    take_all()
    missing = sorted(acknowledged - set(received))
    assert not missing, f"{len(missing)} of {len(acknowledged)} acknowledged messages never arrived: {missing[:10]}"
    twice = sorted(payload for payload, count in Counter(received).items() if count > 1)
    assert not twice, f"{len(twice)} delivered twice: {twice[:10]}"
    # per topic, each publisher's messages arrive in the order they were acknowledged
    topic_of = {payload: topic for publisher in publishers for payload, topic in publisher.acknowledged.items()}
    seen: dict[tuple[str, str], list[int]] = defaultdict(list)
    for payload in received:
        if payload in topic_of:
            name, sequence = payload.rsplit("-", 1)
            seen[(name, topic_of[payload])].append(int(sequence))
    out_of_order = [key for key, sequences in seen.items() if sequences != sorted(sequences)]
    assert not out_of_order, f"out of order on {out_of_order[:5]}"
    refused = [entry for publisher in publishers for entry in publisher.refused]
    assert {code for code, _reason, _topic in refused} <= RETRYABLE, refused[:5]
    assert all(reason for _code, reason, _topic in refused)


def test_publishes_right_after_a_stream_is_created_on_another_node_are_stored(
    started: list[ClusterNodeProcess], etcd: EtcdServer, tmp_path: Path,
) -> None:
    """A stream created through n1 is used at once through n1: its shards that n2 owns get
    forwarded publishes before n2 may have learned the stream; n2 waits (bounded) for it
    instead of refusing them."""
    n1 = protocol_node(tmp_path, "n1", etcd.url).start()
    n2 = protocol_node(tmp_path, "n2", etcd.url).start()
    started += [n1, n2]
    wait_settled(started)
    from shardgate.protocols.mqtt import packets as p

    from tests.mqtt_clients import RawClient

    client = RawClient(n1.mqtt_port, version=5)
    client.connect("eager")
    packet_id = 0
    for round_ in range(3):
        name = f"fresh{round_}"

        async def create(name: str = name) -> None:
            async with Client(n1.grpc_url) as admin:
                await admin.admin.create_stream(name, partitions=4, mode="reliable")

        asyncio.run(create())
        # the first publishes the moment n1 knows where the shards are
        wait_for(lambda name=name: name in n1.status()["placement"], timeout=30, interval=0.01)
        for topic in topics_of(n1.status(), name, name):
            packet_id += 1
            client.send(p.Publish(topic, b"first", 1, packet_id=packet_id))
            puback = client.receive()
            assert isinstance(puback, p.Puback)
            assert puback.reason_code == 0, (topic, puback.properties.reason_string)
    client.close()
