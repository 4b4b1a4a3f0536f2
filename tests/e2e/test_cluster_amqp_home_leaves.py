"""What an AMQP client sees when the node a durable queue lives on leaves the cluster with
SIGTERM, as README's "Running a cluster" section says, with aiormq against `shardgate serve
--cluster` processes and a real etcd. RabbitMQ's classic queues behave the same: the queue is
unavailable (404 "home node ... is down or inaccessible") until its node returns, and then it
has every message, those its consumers held unacknowledged (delivered again with the
`redelivered` flag) and those published meanwhile."""

from __future__ import annotations

import asyncio
import re

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


async def test_a_durable_queue_whose_node_leaves_is_unavailable_until_it_returns(
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

        # every use of the queue through the other node: 404, naming the node that is down
        down = re.escape(f"home node '{home.node_id}' of durable queue 'orders-q' in vhost '/' "
                         "is down or inaccessible")
        for use in ("passive", "declare", "get", "consume", "bind", "purge"):
            channel = await on_owner.channel()
            with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity, match=down):
                if use == "passive":
                    await channel.queue_declare("orders-q", passive=True)
                elif use == "declare":
                    await channel.queue_declare("orders-q", durable=True)
                elif use == "get":
                    await channel.basic_get("orders-q")
                elif use == "consume":
                    await channel.basic_consume("orders-q", hold)
                elif use == "bind":
                    await channel.queue_bind("orders-q", "amq.topic", routing_key="more.#")
                else:
                    await channel.queue_purge("orders-q")
        # its bindings do not route meanwhile: a mandatory publish comes back (basic.return
        # before the ack); a plain one is stored by the shard's owner and acknowledged
        with pytest.raises(aiormq.exceptions.PublishError, match="312.*NO_ROUTE"):
            await publish(publisher, "orders.new", b"returned", mandatory=True)
        assert isinstance(await publish(publisher, "orders.new", b"m3"), aiormq.spec.Basic.Ack)

        home.start()
        wait_joined(amqp_nodes)
        # back with every message: the one the cancelled consumer held, and m3
        await eventually(lambda: _equals(message_count(amqp_url(owner), "orders-q"), 4), timeout=30)
        reader = await on_owner.channel()
        got = {}
        for _ in range(4):
            message = await reader.basic_get("orders-q", no_ack=True)
            got[message.body] = message.delivery.redelivered
        # the one the consumer held comes back too, with the redelivered flag, as in RabbitMQ
        # (m1 and m2, waiting in the queue when its node left, may get it too: conservative);
        # m3, published meanwhile, is a first delivery
        assert sorted(got) == [b"m0", b"m1", b"m2", b"m3"]
        assert held[0].delivery.redelivered is False
        assert got[held[0].body] is True
        assert got[b"m3"] is False
    finally:
        await on_owner.close()
        if not on_home.is_closed:
            await on_home.close()


async def _value(value: object) -> object:
    return value
