"""`shardgate cluster drain` of the node that leads a reliable stream's shards while QoS 1
clients publish to it: every acknowledged message reaches the subscribers of the other nodes,
and none twice. Real etcd, three real `shardgate serve` processes, the real CLI, paho
subscribers (a persistent session and a clean one, each connected throughout).

The stream has the default 3 replicas (on each of 3 nodes; on 3 of 4 nodes). A drain moves each shard's leadership
to a follower in a new epoch while the old leader still runs. The new leader hands on what it
inherited from the high watermark it knew. Unless the old leader quiesced the shard first (no
more publishes, what it holds committed, its followers told the high watermark it ends at:
the controller asks it to, `leader_handoff.py`), that mark lags the old leader's own, and the
messages between reach the clean-session subscriber twice: 4 to 8 of them in every run
without the handshake (3 runs before it was built, at 3 nodes; 2 runs of each case with the
controller's wait for the answer set to 0).
"""

from __future__ import annotations

import contextlib
import queue
import subprocess
import sys
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
    wait_settled,
)
from tests.mqtt_clients import V5, Paho

SAFE = '[[streams]]\nname = "safe"\nmode = "reliable"\npartitions = 6\n'


def cli(node: ClusterNodeProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardgate", "cluster", *args,
         "--http-url", f"http://127.0.0.1:{node.ports['http']}"],
        capture_output=True, text=True, timeout=60)


def leaders(status: dict[str, Any]) -> list[str]:
    return [leader for leader, _epoch in status["placement"].get("safe", [])]


class Collected:
    """What one subscriber received, in order."""

    def __init__(self, subscriber: Paho) -> None:
        self.subscriber = subscriber
        self.payloads: list[str] = []

    def take(self) -> Collected:
        while True:
            try:
                self.payloads.append(self.subscriber.expect(timeout=0).payload.decode())
            except queue.Empty:
                return self


@pytest.mark.timeout(400)
@pytest.mark.parametrize("count", [3, 4])
def test_a_drain_of_the_leading_node_while_publishing_loses_and_duplicates_nothing(
        cluster: Callable[..., list[ClusterNodeProcess]], etcd: EtcdServer, count: int) -> None:
    """With 3 nodes the drained node's replicas are dropped; with 4 each is first copied to
    the fourth node (a new epoch under the same leader), then the leadership moves."""
    nodes = {node.node_id: node for node in cluster(count, extra_config=SAFE)}
    wait_settled(list(nodes.values()))
    status = nodes["n1"].status()
    assert all(len(shard["replicas"]) == 3 for name, shard in status["replicated_shards"].items()
               if name.startswith("safe/")), status["replicated_shards"]
    counts = Counter(leaders(status))
    drained = max(sorted(counts), key=lambda node_id: counts[node_id])
    stay = sorted(set(nodes) - {drained})
    topics = topics_of(status, "safe", "safe/m", per_shard=2)
    persistent = Paho(nodes[stay[0]].mqtt_port, "kept", V5, clean=False, session_expiry=600)
    persistent.subscribe("safe/m/#", 1)
    clean = Paho(nodes[stay[1]].mqtt_port, "live", V5)
    clean.subscribe("safe/m/#", 1)
    subscribers = [Collected(persistent), Collected(clean)]
    publishers = [ContinuousPublisher(nodes[node_id].mqtt_port, f"via-{node_id}", topics)
                  for node_id in sorted(nodes)]

    def take_all() -> None:
        for collected in subscribers:
            collected.take()

    def published_more(count: int) -> None:
        marks = [publisher.count() for publisher in publishers]
        wait_for(lambda: all(p.count() >= mark + count for p, mark in zip(publishers, marks, strict=True))
                 and (take_all() or True), timeout=90, interval=0.05)

    try:
        published_more(50)
        # the drain, mid-stream: each shard's leadership goes to a follower, its replica away
        done = cli(nodes[stay[0]], "drain", drained)
        assert done.returncode == 0, done.stderr
        wait_for(lambda: (take_all() or True) and drained not in leaders(nodes[stay[1]].status())
                 and not nodes[stay[1]].status()["draining"].get(drained),
                 timeout=120, interval=0.1)
        published_more(50)
    finally:
        for publisher in publishers:
            publisher.stop()
    acknowledged = {payload for publisher in publishers for payload in publisher.acknowledged}
    with contextlib.suppress(AssertionError):  # (what is missing is reported below)
        wait_for(lambda: (take_all() or True)
                 and all(acknowledged <= set(c.payloads) for c in subscribers),
                 timeout=60, interval=0.1)
    take_all()
    for name, collected in zip(["persistent", "clean"], subscribers, strict=True):
        missing = sorted(acknowledged - set(collected.payloads))
        assert not missing, (f"{name}: {len(missing)} of {len(acknowledged)} acknowledged "
                             f"messages never arrived: {missing[:10]}")
        twice = sorted(payload for payload, count in Counter(collected.payloads).items()
                       if count > 1)
        assert not twice, f"{name}: {len(twice)} delivered twice: {twice[:10]}"
    # no client is refused: a publish made while a shard is quiesced on the drained node, or
    # before the new leader's log leads, is held (on the node its client is connected to)
    # and stored by the next leader, a pause
    refused = [entry for publisher in publishers for entry in publisher.refused]
    assert not refused, refused[:5]
    assert not any(publisher.dropped.is_set() for publisher in publishers)
    # the handshake's keys are gone: requests deleted by the controller, answers by the leader
    wait_for(lambda: not etcd.keys("/quiesce"), timeout=30, interval=0.1)
