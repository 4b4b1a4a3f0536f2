"""The repeat window after a holder's SIGKILL is at least once, never a loss: a persistent MQTT
session and a durable gRPC subscription consume continuously (each message acknowledged as it
comes) from a reliable shard another node owns while a publisher goes on; their holder is
SIGKILLed mid-stream and they resume on the surviving node from their last checkpoint in etcd.

Every message the publisher had acknowledged reaches them, and what comes twice is only what
they had already received before the kill (the checkpoint's lag), never a
message they had not seen. A real etcd, two `shardgate serve --cluster` processes, paho MQTT
5.0, the gRPC SDK and SIGKILL.
"""

from __future__ import annotations

import asyncio
import queue
from collections import Counter
from collections.abc import Callable

import pytest
from shardgate.client import Client
from shardgate.protocols.mqtt.snapshot import CursorState

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import (
    ClusterNodeProcess,
    ContinuousPublisher,
    EtcdServer,
    topics_of,
)
from tests.e2e.test_cluster_state_sessions import create_spread, etcd_get
from tests.mqtt_clients import V5, Paho

Cluster = Callable[..., list[ClusterNodeProcess]]

# ONE_COPY: the streams keep one copy per shard, so n2's shards take publishes while n1 is
# dead; on two nodes a replicated shard (both replicas needed in sync) refuses them meanwhile.


def alone(node: ClusterNodeProcess) -> bool:
    return {entry["node_id"] for entry in node.status()["nodes"]} == {node.node_id}


def checkpointed_past(etcd: EtcdServer, key: str, stream: str, count: int) -> bool:
    """Whether etcd's checkpoint at `key` has read at least `count` messages of `stream`,
    acknowledged or not (its cursors: a session snapshot's, `SessionSnapshot`, or a durable
    subscription's, [stream, shard, position, unacknowledged])."""
    state = etcd_get(etcd, f"/shardgate/test.state/{key}") or {}
    version = int(state.get("version", 0))
    cursors = [CursorState.decode(entry, version) for entry in state.get("cursors", [])]
    return sum(cursor.position for cursor in cursors if cursor.stream == stream) >= count


def assert_at_least_once(acknowledged: set[str], before_kill: list[str], after_resume: list[str]
                         ) -> int:
    """Every acknowledged payload came; what came twice had come before the kill, once more
    after the resume (never twice within one side). Returns how many came again."""
    seen = Counter(before_kill) + Counter(after_resume)
    missing = sorted(acknowledged - set(seen))
    assert not missing, f"{len(missing)} of {len(acknowledged)} acknowledged lost: {missing[:10]}"
    assert max(Counter(before_kill).values()) == 1, "a duplicate while the cluster was steady"
    assert max(Counter(after_resume).values()) == 1, "a duplicate after the resume"
    again = set(before_kill) & set(after_resume)
    assert len(again) < len(before_kill), "the checkpoint taken before the kill was not used"
    return len(again)


@pytest.mark.timeout(240)
def test_a_session_resumed_after_its_holders_sigkill_loses_nothing_published_meanwhile(
        cluster: Cluster, etcd: EtcdServer) -> None:
    n1, n2 = cluster(2)
    create_spread(n1, [n1, n2], "kw", replicas=1)  # see ONE_COPY
    topics = topics_of(n1.status(), "kw", "kw/m", owner="n2")  # the shards outlive the holder
    session = Paho(n1.mqtt_port, "windowed", V5, clean=False, session_expiry=3600)
    session.subscribe("kw/#", qos=1)
    publisher = ContinuousPublisher(n2.mqtt_port, "kw", topics)
    before_kill: list[str] = []

    def received(client: Paho, into: list[str], at_least: int) -> bool:
        while True:
            try:
                into.append(client.messages.get_nowait().payload.decode())
            except queue.Empty:
                return len(into) >= at_least

    # acknowledged by paho as they come, and a checkpoint taken of a part of them
    wait_for(lambda: received(session, before_kill, 300)
             and checkpointed_past(etcd, "sessions/windowed", "kw", 150), timeout=60)
    n1.kill()
    received(session, before_kill, 0)
    session.drop()
    received(session, before_kill, 0)
    wait_for(lambda: alone(n2), timeout=20)
    back = Paho(n2.mqtt_port, "windowed", V5, clean=False, session_expiry=3600, connect=False)
    assert back.connect()[0].session_present
    resumed_at = publisher.count()
    wait_for(lambda: publisher.count() >= resumed_at + 100, timeout=60)
    publisher.stop()
    assert not publisher.refused and not publisher.dropped.is_set()
    acknowledged = set(publisher.acknowledged)
    after_resume: list[str] = []
    wait_for(lambda: received(back, after_resume, 0) and acknowledged <= set(before_kill + after_resume),
             timeout=60)
    back.expect_none(within=0.5)
    received(back, after_resume, 0)
    again = assert_at_least_once(acknowledged, before_kill, after_resume)
    print(f"MQTT session: {len(acknowledged)} acknowledged, {len(before_kill)} before the kill, "
          f"{again} came again")
    back.disconnect()


@pytest.mark.timeout(240)
def test_a_durable_subscription_resumed_after_its_holders_sigkill_loses_nothing_published_meanwhile(
        cluster: Cluster, etcd: EtcdServer) -> None:
    n1, n2 = cluster(2)
    create_spread(n1, [n1, n2], "kd", replicas=1)  # see ONE_COPY
    topics = topics_of(n1.status(), "kd", "kd/m", owner="n2")
    before_kill: list[str] = []
    after_resume: list[str] = []

    async def consume(url: str, into: list[str], until: Callable[[], bool], *,
                      reconnect: bool, subscribed: asyncio.Event | None = None) -> None:
        async with Client(url) as client:
            consumer = client.consumer("windowed", ["kd/#"], durable=True, reconnect=reconnect)
            await consumer.subscribe()
            if subscribed is not None:
                subscribed.set()
            while not until():
                try:
                    message = await consumer.receive(0.5)
                except TimeoutError:
                    continue
                into.append(message.text())
                message.ack()
            await consumer.close()

    async def scenario() -> tuple[set[str], int]:
        subscribed = asyncio.Event()
        holder = asyncio.create_task(consume(n1.grpc_url, before_kill, lambda: False,
                                             reconnect=False, subscribed=subscribed))
        await asyncio.wait_for(subscribed.wait(), 30)  # (the subscription starts at the tail)
        publisher = ContinuousPublisher(n2.mqtt_port, "kd", topics)
        await asyncio.to_thread(
            wait_for, lambda: len(before_kill) >= 300
            and checkpointed_past(etcd, "durables/windowed", "kd", 150), timeout=60)
        n1.kill()
        with pytest.raises(Exception):  # noqa: B017  (the holder's stream breaks, whatever it says)
            await asyncio.wait_for(holder, 30)
        await asyncio.to_thread(wait_for, lambda: alone(n2), timeout=20)
        resumed_at = publisher.count()
        acknowledged: set[str] = set()

        done = asyncio.Event()

        def complete() -> bool:
            return done.is_set() or (
                bool(acknowledged) and acknowledged <= set(before_kill + after_resume))

        taker = asyncio.create_task(consume(n2.grpc_url, after_resume, complete, reconnect=True))
        await asyncio.to_thread(wait_for, lambda: publisher.count() >= resumed_at + 100, timeout=60)
        publisher.stop()
        assert not publisher.refused and not publisher.dropped.is_set()
        acknowledged.update(publisher.acknowledged)
        try:
            await asyncio.wait_for(asyncio.shield(taker), 60)
        except TimeoutError:
            done.set()  # (what is missing is reported below)
            await asyncio.wait_for(taker, 10)
        return acknowledged, len(before_kill)

    acknowledged, count_before = asyncio.run(scenario())
    again = assert_at_least_once(acknowledged, before_kill, after_resume)
    print(f"durable subscription: {len(acknowledged)} acknowledged, {count_before} before the "
          f"kill, {again} came again")
