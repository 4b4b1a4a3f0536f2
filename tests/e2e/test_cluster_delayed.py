"""Delayed messages are cluster state (issue 14): a `$delayed/{s}/{topic}` publish or an
`x-delay` header accepted by any node is kept in etcd before its publisher is acknowledged, and
released once, on time, by its holder, or by the node that took it over when its holder died
(SIGKILL), left (SIGTERM) or the whole cluster restarted, also when the holder died between
its release and the etcd delete (shardgate/cluster/delayed.py; the test hook
`SG_TEST_PAUSE_BEFORE_DELAYED_DELETE` holds it there). Real etcd, real nodes, paho, aio-pika
and the gRPC SDK."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import aiormq
import pytest
from shardgate.protocols.mqtt import packets as p

from shardgate.cluster.delayed import DELETE_PAUSE_ENV, MAX_RECORD_BYTES
from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import (
    ClusterNodeProcess,
    EtcdServer,
    amqp_url,
    eventually,
    protocol_node,
    read_back,
    settled_nodes,
    start_together,
    topics_of,
    wait_settled,
)
from tests.mqtt_clients import V5, Paho, RawClient

# Non-reliable, so a dead node's shards move to a survivor at once.
LATER = '[[streams]]\nname = "later"\nmode = "non-reliable"\npartitions = 2\nroutes = ["later/#"]\n'
# Reliable (a journal to find a release in), one shard per node.
TIMED = '[[streams]]\nname = "timed"\nmode = "reliable"\npartitions = 3\nroutes = ["timed/#"]\n'


@pytest.fixture
def trio(etcd: EtcdServer, tmp_path: Path) -> Iterator[list[ClusterNodeProcess]]:
    nodes = [protocol_node(tmp_path, name, etcd.url, LATER) for name in ("n1", "n2", "n3")]
    start_together(nodes)
    with settled_nodes(nodes):
        yield nodes


async def read_held(etcd: EtcdServer) -> dict[str, dict]:
    """Every delayed message etcd keeps: key (`<holder>/<due>-<id>`) -> value."""
    from shardgate.cluster.etcd import EtcdClient

    client = EtcdClient([etcd.url])
    try:
        kvs, _revision = await client.get_prefix("/")
    finally:
        await client.close()
    marker = ".state/delayed/"
    return {kv.key.split(marker, 1)[1]: json.loads(kv.value) for kv in kvs if marker in kv.key}


def held_in_etcd(etcd: EtcdServer) -> dict[str, dict]:
    return asyncio.run(read_held(etcd))


def holders(etcd: EtcdServer) -> set[str]:
    return {key.split("/", 1)[0] for key in held_in_etcd(etcd)}


def by_role(nodes: list[ClusterNodeProcess]) -> tuple[ClusterNodeProcess, list[ClusterNodeProcess]]:
    """The controller, and the others."""
    controller_id = nodes[0].status()["controller"]
    controller = next(node for node in nodes if node.node_id == controller_id)
    return controller, [node for node in nodes if node is not controller]


def test_a_delayed_message_is_held_in_etcd_and_released_once_on_time_on_another_node(
        trio: list[ClusterNodeProcess], etcd: EtcdServer) -> None:
    n1, n2, _n3 = trio
    watcher = Paho(n2.mqtt_port, "watcher", V5)
    watcher.subscribe("later/#", 1)
    publisher = Paho(n1.mqtt_port, "scheduler", V5)
    sent_at = time.monotonic()
    for index in range(4):  # topics on both shards
        publisher.publish(f"$delayed/5/later/job-{index}", f"job {index}", qos=1)
    # acknowledged: every one is in etcd, held by the node that accepted it
    held = held_in_etcd(etcd)
    assert len(held) == 4 and {key.split("/", 1)[0] for key in held} == {"n1"}
    got = sorted((m.topic, m.payload) for m in watcher.expect_n(4, timeout=30))
    assert time.monotonic() - sent_at >= 4.9  # not before the delay
    assert got == [(f"later/job-{i}", f"job {i}".encode()) for i in range(4)]
    assert wait_for(lambda: not held_in_etcd(etcd), timeout=10, interval=0.1)
    watcher.expect_none(within=1.5)  # once
    watcher.disconnect()
    publisher.disconnect()


def test_the_accepting_node_killed_before_the_delay_another_node_releases_it_once(
        trio: list[ClusterNodeProcess], etcd: EtcdServer) -> None:
    controller, (holder, survivor) = by_role(trio)
    watcher = Paho(survivor.mqtt_port, "watcher", V5)
    watcher.subscribe("later/#", 1)
    publisher = Paho(holder.mqtt_port, "scheduler", V5)
    sent_at = time.monotonic()
    publisher.publish("$delayed/8/later/after-kill", "still due", qos=1)
    assert holders(etcd) == {holder.node_id}
    holder.kill()  # SIGKILL, never returns
    # the controller takes it over once the holder's lease expires (3 s), before it is due
    message = watcher.expect(timeout=40)
    assert time.monotonic() - sent_at >= 7.9
    assert (message.topic, message.payload) == ("later/after-kill", b"still due")
    assert wait_for(lambda: not held_in_etcd(etcd), timeout=10, interval=0.1)
    watcher.expect_none(within=2)
    assert controller.alive()
    watcher.disconnect()


def test_the_accepting_node_leaving_with_sigterm_hands_its_delayed_messages_over(
        trio: list[ClusterNodeProcess], etcd: EtcdServer) -> None:
    # the leaving node is the controller: the next one is elected and takes its messages
    leaving, (survivor, _other) = by_role(trio)
    watcher = Paho(survivor.mqtt_port, "watcher", V5)
    watcher.subscribe("later/#", 1)
    publisher = Paho(leaving.mqtt_port, "scheduler", V5)
    sent_at = time.monotonic()
    for index in range(3):
        publisher.publish(f"$delayed/10/later/leave-{index}", f"leave {index}", qos=1)
    assert holders(etcd) == {leaving.node_id}
    assert leaving.terminate() == 0
    # taken over by a live node before they are due
    assert wait_for(lambda: holders(etcd) and leaving.node_id not in holders(etcd), timeout=30, interval=0.1)
    got = sorted(m.payload for m in watcher.expect_n(3, timeout=40))
    assert time.monotonic() - sent_at >= 9.9
    assert got == [f"leave {i}".encode() for i in range(3)]
    assert wait_for(lambda: not held_in_etcd(etcd), timeout=10, interval=0.1)
    watcher.expect_none(within=2)
    watcher.disconnect()


def test_a_delayed_message_outlives_a_restart_of_the_whole_cluster(
        trio: list[ClusterNodeProcess], etcd: EtcdServer) -> None:
    n1, n2, n3 = trio
    publisher = Paho(n1.mqtt_port, "scheduler", V5)
    accepted_ms = time.time() * 1000
    publisher.publish("$delayed/5/jobs/nightly", "after the restart", qos=1)  # the reliable default stream
    publisher.drop()
    for node in trio:
        node.kill()
    for node in trio:
        node.start()
    wait_settled(trio)

    async def read() -> list[tuple[str, float]]:
        from shardgate.client import Client

        got = await read_back(n2.grpc_url, ["jobs/#"], {"after the restart"})
        assert got == {"after the restart": 1}  # released once
        async with Client(n3.grpc_url) as client:
            consumer = client.consumer("released-at", ["jobs/#"], position="earliest")
            await consumer.subscribe()
            message = await consumer.receive(20)
            return [(message.text(), message.publish_time_ms)]

    [(text, released_ms)] = asyncio.run(read())
    assert text == "after the restart"
    assert released_ms >= accepted_ms + 5000 - 50  # not before the delay (clocks of one host)
    assert wait_for(lambda: not held_in_etcd(etcd), timeout=10, interval=0.1)


async def test_an_amqp_x_delay_message_published_on_one_node_reaches_a_queue_on_another(
        etcd: EtcdServer, tmp_path: Path) -> None:
    nodes = [protocol_node(tmp_path, name, etcd.url, LATER).start() for name in ("n1", "n2")]
    with settled_nodes(nodes) as (n1, n2):
        received: asyncio.Queue[tuple[str, bytes, float]] = asyncio.Queue()
        async with await aio_pika.connect(amqp_url(n1)) as c1, await aio_pika.connect(amqp_url(n2)) as c2:
            queue = await (await c2.channel()).declare_queue("", exclusive=True)
            await queue.bind("amq.topic", "later.#")

            async def take(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                received.put_nowait((message.routing_key or "", message.body, time.monotonic()))
                await message.ack()

            await queue.consume(take)
            exchange = (await c1.channel(publisher_confirms=True)).default_exchange
            topic = await exchange.channel.get_exchange("amq.topic")
            # the binding reaches n1 shortly after its bind-ok: probe until a publish is routed
            deadline = asyncio.get_running_loop().time() + 15
            while not isinstance(await topic.publish(aio_pika.Message(b"probe"), "later.probe"),
                                 aiormq.spec.Basic.Ack):
                assert asyncio.get_running_loop().time() < deadline, "the binding never reached n1"
            assert (await asyncio.wait_for(received.get(), 20))[:2] == ("later.probe", b"probe")

            sent_at = time.monotonic()
            confirmation = await topic.publish(
                aio_pika.Message(b"in two seconds", headers={"x-delay": 2000}), "later.amqp")
            assert isinstance(confirmation, aiormq.spec.Basic.Ack)  # once etcd holds it
            assert {key.split("/", 1)[0] for key in await read_held(etcd)} == {"n1"}
            routing_key, body, arrived = await asyncio.wait_for(received.get(), 30)
            assert (routing_key, body) == ("later.amqp", b"in two seconds")
            assert arrived - sent_at >= 1.9
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(received.get(), 1.5)  # once

            async def released() -> bool:
                return not await read_held(etcd)

            await eventually(released)


def test_a_delayed_message_too_large_for_etcd_is_refused_with_a_reason(
        trio: list[ClusterNodeProcess], etcd: EtcdServer) -> None:
    raw = RawClient(trio[0].mqtt_port, version=5)
    raw.connect("big-scheduler")
    payload = b"x" * (MAX_RECORD_BYTES + 1)
    raw.send(p.Publish("$delayed/5/later/big", payload, qos=1, packet_id=7))
    ack = raw.receive()
    assert isinstance(ack, p.Puback) and ack.packet_id == 7
    assert ack.reason_code == 0x80  # unspecified error, with the reason string
    assert "at most" in (ack.properties.reason_string or "")
    raw.send(p.Publish("$delayed/5/later/small", b"fits", qos=1, packet_id=8))
    ack = raw.receive()
    assert isinstance(ack, p.Puback) and (ack.packet_id, ack.reason_code) == (8, 0)
    assert len(held_in_etcd(etcd)) == 1
    raw.close()


def test_a_holder_killed_between_its_release_and_the_etcd_delete_is_not_released_again(
        etcd: EtcdServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pause = tmp_path / "pause-before-delayed-delete"
    pause.touch()
    monkeypatch.setenv(DELETE_PAUSE_ENV, str(pause))
    started = [protocol_node(tmp_path, name, etcd.url, TIMED) for name in ("n1", "n2", "n3")]
    start_together(started)
    with settled_nodes(started) as nodes:
        controller, _others = by_role(nodes)
        # the topic's shard is owned by a node that stays up (its journal holds the release);
        # the holder is another node, not the controller
        placement = controller.status()["placement"]["timed"]
        owner = next(node for node in nodes if node.node_id in {owner for owner, _epoch in placement})
        holder = next(node for node in nodes if node not in (owner, controller))
        topic = topics_of(owner.status(), "timed", "timed/job", owner=owner.node_id)[0]
        watcher = Paho(owner.mqtt_port, "watcher", V5)
        watcher.subscribe("timed/#", 1)
        publisher = Paho(holder.mqtt_port, "scheduler", V5)
        publisher.publish(f"$delayed/2/{topic}", "exactly once", qos=1)
        message = watcher.expect(timeout=30)
        assert (message.topic, message.payload) == (topic, b"exactly once")
        # released and acknowledged by the owner; the holder waits before deleting its key
        assert holders(etcd) == {holder.node_id}
        holder.kill()
        pause.unlink()
        # the controller takes it over once the holder's lease expires, finds the release in
        # the owner's journal and only deletes the key
        assert wait_for(lambda: not held_in_etcd(etcd), timeout=40, interval=0.1)
        watcher.expect_none(within=2)
        got = asyncio.run(read_back(controller.grpc_url, ["timed/#"], {"exactly once"}, timeout=20))
        assert got == {"exactly once": 1}
        watcher.disconnect()
        publisher.drop()
