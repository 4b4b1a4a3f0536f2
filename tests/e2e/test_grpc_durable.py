"""Durable gRPC subscriptions on reliable streams: replay from earliest, cursor reset, lag,
and cursors that survive a SIGKILL of the broker."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from shardgate.client import Client, Position

from tests.conftest import free_port


@pytest.fixture
def url(broker_factory) -> str:
    broker = broker_factory(listeners={"grpc_port": free_port()})
    return f"127.0.0.1:{broker.app.port('grpc')}"


async def take(consumer, count: int, ack: bool = True, timeout: float = 10) -> list[bytes]:
    got = []

    async def run() -> None:
        async for message in consumer:
            got.append(message.payload)
            if ack:
                message.ack()
            if len(got) == count:
                return

    await asyncio.wait_for(run(), timeout)
    return got


async def test_durable_subscription_replays_history_from_earliest(url):
    async with Client(url) as client:
        producer = client.producer()
        for index in range(10):
            await producer.send("history/a", str(index).encode())
        consumer = client.consumer("late", ["history/#"], durable=True, position=Position.earliest())
        assert await take(consumer, 10) == [str(i).encode() for i in range(10)]
        await producer.send("history/a", b"live")
        assert await take(consumer, 1) == [b"live"]
        await consumer.close()


async def test_reset_cursor_and_lag(url):
    async with Client(url) as client:
        producer = client.producer()
        consumer = client.consumer("resettable", ["reset/#"], durable=True)
        await consumer.subscribe()
        for index in range(5):
            await producer.send("reset/x", str(index).encode())
        assert await take(consumer, 5) == [str(i).encode() for i in range(5)]
        await client.admin.reset_cursor("resettable", Position.earliest())
        assert await take(consumer, 5) == [str(i).encode() for i in range(5)]
        info = await client.admin.describe_subscription("resettable")
        assert info.durable
        await consumer.close()


async def saved_ack_floor(data_dir, subscription: str, floor: int, timeout: float = 10) -> None:
    """Wait until the metadata store holds a cursor of `subscription` acknowledged below
    `floor` (cursors are saved every 200 ms); read it from outside, read-only."""
    import sqlite3

    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(sqlite3.OperationalError):  # not created yet
            with sqlite3.connect(f"file:{data_dir / 'metadata.db'}?mode=ro", uri=True) as db:
                row = db.execute("select max(ack_floor) from cursors where subscription = ?",
                                 (subscription,)).fetchone()
            if row[0] is not None and row[0] >= floor:
                return
        assert time.monotonic() < deadline, f"cursor of {subscription!r} not saved at {floor}"
        await asyncio.sleep(0.05)


def test_durable_cursor_survives_sigkill(broker_process):
    grpc_port = free_port()
    broker = broker_process(extra_args=["--grpc-port", str(grpc_port)]).start()
    url = f"127.0.0.1:{grpc_port}"

    async def first_run() -> None:
        async with Client(url) as client:
            consumer = client.consumer("billing", ["orders/#"], durable=True, reconnect=False)
            await consumer.subscribe()
            producer = client.producer()
            for index in range(10):
                await producer.send("orders/eu", str(index).encode())
            assert await take(consumer, 4) == [b"0", b"1", b"2", b"3"]
            await saved_ack_floor(broker.data_dir, "billing", 4)

    asyncio.run(first_run())
    broker.kill()
    broker.start(mqtt_port=broker.mqtt_port)

    async def second_run() -> list[bytes]:
        async with Client(url) as client:
            consumer = client.consumer("billing", ["orders/#"], durable=True)
            return await take(consumer, 6)

    deadline = time.monotonic() + 20
    while True:
        try:
            rest = asyncio.run(second_run())
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    assert rest == [b"4", b"5", b"6", b"7", b"8", b"9"]


async def test_shared_consumers_out_of_credit_get_every_message_once_when_they_read_again(url):
    """Two consumers of a Shared durable subscription take their small credit windows and stop
    while 15,000 messages are published, more than a consumer queues: none is queued on a
    consumer nobody drains; when they read again each message comes once."""
    async with Client(url) as client:
        consumers = [client.consumer("flood", ["flood/#"], type="shared", durable=True,
                                     reconnect=False, credit=10, name=name) for name in "ab"]
        for consumer in consumers:
            await consumer.subscribe()
        producer = client.producer()
        sent = [f"flood-{number}".encode() for number in range(15_000)]
        await asyncio.gather(*(producer.send_nowait("flood/x", payload) for payload in sent))
        got: list[bytes] = []
        done = asyncio.Event()

        async def drain(consumer) -> None:
            async for message in consumer:
                got.append(message.payload)
                message.ack()
                if len(got) >= len(sent):
                    done.set()

        tasks = [asyncio.ensure_future(drain(consumer)) for consumer in consumers]
        try:
            await asyncio.wait_for(done.wait(), 60)
            await asyncio.sleep(0.5)  # anything delivered twice would come right after
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        assert len(got) == len(set(got)) == len(sent)
        for consumer in consumers:
            await consumer.close()
