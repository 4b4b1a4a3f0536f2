"""A publish made on the node leading a replicated shard, appended there while the in-sync set
falls below `min_insync_replicas`, is stored once: three nodes and a real etcd on loopback, a
stream of two replicas (two in sync needed), an MQTT 5 client on the leader's node.

The follower is frozen (SIGSTOP) with the publish waiting for it; the controller takes it out
of the in-sync set, and the leader's high watermark passes the message, which is then in the
shard for good. Refused then (as Kafka's NOT_ENOUGH_REPLICAS_AFTER_APPEND), its client would
send it again once the follower is back and the shard would hold it twice. It is held instead,
and acknowledged once the follower is back in the set: the client sees a pause, not an error,
and the stream holds the message once. The client below sends it again whenever it is
refused, as a client that wants its message stored does.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess, read_back
from tests.mqtt_clients import RawClient

STREAM = "once"
ONCE = (f'[[streams]]\nname = "{STREAM}"\nmode = "reliable"\npartitions = 1\nroutes = ["{STREAM}/#"]\n'
        'replicas = 2\nmin_insync_replicas = 2\n')


def shard(node: ClusterNodeProcess) -> dict[str, Any] | None:
    try:
        return node.status()["replicated_shards"].get(f"{STREAM}/0")
    except OSError:
        return None


@pytest.mark.timeout(300)
def test_a_publish_on_the_leader_appended_as_the_in_sync_set_fell_below_the_minimum_is_stored_once(
        cluster: Callable[..., list[ClusterNodeProcess]]) -> None:
    from shardgate.protocols.mqtt import packets as p

    nodes = {node.node_id: node for node in cluster(3, extra_config=ONCE)}

    def in_sync() -> dict[str, Any] | None:
        placed = shard(nodes["n1"])
        if placed is None or len(placed["replicas"]) != 2 or len(placed["isr"]) != 2:
            return None
        return placed

    placed = wait_for(in_sync, timeout=60, interval=0.1)
    leader = nodes[placed["leader"]]
    follower = nodes[next(name for name in placed["replicas"] if name != leader.node_id)]
    client = RawClient(leader.mqtt_port, version=5)
    client.connect("once-writer")
    client.send(p.Publish(f"{STREAM}/a", b"before", 1, packet_id=1))
    assert client.receive(30).reason_code == 0

    assert follower.proc is not None
    follower.proc.send_signal(signal.SIGSTOP)
    try:
        client.send(p.Publish(f"{STREAM}/a", b"once", 1, packet_id=2))
        # the controller takes the frozen follower out: the leader's mark passes the message
        wait_for(lambda: (shard(leader) or {}).get("isr") == [leader.node_id], timeout=60,
                 interval=0.1)
        # (a refusal after the append, if any, comes now)
        wait_for(lambda: (shard(leader) or {}).get("high_watermark", 0) >= 2, timeout=30,
                 interval=0.1)
        time.sleep(0.5)  # a PUBACK sent meanwhile is read below either way
    finally:
        follower.proc.send_signal(signal.SIGCONT)

    refusals: list[tuple[int, str]] = []
    packet_id = 2
    deadline = time.monotonic() + 120
    while True:
        puback = client.receive(120)
        assert isinstance(puback, p.Puback) and puback.packet_id == packet_id, puback
        if puback.reason_code == 0:
            break
        refusals.append((puback.reason_code, puback.properties.reason_string or ""))
        assert time.monotonic() < deadline, f"never acknowledged: {refusals}"
        time.sleep(0.2)
        packet_id += 1  # refused: sent again, as a new publish
        client.send(p.Publish(f"{STREAM}/a", b"once", 1, packet_id=packet_id))
    client.send(p.Publish(f"{STREAM}/a", b"after", 1, packet_id=packet_id + 1))
    assert client.receive(60).reason_code == 0
    client.close()

    got = asyncio.run(read_back(leader.grpc_url, [f"{STREAM}/#"], {"before", "once", "after"}))
    assert got["once"] == 1, f"stored {got['once']} times (refused first: {refusals})"
    assert not refusals, f"refused although it was stored: {refusals}"
