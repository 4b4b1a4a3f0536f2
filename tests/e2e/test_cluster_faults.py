"""Faults while a cluster serves, with real clients and real processes (issue 14's "Bad input
and faults"): a node SIGKILLed while clients publish QoS 1 to its reliable shards (directly and
through another node), a node stopped for a while (SIGSTOP, then SIGCONT), and etcd killed and
restarted on the same data directory and ports while nodes serve and clients publish.

Each test publishes continuously (`ContinuousPublisher`: one QoS 1 message at a time, each
payload unique) and afterwards reads every stored message back through the gRPC SDK from the
earliest offset: every message that was acknowledged must be there, once.
"""

from __future__ import annotations

import asyncio
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from shardgate.client import Client, Unavailable

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import (
    ClusterNodeProcess,
    ContinuousPublisher,
    EtcdServer,
    protocol_node,
    read_back,
    topics_of,
    wait_settled,
)

RETRYABLE = {0x80, 0x97}  # MQTT 5: unspecified error, quota exceeded (both say "try again")


@pytest.fixture
def nodes(etcd: EtcdServer, tmp_path: Path) -> Iterator[list[ClusterNodeProcess]]:
    """n1 and n2 with every protocol, and a reliable stream `safe` (4 shards) created once
    both are members, so that each of them owns some of its shards."""
    started = [protocol_node(tmp_path, name, etcd.url).start() for name in ("n1", "n2")]
    try:
        wait_settled(started)

        async def create() -> None:
            async with Client(started[0].grpc_url) as client:
                await client.admin.create_stream("safe", partitions=4, mode="reliable")

        asyncio.run(create())
        wait_for(lambda: all(placed_on_both(node.status()) for node in started), timeout=30)
        yield started
    finally:
        for node in started:
            if node.alive():
                node.kill()


def placed_on_both(status: dict[str, Any]) -> bool:
    owners = {owner for owner, _epoch in status["placement"].get("safe", [])}
    return owners == {"n1", "n2"}


def sequence(payload: str) -> int:
    return int(payload.rsplit("-", 1)[1])


def assert_every_acknowledged_message_is_stored_once(
    nodes: list[ClusterNodeProcess], publishers: list[ContinuousPublisher],
) -> None:
    """Read each shard of `safe` back from the node that owns it (a consumer from the earliest
    offset, filtered to the topics on that node's shards): every acknowledged payload once."""
    acknowledged = {payload for publisher in publishers for payload in publisher.acknowledged}
    topics = {topic for publisher in publishers for topic in publisher.topics}
    placement = nodes[0].status()["placement"]["safe"]
    got: Counter[str] = Counter()
    for node in nodes:
        own = sorted(topic for topic in topics
                     if placement[zlib.crc32(topic.encode()) % len(placement)][0] == node.node_id)
        expected = {payload for publisher in publishers
                    for payload, topic in publisher.acknowledged.items() if topic in own}
        if own:
            got += asyncio.run(read_back(node.grpc_url, own, expected))
    missing = sorted(acknowledged - set(got), key=lambda payload: (payload[:2], sequence(payload)))
    assert not missing, f"{len(missing)} of {len(acknowledged)} acknowledged messages lost: {missing[:10]}"
    twice = sorted(payload for payload, count in got.items() if count > 1)
    assert not twice, f"{len(twice)} messages stored twice: {twice[:10]}"


@pytest.mark.timeout(300)
def test_a_node_killed_mid_publish_returns_with_every_acknowledged_message(
    nodes: list[ClusterNodeProcess],
) -> None:
    n1, n2 = nodes
    status = n1.status()
    topics = topics_of(status, "safe", "safe/k", per_shard=2)
    on_n2 = set(topics_of(status, "safe", "safe/k", owner="n2", per_shard=2))
    through_n1 = ContinuousPublisher(n1.mqtt_port, "via-n1", topics)
    on_n2_itself = ContinuousPublisher(n2.mqtt_port, "on-n2", topics)
    wait_for(lambda: through_n1.count() >= 100 and on_n2_itself.count() >= 100, timeout=60)
    n2.kill()
    assert on_n2_itself.dropped.wait(10), "the client of the killed node noticed"
    # publishes to n2's shards through n1 are refused with a retryable reason and a reason
    # string; publishes to n1's shards go on being acknowledged
    acknowledged_at_kill = through_n1.count()
    wait_for(lambda: through_n1.refusals() >= 10 and through_n1.count() >= acknowledged_at_kill + 10,
             timeout=30)
    assert {code for code, _reason, _topic in through_n1.refused} <= RETRYABLE, through_n1.refused[:5]
    assert all(reason for _code, reason, _topic in through_n1.refused), "every refusal says why"
    assert {topic for _code, _reason, topic in through_n1.refused} <= on_n2
    refused_topic = next(iter(on_n2))
    assert_amqp_and_grpc_publishes_are_refused(n1, refused_topic)
    # n2 returns with its data directory: its shards are available again
    n2.start()
    wait_settled(nodes)
    wait_for(lambda: not n1.status()["unavailable_shards"], timeout=30)
    refused_before = through_n1.refusals()

    def n2_shard_acknowledged_again() -> bool:
        later = [payload for payload, topic in list(through_n1.acknowledged.items())[-len(topics) * 2:]
                 if topic in on_n2]
        return bool(later) and through_n1.refusals() == refused_before

    wait_for(n2_shard_acknowledged_again, timeout=30)
    through_n1.stop()
    on_n2_itself.stop()
    assert_every_acknowledged_message_is_stored_once(nodes, [through_n1, on_n2_itself])


def assert_amqp_and_grpc_publishes_are_refused(node: ClusterNodeProcess, topic: str) -> None:
    """While `topic`'s owner is down: an AMQP publisher with confirms gets a nack for a
    persistent message, the gRPC SDK gets UNAVAILABLE. (Not mandatory: a mandatory message that
    no AMQP queue is bound for is returned unroutable and confirmed before it reaches a stream,
    as RabbitMQ does.)"""

    async def check() -> None:
        url = f"amqp://guest:guest@127.0.0.1:{node.ports['amqp']}/"
        async with await aio_pika.connect(url) as connection:
            channel = await connection.channel(publisher_confirms=True)
            exchange = await channel.get_exchange("amq.topic")
            with pytest.raises(aio_pika.exceptions.DeliveryError):
                await exchange.publish(aio_pika.Message(b"refused", delivery_mode=2),
                                       topic.replace("/", "."), mandatory=False)
        async with Client(node.grpc_url) as client:
            with pytest.raises(Unavailable):
                await client.producer().send(topic, "refused")

    asyncio.run(check())
