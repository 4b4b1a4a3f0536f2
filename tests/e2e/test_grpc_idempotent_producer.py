"""The SDK's idempotent producer on one node: a publish whose answer is lost is retried by the SDK
and stored once, answered with the first copy's offset (unary `publish` and the batching
`send`). The real SDK over a real channel against a whole Shardgate with a journal; the answer
is lost by a TCP proxy between them (`lost_answers.py`), which drops what the broker sends
until the message is in the stream, then breaks the connection.

Without the producer's identity (`idempotent=False`, as every SDK before it) the same retry is
stored a second time: the last test shows the scenario does retry.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from shardgate.client import Client, Receipt
from shardgate.proto import shardgate_pb2 as pb
from shardgate.proto import shardgate_pb2_grpc as pb_grpc

from tests.conftest import ThreadedBroker, free_port
from tests.e2e.lost_answers import AnswerLosingProxy

STREAM = "once"
TIMEOUT = 30.0


@pytest.fixture
def grpc_broker(broker_factory: Callable[..., ThreadedBroker]) -> ThreadedBroker:
    return broker_factory(listeners={"grpc_port": free_port()})


@pytest.fixture
async def direct(grpc_broker: ThreadedBroker) -> AsyncIterator[Client]:
    async with Client(f"127.0.0.1:{grpc_broker.app.port('grpc')}") as client:
        await client.admin.create_stream(STREAM, partitions=1, mode="reliable")
        yield client


@pytest.fixture
async def proxy(grpc_broker: ThreadedBroker) -> AsyncIterator[AnswerLosingProxy]:
    proxy = await AnswerLosingProxy(grpc_broker.app.port("grpc")).start()
    yield proxy
    await proxy.close()


async def stored(client: Client) -> int:
    """How many messages the stream holds."""
    info = await client.admin.describe_stream(STREAM)
    return sum(shard.next_offset for shard in info.shards)


async def eventually(condition: Callable[[], Awaitable[Any]], timeout: float = TIMEOUT) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def payloads(client: Client, count: int) -> list[str]:
    """The first `count` messages of the stream, in order (and nothing more comes soon after)."""
    consumer = client.consumer("check", stream=STREAM, position="earliest")
    await consumer.subscribe()
    got = [(await consumer.receive(TIMEOUT)).text() for _ in range(count)]
    with pytest.raises(TimeoutError):
        extra = await consumer.receive(1.0)
        got.append(extra.text())
    await consumer.close()
    return got


async def lose_answer(proxy: AnswerLosingProxy, direct: Client, held: int,
                      send: Awaitable[Receipt]) -> Receipt:
    """Send through the proxy with the broker's answers dropped; once the stream holds the
    message (`held` messages), break the connection: the SDK retries on a new one."""
    proxy.dropping = True
    task = asyncio.ensure_future(send)
    await eventually(lambda: _answered(proxy, direct, held))
    assert not task.done()
    proxy.cut()
    proxy.dropping = False
    return await asyncio.wait_for(task, TIMEOUT)


async def _answered(proxy: AnswerLosingProxy, client: Client, count: int) -> bool:
    return await stored(client) >= count and proxy.dropped_bytes > 0


async def test_a_unary_publish_whose_answer_was_lost_is_stored_once(
        direct: Client, proxy: AnswerLosingProxy) -> None:
    async with Client(f"127.0.0.1:{proxy.port}") as client:
        producer = client.producer()
        first = await producer.publish(f"{STREAM}/a", b"first")
        receipt = await lose_answer(proxy, direct, 2, producer.publish(f"{STREAM}/a", b"lost"))
        assert (receipt.stream, receipt.shard, receipt.offset) == (STREAM, 0, first.offset + 1)
        after = await producer.publish(f"{STREAM}/a", b"after")
        assert after.offset == first.offset + 2
    assert await payloads(direct, 3) == ["first", "lost", "after"]


async def test_a_batch_whose_acknowledgement_was_lost_is_resent_and_stored_once(
        direct: Client, proxy: AnswerLosingProxy) -> None:
    async with Client(f"127.0.0.1:{proxy.port}") as client:
        producer = client.producer()
        first = await producer.send(f"{STREAM}/a", b"first")
        futures = [producer.send_nowait(f"{STREAM}/a", text) for text in ("lost-1", "lost-2")]

        async def both() -> Receipt:
            await asyncio.gather(*futures)
            return futures[-1].result()

        await lose_answer(proxy, direct, 3, both())
        assert [future.result().offset for future in futures] == [first.offset + 1, first.offset + 2]
        after = await producer.send(f"{STREAM}/a", b"after")
        assert after.offset == first.offset + 3
        await producer.close()
    assert await payloads(direct, 4) == ["first", "lost-1", "lost-2", "after"]


async def test_a_resend_of_the_same_identity_is_answered_with_the_first_copy(
        direct: Client, grpc_broker: ThreadedBroker) -> None:
    """What the SDK sends, by hand: the same identity again, marked resent, is answered with
    the first copy's place; a new sequence number, or a resend never stored, is stored."""
    stub = pb_grpc.ProducerStub(direct.channel)
    identity = pb.ProducerIdentity(producer_id=b"p" * 16, sequence=7)
    request = pb.PublishRequest(topic=f"{STREAM}/b", payload=b"seven", identity=identity)
    first = await stub.Publish(request)
    request.identity.resent = True
    request.identity.first_sent_ms_ago = 1500
    again = await stub.Publish(request)
    assert (again.stream, again.shard, again.offset) == (first.stream, first.shard, first.offset)
    request.identity.sequence = 8
    request.payload = b"eight"
    eight = await stub.Publish(request)  # resent, but never stored before: stored now
    assert eight.offset == first.offset + 1
    assert (await stub.Publish(request)).offset == eight.offset
    assert await payloads(direct, 2) == ["seven", "eight"]


async def test_without_the_identity_the_lost_answer_is_stored_twice(
        direct: Client, proxy: AnswerLosingProxy) -> None:
    async with Client(f"127.0.0.1:{proxy.port}") as client:
        producer = client.producer(idempotent=False)
        first = await producer.publish(f"{STREAM}/a", b"first")
        receipt = await lose_answer(proxy, direct, 2, producer.publish(f"{STREAM}/a", b"lost"))
        assert receipt.offset == first.offset + 2  # the retry is a second copy
    assert await payloads(direct, 3) == ["first", "lost", "lost"]
