"""The SDK as an operator's users meet it, against a real broker over gRPC: a nack's delay
and redelivery count, dead-lettering after `max_deliveries` (per subscription, or the
broker's `grpc.max_deliveries`), the producer as a context manager, an ack that can be
awaited, and a subscription's lag in `describe_subscription`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from shardgate.client import Client, Position, SyncClient

from tests.conftest import ThreadedBroker, free_port


@pytest.fixture
def url(broker_factory: Callable[..., ThreadedBroker]) -> str:
    broker = broker_factory(listeners={"grpc_port": free_port()})
    return f"127.0.0.1:{broker.app.port('grpc')}"


@pytest.mark.parametrize("durable", [True, False])
async def test_nack_with_a_delay_redelivers_after_that_delay_counting_the_redelivery(
    url: str, durable: bool,
) -> None:
    async with Client(url) as client, client.producer() as producer:
        consumer = client.consumer(f"retry-{durable}", ["jobs/#"], durable=durable)
        await consumer.subscribe()
        await producer.send("jobs/1", b"work")
        first = await consumer.receive(timeout=10)
        assert first.redelivery_count == 0
        nacked_at = time.monotonic()
        await first.nack(delay_s=0.5)
        again = await consumer.receive(timeout=10)
        waited = time.monotonic() - nacked_at
        assert again.payload == b"work" and again.redelivery_count == 1
        assert 0.45 <= waited < 0.95, waited  # the delay asked for, not the next 1 s tick
        await again.ack()
        await consumer.close()


async def test_a_message_nacked_max_deliveries_times_goes_to_the_dead_letter_topic(url: str) -> None:
    async with Client(url) as client:
        dead = client.consumer("dead-letters", ["$dlq/#"])
        await dead.subscribe()
        consumer = client.consumer("picky", ["orders/#"], durable=True, max_deliveries=2)
        await consumer.subscribe()
        info = await client.admin.describe_subscription("picky")
        assert info.max_deliveries == 2
        async with client.producer() as producer:
            await producer.send("orders/7", b"poison")
        for attempt in range(2):
            message = await consumer.receive(timeout=10)
            assert (message.payload, message.redelivery_count) == (b"poison", attempt)
            await message.nack()
        dead_letter = await dead.receive(timeout=10)
        assert (dead_letter.topic, dead_letter.payload) == ("$dlq/picky", b"poison")
        with pytest.raises(TimeoutError):
            await consumer.receive(timeout=0.5)  # not delivered a third time
        await consumer.close()
        await dead.close()


async def test_the_brokers_max_deliveries_applies_to_subscriptions_that_set_none(
    broker_factory: Callable[..., ThreadedBroker],
) -> None:
    broker = broker_factory(listeners={"grpc_port": free_port()}, grpc={"max_deliveries": 1})
    async with Client(f"127.0.0.1:{broker.app.port('grpc')}") as client:
        consumer = client.consumer("strict", ["t/#"], durable=True)
        await consumer.subscribe()
        assert (await client.admin.describe_subscription("strict")).max_deliveries == 1
        await consumer.close()


async def test_describe_subscription_shows_the_lag_and_an_awaited_ack_has_reached_the_broker(
    url: str,
) -> None:
    async with Client(url) as client:
        consumer = client.consumer("audit", ["audit/#"], durable=True, position=Position.earliest())
        await consumer.subscribe()
        async with client.producer() as producer:
            for index in range(3):
                await producer.send("audit/x", str(index).encode())
        received = [await consumer.receive(timeout=10) for _ in range(3)]
        assert (await client.admin.describe_subscription("audit")).lag == 3
        for message in received:
            await message.ack()  # written to the broker when this returns
        deadline = time.monotonic() + 10
        while (lag := (await client.admin.describe_subscription("audit")).lag) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert lag == 0
        listed = {s.name: s for s in await client.admin.list_subscriptions()}
        assert listed["audit"].lag == 0
        await consumer.close()


def test_the_sync_producer_is_a_context_manager_and_ack_returns_at_once(url: str) -> None:
    with SyncClient(url) as client:
        consumer = client.consumer("sync-sub", ["sync/#"])
        consumer.subscribe()
        with client.producer("sync-producer") as producer:
            producer.send("sync/1", b"one")
        message = consumer.receive(timeout=10)
        message.ack().wait(10)
        consumer.close()
