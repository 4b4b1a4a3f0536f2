"""Durable subscriptions shared by the nodes of a cluster, with the gRPC SDK against a real etcd
and `shardgate serve --cluster` processes: a durable subscription consumed on one node is
consumed later on another from where it stopped, with what was published meanwhile; its
consumers are on one node at a time, and a consumer elsewhere is told where."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable

import pytest
from shardgate.client import Client, FailedPrecondition

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess, EtcdServer
from tests.e2e.test_cluster_state_sessions import TOPICS, etcd_get, spread_stream

Cluster = Callable[..., list[ClusterNodeProcess]]


async def take(consumer, count: int, *, ack: int | None = None, timeout: float = 30) -> dict[str, list[bytes]]:
    """`count` messages by topic; only the first `ack` (all by default) are acknowledged."""
    got: dict[str, list[bytes]] = defaultdict(list)
    seen = 0

    async def run() -> None:
        nonlocal seen
        async for message in consumer:
            got[message.topic].append(message.payload)
            if ack is None or seen < ack:
                message.ack()
            seen += 1
            if seen == count:
                return

    await asyncio.wait_for(run(), timeout)
    return got


async def publish(url: str, tag: str) -> dict[str, list[bytes]]:
    sent: dict[str, list[bytes]] = defaultdict(list)
    async with Client(url) as client:
        producer = client.producer()
        for sequence in range(3):
            for topic in TOPICS:
                payload = f"{tag}-{topic}-{sequence}".encode()
                await producer.send(topic, payload)
                sent[topic].append(payload)
    return sent


def test_a_durable_subscription_moves_to_the_node_its_consumer_comes_back_to(
        cluster: Cluster, etcd: EtcdServer) -> None:
    n1, n2, n3 = cluster(3)
    spread_stream([n1, n2, n3])

    async def scenario() -> None:
        async with Client(n1.grpc_url) as client:
            consumer = client.consumer("billing", ["away/#"], durable=True, reconnect=False)
            await consumer.subscribe()
            first = await publish(n3.grpc_url, "first")
            # everything delivered, one message of each topic left unacknowledged
            got = await take(consumer, sum(map(len, first.values())), ack=len(TOPICS) * 2)
            assert got == first
            await consumer.close()
        wait_for(lambda: (etcd_get(etcd, "/shardgate/test.state/durables/billing") or {}).get("node") == "n1",
                 timeout=20)
        later = await publish(n3.grpc_url, "later")

        async with Client(n2.grpc_url) as client:
            consumer = client.consumer("billing", ["away/#"], durable=True, reconnect=False)
            await consumer.subscribe()
            # the unacknowledged ones come again, then what was published while nobody consumed
            acked = 2 * len(TOPICS)
            unacked_count = sum(map(len, first.values())) - acked
            again = await take(consumer, unacked_count + sum(map(len, later.values())))
            assert sum(map(len, again.values())) == unacked_count + sum(map(len, later.values()))
            for topic in TOPICS:
                assert again[topic][-len(later[topic]):] == later[topic]  # in order per topic
                assert set(again[topic][:-len(later[topic])]) <= set(first[topic])
            live = await publish(n1.grpc_url, "live")
            assert await take(consumer, sum(map(len, live.values()))) == live
            info = await client.admin.describe_subscription("billing")
            assert info.durable
            await consumer.close()
        wait_for(lambda: (etcd_get(etcd, "/shardgate/test.state/durables/billing") or {}).get("node") == "n2",
                 timeout=20)

    asyncio.run(scenario())


def test_a_consumer_on_another_node_is_told_where_the_subscription_is_consumed(cluster: Cluster) -> None:
    n1, n2 = cluster(2)

    async def scenario() -> None:
        async with Client(n1.grpc_url) as first, Client(n2.grpc_url) as second:
            holder = first.consumer("audit", ["audit/#"], durable=True, reconnect=False)
            await holder.subscribe()
            elsewhere = second.consumer("audit", ["audit/#"], durable=True, reconnect=False)
            with pytest.raises(FailedPrecondition, match="consumed on node n1"):
                await elsewhere.subscribe()
            await first.producer().send("audit/x", b"still here")
            assert await take(holder, 1) == {"audit/x": [b"still here"]}
            await holder.close()

    asyncio.run(scenario())


async def take_from(consumers: list, count: int, timeout: float = 30) -> list[list[bytes]]:
    """`count` messages across `consumers` (acknowledged); what each one got, in order."""
    got: list[list[bytes]] = [[] for _ in consumers]
    done = asyncio.Event()

    async def drain(index: int, consumer) -> None:
        async for message in consumer:
            got[index].append(message.payload)
            message.ack()
            if sum(map(len, got)) >= count:
                done.set()

    tasks = [asyncio.ensure_future(drain(index, consumer)) for index, consumer in enumerate(consumers)]
    try:
        await asyncio.wait_for(done.wait(), timeout)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return got


@pytest.mark.parametrize("sub_type", ["shared", "failover"])
def test_shared_and_failover_consumers_share_one_node_and_a_consumer_elsewhere_is_refused(
        cluster: Cluster, sub_type: str) -> None:
    """Several consumers of a Shared or Failover durable subscription on its node: each message
    once across them (Shared) or all to the active one (Failover). A consumer on another node
    gets FAILED_PRECONDITION naming the node; once those consumers are gone, it is served."""
    n1, n2 = cluster(2)

    async def scenario() -> None:
        async with Client(n1.grpc_url) as first, Client(n2.grpc_url) as second:
            consumers = [first.consumer("work", ["work/#"], type=sub_type, durable=True,
                                        reconnect=False, name=f"c{index}") for index in range(2)]
            for consumer in consumers:
                await consumer.subscribe()
            elsewhere = second.consumer("work", ["work/#"], type=sub_type, durable=True, reconnect=False)
            with pytest.raises(FailedPrecondition, match="consumed on node n1"):
                await elsewhere.subscribe()
            producer = second.producer()
            sent = [f"job-{number}".encode() for number in range(20)]
            for payload in sent:
                await producer.send("work/x", payload)
            got = await take_from(consumers, len(sent))
            assert sorted(got[0] + got[1]) == sorted(sent)  # each once
            if sub_type == "failover":
                assert sent in got  # all to the active consumer, in order
            else:
                assert got[0] and got[1]  # spread over both
            for consumer in consumers:
                await consumer.close()
            later = second.consumer("work", ["work/#"], type=sub_type, durable=True, reconnect=False)
            await later.subscribe()
            await producer.send("work/x", b"after")
            assert await take(later, 1) == {"work/x": [b"after"]}
            await later.close()

    asyncio.run(scenario())
