"""AMQP queues in a cluster, as in a RabbitMQ cluster: a durable queue declared and bound on
one node is used from every node (passive declare with its message count, publish, basic.get
and basic.consume with acks, nacks and requeues, purge, unbind, delete), with real aio-pika
and pika clients against `shardgate serve --cluster` processes and a real etcd.

The queue lives on the node where it was declared (its home, recorded in etcd); the other
nodes reach it over the cluster port. Exclusive queues stay on their connection's node. When
the home node leaves, another node takes a durable queue over from its replicated state, as
RabbitMQ moves a quorum queue's leader, with its messages.

The tests that neither stop nor restart a node share one pair of nodes (`shared_nodes`: one
start for the module), each with queue names and routing keys of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import aiormq
import pika
import pytest

from tests.conftest import free_port, wait_for
from tests.e2e.cluster_fixtures import (
    ClusterNodeProcess,
    EtcdServer,
    linked,
    ready_shared,
    settled,
    shared_cluster,
)


@pytest.fixture
def amqp_nodes(etcd: EtcdServer, tmp_path: Path) -> Iterator[list[ClusterNodeProcess]]:
    nodes = [
        ClusterNodeProcess(tmp_path / f"n{index}", f"n{index}", etcd.url,
                           extra_args=["--amqp-port", str(free_port())]).start()
        for index in (1, 2)
    ]
    wait_joined(nodes)
    yield nodes
    for node in nodes:
        if node.alive():
            node.kill()


@pytest.fixture(scope="module")
def module_amqp_nodes(module_etcd: EtcdServer, tmp_path_factory: pytest.TempPathFactory,
                      ) -> Iterator[list[ClusterNodeProcess]]:
    directory = tmp_path_factory.mktemp("amqp-queues")
    with shared_cluster([ClusterNodeProcess(directory / f"n{index}", f"n{index}", module_etcd.url,
                                            extra_args=["--amqp-port", str(free_port())])
                         for index in (1, 2)]) as nodes:
        yield nodes


@pytest.fixture
def shared_nodes(module_amqp_nodes: list[ClusterNodeProcess]) -> list[ClusterNodeProcess]:
    """Two nodes (as `amqp_nodes`) shared by the module's tests that neither stop nor restart
    them."""
    return ready_shared(module_amqp_nodes)


def wait_joined(nodes: list[ClusterNodeProcess]) -> None:
    names = {node.node_id for node in nodes}
    for node in nodes:
        wait_for(lambda node=node: settled(node, names), timeout=30, interval=0.05)
        wait_for(lambda node=node: linked(node) >= names - {node.node_id}, timeout=30, interval=0.05)


def amqp_url(node: ClusterNodeProcess) -> str:
    return f"amqp://guest:guest@127.0.0.1:{node.ports['amqp']}/"


def by_shard_owner(nodes: list[ClusterNodeProcess]) -> tuple[ClusterNodeProcess, ClusterNodeProcess]:
    """(the node owning the default stream's only shard, the other one)."""
    shards = nodes[0].status()["placement"]["default"]
    assert len(shards) == 1, "the test expects the default stream to have one shard"
    owner = next(node for node in nodes if node.node_id == shards[0][0])
    return owner, next(node for node in nodes if node is not owner)


async def eventually(check, timeout: float = 20) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def message_count(url: str, name: str) -> int:
    async with await aio_pika.connect(url) as connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(name, passive=True)
        return int(queue.declaration_result.message_count)


async def publish_all(url: str, routing_keys_and_bodies: list[tuple[str, bytes]], *,
                      mandatory: bool = True) -> None:
    async with await aio_pika.connect(url) as connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange("amq.topic")
        for routing_key, body in routing_keys_and_bodies:
            confirmation = await exchange.publish(
                aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT), routing_key,
                mandatory=mandatory)
            assert isinstance(confirmation, aiormq.spec.Basic.Ack), confirmation


async def test_a_queue_declared_and_bound_on_one_node_is_used_from_another(
        shared_nodes: list[ClusterNodeProcess]) -> None:
    n1, n2 = shared_nodes
    url1, url2 = amqp_url(n1), amqp_url(n2)
    async with await aio_pika.connect(url1) as c1, await aio_pika.connect(url2) as c2:
        ch1 = await c1.channel()
        home_queue = await ch1.declare_queue("orders-q", durable=True)
        await home_queue.bind("amq.topic", "orders.#")
        await publish_all(url1, [("orders.eu", f"on-n1-{i}".encode()) for i in range(3)])

        # passive declare through n2 sees the queue and its messages
        await eventually(lambda: _equals(message_count(url2, "orders-q"), 3))
        # a publish through n2 reaches it (bound on n1); a redeclare through n2 is the same queue
        await publish_all(url2, [("orders.us", b"on-n2")])
        ch2 = await c2.channel()
        queue = await ch2.declare_queue("orders-q", durable=True)
        assert queue.declaration_result.message_count == 4
        with pytest.raises(aio_pika.exceptions.ChannelPreconditionFailed, match="inequivalent arg"):
            other = await c2.channel()
            await other.declare_queue("orders-q", durable=True, arguments={"x-max-length": 5})

        # basic.get through n2: a nack with requeue gives it back, redelivered, then an ack
        first = await queue.get(no_ack=False)
        assert (first.body, first.redelivered) == (b"on-n1-0", False)
        await first.nack(requeue=True)
        again = await queue.get(no_ack=False)
        assert (again.body, again.redelivered) == (b"on-n1-0", True)
        await again.ack()
        assert await message_count(url1, "orders-q") == 3

        # consumers on both nodes: each message once, whichever node consumes it
        got: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()

        def taker(node: str):
            async def take(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                got.put_nowait((node, message.body))
                await message.ack()
            return take

        await ch1.set_qos(prefetch_count=1)
        await ch2.set_qos(prefetch_count=1)
        tag2 = await queue.consume(taker("n2"))
        tag1 = await home_queue.consume(taker("n1"))
        await publish_all(url2, [("orders.eu", f"more-{i}".encode()) for i in range(20)])
        received = [await asyncio.wait_for(got.get(), 20) for _ in range(23)]
        bodies = sorted(body for _, body in received)
        assert bodies == sorted([b"on-n1-1", b"on-n1-2", b"on-n2"] + [f"more-{i}".encode() for i in range(20)])
        assert {node for node, _ in received} == {"n1", "n2"}, received
        await queue.cancel(tag2)
        await home_queue.cancel(tag1)

        # purge, unbind and delete through n2 act on n1's queue
        await publish_all(url1, [("orders.eu", b"to-purge")] * 2)
        await eventually(lambda: _equals(message_count(url2, "orders-q"), 2))
        assert (await queue.purge()).message_count == 2
        assert await message_count(url1, "orders-q") == 0
        await queue.unbind("amq.topic", "orders.#")
        async with await aio_pika.connect(url1) as c3:
            out = await c3.channel(publisher_confirms=True)
            exchange = await out.get_exchange("amq.topic")
            returned = await exchange.publish(aio_pika.Message(b"x"), "orders.eu", mandatory=True)
            assert not isinstance(returned, aiormq.spec.Basic.Ack), "still bound after the unbind"
        await queue.delete(if_unused=False, if_empty=False)
        with pytest.raises(aio_pika.exceptions.ChannelNotFoundEntity, match="no queue 'orders-q'"):
            await message_count(url1, "orders-q")


async def _equals(value, expected) -> bool:
    return await value == expected


def test_pika_consumer_on_another_node_acks_rejects_and_requeues(
        shared_nodes: list[ClusterNodeProcess]) -> None:
    """pika's blocking client on n2, the queue on n1: a requeued delivery comes back (to a
    consumer on n1 as well), a rejected one goes to the dead-letter exchange, acks settle,
    and a consumer whose connection closes gives its unacked messages back."""
    n1, n2 = shared_nodes
    home = pika.BlockingConnection(pika.URLParameters(amqp_url(n1)))
    away = pika.BlockingConnection(pika.URLParameters(amqp_url(n2)))
    try:
        ch1 = home.channel()
        ch1.queue_declare("dead-q", durable=True)
        ch1.queue_bind("dead-q", "amq.direct", "dead")
        ch1.queue_declare("work-q", durable=True, arguments={
            "x-dead-letter-exchange": "amq.direct", "x-dead-letter-routing-key": "dead"})
        ch1.confirm_delivery()
        for body in (b"a", b"b", b"c"):
            ch1.basic_publish("", "work-q", body, pika.BasicProperties(delivery_mode=2))

        ch2 = away.channel()
        wait_for(lambda: ch2.queue_declare("work-q", passive=True).method.message_count == 3, timeout=20)
        ch2.basic_qos(prefetch_count=3)
        deliveries = []
        for method, _properties, body in ch2.consume("work-q", inactivity_timeout=20):
            assert method is not None, "no delivery from the queue on n1"
            deliveries.append((method, body))
            if len(deliveries) == 3:
                break
        assert [body for _, body in deliveries] == [b"a", b"b", b"c"]
        ch2.basic_ack(deliveries[0][0].delivery_tag)
        ch2.basic_reject(deliveries[1][0].delivery_tag, requeue=False)
        ch2.basic_nack(deliveries[2][0].delivery_tag, requeue=True)
        method, _properties, body = next(ch2.consume("work-q", inactivity_timeout=20))
        assert (body, method.redelivered) == (b"c", True)
        ch2.basic_nack(method.delivery_tag, requeue=True)
        ch2.cancel()

        # on n1: "c" again (redelivered), "b" dead-lettered, "a" gone
        wait_for(lambda: ch1.queue_declare("work-q", passive=True).method.message_count == 1, timeout=20)
        method, _properties, body = ch1.basic_get("work-q")
        assert (body, method.redelivered) == (b"c", True)
        ch1.basic_ack(method.delivery_tag)
        assert ch1.basic_get("work-q") == (None, None, None)
        method, properties, body = ch1.basic_get("dead-q", auto_ack=True)
        assert body == b"b" and properties.headers["x-death"][0]["reason"] == "rejected"

        # a consumer's connection closing gives back what it held
        ch1.basic_publish("", "work-q", b"d", pika.BasicProperties(delivery_mode=2))
        method, _properties, body = next(ch2.consume("work-q", inactivity_timeout=20))
        assert body == b"d"
        away.close()
        wait_for(lambda: ch1.queue_declare("work-q", passive=True).method.message_count == 1, timeout=20)
        method, _properties, body = ch1.basic_get("work-q", auto_ack=True)
        assert (body, method.redelivered) == (b"d", True)
    finally:
        for connection in (home, away):
            if connection.is_open:
                connection.close()


async def test_bind_ok_and_consume_ok_come_once_every_node_routes_to_the_queue(
        shared_nodes: list[ClusterNodeProcess]) -> None:
    """Right after queue.bind-ok (on the queue's node or through another one) a mandatory
    publish on the other node is routed, never returned; after basic.consume-ok the same,
    when the bind went with nowait."""
    n1, n2 = shared_nodes
    async with await aio_pika.connect(amqp_url(n1)) as c1, await aio_pika.connect(amqp_url(n2)) as c2:
        ch1 = await c1.channel()
        out2 = await c2.channel(publisher_confirms=True)
        exchange2 = await out2.get_exchange("amq.topic")
        for round_ in range(10):
            queue = await ch1.declare_queue("", exclusive=True)
            await queue.bind("amq.topic", f"fresh.{round_}.#")
            confirmation = await exchange2.publish(aio_pika.Message(b"now"), f"fresh.{round_}.x", mandatory=True)
            assert isinstance(confirmation, aiormq.spec.Basic.Ack), f"round {round_}: {confirmation}"
            message = await queue.get(timeout=10, fail=False) or await _next(queue)
            assert message.body == b"now"

        # bound through n2 (the queue lives on n1); a publish on n1 right after bind-ok
        shared = await ch1.declare_queue("bound-elsewhere-q", durable=True)
        ch2 = await c2.channel()
        away = await ch2.declare_queue("bound-elsewhere-q", durable=True)
        out1 = await c1.channel(publisher_confirms=True)
        exchange1 = await out1.get_exchange("amq.topic")
        for round_ in range(5):
            await away.bind("amq.topic", f"far.{round_}.#")
            confirmation = await exchange1.publish(aio_pika.Message(b"far"), f"far.{round_}.y", mandatory=True)
            assert isinstance(confirmation, aiormq.spec.Basic.Ack), f"round {round_}: {confirmation}"
        await eventually(lambda: _equals(message_count(amqp_url(n1), "bound-elsewhere-q"), 5))
        await shared.delete(if_empty=False)

        # basic.consume-ok after a bind sent with nowait (raw aiormq: aio-pika always waits)
        raw = await aiormq.connect(amqp_url(n1))
        try:
            channel = await raw.channel()
            declared = await channel.queue_declare("", exclusive=True)
            await channel.queue_bind(declared.queue, "amq.topic", routing_key="late.#", nowait=True)
            seen: asyncio.Queue[bytes] = asyncio.Queue()

            async def on_message(message: aiormq.abc.DeliveredMessage) -> None:
                seen.put_nowait(message.body)

            await channel.basic_consume(declared.queue, on_message, no_ack=True)
            confirmation = await exchange2.publish(aio_pika.Message(b"late"), "late.z", mandatory=True)
            assert isinstance(confirmation, aiormq.spec.Basic.Ack), confirmation
            assert await asyncio.wait_for(seen.get(), 20) == b"late"
        finally:
            await raw.close()


async def _next(queue: aio_pika.abc.AbstractQueue) -> aio_pika.abc.AbstractIncomingMessage:
    deadline = asyncio.get_running_loop().time() + 20
    while True:
        message = await queue.get(fail=False)
        if message is not None:
            return message
        assert asyncio.get_running_loop().time() < deadline, "nothing arrived"
        await asyncio.sleep(0.05)


async def test_exclusive_queues_stay_on_their_node_and_non_durable_ones_end_with_it(
        amqp_nodes: list[ClusterNodeProcess]) -> None:
    """Exclusive queues are their connection's, on its node (another node's connection gets
    405 RESOURCE_LOCKED, as in RabbitMQ). A non-durable queue is shared like a durable one while
    its node lives, and ends with it (as in RabbitMQ): after that node restarts, the name is
    free to declare anywhere."""
    n1, n2 = amqp_nodes
    async with await aio_pika.connect(amqp_url(n1)) as c1, await aio_pika.connect(amqp_url(n2)) as c2:
        mine = await (await c1.channel()).declare_queue("private-q", exclusive=True)
        assert mine.name == "private-q"
        with pytest.raises(aiormq.exceptions.ChannelLockedResource):
            await (await c2.channel()).declare_queue("private-q", exclusive=True)
        with pytest.raises(aio_pika.exceptions.ChannelNotFoundEntity):
            await (await c2.channel()).declare_queue("amq.gen-nowhere", passive=True)

        transient = await (await c1.channel()).declare_queue("transient-q", durable=False)
        await transient.bind("amq.topic", "transient.#")
    await publish_all(amqp_url(n2), [("transient.a", b"t")])
    assert await message_count(amqp_url(n2), "transient-q") == 1
    n1.terminate()
    n1.start()
    wait_joined(amqp_nodes)
    with pytest.raises(aio_pika.exceptions.ChannelNotFoundEntity, match="no queue 'transient-q'"):
        await message_count(amqp_url(n2), "transient-q")
    async with await aio_pika.connect(amqp_url(n2)) as c2:
        again = await (await c2.channel()).declare_queue("transient-q", durable=False)
        assert again.declaration_result.message_count == 0
    assert await message_count(amqp_url(n1), "transient-q") == 0  # n2's now, seen from n1


async def test_a_durable_queue_whose_node_left_is_served_by_the_other_node_and_stays_there(
        amqp_nodes: list[ClusterNodeProcess]) -> None:
    """The queue's home (the node that also owns the default stream's reliable shard) leaves
    with SIGTERM: its consumer on the other node gets basic.cancel, and the other node takes
    the queue over from its replicated state, as RabbitMQ moves a quorum queue's leader, with
    every message. The old home returns: it drops its copy, and its clients use the queue
    where it lives now."""
    home, other = by_shard_owner(amqp_nodes)
    url_home, url_other = amqp_url(home), amqp_url(other)
    async with await aio_pika.connect(url_home) as connection:
        queue = await (await connection.channel()).declare_queue("kept-q", durable=True)
        await queue.bind("amq.topic", "kept.#")
    await publish_all(url_home, [("kept.a", f"m{i}".encode()) for i in range(5)])
    await eventually(lambda: _equals(message_count(url_other, "kept-q"), 5))

    watcher = await aio_pika.connect(url_other)
    channel = await watcher.channel()
    await channel.set_qos(prefetch_count=1)
    consumer_queue = await channel.get_queue("kept-q", ensure=False)
    held: list[aio_pika.abc.AbstractIncomingMessage] = []
    await consumer_queue.consume(held.append)
    await eventually(lambda: _true(len(held) == 1))
    assert held[0].body == b"m0"

    assert home.terminate() == 0
    # taken over: every message, m0 (unacknowledged by the consumer, cancelled) too
    await eventually(lambda: _equals(_count_or_none(url_other, "kept-q"), 5), timeout=30)
    assert not watcher.is_closed  # the consumer's channel stays open
    await watcher.close()

    home.start()
    wait_joined(amqp_nodes)
    assert await message_count(url_home, "kept-q") == 5  # the other node's, seen from the old home
    async with await aio_pika.connect(url_home) as c2:
        q = await (await c2.channel()).declare_queue("kept-q", passive=True)
        bodies = []
        while (message := await q.get(no_ack=True, fail=False)) is not None:
            bodies.append(message.body)
        assert sorted(bodies) == [f"m{i}".encode() for i in range(5)]
    assert await message_count(url_other, "kept-q") == 0


async def _count_or_none(url: str, queue: str) -> int | None:
    """The queue's message count, or None while no node serves it (404)."""
    try:
        return await message_count(url, queue)
    except aio_pika.exceptions.ChannelNotFoundEntity:
        return None


async def _true(value: bool) -> bool:
    return value


async def test_what_is_published_while_a_queues_node_is_away_reaches_it_when_it_returns(
        amqp_nodes: list[ClusterNodeProcess]) -> None:
    """The queue's home is not the shard's owner: what it had and the persistent messages
    published on the owner while the home was away (acknowledged: they are in the owner's
    journal) are all in the queue, in order, once the home is back (read from the owner's
    journal, then followed live)."""
    owner, home = by_shard_owner(amqp_nodes)
    async with await aio_pika.connect(amqp_url(home)) as connection:
        queue = await (await connection.channel()).declare_queue("away-q", durable=True)
        await queue.bind("amq.topic", "away.#")
    await publish_all(amqp_url(owner), [("away.a", b"before")])
    await eventually(lambda: _equals(message_count(amqp_url(owner), "away-q"), 1))
    assert home.terminate() == 0
    # (not mandatory: no live node routes them meanwhile; the owner stores them all the same)
    await publish_all(amqp_url(owner), [("away.a", f"during-{i}".encode()) for i in range(3)], mandatory=False)
    home.start()
    wait_joined(amqp_nodes)
    await publish_all(amqp_url(owner), [("away.a", b"after")])
    await eventually(lambda: _equals(message_count(amqp_url(owner), "away-q"), 5), timeout=30)
    async with await aio_pika.connect(amqp_url(owner)) as connection:
        q = await (await connection.channel()).declare_queue("away-q", passive=True)
        bodies = [(await q.get(no_ack=True)).body for _ in range(5)]
    assert bodies == [b"before", b"during-0", b"during-1", b"during-2", b"after"]


async def test_a_no_ack_consumer_on_another_node_gets_every_message(
        shared_nodes: list[ClusterNodeProcess]) -> None:
    """More messages than the home node sends ahead of a no-ack consumer's client: the rest
    follow as the client takes them, in order."""
    n1, n2 = shared_nodes
    async with await aio_pika.connect(amqp_url(n1)) as connection:
        await (await connection.channel()).declare_queue("firehose-q", durable=True)
    sent = [f"f{i}".encode() for i in range(1500)]
    async with await aio_pika.connect(amqp_url(n1)) as connection:
        channel = await connection.channel(publisher_confirms=True)
        await asyncio.gather(*(channel.default_exchange.publish(aio_pika.Message(body), "firehose-q")
                               for body in sent))
    got: list[bytes] = []
    done = asyncio.Event()

    async def take(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        got.append(message.body)
        if len(got) == len(sent):
            done.set()

    async with await aio_pika.connect(amqp_url(n2)) as connection:
        queue = await (await connection.channel()).get_queue("firehose-q", ensure=False)
        await queue.consume(take, no_ack=True)
        await asyncio.wait_for(done.wait(), 60)
    assert got == sent
