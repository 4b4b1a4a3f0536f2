"""The native gRPC API end to end: the SDK over a real channel against a whole Shardgate."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from shardgate.client import (
    AlreadyExists,
    Client,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    Position,
    ResourceExhausted,
    SyncClient,
    schemas,
)
from shardgate.proto import shardgate_pb2 as pb
from shardgate.proto import shardgate_pb2_grpc as pb_grpc
from shardgate.protocols.grpc.server import start_grpc_server

from tests.conftest import ThreadedBroker, free_port

TIMEOUT = 5.0


@pytest.fixture
def grpc_broker(broker_factory: Callable[..., ThreadedBroker]) -> ThreadedBroker:
    return broker_factory(listeners={"grpc_port": free_port()})


@pytest.fixture
def url(grpc_broker: ThreadedBroker) -> str:
    return f"127.0.0.1:{grpc_broker.app.port('grpc')}"


@pytest.fixture
async def client(url: str) -> AsyncIterator[Client]:
    async with Client(url) as client:
        yield client


async def eventually(condition: Callable[[], Any], timeout: float = TIMEOUT) -> Any:
    """Await until `condition()` (sync or async) is truthy."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.02)


# ------------------------------------------------------------------------------ Admin
async def test_stream_lifecycle_create_list_describe_delete(client: Client) -> None:
    created = await client.admin.create_stream("orders", partitions=3, schema="json",
                                               retention_ms=60_000)
    assert created.partitions == 3 and created.schema == "json"
    assert sorted(created.routes) == ["orders", "orders/#"]
    assert [shard.index for shard in created.shards] == [0, 1, 2]
    assert "orders" in [s.name for s in await client.admin.list_streams()]

    producer = client.producer()
    receipt = await producer.send("orders/eu", b'{"id": 1}')
    assert receipt.stream == "orders"
    described = await client.admin.describe_stream("orders")
    assert sum(shard.next_offset for shard in described.shards) == 1
    assert described.retention_ms == 60_000

    with pytest.raises(AlreadyExists):
        await client.admin.create_stream("orders")
    await client.admin.delete_stream("orders")
    with pytest.raises(NotFound):
        await client.admin.describe_stream("orders")
    with pytest.raises(NotFound):
        await client.admin.delete_stream("orders")


async def test_admin_refuses_bad_stream_definitions(client: Client) -> None:
    with pytest.raises(InvalidArgument):
        await client.admin.create_stream("bad name!")
    with pytest.raises(InvalidArgument):
        await client.admin.create_stream("ok", routes=["a/#/b"])
    with pytest.raises(FailedPrecondition, match="default"):
        await client.admin.delete_stream("default")


async def test_reliable_stream_acknowledges_once_journaled(client: Client) -> None:
    created = await client.admin.create_stream("ledger", mode="reliable", partitions=2)
    assert created.mode == "reliable"
    consumer = await client.consumer("ledger-sub", stream="ledger").subscribe()
    producer = client.producer()
    unary = await producer.publish("ledger/a", b"1", key="k")
    streamed = await asyncio.gather(*(producer.send_nowait("ledger/a", b"2", key="k")
                                      for _ in range(50)))
    assert [r.offset for r in streamed] == list(range(unary.offset + 1, unary.offset + 51))
    assert {r.shard for r in streamed} == {unary.shard}
    payloads = [(await consumer.receive(TIMEOUT)).payload for _ in range(51)]
    assert payloads == [b"1"] + [b"2"] * 50


async def test_routes_send_topics_to_streams(client: Client) -> None:
    await client.admin.create_stream("metrics", routes=["telemetry/+/cpu"])
    await client.admin.add_route("telemetry/+/mem", "metrics")
    assert ("telemetry/+/mem", "metrics") in await client.admin.list_routes()
    producer = client.producer()
    assert (await producer.send("telemetry/h1/mem", b"1")).stream == "metrics"
    await client.admin.remove_route("telemetry/+/mem")
    assert (await producer.send("telemetry/h1/mem", b"1")).stream == "default"
    with pytest.raises(NotFound):
        await client.admin.add_route("x/#", "missing")


async def test_broker_info_and_clients(client: Client, grpc_broker: ThreadedBroker) -> None:
    info = await client.admin.broker_info()
    assert info.listeners["grpc"][1] == grpc_broker.app.port("grpc")
    consumer = await client.consumer("watch", ["a/#"], name="watcher").subscribe()
    clients = await client.admin.list_clients()
    assert any(c.protocol == "grpc" and "consumer of watch" in c.detail for c in clients)
    await consumer.close()


# ------------------------------------------------------------------------------ Producer
async def test_unary_and_streamed_publish_return_offsets_in_order(client: Client) -> None:
    await client.admin.create_stream("seq")
    producer = client.producer()
    first = await producer.publish("seq", b"a")
    futures = [producer.send_nowait("seq", f"m{i}".encode()) for i in range(2500)]
    receipts = await asyncio.gather(*futures)
    assert first.offset == 0
    assert [r.offset for r in receipts] == list(range(1, 2501))


async def test_publish_to_unknown_stream_is_not_found(client: Client) -> None:
    producer = client.producer()
    with pytest.raises(NotFound, match="nowhere"):
        await producer.publish("", b"x", stream="nowhere")
    with pytest.raises(NotFound):
        await producer.send("", b"x", stream="nowhere")
    await client.admin.create_stream("here")
    with pytest.raises(InvalidArgument, match="resolves to stream 'default'"):
        await producer.publish("elsewhere/t", b"x", stream="here")


async def test_bad_topics_and_oversized_payloads_are_refused(client: Client) -> None:
    producer = client.producer()
    with pytest.raises(InvalidArgument):
        await producer.publish("a/+/b", b"x")
    with pytest.raises(InvalidArgument):
        await producer.send("", b"x")
    with pytest.raises(ResourceExhausted, match="exceeds"):
        await producer.publish("big", b"x" * (1024 * 1024 + 1))
    # A refused message in a batch fails alone; its neighbours are stored.
    good = producer.send_nowait("fine", b"1")
    bad = producer.send_nowait("bad/#", b"2")
    also_good = producer.send_nowait("fine", b"3")
    assert (await good).offset + 1 == (await also_good).offset
    with pytest.raises(InvalidArgument):
        await bad


@pytest.mark.parametrize(("schema", "good", "bad", "reason"), [
    ("string", "héllo".encode(), b"\xff\xfe", "UTF-8"),
    ("int64", schemas.encode_int64(-42), b"42", "8 bytes"),
    ("json", schemas.encode_json({"t": 21.5}), b"{broken", "JSON"),
])
async def test_schema_mismatch_is_invalid_argument_with_reason(
    client: Client, schema: str, good: bytes, bad: bytes, reason: str
) -> None:
    await client.admin.create_stream("typed", schema=schema)
    producer = client.producer()
    consumer = await client.consumer("typed-sub", stream="typed").subscribe()
    await producer.send("typed", good)
    with pytest.raises(InvalidArgument, match=reason):
        await producer.send("typed/x", bad)
    with pytest.raises(InvalidArgument, match=reason):
        await producer.publish("typed", bad)
    message = await consumer.receive(TIMEOUT)
    assert message.payload == good
    if schema == "int64":
        assert message.int64() == -42
    if schema == "json":
        assert message.json() == {"t": 21.5}



async def test_a_batch_with_a_schema_violation_acks_the_others_and_refuses_only_it(
    client: Client,
) -> None:
    await client.admin.create_stream("counts", schema="int64", routes=["counts/#"])
    consumer = await client.consumer("counts-sub", stream="counts").subscribe()
    producer = client.producer()
    # Sent in one tick, they travel in one PublishBatch and reach the core in one call.
    sent = [
        producer.send_nowait("counts/a", schemas.encode_int64(1)),
        producer.send_nowait("counts/a", b"not eight bytes"),
        producer.send_nowait("plain/t", b"bytes stream"),
        producer.send_nowait("bad/#", b"invalid topic"),
        producer.send_nowait("counts/a", schemas.encode_int64(2)),
    ]
    outcomes = await asyncio.gather(*sent, return_exceptions=True)
    first, violation, plain, bad_topic, second = outcomes
    assert isinstance(violation, InvalidArgument) and "8 bytes" in str(violation)
    assert isinstance(bad_topic, InvalidArgument)
    assert (first.stream, second.stream, plain.stream) == ("counts", "counts", "default")
    assert second.offset == first.offset + 1
    # Delivered in order, with nothing stored between them.
    got = [await consumer.receive(TIMEOUT) for _ in range(2)]
    assert [(m.int64(), m.offset) for m in got] == [(1, first.offset), (2, second.offset)]


# ------------------------------------------------------------------------------ Consumer
async def test_exclusive_refuses_a_second_consumer(client: Client) -> None:
    first = await client.consumer("solo", ["jobs/#"], type="exclusive").subscribe()
    with pytest.raises(FailedPrecondition, match="exclusive"):
        await client.consumer("solo", ["jobs/#"], type="exclusive").subscribe()
    with pytest.raises(FailedPrecondition, match="exclusive, not shared"):
        await client.consumer("solo", ["jobs/#"], type="shared").subscribe()
    await client.producer().send("jobs/1", b"j")
    assert (await first.receive(TIMEOUT)).payload == b"j"
    await first.close()
    # Once the consumer left, the name is free again.
    again = await client.consumer("solo", ["jobs/#"]).subscribe()
    await again.close()


async def test_shared_round_robins(client: Client) -> None:
    consumers = [await client.consumer("pool", ["work/#"], type="shared").subscribe()
                 for _ in range(3)]
    producer = client.producer()
    for i in range(9):
        await producer.send("work/item", str(i).encode())
    got = [[(await c.receive(TIMEOUT)).payload for _ in range(3)] for c in consumers]
    assert sorted(p for chunk in got for p in chunk) == sorted(str(i).encode() for i in range(9))
    assert all(len(chunk) == 3 for chunk in got)
    assert got[0] == [b"0", b"3", b"6"]


async def test_failover_standby_takes_over_when_active_leaves(client: Client) -> None:
    active = await client.consumer("ha", ["ha/#"], type="failover").subscribe()
    standby = await client.consumer("ha", ["ha/#"], type="failover").subscribe()
    assert active.active and not standby.active
    producer = client.producer()
    await producer.send("ha/1", b"before")
    message = await active.receive(TIMEOUT)
    assert message.payload == b"before"
    # Leave without acking: the unacked message goes to the standby, now active.
    await active.close()
    await asyncio.wait_for(standby.wait_active(), TIMEOUT)
    redelivered = await standby.receive(TIMEOUT)
    assert redelivered.payload == b"before" and redelivered.redelivery_count == 1
    await producer.send("ha/1", b"after")
    assert (await standby.receive(TIMEOUT)).payload == b"after"


async def test_consumer_killed_with_unacked_messages_they_are_redelivered(url: str) -> None:
    async with Client(url) as survivor_client:
        survivor = await survivor_client.consumer("jobs", ["q/#"], type="shared", credit=100).subscribe()
        doomed_client = Client(url)
        doomed = await doomed_client.consumer("jobs", ["q/#"], type="shared").subscribe()
        producer = survivor_client.producer()
        for i in range(4):
            await producer.send("q/x", str(i).encode())
        taken = [await doomed.receive(TIMEOUT) for _ in range(2)]
        assert {m.payload for m in taken} == {b"1", b"3"}
        await doomed_client._channel.close(grace=None)  # the connection drops, no goodbye
        payloads = [(await survivor.receive(TIMEOUT)).payload for _ in range(4)]
        assert sorted(payloads) == [b"0", b"1", b"2", b"3"]


async def test_nack_redelivers_after_delay_and_acks_are_checked(client: Client) -> None:
    consumer = await client.consumer("retry", ["r/#"]).subscribe()
    await client.producer().send("r/1", b"again")
    message = await consumer.receive(TIMEOUT)
    message.nack(delay_s=0.2)
    started = asyncio.get_running_loop().time()
    again = await consumer.receive(TIMEOUT)
    assert again.payload == b"again" and again.redelivery_count == 1
    assert asyncio.get_running_loop().time() - started >= 0.15
    again.ack()
    again.ack()  # a second ack of the same delivery is reported, not fatal
    await eventually(lambda: consumer.errors)
    assert consumer.errors[0].code == grpc.StatusCode.NOT_FOUND


async def test_credit_window_limits_what_is_pushed(client: Client, grpc_broker: ThreadedBroker) -> None:
    consumer = await client.consumer("slow", ["flow/#"], credit=5).subscribe()
    producer = client.producer()
    for i in range(20):
        producer.send_nowait("flow/x", str(i).encode())
    await producer.flush()

    def described() -> Any:
        return client.admin.describe_subscription("slow")

    info = await eventually(described)
    await eventually(lambda: consumer.buffered == 5)
    info = await described()
    assert info.consumers[0].delivered == 5 and info.consumers[0].credit == 0
    payloads = [(await consumer.receive(TIMEOUT)).payload for _ in range(20)]
    assert payloads == [str(i).encode() for i in range(20)]


async def test_subscribe_errors(client: Client) -> None:
    with pytest.raises(NotFound):
        await client.consumer("s", stream="missing").subscribe()
    with pytest.raises(InvalidArgument):
        await client.consumer("s", ["a/#/b"]).subscribe()
    with pytest.raises(InvalidArgument):
        await client.consumer("s", []).subscribe()
    await client.admin.create_stream("short")
    with pytest.raises(OutOfRange):
        await client.consumer("s", stream="short", position=Position.at_offset(10)).subscribe()


async def test_subscription_list_describe_delete(client: Client) -> None:
    consumer = await client.consumer("audit", ["logs/#"], type="shared").subscribe()
    names = [s.name for s in await client.admin.list_subscriptions()]
    assert "audit" in names
    info = await client.admin.describe_subscription("audit")
    assert info.type == "shared" and info.topic_filters == ["logs/#"] and info.protocol == "grpc"
    with pytest.raises(FailedPrecondition, match="live-only"):
        await client.admin.reset_cursor("audit", Position.earliest())
    await client.admin.delete_subscription("audit")
    with pytest.raises(NotFound):
        await client.admin.describe_subscription("audit")
    consumer.reconnect = False
    with pytest.raises(NotFound, match="deleted"):
        await consumer.receive(TIMEOUT)


async def test_stream_subscription_sees_only_that_stream(client: Client) -> None:
    await client.admin.create_stream("east", routes=["region/east/#"])
    consumer = await client.consumer("east-sub", stream="east").subscribe()
    producer = client.producer()
    await producer.send("region/west/1", b"w")
    await producer.send("region/east/1", b"e")
    assert (await consumer.receive(TIMEOUT)).payload == b"e"


async def test_first_request_must_be_subscribe(url: str) -> None:
    async with grpc.aio.insecure_channel(url) as channel:
        call = pb_grpc.ConsumerStub(channel).Subscribe()
        await call.write(pb.ConsumeRequest(ack=pb.Ack(delivery_ids=[1])))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call.read()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_consumer_and_producer_reconnect_after_listener_restart(
    client: Client, grpc_broker: ThreadedBroker,
) -> None:
    app = grpc_broker.app
    port = app.port("grpc")
    consumer = await client.consumer("sticky", ["s/#"], credit=10).subscribe()
    producer = client.producer()
    await producer.send("s/1", b"before")
    assert (await consumer.receive(TIMEOUT)).payload == b"before"

    async def restart() -> None:
        old = app.listeners["grpc"].server
        old.close()
        await old.wait_closed()
        app.listeners["grpc"].server = app.grpc = await start_grpc_server(app.edge, "127.0.0.1", port)

    grpc_broker.call(restart())

    async def delivered() -> bool:
        await producer.send("s/1", b"back")
        try:
            return (await consumer.receive(0.3)).payload == b"back"
        except TimeoutError:
            return False

    await eventually(delivered, timeout=15)


def test_sync_client(url: str) -> None:
    with SyncClient(url) as client:
        client.admin.create_stream("sync")
        consumer = client.consumer("sync-sub", stream="sync")
        consumer.subscribe()
        receipt = client.producer().send("sync", "hello")
        assert receipt.stream == "sync"
        message = consumer.receive(TIMEOUT)
        assert message.text() == "hello"
        message.ack()
        assert [s.name for s in client.admin.list_subscriptions()] == ["sync-sub"]


async def test_acks_are_batched_and_receive_batch(client: Client, grpc_broker: ThreadedBroker) -> None:
    consumer = await client.consumer("batched", ["many/#"], credit=400).subscribe()
    writes: list[str] = []
    original = consumer._write

    async def counting(call: Any, request: pb.ConsumeRequest) -> None:
        writes.append(request.WhichOneof("request"))
        await original(call, request)

    consumer._write = counting  # type: ignore[method-assign]
    producer = client.producer()
    for i in range(1000):
        producer.send_nowait("many/x", str(i).encode())
    await producer.flush()
    got: list[bytes] = []
    while len(got) < 1000:
        batch = await consumer.receive_batch(300, TIMEOUT)
        assert 1 <= len(batch) <= 300
        for message in batch:
            got.append(message.payload)
            message.ack()
    assert got == [str(i).encode() for i in range(1000)]
    server_side = next(iter(grpc_broker.app.grpc.consumers))
    await eventually(lambda: server_side.acked == 1000)
    assert server_side.unacked == 0
    # 1000 acks and 5 credit grants of 200 travel in a handful of requests, not one each.
    assert writes.count("ack") <= 12 and writes.count("credit") <= 5, writes
    await consumer.close()
