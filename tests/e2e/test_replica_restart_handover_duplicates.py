"""How many messages a live clean-session subscriber gets twice when the node that takes a
replicated shard over was started again and knows nothing in memory: real `shardgate serve`
processes and a real etcd on loopback, a steady QoS 1 publisher and a clean-session QoS 1
subscriber on a node that stays up.

Both replicas of a two-replica shard are killed (all the shard's nodes, as at a power loss);
the subscriber and the publisher are on the third node. One of them is started again first and
takes the shard over while the other is still down, as the only live in-sync replica; the other
comes back later as its follower:
- the old leader: no mark was told of its earlier run;
- the follower: it fetched nothing since it started, so it was told no mark either.

Either new leader hands on what may not have reached subscribers from the dispatched mark kept
on its disk (`dispatch_checkpoints.py`: its own as leader, or the one it was told as a
follower, written at most half a second apart), not from 10,000 records below its log's end.
Before, every message published before the kill came twice; now about half a second of
publishing at most, and nothing acknowledged is lost.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import (
    ClusterNodeProcess,
    ContinuousPublisher,
    EtcdServer,
    topics_of,
)
from tests.e2e.test_replica_crash_handover_duplicates import collect
from tests.mqtt_clients import V5, Paho

# The publisher waits this long after each acknowledgement, so that it publishes at most
# 1 / PAUSE_S messages a second however fast the machine is.
PAUSE_S = 0.02
# Acknowledged before the kill: before the kept mark, every one of them came twice.
BEFORE_KILL = 300
# The most messages a subscriber may get twice: what the old leader dispatched after the mark
# kept last (written every 0.5 s, lagging its dispatch by about a fetch round and a push round
# trip): at most 25 at this pace, with room for a loaded machine (2 s of publishing).
MOST_TWICE = 100


def replicated(name: str, replicas: int) -> str:
    return (f'[[streams]]\nname = "{name}"\nmode = "reliable"\npartitions = 1\n'
            f"replicas = {replicas}\n")


def placed(node: ClusterNodeProcess, stream: str) -> dict[str, Any] | None:
    try:
        return node.status()["replicated_shards"].get(f"{stream}/0")
    except OSError:
        return None


def in_sync(node: ClusterNodeProcess, stream: str, replicas: int) -> dict[str, Any] | None:
    shard = placed(node, stream)
    if shard is None or len(shard["replicas"]) != replicas or len(shard["isr"]) != replicas:
        return None
    return shard


def subscribed(nodes: list[ClusterNodeProcess], stream: str, topic: str) -> dict[str, Paho]:
    """A clean-session QoS 1 subscriber on each of `nodes`, once a message published after its
    subscription came to it (its node's routes reached the leader)."""
    subscribers = {node.node_id: Paho(node.mqtt_port, f"twice-{node.node_id}", V5)
                   for node in nodes}
    for subscriber in subscribers.values():
        subscriber.subscribe(f"{stream}/#", qos=1)
    probe = Paho(nodes[0].mqtt_port, "twice-probe", V5)
    probe.publish(topic, b"probe", qos=1)
    probe.disconnect()
    for subscriber in subscribers.values():
        assert subscriber.expect(60).payload == b"probe"
    return subscribers


def assert_each_once(subscribers: dict[str, Paho], publisher: ContinuousPublisher) -> None:
    """Every acknowledged message came to each subscriber, and at most MOST_TWICE twice."""
    acknowledged = {payload.encode() for payload in publisher.acknowledged}
    deadline = time.monotonic() + 120
    for name, subscriber in subscribers.items():
        counts: Counter[bytes] = Counter()
        collect(subscriber, counts, acknowledged, deadline)
        missing = acknowledged - counts.keys()
        twice = sorted(payload for payload, count in counts.items() if count > 1)
        print(f"{name}: {len(counts)} messages, {len(twice)} came twice or more "
              f"({[p.decode() for p in twice[:5]]}...), {len(missing)} of {len(acknowledged)} "
              f"acknowledged missing")
        assert not missing, f"{name}: {len(missing)} acknowledged messages never came"
        assert len(twice) <= MOST_TWICE, f"{name}: {len(twice)} messages came twice"
        subscriber.disconnect()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("first", ["leader", "follower"])
def test_a_replica_started_again_takes_over_from_the_mark_it_kept(
        first: str, cluster: Callable[..., list[ClusterNodeProcess]], etcd: EtcdServer) -> None:
    stream = "pair"
    nodes = {node.node_id: node for node in cluster(3, lease_ttl_s=5,
                                                    extra_config=replicated(stream, 2))}
    shard = wait_for(lambda: in_sync(nodes["n1"], stream, 2), timeout=60, interval=0.1)
    leader = nodes[shard["leader"]]
    follower = nodes[next(name for name in shard["replicas"] if name != shard["leader"])]
    elsewhere = next(node for name, node in nodes.items() if name not in shard["replicas"])
    topics = topics_of(elsewhere.status(), stream, f"{stream}/d")
    subscribers = subscribed([elsewhere], stream, topics[0])
    publisher = ContinuousPublisher(elsewhere.mqtt_port, "twice", topics, pause_s=PAUSE_S,
                                    ack_timeout_s=90)
    wait_for(lambda: publisher.count() >= BEFORE_KILL, timeout=120)
    taker, other = (leader, follower) if first == "leader" else (follower, leader)
    # the one to take over is killed last: it stays in the in-sync set (killed first, it would
    # leave it while the other still lived)
    other.kill()
    taker.kill()
    taker.start()
    # it leads, in a new epoch, once the other's lease ended: as the only live in-sync replica
    # (the old leader: no mark was told of its earlier run; the follower: it fetched nothing
    # since it started)
    wait_for(lambda: (now := placed(elsewhere, stream)) is not None
             and now["leader"] == taker.node_id and now["leader_epoch"] > shard["leader_epoch"],
             timeout=90, interval=0.1)
    other.start()
    before = publisher.count()
    wait_for(lambda: publisher.count() >= before + 100, timeout=120)
    publisher.stop()
    now = placed(elsewhere, stream)
    assert now is not None and now["leader"] == taker.node_id
    assert_each_once(subscribers, publisher)
