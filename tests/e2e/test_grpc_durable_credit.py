"""Durable gRPC subscriptions on a non-reliable stream (memory only) respect credit: a consumer
is pushed no more than its credit, the broker holds the rest for the subscription, and a
Failover standby that takes over gets what the consumer before it was given but never acked,
then everything held, in order. (Before, everything went into the first consumer's queue
whatever its credit, and was lost when it left.)"""

from __future__ import annotations

import asyncio

import pytest
from shardgate.client import Client, SubscriptionType

from tests.conftest import free_port


@pytest.fixture
def url(broker_factory) -> str:
    broker = broker_factory(listeners={"grpc_port": free_port()})
    return f"127.0.0.1:{broker.app.port('grpc')}"


async def test_a_failover_standby_gets_every_message_the_active_consumer_had_no_credit_for(url):
    async with Client(url) as client:
        await client.admin.create_stream("fast", mode="non-reliable")
        active = client.consumer("fo", ["fast/#"], durable=True, type=SubscriptionType.FAILOVER,
                                 credit=4, name="active")
        await active.subscribe()
        standby = client.consumer("fo", ["fast/#"], durable=True, type=SubscriptionType.FAILOVER,
                                  name="standby")
        await standby.subscribe()
        producer = client.producer()
        for index in range(40):
            await producer.send("fast/x", str(index))
        # the active consumer takes nothing from its buffer, so it grants no more credit
        await asyncio.sleep(0)
        deadline = asyncio.get_running_loop().time() + 10
        while active.buffered < 4:
            assert asyncio.get_running_loop().time() < deadline, active.buffered
            await asyncio.sleep(0.02)
        await producer.send("fast/x", "last")
        with pytest.raises(TimeoutError):
            await standby.receive(0.3)  # a standby gets nothing while the active one is there
        assert active.buffered == 4  # its credit, not more
        await active.close()
        got = []
        while len(got) < 41:
            message = await standby.receive(10)
            got.append(message.text())
            message.ack()
        assert got == [str(index) for index in range(40)] + ["last"]
        await standby.close()
