"""Faults while a cluster serves, with real clients and real processes (issue 14's "Bad input
and faults"): a node SIGKILLed while clients publish QoS 1 to its reliable shards (directly and
through another node), a node stopped for a while (SIGSTOP, then SIGCONT), and etcd killed and
restarted on the same data directory and ports while nodes serve and clients publish.

Each test publishes continuously (`ContinuousPublisher`: one QoS 1 message at a time, each
payload unique) and afterwards reads every stored message back through the gRPC SDK from the
earliest offset: every message that was acknowledged must be there, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import time
import urllib.request
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from shardgate.client import Client, ShardgateError, Unavailable
from shardgate.protocols.mqtt import packets as p

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import (
    ClusterNodeProcess,
    ContinuousPublisher,
    EtcdServer,
    protocol_node,
    read_back,
    topics_of,
    wait_settled,
)
from tests.mqtt_clients import RawClient

RETRYABLE = {0x80, 0x97}  # MQTT 5: unspecified error, quota exceeded (both say "try again")


@pytest.fixture
def nodes(etcd: EtcdServer, tmp_path: Path) -> Iterator[list[ClusterNodeProcess]]:
    """n1 and n2 with every protocol, and a reliable stream `safe` (4 shards) created once
    both are members, so that each of them owns some of its shards. One copy per shard
    (`replicas=1`): these faults are those of a shard whose only node fails; replicated shards
    (the default in a cluster) are `test_cluster_replicated_shards.py`,
    `test_replica_failover.py` and `test_cluster_replication_default.py`."""
    # A forwarded publish is held for a next leader `forward_hold_s` (10 s by default) before
    # it is refused retryably; no other node leads a shard of one copy whose node is gone, so
    # the refusal comes after the hold, shortened here.
    started = [protocol_node(tmp_path, name, etcd.url, extra_config="forward_hold_s = 1\n").start()
               for name in ("n1", "n2")]
    try:
        wait_settled(started)

        async def create() -> None:
            async with Client(started[0].grpc_url) as client:
                await client.admin.create_stream("safe", partitions=4, mode="reliable",
                                                 replicas=1)

        asyncio.run(create())
        wait_for(lambda: all(placed_on_both(node.status()) for node in started), timeout=30)
        yield started
    finally:
        for node in started:
            if node.alive():
                node.kill()


def placed_on_both(status: dict[str, Any]) -> bool:
    owners = {owner for owner, _epoch in status["placement"].get("safe", [])}
    return owners == {"n1", "n2"}


def forward_latency_count(node: ClusterNodeProcess) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{node.ports['http']}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    series = r"^shardgate_cluster_forward_latency_seconds_count\{[^}]*node=\"" + node.node_id
    found = re.search(series + r"\"[^}]*\} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def answered(publisher: ContinuousPublisher) -> int:
    """How many of `publisher`'s publishes got a PUBACK (acknowledged or refused)."""
    return publisher.count() + publisher.refusals()


def assert_publishes_answered_again(publisher: ContinuousPublisher, frozen_s: float) -> None:
    """A client of the node that was frozen gets its publishes answered (forwarded and
    acknowledged, or refused retryably) soon after the node continues: none waits for ever.
    (Its connection may end by keep alive only when the freeze outlasted it.)"""
    mark = answered(publisher)
    wait_for(lambda: answered(publisher) >= mark + 5 or publisher.dropped.is_set(), timeout=20)
    assert not publisher.dropped.is_set() or frozen_s > 60, (
        f"{publisher.name} was dropped: {publisher.disconnect}")


def sequence(payload: str) -> int:
    return int(payload.rsplit("-", 1)[1])


def assert_every_acknowledged_message_is_stored_once(
    nodes: list[ClusterNodeProcess], publishers: list[ContinuousPublisher],
) -> None:
    """Read each shard of `safe` back from the node that owns it (a consumer from the earliest
    offset, filtered to the topics on that node's shards): every acknowledged payload once."""
    acknowledged = {payload for publisher in publishers for payload in publisher.acknowledged}
    topics = {topic for publisher in publishers for topic in publisher.topics}
    placement = nodes[0].status()["placement"]["safe"]
    got: Counter[str] = Counter()
    for node in nodes:
        own = sorted(topic for topic in topics
                     if placement[zlib.crc32(topic.encode()) % len(placement)][0] == node.node_id)
        expected = {payload for publisher in publishers
                    for payload, topic in publisher.acknowledged.items() if topic in own}
        if own:
            got += asyncio.run(read_back(node.grpc_url, own, expected))
    missing = sorted(acknowledged - set(got), key=lambda payload: (payload[:2], sequence(payload)))
    assert not missing, f"{len(missing)} of {len(acknowledged)} acknowledged messages lost: {missing[:10]}"
    twice = sorted(payload for payload, count in got.items() if count > 1)
    assert not twice, f"{len(twice)} messages stored twice: {twice[:10]}"


@pytest.mark.timeout(300)
def test_a_node_killed_mid_publish_returns_with_every_acknowledged_message(
    nodes: list[ClusterNodeProcess],
) -> None:
    n1, n2 = nodes
    status = n1.status()
    topics = topics_of(status, "safe", "safe/k", per_shard=2)
    on_n2 = set(topics_of(status, "safe", "safe/k", owner="n2", per_shard=2))
    through_n1 = ContinuousPublisher(n1.mqtt_port, "via-n1", topics)
    on_n2_itself = ContinuousPublisher(n2.mqtt_port, "on-n2", topics)
    wait_for(lambda: through_n1.count() >= 100 and on_n2_itself.count() >= 100, timeout=60)
    # the forwards to n2 were measured (latency histogram, with the node label)
    assert forward_latency_count(n1) > 0
    n2.kill()
    assert on_n2_itself.dropped.wait(10), "the client of the killed node noticed"
    # publishes to n2's shards through n1 are held (`forward_hold_s`) and then refused with a
    # retryable reason and a reason string; publishes to n1's shards go on being acknowledged
    acknowledged_at_kill = through_n1.count()
    wait_for(lambda: through_n1.refusals() >= 10 and through_n1.count() >= acknowledged_at_kill + 10,
             timeout=30)
    assert {code for code, _reason, _topic in through_n1.refused} <= RETRYABLE, through_n1.refused[:5]
    assert all(reason for _code, reason, _topic in through_n1.refused), "every refusal says why"
    assert {topic for _code, _reason, topic in through_n1.refused} <= on_n2
    refused_topic = next(iter(on_n2))
    assert_other_protocols_are_refused(n1, refused_topic)
    # n2 returns with its data directory: its shards are available again
    n2.start()
    wait_settled(nodes)
    wait_for(lambda: not n1.status()["unavailable_shards"], timeout=30)
    refused_before = through_n1.refusals()

    def n2_shard_acknowledged_again() -> bool:
        later = [payload for payload, topic in through_n1.latest_acknowledged(len(topics) * 2)
                 if topic in on_n2]
        return bool(later) and through_n1.refusals() == refused_before

    wait_for(n2_shard_acknowledged_again, timeout=30)
    through_n1.stop()
    on_n2_itself.stop()
    assert_every_acknowledged_message_is_stored_once(nodes, [through_n1, on_n2_itself])


def assert_other_protocols_are_refused(node: ClusterNodeProcess, topic: str) -> None:
    """While `topic`'s owner is down: an MQTT 3.1.1 publisher (which has no refusal PUBACK) is
    disconnected without a PUBACK, an AMQP publisher with confirms gets a nack for a
    persistent message, the gRPC SDK gets UNAVAILABLE. (Not mandatory: a mandatory message that
    no AMQP queue is bound for is returned unroutable and confirmed before it reaches a stream,
    as RabbitMQ does.)"""

    async def check() -> None:
        url = f"amqp://guest:guest@127.0.0.1:{node.ports['amqp']}/"
        async with await aio_pika.connect(url) as connection:
            channel = await connection.channel(publisher_confirms=True)
            exchange = await channel.get_exchange("amq.topic")
            with pytest.raises(aio_pika.exceptions.DeliveryError):
                await exchange.publish(aio_pika.Message(b"refused", delivery_mode=2),
                                       topic.replace("/", "."), mandatory=False)
        async with Client(node.grpc_url) as client:
            with pytest.raises(Unavailable):
                await client.producer().send(topic, "refused")

    asyncio.run(check())
    legacy = RawClient(node.mqtt_port, version=4)
    legacy.connect("legacy")
    legacy.send(p.Publish(topic, b"refused", 1, packet_id=1))
    assert legacy.receive() is None, "closed, not acknowledged"
    legacy.close()


def rss_mib(node: ClusterNodeProcess) -> float:
    assert node.proc is not None
    status = Path(f"/proc/{node.proc.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) / 1024


@pytest.mark.timeout(300)
def test_a_stopped_node_does_not_stop_the_others_and_catches_up_when_it_continues(
    nodes: list[ClusterNodeProcess],
) -> None:
    """n2 is frozen (SIGSTOP) for longer than its lease: n1 goes on acknowledging its own
    shards, a publish for n2's shards gets an answer (a retryable refusal after the hold for a
    next leader, which a shard of one copy never gets; never a hang), n1's
    memory stays bounded; after SIGCONT n2 rejoins and nothing acknowledged is lost."""
    n1, n2 = nodes
    status = n1.status()
    own = topics_of(status, "safe", "safe/s", owner="n1", per_shard=2)
    theirs = topics_of(status, "safe", "safe/s", owner="n2", per_shard=2)
    to_n1 = ContinuousPublisher(n1.mqtt_port, "to-n1", own)
    to_n2 = ContinuousPublisher(n1.mqtt_port, "to-n2", theirs)
    # (a publish that n2 read just before it froze is answered after SIGCONT)
    on_n2 = ContinuousPublisher(n2.mqtt_port, "on-n2", own + theirs, ack_timeout_s=120)
    wait_for(lambda: min(p.count() for p in (to_n1, to_n2, on_n2)) >= 50, timeout=60)
    rss_before = rss_mib(n1)
    assert n2.proc is not None
    n2.proc.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        at_stop = to_n1.count()
        # n1's own shards keep being served while n2 is frozen ...
        wait_for(lambda: to_n1.count() >= at_stop + 200, timeout=30)
        # ... and a publish for n2's shards is answered: refused, retryably, once n2 is found
        # dead (no answer within its lease) or the link to it is full
        wait_for(lambda: to_n2.refusals() >= 3, timeout=30)
        assert not to_n2.dropped.is_set() and not to_n1.dropped.is_set()
        assert {code for code, _reason, _topic in to_n2.refused} <= RETRYABLE, to_n2.refused[:3]
        wait_for(lambda: to_n1.count() >= at_stop + 300, timeout=60)
        assert rss_mib(n1) - rss_before < 100, "n1 holds what it cannot send to n2 in bounded memory"
    finally:
        n2.proc.send_signal(signal.SIGCONT)
    frozen_s = time.monotonic() - stopped_at
    # n2 finds its lease gone, stops acting for its shards, registers again and serves them
    wait_settled(nodes)
    # its own client's publishes (n1's shards among them) are answered again, within a bound
    assert_publishes_answered_again(on_n2, frozen_s)
    wait_for(lambda: not n1.status()["unavailable_shards"], timeout=30)
    refused = to_n2.refusals()
    at_return = to_n2.count()
    wait_for(lambda: to_n2.count() >= at_return + 20 and to_n2.refusals() == refused, timeout=30)
    for publisher in (to_n1, to_n2, on_n2):
        publisher.stop()
    assert n1.alive() and n2.alive()
    assert not to_n1.dropped.is_set() and not to_n2.dropped.is_set()
    # (n2's own client may be disconnected by n2 after SIGCONT: `keep alive timeout` when
    # the freeze outlasted 1.5 times its keep alive; what it had acknowledged still counts)
    assert_every_acknowledged_message_is_stored_once(nodes, [to_n1, to_n2, on_n2])


@pytest.mark.timeout(300)
def test_etcd_restarted_while_nodes_serve_loses_nothing_acknowledged_and_nodes_rejoin(
    nodes: list[ClusterNodeProcess], etcd: EtcdServer,
) -> None:
    """etcd is SIGKILLed while clients publish QoS 1 on both nodes, and started again on the same
    data directory and ports after the nodes' leases ran out: the nodes keep running, refuse
    (retryably) what they can no longer prove they own, register again, the controller and the
    placement come back, publishing resumes, and every acknowledged message is stored once."""
    n1, n2 = nodes
    topics = topics_of(n1.status(), "safe", "safe/e", per_shard=2)
    on_n1 = ContinuousPublisher(n1.mqtt_port, "on-n1", topics)
    on_n2 = ContinuousPublisher(n2.mqtt_port, "on-n2", topics)
    wait_for(lambda: on_n1.count() >= 100 and on_n2.count() >= 100, timeout=60)
    placement_before = n1.status()["placement"]["safe"]
    etcd.kill()
    # past the lease TTL the nodes stop acting for their shards: publishes are refused, retryably
    wait_for(lambda: not n1.status()["lease_alive"] and not n2.status()["lease_alive"], timeout=20)
    wait_for(lambda: on_n1.refusals() >= 5 and on_n2.refusals() >= 5, timeout=30)
    assert n1.alive() and n2.alive()
    etcd.start()
    wait_for(lambda: n1.status()["lease_alive"] and n2.status()["lease_alive"], timeout=30)
    wait_settled(nodes)
    status = n1.status()
    assert status["controller"] in {"n1", "n2"}
    # the reliable shards stay with the nodes that hold their journals
    assert [owner for owner, _epoch in status["placement"]["safe"]] == [
        owner for owner, _epoch in placement_before]
    marks = [(p.count(), p.refusals()) for p in (on_n1, on_n2)]
    wait_for(lambda: all(p.count() >= count + 50 for p, (count, _) in zip((on_n1, on_n2), marks, strict=True)),
             timeout=30)
    for publisher in (on_n1, on_n2):
        publisher.stop()
        assert not publisher.dropped.is_set(), f"{publisher.name} lost its connection"
        assert {code for code, _reason, _topic in publisher.refused} <= RETRYABLE, publisher.refused[:3]
        assert all(reason for _code, reason, _topic in publisher.refused)
    assert_every_acknowledged_message_is_stored_once(nodes, [on_n1, on_n2])
    # and what needs etcd at run time works again: a durable subscription is defined
    for node in nodes:
        wait_for(lambda node=node: durable_defined(node), timeout=20, interval=0.5)


def durable_defined(node: ClusterNodeProcess) -> bool:
    async def define() -> bool:
        async with Client(node.grpc_url) as client:
            consumer = client.consumer(f"after-etcd-{node.node_id}", ["safe/#"], durable=True)
            try:
                await consumer.subscribe()
            except ShardgateError:
                return False
            await consumer.close()
            return True

    return asyncio.run(define())


def test_a_durable_subscribe_while_etcd_is_down_is_unavailable_then_works(
    nodes: list[ClusterNodeProcess], etcd: EtcdServer,
) -> None:
    """Where a durable subscription lives is kept in etcd: while etcd is away, subscribing to
    one is refused with UNAVAILABLE (retryable) and a reason, not an internal error."""
    n1, _n2 = nodes
    etcd.kill()

    async def subscribe() -> None:
        async with Client(n1.grpc_url) as client:
            consumer = client.consumer("kept", ["safe/#"], durable=True)
            await consumer.subscribe()
            await consumer.close()

    with pytest.raises(Unavailable, match="etcd"):
        asyncio.run(subscribe())
    etcd.start()
    wait_for(lambda: n1.status()["lease_alive"], timeout=30)
    wait_for(lambda: durable_defined(n1), timeout=20, interval=0.5)


@pytest.mark.timeout(300)
def test_a_persistent_session_gets_every_message_acknowledged_while_a_node_was_frozen(
    nodes: list[ClusterNodeProcess],
) -> None:
    """A persistent MQTT session subscribed on n1 to every shard, n2 frozen (SIGSTOP past its
    lease) while publishers on both nodes go on: once n2 is back, the session has every
    acknowledged message: those n2 stored but could not push, and those n1 stored."""
    from tests.e2e.test_cluster_cross_node import routes_reach
    from tests.mqtt_clients import V5, Paho

    n1, n2 = nodes
    topics = topics_of(n1.status(), "safe", "safe/p", per_shard=2)
    keeper = Paho(n1.mqtt_port, "keeper", V5, clean=False, session_expiry=600)
    keeper.subscribe("safe/p/#", 1)
    routes_reach(nodes, n1)
    on_n1 = ContinuousPublisher(n1.mqtt_port, "on-n1", topics)
    on_n2 = ContinuousPublisher(n2.mqtt_port, "on-n2", topics, ack_timeout_s=120)
    wait_for(lambda: on_n1.count() >= 100 and on_n2.count() >= 100, timeout=60)
    assert n2.proc is not None
    n2.proc.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    wait_for(lambda: "n2" not in {e["node_id"] for e in n1.status()["nodes"]}, timeout=30)
    n2.proc.send_signal(signal.SIGCONT)
    frozen_s = time.monotonic() - stopped_at
    wait_settled(nodes)
    # n1 forgot n2's link session while n2 was away: n2's forwards are answered again
    assert_publishes_answered_again(on_n2, frozen_s)
    wait_for(lambda: not n1.status()["unavailable_shards"], timeout=30)
    mark = on_n1.count()
    wait_for(lambda: on_n1.count() >= mark + 50, timeout=30)
    on_n1.stop()
    on_n2.stop()
    acknowledged = set(on_n1.acknowledged) | set(on_n2.acknowledged)
    received: set[str] = set()

    def take() -> bool:
        while not keeper.messages.empty():
            received.add(keeper.messages.get().payload.decode())
        return acknowledged <= received

    with contextlib.suppress(AssertionError):
        wait_for(take, timeout=15, interval=0.1)
    keeper.disconnect()
    # what did not arrive live comes when the session connects again
    if not acknowledged <= received:
        keeper = Paho(n1.mqtt_port, "keeper", V5, clean=False, session_expiry=600)
        with contextlib.suppress(AssertionError):
            wait_for(take, timeout=15, interval=0.1)
        keeper.disconnect()
    missing = sorted(acknowledged - received, key=lambda payload: (payload[:5], sequence(payload)))
    assert not missing, f"{len(missing)} of {len(acknowledged)} acknowledged messages never reached the session: {missing[:10]}"
