"""A leader SIGKILLed and started again at once, before its old lease ran out, while the
placement in etcd still names it leader in its old epoch: the new process does not lead in
that epoch, even for a moment (its followers may hold records the old process sent them
before they were durable on its own disk: leading the same epoch again could give one offset
two different records in one epoch, which truncation by epochs cannot see). It leads again
only in the epoch the controller names for a node registered again, and nothing acknowledged
is lost. Three nodes and a real etcd on loopback."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import pytest

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import (
    ClusterNodeProcess,
    ContinuousPublisher,
    EtcdServer,
    topics_of,
)
from tests.e2e.test_replica_failover import (
    SAFE,
    STREAM,
    all_acknowledged_are_stored,
    epoch_in_etcd,
    fully_replicated,
    shard,
)

LEADING = re.compile(rf"{STREAM}/0: leading in epoch (\d+)")


@pytest.mark.timeout(400)
def test_a_leader_restarted_before_its_lease_ends_never_leads_in_its_old_epoch(
        cluster: Callable[..., list[ClusterNodeProcess]], etcd: EtcdServer) -> None:
    # a lease far longer than the restart: the placement still names the killed leader in its
    # epoch when the new process reads it
    nodes = {node.node_id: node for node in cluster(3, lease_ttl_s=30, extra_config=SAFE)}
    placed = wait_for(lambda: fully_replicated(nodes["n1"]), timeout=60, interval=0.1)
    leader = nodes[placed["leader"]]
    old_epoch = placed["leader_epoch"]
    other = next(node for name, node in nodes.items() if name != leader.node_id)
    topics = topics_of(other.status(), STREAM, f"{STREAM}/r")
    publisher = ContinuousPublisher(other.mqtt_port, "restart-writer", topics, ack_timeout_s=60)
    wait_for(lambda: publisher.count() >= 50, timeout=60)
    leader.kill()
    log_start = leader.log_path.stat().st_size
    started_at = time.monotonic()
    leader.start()
    assert time.monotonic() - started_at < 30, "the restart outlived the old lease"

    def led_again() -> int | None:
        now = shard(leader)
        if now is None or now["leader_epoch"] <= old_epoch:
            return None
        return int(now["leader_epoch"])

    new_epoch = wait_for(led_again, timeout=120, interval=0.1)
    before = publisher.count()
    wait_for(lambda: publisher.count() >= before + 50, timeout=120)
    publisher.stop()
    with open(leader.log_path, "rb") as log:
        log.seek(log_start)
        output = log.read().decode(errors="replace")
    led = [int(epoch) for epoch in LEADING.findall(output)]
    assert old_epoch not in led, f"the restarted node led in its old epoch {old_epoch}: {led}"
    assert all(epoch > old_epoch for epoch in led)
    _leader, epoch = epoch_in_etcd(etcd)
    assert epoch >= new_epoch > old_epoch
    all_acknowledged_are_stored(other, publisher)
