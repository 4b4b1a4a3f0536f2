"""A new leader dispatches the tail it inherited from an earlier epoch: three nodes and a real
etcd on loopback, a stream of one shard and three replicas, live subscribers on a node that
does not lead it yet.

The leader stores a message and replicates it to that node, but cannot commit it (the third
replica is frozen and still in the in-sync set), so it dispatches it to nobody. Then the leader
leaves (SIGTERM): the controller hands its leadership to the subscribers' node in a new epoch,
while the old leader still runs. Once the frozen replica runs again, the new leader commits the
message, which is now in the stream for good, and must dispatch it: nobody else ever will.
Before it did, only a leader whose predecessor's node was no longer registered handed its tail
on, so here the clean-session subscriber never got the message, and a persistent session whose
cursor had gone live again passed over it when the next message came. The publisher of that
message got a retryable refusal and never sends it again. (The old leader's process being gone,
or started again under a new lease, is the other way in: then from the dispatched mark it told,
below the high watermark, since it may have died after committing and before its pushes
arrived; `test_replica_handover_decision.py`, `test_replica_crash_handover_duplicates.py`.)
"""

from __future__ import annotations

import asyncio
import queue
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
from shardgate.protocols.mqtt import packets as p

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess, EtcdServer, read_back, topics_of
from tests.e2e.test_replica_failover import SAFE, STREAM, fully_replicated, shard
from tests.mqtt_clients import V5, Paho, RawClient


def leading(node: ClusterNodeProcess) -> dict[str, Any] | None:
    """The shard as its leader shows it (with its high watermark, log end and lags)."""
    now = shard(node)
    return now if now is not None and "high_watermark" in now else None


def received(subscriber: Paho, got: set[bytes], wanted: bytes, deadline: float) -> bool:
    """Collects what `subscriber` received until `wanted` came (True) or the deadline."""
    while wanted not in got:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        try:
            got.add(subscriber.expect(min(remaining, 1.0)).payload)
        except queue.Empty:
            continue
    return True


@pytest.mark.timeout(400)
def test_a_new_leader_dispatches_the_tail_it_commits_from_the_epoch_of_a_leader_that_left(
        cluster: Callable[..., list[ClusterNodeProcess]], etcd: EtcdServer) -> None:
    nodes = {node.node_id: node for node in cluster(3, lease_ttl_s=30, extra_config=SAFE)}
    placed = wait_for(lambda: fully_replicated(nodes["n1"]), timeout=60, interval=0.1)
    leader = nodes[placed["leader"]]
    # a leaving leader's shard goes to the first other in-sync replica in the replicas' order
    watching, frozen = (nodes[name] for name in placed["replicas"] if name != leader.node_id)
    assert leader.status()["controller"] != frozen.node_id, "the controller is the replica to freeze"
    [topic] = topics_of(watching.status(), STREAM, f"{STREAM}/t")
    live = Paho(watching.mqtt_port, "tail-live", V5)
    live.subscribe(f"{STREAM}/#", qos=1)
    kept = Paho(watching.mqtt_port, "tail-kept", V5, clean=False, session_expiry=600)
    kept.subscribe(f"{STREAM}/#", qos=1)
    publisher = Paho(watching.mqtt_port, "tail-before", V5)
    publisher.publish(topic, b"before", qos=1)
    publisher.disconnect()
    deadline = time.monotonic() + 60
    live_got: set[bytes] = set()
    kept_got: set[bytes] = set()
    assert received(live, live_got, b"before", deadline) and received(kept, kept_got, b"before", deadline)

    assert frozen.proc is not None and leader.proc is not None
    frozen.proc.send_signal(signal.SIGSTOP)
    try:
        before = leading(leader)
        assert before is not None and before["high_watermark"] == before["log_end"]
        # stored and replicated to the watching node, not committed (the frozen replica is
        # in sync and lacks it), so dispatched to nobody; never sent again
        raw = RawClient(watching.mqtt_port, version=5)
        assert raw.connect("tail-once").reason_code == 0
        raw.send(p.Publish(topic, b"inherited", qos=1, packet_id=1))

        def replicated() -> dict[str, Any] | None:
            now = leading(leader)
            return now if (now is not None and now["log_end"] == before["log_end"] + 1
                           and now["lag"].get(watching.node_id) == 0) else None

        held = wait_for(replicated, timeout=60, interval=0.05)
        assert held["high_watermark"] == before["high_watermark"]
        leader.proc.send_signal(signal.SIGTERM)  # a graceful leave: its leadership moves

        def moved() -> dict[str, Any] | None:
            now = shard(watching)
            return now if (now is not None and now["leader"] == watching.node_id
                           and now["leader_epoch"] > placed["leader_epoch"]) else None

        wait_for(moved, timeout=60, interval=0.05)
        raw.close()
    finally:
        frozen.proc.send_signal(signal.SIGCONT)
    # the frozen replica catches up: the new leader commits the inherited message
    stored = asyncio.run(read_back(watching.grpc_url, [f"{STREAM}/#"], {"inherited"}, timeout=120))
    assert "inherited" in stored, "the replicated message was cut (not what this test is about)"
    publisher = Paho(watching.mqtt_port, "tail-after", V5)
    publisher.publish(topic, b"after", qos=1)
    publisher.disconnect()
    deadline = time.monotonic() + 60
    assert received(live, live_got, b"after", deadline), "the message after never came"
    assert received(kept, kept_got, b"after", deadline), "the message after never came"
    # what the new leader hands on goes out before what it stores itself
    assert b"inherited" in live_got, "the clean-session subscriber never got the inherited message"
    assert b"inherited" in kept_got, "the persistent session passed over the inherited message"
    live.disconnect()
    kept.disconnect()
    assert leader.proc.wait(60) == 0
