"""A replicated shard's follower partitioned from the other nodes by Linux network namespaces
(issue 28): three `shardgate serve` nodes as in `test_cluster_partition.py`, a reliable stream
of one shard with three replicas of which two must be in sync.

One follower is cut from its peers (its peer link down; etcd and its own clients still reach
it). It cannot fetch, so the leader takes it out of the in-sync set; the leader and the other
follower are still `min_insync_replicas`, so publishes go on being acknowledged, never refused.
Healed, the follower catches up and is in sync again, with a journal byte-identical to the
leader's; a persistent QoS 1 subscriber on each follower (the cut one included: the pushes
it missed are read again from the leader) gets every acknowledged message.

The test skips where namespaces cannot be made (not root, no iproute2 `ip`) or etcd is absent.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ContinuousPublisher, linked
from tests.e2e.test_cluster_partition import (
    TOPIC,
    Subscriber,
    fully_in_sync,
    identical,
    journal_payloads,
    partitionable_cluster,
    shard,
)


@pytest.mark.timeout(240)
def test_a_follower_cut_from_its_peers_leaves_the_isr_while_publishes_go_on_and_rejoins_identical(
        tmp_path: Path) -> None:
    with partitionable_cluster(tmp_path) as nodes:
        placed = wait_for(lambda: fully_in_sync(nodes["n1"]), timeout=60, interval=0.1)
        leader = nodes[placed["leader"]]
        cut, other = (nodes[name] for name in placed["replicas"] if name != leader.node_id)
        subscribers = [Subscriber(cut, "part-follower-sub-cut"),
                       Subscriber(other, "part-follower-sub-other")]
        publisher = ContinuousPublisher(leader.mqtt_port, "pf", [TOPIC], host=leader.front,
                                        pause_s=0.005, ack_timeout_s=60)
        try:
            wait_for(lambda: publisher.count() >= 50, timeout=60)

            cut.net.cut_from_peers(cut.index)
            cut_at = time.monotonic()

            def shrunk() -> dict[str, Any] | None:
                now = shard(leader)
                return (now if now is not None
                        and sorted(now["isr"]) == sorted([leader.node_id, other.node_id])
                        else None)

            during = wait_for(shrunk, timeout=60, interval=0.1)
            shrunk_s = time.monotonic() - cut_at
            assert sorted(during["replicas"]) == sorted(placed["replicas"]), during
            # the partition is real: the leader's link to the cut follower is down
            wait_for(lambda: cut.node_id not in linked(leader), timeout=30, interval=0.1)
            # the leader and the other follower are min_insync_replicas: still acknowledged
            acknowledged_at_shrink = publisher.count()
            wait_for(lambda: publisher.count() >= acknowledged_at_shrink + 100, timeout=60)
            assert publisher.refusals() == 0, sorted(
                {(code, reason) for code, reason, _topic in publisher.refused})[:3]
            in_partition = publisher.count() - acknowledged_at_shrink
            print(f"in-sync set without {cut.node_id} {shrunk_s:.1f} s after the cut; "
                  f"{in_partition} acknowledged meanwhile, none refused")

            cut.net.heal(cut.index)
            healed_at = time.monotonic()
            back = wait_for(lambda: fully_in_sync(leader), timeout=60, interval=0.1)
            rejoined_s = time.monotonic() - healed_at
            assert back["leader"] == leader.node_id
            assert back["leader_epoch"] == placed["leader_epoch"], "the leader changed"
            acknowledged_at_heal = publisher.count()
            wait_for(lambda: publisher.count() >= acknowledged_at_heal + 50, timeout=60)
            publisher.stop()
            assert not publisher.dropped.is_set()
            assert publisher.refusals() == 0, sorted(
                {(code, reason) for code, reason, _topic in publisher.refused})[:3]

            everything = set(publisher.acknowledged)
            # nothing acknowledged is lost: on every replica, byte for byte the same log
            wait_for(lambda: identical([leader, cut, other]), timeout=60, interval=0.2)
            lacking = everything - {payload.decode() for payload in journal_payloads(cut)}
            assert not lacking, f"{len(lacking)} acknowledged, not on the cut follower"
            for subscriber in subscribers:
                missing = subscriber.received_all(everything, timeout=60)
                assert not missing, (f"a subscriber lacks {len(missing)} of {len(everything)} "
                                     f"acknowledged, e.g. {sorted(missing)[:5]}")
            print(f"back in the in-sync set {rejoined_s:.1f} s after the heal; "
                  f"{len(everything)} acknowledged, none refused, all on every replica and "
                  f"received on both followers")
        finally:
            with contextlib.suppress(AssertionError):
                publisher.stop()
            for subscriber in subscribers:
                subscriber.close()
