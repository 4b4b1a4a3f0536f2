"""What an AMQP client sees when the node a durable queue lives on leaves the cluster with
SIGTERM, as README's "Running a cluster" section says, with aiormq against `shardgate serve
--cluster` processes and a real etcd. As RabbitMQ moves a quorum queue's leader, another node
takes the queue over from its replicated state: it has every message, those its consumers
held unacknowledged (delivered again with the `redelivered` flag) and those published
meanwhile, and its bindings route again. The node that left comes back without taking it back."""

from __future__ import annotations

import asyncio

import aiormq
import pytest

from tests.e2e.cluster_fixtures import ClusterNodeProcess
from tests.e2e.test_cluster_amqp_queues import (  # noqa: F401 - the fixture
    _equals,
    amqp_nodes,
    amqp_url,
    by_shard_owner,
    eventually,
    message_count,
    wait_joined,
)


async def publish(channel: aiormq.abc.AbstractChannel, routing_key: str, body: bytes, *,
                  mandatory: bool = False) -> object:
    return await channel.basic_publish(
        body, exchange="amq.topic", routing_key=routing_key, mandatory=mandatory,
        properties=aiormq.spec.Basic.Properties(delivery_mode=2, message_id=body.decode()))


async def test_a_durable_queue_whose_node_leaves_is_taken_over_by_another_node(
        amqp_nodes: list[ClusterNodeProcess]) -> None:  # noqa: F811 - the imported fixture
    # the queue's node is not the one owning the default stream's shard, so publishing goes on
    owner, home = by_shard_owner(amqp_nodes)
    on_home = await aiormq.connect(amqp_url(home))
    setup = await on_home.channel()
    await setup.queue_declare("orders-q", durable=True)
    await setup.queue_bind("orders-q", "amq.topic", routing_key="orders.#")

    on_owner = await aiormq.connect(amqp_url(owner))
    try:
        publisher = await on_owner.channel()
        await publisher.confirm_delivery()
        for index in range(3):
            assert isinstance(await publish(publisher, "orders.new", f"m{index}".encode()),
                              aiormq.spec.Basic.Ack)
        await eventually(lambda: _equals(message_count(amqp_url(owner), "orders-q"), 3))

        # a consumer on the other node holds one message unacknowledged
        consumer = await on_owner.channel()
        await consumer.basic_qos(prefetch_count=1)
        held: list[aiormq.abc.DeliveredMessage] = []

        async def hold(message: aiormq.abc.DeliveredMessage) -> None:
            held.append(message)

        tag = (await consumer.basic_consume("orders-q", hold)).consumer_tag
        await eventually(lambda: _equals(_value(len(held)), 1))

        assert home.terminate() == 0
        # the queue's node closed its own clients' connections: 320 CONNECTION_FORCED
        with pytest.raises(aiormq.exceptions.ConnectionClosed, match="320"):
            await asyncio.wait_for(on_home.closing, 10)
        # the consumer on the other node is cancelled (basic.cancel), its channel stays open
        await eventually(lambda: _value(tag not in consumer.consumers))
        assert not consumer.is_closed

        # the other node takes the queue over: every message, the held one too
        await eventually(lambda: _equals(_count_or_none(amqp_url(owner), "orders-q"), 3),
                         timeout=30)
        # its bindings route again: a mandatory publish is taken
        assert isinstance(await publish(publisher, "orders.new", b"m3", mandatory=True),
                          aiormq.spec.Basic.Ack)

        home.start()
        wait_joined(amqp_nodes)
        # the node that left does not take it back: its clients use it where it lives now
        await eventually(lambda: _equals(message_count(amqp_url(home), "orders-q"), 4), timeout=30)
        reader = await on_owner.channel()
        got = {}
        for _ in range(4):
            message = await reader.basic_get("orders-q", no_ack=True)
            got[message.body] = message.delivery.redelivered
        # the one the consumer held comes back with the redelivered flag, as in RabbitMQ
        # (m1 and m2, waiting in the queue when its node left, may get it too: conservative);
        # m3, published after the takeover, is a first delivery
        assert sorted(got) == [b"m0", b"m1", b"m2", b"m3"]
        assert held[0].delivery.redelivered is False
        assert got[held[0].body] is True
        assert got[b"m3"] is False
    finally:
        await on_owner.close()
        if not on_home.is_closed:
            await on_home.close()


async def _count_or_none(url: str, queue: str) -> int | None:
    """The queue's message count, or None while no node serves it (404)."""
    try:
        return await message_count(url, queue)
    except aiormq.exceptions.ChannelNotFoundEntity:
        return None


async def _value(value: object) -> object:
    return value
