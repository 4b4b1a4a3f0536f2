"""What lives with one node survives its SIGKILL (issue 28, "Everything that today lives with one
node survives its loss"). Real etcd, three `shardgate serve --cluster` nodes on loopback, a
reliable stream of three replicas (two in sync), real paho-mqtt, aio-pika and the gRPC SDK.

Each test sets its state up on node A (its home, and the leader of the stream's shard, so
that both go at once), SIGKILLs A, and on another node shows what the user was promised,
waiting on the condition for at most the failover goal (5 s after SIGKILL) plus a margin for
the loaded test machine:

- a persistent MQTT 5 session subscribed QoS 1, offline while messages were acknowledged for
  it, resumes on B with every one of them; one connected with messages in flight (not yet
  acknowledged by its client) gets them again;
- the session's QoS 2 exactly-once state: a PUBLISH whose PUBREC the client never saw, sent
  again on B, is delivered once;
- a durable AMQP queue: another node serves it, the unacknowledged deliveries come again with
  `redelivered`, the acknowledged ones never;
- a durable gRPC subscription: consumed on B from its cursor, nothing acknowledged again;
- a retained message, a delayed message and the will of a client of A.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
import aiormq
import pytest
from shardgate.client import Client, SyncClient
from shardgate.protocols.mqtt import packets as p

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import (
    ClusterNodeProcess,
    EtcdServer,
    amqp_url,
    protocol_node,
    settled_nodes,
    wait_settled,
    wills_in_etcd,
)
from tests.mqtt_clients import V5, Paho, RawClient

STREAM = "survive"
# The goal: the first acknowledgement by the new leader at most 5 s after SIGKILL with
# the default lease; the margin is for a machine running several clusters at once.
FAILOVER_GOAL_S = 5.0
MARGIN_S = 25.0
WITHIN_S = FAILOVER_GOAL_S + MARGIN_S


class Nodes:
    """The three nodes; `home` leads the stream's only shard (and holds the state under test),
    `other` and `third` survive its SIGKILL."""

    def __init__(self, nodes: list[ClusterNodeProcess], leader: str) -> None:
        self.by_id = {node.node_id: node for node in nodes}
        self.home = self.by_id[leader]
        self.other, self.third = (node for node in nodes if node.node_id != leader)

    def kill_home(self) -> float:
        """SIGKILL the home node; the monotonic time of the kill."""
        self.home.kill()
        return time.monotonic()


def _shard(node: ClusterNodeProcess) -> dict[str, Any] | None:
    try:
        shards = node.status()["replicas"].get(STREAM)
    except OSError:
        return None
    return shards[0] if shards else None


def _replicated(node: ClusterNodeProcess) -> dict[str, Any] | None:
    placed = _shard(node)
    if placed is None or len(placed["replicas"]) != 3 or len(placed["isr"]) != 3:
        return None
    return placed


@pytest.fixture
def nodes(tmp_path: Path, etcd: EtcdServer) -> Iterator[Nodes]:
    started = [protocol_node(tmp_path, f"n{index}", etcd.url).start() for index in (1, 2, 3)]
    with settled_nodes(started) as live:
        with SyncClient(live[0].grpc_url) as client:
            client.admin.create_stream(STREAM, mode="reliable", partitions=1, replicas=3,
                                       min_insync_replicas=2)
        placed = wait_for(lambda: _replicated(live[0]), timeout=60, interval=0.1)
        for node in live:
            wait_for(lambda node=node: _replicated(node), timeout=60, interval=0.1)
        yield Nodes(live, placed["leader"])


def _new_leader(survivor: ClusterNodeProcess, dead: ClusterNodeProcess) -> str | None:
    leader = (_shard(survivor) or {}).get("leader")
    return leader if leader not in (None, dead.node_id) else None


def _resume(port: int, client_id: str, deadline: float) -> tuple[Paho, Any]:
    """A paho MQTT 5 client resuming its persistent session (clean start 0) on `port`, trying
    again, as a device would, until the node answers with success or `deadline` passes;
    (client, CONNACK flags)."""
    while True:
        client = Paho(port, client_id, V5, clean=False, session_expiry=600, connect=False)
        try:
            flags, reason, _props = client.connect()
        except (queue.Empty, OSError):
            client.drop()
            flags, reason = None, None
        if reason is not None and not reason.is_failure:
            return client, flags
        client.drop()
        assert time.monotonic() < deadline, f"session not resumed in time (last CONNACK {reason})"
        time.sleep(0.2)


def _take_until(reader: Paho, wanted: set[str], deadline: float) -> list[str]:
    """Payloads received until every one of `wanted` came (fails at `deadline`)."""
    got: list[str] = []
    while not wanted <= set(got):
        remaining = deadline - time.monotonic()
        assert remaining > 0, (
            f"{len(wanted - set(got))} acknowledged messages never arrived, "
            f"e.g. {sorted(wanted - set(got))[:5]}; got {got[:10]}")
        with contextlib.suppress(queue.Empty):
            got.append(reader.expect(timeout=min(remaining, 1.0)).payload.decode())
    return got


# ---------------------------------------------------------------- MQTT persistent sessions

@pytest.mark.timeout(300)
def test_a_persistent_mqtt_session_resumes_on_another_node_with_every_acknowledged_message(
        nodes: Nodes) -> None:
    reader = Paho(nodes.home.mqtt_port, "survivor-reader", V5, clean=False, session_expiry=600)
    reader.subscribe(f"{STREAM}/#", qos=1)
    reader.disconnect()  # offline: the session stays on its home, A
    publisher = Paho(nodes.other.mqtt_port, "survivor-writer", V5)
    sent = [f"offline-{index:03d}" for index in range(50)]
    for payload in sent:
        publisher.publish(f"{STREAM}/a", payload, qos=1)  # waits for its PUBACK
    publisher.disconnect()

    killed_at = nodes.kill_home()
    deadline = killed_at + WITHIN_S
    resumed, flags = _resume(nodes.other.mqtt_port, "survivor-reader", deadline)
    assert flags.session_present, "the session was lost with its home node"
    got = _take_until(resumed, set(sent), deadline)
    print(f"every acknowledged message on the resumed session {time.monotonic() - killed_at:.1f} s"
          " after SIGKILL")
    firsts = list(dict.fromkeys(got))
    assert firsts == sent  # in publish order (again at most where it was in flight)
    # and the session goes on receiving what is published now
    publisher = Paho(nodes.third.mqtt_port, "survivor-writer-2", V5)
    publisher.publish(f"{STREAM}/a", "after", qos=1)
    assert _take_until(resumed, {"after"}, time.monotonic() + WITHIN_S)[-1] == "after"
    publisher.disconnect()
    resumed.disconnect()


@pytest.mark.timeout(300)
def test_the_in_flight_messages_of_a_connected_session_whose_node_died_come_again(
        nodes: Nodes) -> None:
    reader = RawClient(nodes.home.mqtt_port, version=5)
    connack = reader.connect("inflight-reader", clean=False,
                             properties=p.Properties(session_expiry_interval=600))
    assert connack.reason_code == 0
    reader.send(p.Subscribe(1, [p.SubscriptionRequest(f"{STREAM}/#", 1)]))
    assert isinstance(reader.receive(30), p.Suback)
    publisher = Paho(nodes.other.mqtt_port, "inflight-writer", V5)
    sent = [f"inflight-{index:02d}" for index in range(10)]
    for payload in sent:
        publisher.publish(f"{STREAM}/a", payload, qos=1)
    publisher.disconnect()
    # the client gets them all and acknowledges none: in flight when its node dies
    received = [reader.receive(30) for _ in sent]
    assert [packet.payload.decode() for packet in received] == sent

    deadline = nodes.kill_home() + WITHIN_S
    reader.close()
    resumed, flags = _resume(nodes.third.mqtt_port, "inflight-reader", deadline)
    assert flags.session_present, "the session was lost with its home node"
    got = _take_until(resumed, set(sent), deadline)
    assert list(dict.fromkeys(got)) == sent
    resumed.disconnect()


def _raw_resume(port: int, client_id: str, deadline: float) -> tuple[RawClient, p.Connack]:
    """A raw MQTT 5 client resuming its persistent session on `port`, again until accepted."""
    while True:
        raw = RawClient(port, version=5)
        connack = raw.connect(client_id, clean=False,
                              properties=p.Properties(session_expiry_interval=600))
        if connack.reason_code == 0:
            return raw, connack
        raw.close()
        assert time.monotonic() < deadline, f"session not resumed in time ({connack})"
        time.sleep(0.2)


def _until_accepted(raw: RawClient, packet: p.Publish, deadline: float) -> Any:
    """Sends `packet` until its PUBACK / PUBREC is a success: a refusal while the shard has
    no leader yet (0x80, retryable) is sent again, as a client does; the accepting reply."""
    while True:
        raw.send(packet)
        reply = raw.receive(max(1.0, deadline - time.monotonic()))
        assert isinstance(reply, p.Puback | p.Pubrec) and reply.packet_id == packet.packet_id, reply
        if reply.reason_code < 0x80:
            return reply
        assert time.monotonic() < deadline, f"never accepted: {reply}"
        time.sleep(0.2)


@pytest.mark.timeout(300)
def test_the_qos2_state_of_a_session_whose_node_died_delivers_a_resent_publish_once(
        nodes: Nodes) -> None:
    # a persistent session: its cursor drops what the stream's new leader hands on again of
    # what it inherited (`replicated_shards`: a live subscriber may get that twice), so only
    # a second copy stored by the broker would come twice
    watcher = Paho(nodes.third.mqtt_port, "qos2-watcher", V5, clean=False, session_expiry=600)
    watcher.subscribe(f"{STREAM}/#", qos=2)
    raw = RawClient(nodes.home.mqtt_port, version=5)
    connack = raw.connect("qos2-sender", clean=False,
                          properties=p.Properties(session_expiry_interval=600))
    assert connack.reason_code == 0
    raw.send(p.Publish(f"{STREAM}/q2", b"exactly-once", qos=2, packet_id=7))
    pubrec = raw.receive(30)
    assert isinstance(pubrec, p.Pubrec) and pubrec.packet_id == 7 and pubrec.reason_code == 0
    assert watcher.expect(30).payload == b"exactly-once"
    # the home dies while the client is connected, before the PUBREC reached it (as far as
    # the client knows): it resumes elsewhere and sends the PUBLISH again, DUP, same id
    deadline = nodes.kill_home() + WITHIN_S
    raw.close()
    raw, connack = _raw_resume(nodes.other.mqtt_port, "qos2-sender", deadline)
    assert connack.session_present, "the session was lost with its home node"
    _until_accepted(raw, p.Publish(f"{STREAM}/q2", b"exactly-once", qos=2, dup=True,
                                   packet_id=7), deadline)
    raw.send(p.Pubrel(7))
    pubcomp = raw.receive(WITHIN_S)
    assert isinstance(pubcomp, p.Pubcomp) and pubcomp.packet_id == 7, pubcomp
    assert pubcomp.reason_code == 0, f"PUBCOMP {pubcomp.reason_code:#x}"
    # a later message arrives, and the resent one did not come again before it
    _until_accepted(raw, p.Publish(f"{STREAM}/q2", b"marker", qos=1, packet_id=8),
                    time.monotonic() + WITHIN_S)
    got = _take_until(watcher, {"marker"}, time.monotonic() + WITHIN_S)
    assert got == ["marker"], f"the resent QoS 2 publish was delivered again: {got}"
    raw.close()
    watcher.disconnect()


def _session_in_etcd(etcd: EtcdServer, client_id: str) -> dict[str, Any] | None:
    """The snapshot of `client_id`'s session etcd holds (decoded), if any."""
    from shardgate.cluster.etcd import EtcdClient

    async def read() -> dict[str, Any] | None:
        client = EtcdClient([etcd.url])
        try:
            kvs, _revision = await client.get_prefix("/")
        finally:
            await client.close()
        for kv in kvs:
            if kv.key.endswith(".state/sessions/" + client_id):
                return json.loads(kv.value)
        return None

    return asyncio.run(read())


@pytest.mark.timeout(300)
def test_a_qos2_message_released_to_a_subscriber_whose_node_died_arrives_once(
        nodes: Nodes, etcd: EtcdServer) -> None:
    reader = RawClient(nodes.home.mqtt_port, version=5)
    connack = reader.connect("qos2-reader", clean=False,
                             properties=p.Properties(session_expiry_interval=600))
    assert connack.reason_code == 0
    reader.send(p.Subscribe(1, [p.SubscriptionRequest(f"{STREAM}/#", 2)]))
    assert isinstance(reader.receive(30), p.Suback)
    publisher = RawClient(nodes.other.mqtt_port, version=5)
    assert publisher.connect("qos2-writer").reason_code == 0
    _until_accepted(publisher, p.Publish(f"{STREAM}/r", b"once", qos=2, packet_id=1),
                    time.monotonic() + WITHIN_S)
    publisher.send(p.Pubrel(1))
    assert isinstance(publisher.receive(30), p.Pubcomp)
    delivery = reader.receive(30)
    assert isinstance(delivery, p.Publish) and delivery.payload == b"once" and delivery.qos == 2
    # etcd's checkpoint of the session holds the message in flight, not released yet
    wait_for(lambda: any(entry["pid"] == delivery.packet_id and not entry["released"]
                         for entry in (_session_in_etcd(etcd, "qos2-reader") or {}).get(
                             "inflight", [])), timeout=30, interval=0.1)
    reader.send(p.Pubrec(delivery.packet_id))
    pubrel = reader.receive(30)
    assert isinstance(pubrel, p.Pubrel) and pubrel.packet_id == delivery.packet_id, pubrel
    # the home dies before the client's PUBCOMP: where the session resumes, the message is
    # released again (PUBREL), never sent again as a PUBLISH [MQTT-4.3.3]
    deadline = nodes.kill_home() + WITHIN_S
    reader.close()
    resumed, connack = _raw_resume(nodes.third.mqtt_port, "qos2-reader", deadline)
    assert connack.session_present, "the session was lost with its home node"
    again = resumed.receive(WITHIN_S)
    assert isinstance(again, p.Pubrel) and again.packet_id == delivery.packet_id, (
        f"the released message came again as {again}")
    resumed.send(p.Pubcomp(again.packet_id))
    # a later message arrives, and the released one did not come again before it
    _until_accepted(publisher, p.Publish(f"{STREAM}/r", b"marker", qos=1, packet_id=2),
                    time.monotonic() + WITHIN_S)
    following = resumed.receive(WITHIN_S)
    assert isinstance(following, p.Publish) and following.payload == b"marker", following
    resumed.close()
    publisher.close()


# ---------------------------------------------------------------- AMQP durable queues

async def _publish_amqp(url: str, routing_key: str, bodies: list[bytes]) -> None:
    async with await aio_pika.connect(url) as connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange("amq.topic")
        for body in bodies:
            confirmation = await exchange.publish(
                aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                routing_key, mandatory=True)
            assert isinstance(confirmation, aiormq.spec.Basic.Ack), confirmation


async def _redelivered_elsewhere(url: str, queue_name: str, wanted: set[bytes],
                                 deadline: float) -> dict[bytes, bool]:
    """Consumes `queue_name` on the node at `url` (declaring it passively, again while the
    node answers 404 or is not reachable) until every body of `wanted` came; body -> its
    `redelivered` flag (the first delivery of each)."""
    got: dict[bytes, bool] = {}
    last_error: BaseException | None = None
    while not wanted <= set(got):
        remaining = deadline - asyncio.get_running_loop().time()
        assert remaining > 0, (f"the queue was not served again in time: got {sorted(got)}, "
                               f"last error {last_error!r}")
        try:
            async with await aio_pika.connect(url, timeout=10) as connection:
                channel = await connection.channel()
                await channel.set_qos(prefetch_count=100)
                queue_ = await channel.declare_queue(queue_name, passive=True)
                async with queue_.iterator() as messages:
                    async with asyncio.timeout(remaining):
                        async for message in messages:
                            got.setdefault(message.body, bool(message.redelivered))
                            await message.ack()
                            if wanted <= set(got):
                                break
        except (aio_pika.exceptions.AMQPError, OSError, TimeoutError) as exc:
            last_error = exc
            await asyncio.sleep(0.2)
    return got


@pytest.mark.timeout(300)
def test_a_durable_amqp_queue_is_served_by_another_node_with_its_unacknowledged_redelivered(
        nodes: Nodes) -> None:
    bodies = [f"order-{index:02d}".encode() for index in range(20)]
    acked, unacked = bodies[:10], bodies[10:]

    async def scenario() -> None:
        home_url = amqp_url(nodes.home)
        connection = await aio_pika.connect(home_url)
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=100)
        queue_ = await channel.declare_queue("orders", durable=True)
        await queue_.bind("amq.topic", f"{STREAM}.#")
        await _publish_amqp(amqp_url(nodes.other), f"{STREAM}.a", bodies)
        delivered = []
        async with queue_.iterator() as messages:
            async for message in messages:
                delivered.append(message)
                if len(delivered) == len(bodies):
                    break
        assert [message.body for message in delivered] == bodies
        for message in delivered[:len(acked)]:
            await message.ack()
        # the acks reached the home: a second channel's passive declare counts what is left
        probe = await connection.channel()

        async def acks_applied() -> bool:
            declared = await probe.declare_queue("orders", passive=True)
            return declared.declaration_result.message_count == 0

        loop = asyncio.get_running_loop()
        ack_deadline = loop.time() + 20
        while not await acks_applied():
            assert loop.time() < ack_deadline
            await asyncio.sleep(0.05)

        deadline = loop.time() + WITHIN_S
        nodes.kill_home()
        with contextlib.suppress(Exception):
            await connection.close()
        got = await _redelivered_elsewhere(amqp_url(nodes.other), "orders", set(unacked), deadline)
        assert not set(got) & set(acked), f"acknowledged messages came again: {sorted(got)}"
        assert all(got[body] for body in unacked), f"not marked redelivered: {got}"

    asyncio.run(scenario())


@pytest.mark.timeout(300)
def test_every_message_confirmed_to_a_durable_amqp_queue_is_delivered_after_its_home_dies(
        nodes: Nodes) -> None:
    """A publisher on another node goes on through the SIGKILL of the queue's home (the leader
    of the stream's shard too): every message it had confirmed reaches the queue's consumer on
    a third node, those confirmed before the kill and those confirmed after."""
    confirmed: list[bytes] = []

    async def scenario() -> None:
        async with await aio_pika.connect(amqp_url(nodes.home)) as connection:
            channel = await connection.channel()
            queue_ = await channel.declare_queue("confirmed", durable=True)
            await queue_.bind("amq.topic", f"{STREAM}.#")
        loop = asyncio.get_running_loop()
        publishing = await aio_pika.connect(amqp_url(nodes.other))
        channel = await publishing.channel(publisher_confirms=True)
        exchange = await channel.get_exchange("amq.topic")
        killed_at: float | None = None
        index = 0
        while len(confirmed) < 60:
            body = f"confirmed-{index:03d}".encode()
            index += 1
            try:
                outcome = await exchange.publish(
                    aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                    f"{STREAM}.c", timeout=10)
            except (aio_pika.exceptions.AMQPError, TimeoutError):
                outcome = None  # refused meanwhile (no leader yet): not confirmed, not counted
            if isinstance(outcome, aiormq.spec.Basic.Ack):
                confirmed.append(body)
            else:
                await asyncio.sleep(0.05)
            if killed_at is None and len(confirmed) == 30:
                nodes.kill_home()  # half confirmed before, half after
                killed_at = loop.time()
            assert killed_at is None or loop.time() < killed_at + WITHIN_S, (
                f"publishes not confirmed again in time: {len(confirmed)} confirmed")
        await publishing.close()
        assert killed_at is not None
        got = await _redelivered_elsewhere(amqp_url(nodes.third), "confirmed", set(confirmed),
                                           killed_at + WITHIN_S)
        assert set(confirmed) <= set(got), sorted(set(confirmed) - set(got))

    asyncio.run(scenario())


@pytest.mark.timeout(300)
def test_an_old_home_that_comes_back_does_not_serve_its_queue_at_a_stale_state(
        nodes: Nodes) -> None:
    """After a takeover, the node that was the queue's home restarts with its old copy on
    disk: it drops it, and its clients use the queue where it lives now, as it is now."""
    old = [f"old-{index}".encode() for index in range(10)]
    new = [f"new-{index}".encode() for index in range(5)]

    async def scenario() -> None:
        async with await aio_pika.connect(amqp_url(nodes.home)) as connection:
            channel = await connection.channel()
            queue_ = await channel.declare_queue("stale", durable=True)
            await queue_.bind("amq.topic", f"{STREAM}.#")
        await _publish_amqp(amqp_url(nodes.other), f"{STREAM}.s", old)
        loop = asyncio.get_running_loop()
        nodes.kill_home()
        # taken over: every old message is consumed and acknowledged on another node
        got = await _redelivered_elsewhere(amqp_url(nodes.other), "stale", set(old),
                                           loop.time() + WITHIN_S)
        assert set(got) == set(old)
        await _publish_amqp(amqp_url(nodes.other), f"{STREAM}.s", new)
        nodes.home.start()
        wait_settled(list(nodes.by_id.values()))
        # on the old home: the queue as it is now (the new messages only), never its old copy
        async with await aio_pika.connect(amqp_url(nodes.home)) as connection:
            channel = await connection.channel()
            declared = await channel.declare_queue("stale", passive=True)
            assert declared.declaration_result.message_count == len(new)
        again = await _redelivered_elsewhere(amqp_url(nodes.home), "stale", set(new),
                                             loop.time() + WITHIN_S)
        assert set(again) == set(new), f"the old home served its stale copy: {sorted(again)}"

    asyncio.run(scenario())


# ---------------------------------------------------------------- durable gRPC cursors

@pytest.mark.timeout(300)
def test_a_durable_grpc_subscription_goes_on_from_its_cursor_on_another_node(
        nodes: Nodes) -> None:
    sent = [f"ledger-{index:02d}".encode() for index in range(20)]

    async def scenario() -> None:
        async with Client(nodes.other.grpc_url) as client:
            producer = client.producer()
            async with Client(nodes.home.grpc_url) as home:
                consumer = home.consumer("ledger", [f"{STREAM}/#"], durable=True, reconnect=False)
                await consumer.subscribe()
                for payload in sent[:10]:
                    await producer.send(f"{STREAM}/a", payload)
                taken = []
                async with asyncio.timeout(30):
                    async for message in consumer:
                        taken.append(message.payload)
                        message.ack()
                        if len(taken) == 10:
                            break
                assert taken == sent[:10]
                await consumer.close()
            for payload in sent[10:]:
                await producer.send(f"{STREAM}/a", payload)

        loop = asyncio.get_running_loop()
        deadline = loop.time() + WITHIN_S
        nodes.kill_home()
        got: list[bytes] = []
        last_error: BaseException | None = None
        while not set(sent[10:]) <= set(got):
            assert loop.time() < deadline, f"got {got}, last error {last_error!r}"
            try:
                async with Client(nodes.other.grpc_url) as client:
                    consumer = client.consumer("ledger", [f"{STREAM}/#"], durable=True,
                                               reconnect=False)
                    await consumer.subscribe()
                    async with asyncio.timeout(max(0.1, deadline - loop.time())):
                        async for message in consumer:
                            got.append(message.payload)
                            message.ack()
                            if set(sent[10:]) <= set(got):
                                break
                    await consumer.close()
            except Exception as exc:  # noqa: BLE001 - retried until the deadline, reported
                last_error = exc
                await asyncio.sleep(0.2)
        assert not set(got) & set(sent[:10]), f"acknowledged messages came again: {got}"
        assert got == sent[10:]

    asyncio.run(scenario())


# ---------------------------------------------------------------- retained, delayed, wills

@pytest.mark.timeout(300)
def test_a_retained_message_set_on_the_killed_node_is_kept_by_the_others(nodes: Nodes) -> None:
    setter = Paho(nodes.home.mqtt_port, "retainer", V5)
    setter.publish(f"{STREAM}/config", "kept", qos=1, retain=True)
    setter.disconnect()
    deadline = nodes.kill_home() + WITHIN_S
    while True:
        reader = Paho(nodes.other.mqtt_port, "retained-reader", V5)
        reader.subscribe(f"{STREAM}/config", qos=1)
        with contextlib.suppress(queue.Empty):
            message = reader.expect(timeout=1.0)
            assert message.payload == b"kept" and message.retain
            break
        reader.disconnect()
        assert time.monotonic() < deadline, "the retained message was lost with its node"
    reader.disconnect()


@pytest.mark.timeout(300)
def test_a_delayed_message_accepted_by_the_killed_node_is_released_by_another(
        nodes: Nodes) -> None:
    watcher = Paho(nodes.other.mqtt_port, "delay-watcher", V5)
    watcher.subscribe(f"{STREAM}/#", qos=1)
    publisher = Paho(nodes.home.mqtt_port, "delay-scheduler", V5)
    publisher.publish(f"$delayed/3/{STREAM}/later", "due in 3 s", qos=1)  # acknowledged: kept
    killed_at = nodes.kill_home()
    # due 3 s after its publish; the controller takes it over once the home's lease is gone
    got = _take_until(watcher, {"due in 3 s"}, killed_at + WITHIN_S)
    assert got == ["due in 3 s"]
    watcher.disconnect()


@pytest.mark.timeout(300)
def test_the_will_of_a_client_of_the_killed_node_is_published_by_another(
        nodes: Nodes, etcd: EtcdServer) -> None:
    watcher = Paho(nodes.other.mqtt_port, "will-watcher", V5)
    watcher.subscribe(f"{STREAM}/#", qos=1)
    device = Paho(nodes.home.mqtt_port, "will-device", V5, clean=False, session_expiry=600,
                  will={"topic": f"{STREAM}/status/will-device", "payload": "gone", "qos": 1})
    # The CONNACK does not wait for the will's etcd write (one write per CONNECT with a will,
    # made just after): A dies once its will is there, with the device still connected.
    assert wait_for(lambda: "will-device" in wills_in_etcd(etcd), timeout=10, interval=0.05)
    killed_at = nodes.kill_home()
    got = _take_until(watcher, {"gone"}, killed_at + WITHIN_S)
    assert got == ["gone"]
    device.drop()
    watcher.disconnect()

