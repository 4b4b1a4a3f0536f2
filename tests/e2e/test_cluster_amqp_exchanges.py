"""AMQP exchanges and exclusive queues in a cluster behave as in a RabbitMQ cluster, with
aio-pika against `shardgate serve --cluster` processes and a real etcd.

Every exchange, durable or not, is the cluster's: declared on one node it is there at once for
a passive declare on another, a redeclare with other properties is refused with 406 wherever
it comes from, an exchange-to-exchange binding made on one node routes for every node's
queues, a delete with if-unused sees the queues of every node, an auto-delete exchange goes only when
no node's queue is bound to it, a delete-ok means gone on every node, and a non-durable
exchange ends with the cluster's last node. An exclusive queue used from another node's
connection answers 405 RESOURCE_LOCKED, as RabbitMQ does.

The tests that leave the nodes running share one pair of nodes (`shared_nodes`, each test with
exchange and queue names of its own); the one that restarts them starts its own."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import aiormq
import pytest

from tests.e2e.cluster_fixtures import (
    ClusterNodeProcess,
    EtcdServer,
    amqp_exchange_exists,
    amqp_node,
    amqp_url,
    eventually,
    ready_shared,
    settled_nodes,
    shared_cluster,
    wait_settled,
)


@pytest.fixture
def amqp_nodes(etcd: EtcdServer, tmp_path: Path) -> Iterator[list[ClusterNodeProcess]]:
    with settled_nodes([amqp_node(tmp_path, f"n{index}", etcd.url).start() for index in (1, 2)]) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def module_amqp_nodes(module_etcd: EtcdServer, tmp_path_factory: pytest.TempPathFactory,
                      ) -> Iterator[list[ClusterNodeProcess]]:
    directory = tmp_path_factory.mktemp("amqp-exchanges")
    with shared_cluster([amqp_node(directory, f"n{index}", module_etcd.url) for index in (1, 2)]) as nodes:
        yield nodes


@pytest.fixture
def shared_nodes(module_amqp_nodes: list[ClusterNodeProcess]) -> list[ClusterNodeProcess]:
    """Two nodes shared by the module's tests that neither stop nor restart them."""
    return ready_shared(module_amqp_nodes)


async def publish_until_routed(exchange: aio_pika.abc.AbstractExchange, routing_key: str,
                               body: bytes, timeout: float = 15) -> None:
    """Publish (mandatory, confirmed) until a queue takes it: a binding made on one node is
    known to the others shortly after its bind-ok."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not isinstance(await exchange.publish(aio_pika.Message(body), routing_key, mandatory=True),
                         aiormq.spec.Basic.Ack):
        assert asyncio.get_running_loop().time() < deadline, "never routed"


async def test_a_non_durable_exchange_is_the_clusters(shared_nodes: list[ClusterNodeProcess]) -> None:
    n1, n2 = shared_nodes
    async with await aio_pika.connect(amqp_url(n1)) as c1, await aio_pika.connect(amqp_url(n2)) as c2:
        await (await c1.channel()).declare_exchange("events-x", aio_pika.ExchangeType.TOPIC,
                                                    durable=False)
        # at once on the other node (no waiting for its watch)
        ch2 = await c2.channel()
        seen = await ch2.declare_exchange("events-x", passive=True)
        assert seen.name == "events-x"
        # the same declare is accepted there; one with other properties is refused (406)
        await ch2.declare_exchange("events-x", aio_pika.ExchangeType.TOPIC, durable=False)
        with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed,
                           match="inequivalent arg 'durable' for exchange 'events-x' in vhost '/': "
                                 "received 'true' but current is 'false'"):
            await (await c2.channel()).declare_exchange("events-x", aio_pika.ExchangeType.TOPIC,
                                                        durable=True)
        with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed,
                           match="inequivalent arg 'type' for exchange 'events-x' in vhost '/': "
                                 "received 'fanout' but current is 'topic'"):
            await (await c1.channel()).declare_exchange("events-x", aio_pika.ExchangeType.FANOUT,
                                                        durable=False)
        with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity,
                           match="no exchange 'nowhere-x' in vhost '/'"):
            await (await c2.channel()).declare_exchange("nowhere-x", passive=True)
        # a publish through n2 right after n1's declare-ok finds the exchange
        await (await c1.channel()).declare_exchange("flash-x", aio_pika.ExchangeType.FANOUT,
                                                    durable=False)
        flash = aio_pika.Exchange(await c2.channel(publisher_confirms=True), "flash-x")
        assert isinstance(await flash.publish(aio_pika.Message(b"x"), "", mandatory=False),
                          aiormq.spec.Basic.Ack)

        # a queue on n2 bound to it gets what a publisher on n1 sends
        queue = await (await c2.channel()).declare_queue("", exclusive=True)
        await queue.bind("events-x", "eu.#")
        out = await c1.channel(publisher_confirms=True)
        exchange = await out.get_exchange("events-x")
        await publish_until_routed(exchange, "eu.paris", b"paris")
        message = await queue.get(timeout=10, fail=True)
        assert message is not None and message.body == b"paris"
        await message.ack()

        # an if-unused delete on n1 sees n2's queue bound to it
        with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed,
                           match="exchange 'events-x' in vhost '/' in use"):
            await (await c1.channel()).exchange_delete("events-x", if_unused=True)
        await queue.unbind("events-x", "eu.#")
        await (await c1.channel()).exchange_delete("events-x", if_unused=True)
    await eventually(lambda: _absent(amqp_url(n2), "events-x"))


async def test_exchange_bindings_and_auto_delete_span_the_nodes(
        shared_nodes: list[ClusterNodeProcess]) -> None:
    n1, n2 = shared_nodes
    async with await aio_pika.connect(amqp_url(n1)) as c1, await aio_pika.connect(amqp_url(n2)) as c2:
        ch1, ch2 = await c1.channel(), await c2.channel()
        source = await ch1.declare_exchange("src-x", aio_pika.ExchangeType.TOPIC, durable=True)
        await ch1.declare_exchange("dst-x", aio_pika.ExchangeType.FANOUT, durable=False,
                                   auto_delete=True)
        # the exchange-to-exchange binding is made through n2, the queue lives on n1
        destination = await ch2.declare_exchange("dst-x", passive=True)
        await destination.bind("src-x", "orders.*")
        queue = await ch1.declare_queue("", exclusive=True)
        await queue.bind("dst-x")
        publisher = await c2.channel(publisher_confirms=True)
        await publish_until_routed(await publisher.get_exchange("src-x"), "orders.new", b"o1")
        message = await queue.get(timeout=10, fail=True)
        assert message is not None and message.body == b"o1"
        await message.ack()
        assert source.name == "src-x"

        # dst-x is auto-delete: a queue of n2 still bound keeps it when n1's goes
        other = await ch2.declare_queue("", exclusive=True)
        await other.bind("dst-x")
        await queue.unbind("dst-x")
        assert await amqp_exchange_exists(amqp_url(n1), "dst-x")
        assert await amqp_exchange_exists(amqp_url(n2), "dst-x")
        await other.unbind("dst-x")
        await eventually(lambda: _absent(amqp_url(n1), "dst-x"))
        await eventually(lambda: _absent(amqp_url(n2), "dst-x"))


async def test_after_delete_ok_on_one_node_the_exchange_is_gone_on_the_other(
        shared_nodes: list[ClusterNodeProcess]) -> None:
    """RabbitMQ deletes an exchange cluster-wide before its delete-ok: a client that deletes
    on n1 and goes straight to n2 finds no old exchange there, for a passive declare, a
    publish, or a declare of the name with another type."""
    n1, n2 = shared_nodes
    async with await aio_pika.connect(amqp_url(n1)) as c1, await aio_pika.connect(amqp_url(n2)) as c2:
        for round_ in range(10):
            name = f"short-lived-{round_}"
            await (await c1.channel()).declare_exchange(name, aio_pika.ExchangeType.FANOUT, durable=False)
            await (await c2.channel()).declare_exchange(name, passive=True)  # n2 knows it
            await (await c1.channel()).exchange_delete(name)
            with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity,
                               match=f"no exchange '{name}' in vhost '/'"):
                await (await c2.channel()).declare_exchange(name, passive=True)
            publisher = await c2.channel(publisher_confirms=True)
            with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity,
                               match=f"no exchange '{name}' in vhost '/'"):
                await aio_pika.Exchange(publisher, name).publish(aio_pika.Message(b"x"), "")
            # the name is free: another type is accepted on n2, and n1 then sees that one
            await (await c2.channel()).declare_exchange(name, aio_pika.ExchangeType.TOPIC, durable=False)
            with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed,
                               match="received 'fanout' but current is 'topic'"):
                await (await c1.channel()).declare_exchange(name, aio_pika.ExchangeType.FANOUT,
                                                            durable=False)
            await (await c2.channel()).exchange_delete(name)


async def test_non_durable_exchanges_end_with_the_clusters_last_node(
        amqp_nodes: list[ClusterNodeProcess]) -> None:
    """As in RabbitMQ: a non-durable exchange outlives any one node's restart, but not a stop
    of the whole cluster; a durable one and its exchange binding outlive both."""
    n1, n2 = amqp_nodes
    async with await aio_pika.connect(amqp_url(n1)) as c1:
        channel = await c1.channel()
        await channel.declare_exchange("kept-x", aio_pika.ExchangeType.TOPIC, durable=True)
        await channel.declare_exchange("also-kept-x", aio_pika.ExchangeType.FANOUT, durable=True)
        await channel.declare_exchange("fleeting-x", aio_pika.ExchangeType.FANOUT, durable=False)
        await (await channel.get_exchange("also-kept-x")).bind("kept-x", "a.#")
        await (await channel.get_exchange("fleeting-x")).bind("kept-x", "b.#")
    assert n1.terminate() == 0
    n1.start()
    wait_settled(amqp_nodes)
    assert await amqp_exchange_exists(amqp_url(n1), "fleeting-x")  # n2 kept the cluster alive
    assert n1.terminate() == 0
    assert n2.terminate() == 0
    n2.start()
    assert not await amqp_exchange_exists(amqp_url(n2), "fleeting-x")
    assert await amqp_exchange_exists(amqp_url(n2), "kept-x")
    # the durable exchange binding still routes: a queue bound to also-kept-x gets a.1
    async with await aio_pika.connect(amqp_url(n2)) as c2:
        channel = await c2.channel(publisher_confirms=True)
        queue = await channel.declare_queue("", exclusive=True)
        await queue.bind("also-kept-x")
        await publish_until_routed(await channel.get_exchange("kept-x"), "a.1", b"a")
        message = await queue.get(timeout=10, fail=True)
        assert message is not None and message.body == b"a"
    n1.start()
    wait_settled(amqp_nodes)
    assert not await amqp_exchange_exists(amqp_url(n1), "fleeting-x")


async def test_an_exclusive_queue_is_locked_to_other_nodes_connections(
        shared_nodes: list[ClusterNodeProcess]) -> None:
    n1, n2 = shared_nodes
    locked = ("cannot obtain exclusive access to locked queue 'private-q' in vhost '/'")
    async with await aio_pika.connect(amqp_url(n1)) as c1, await aio_pika.connect(amqp_url(n2)) as c2:
        mine = await (await c1.channel()).declare_queue("private-q", exclusive=True)
        await mine.bind("amq.topic", "private.#")
        for attempt in (
            lambda ch: ch.declare_queue("private-q", passive=True),
            lambda ch: ch.declare_queue("private-q", exclusive=True),
            lambda ch: ch.queue_delete("private-q"),
        ):
            channel = await c2.channel()
            with pytest.raises(aiormq.exceptions.ChannelLockedResource, match=locked):
                await attempt(channel)
        for use in ("consume", "bind", "get", "purge"):
            channel = await c2.channel()
            queue = await channel.get_queue("private-q", ensure=False)
            with pytest.raises(aiormq.exceptions.ChannelLockedResource, match=locked):
                if use == "consume":
                    await queue.consume(_ignore)
                elif use == "bind":
                    await queue.bind("amq.topic", "other.#")
                elif use == "get":
                    await queue.get(fail=False)
                else:
                    await queue.purge()
        # its own connection still uses it
        await (await c1.channel()).declare_queue("private-q", passive=True)
    # once its connection is gone, the name is free on every node
    async with await aio_pika.connect(amqp_url(n2)) as c2:
        async def free() -> bool:
            try:
                await (await c2.channel()).declare_queue("private-q", exclusive=True)
                return True
            except aiormq.exceptions.ChannelLockedResource:
                return False
        await eventually(free)


async def _ignore(message: aio_pika.abc.AbstractIncomingMessage) -> None:
    pass


async def _absent(url: str, name: str) -> bool:
    return not await amqp_exchange_exists(url, name)
