"""A cluster node's lease outlives a saturated event loop, and fencing still ends with it.

The lease is refreshed from a thread of its own (etcd_lease.LeaseKeeper): an event loop that is
busy for longer than the TTL (a QoS 0 flood, a long synchronous step) must not cost a live
node its registration and its shards. When etcd cannot be reached the node must still stop
acting for its shards once the TTL has run out.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
from aetcd import rpc

from shardgate.cluster.control import ClusterNode
from shardgate.cluster.settings import ClusterSettings
from tests.e2e.cluster_fixtures import CLUSTER_SECRET, EtcdServer

TTL_S = 2


def lease_ttl_in_etcd(etcd: EtcdServer, lease_id: int) -> int:
    """What etcd itself says is left of the lease (-1: gone), asked without the event loop."""
    with grpc.insecure_channel(f"127.0.0.1:{etcd.client_port}") as channel:
        reply = rpc.LeaseStub(channel).LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=lease_id),
                                                       timeout=5)
    return int(reply.TTL)


async def joined_node(tmp_path: Path, etcd: EtcdServer) -> ClusterNode:
    settings = ClusterSettings(etcd=etcd.url, name="lease", lease_ttl_s=TTL_S, connect_timeout_s=5,
                               secret=CLUSTER_SECRET)
    node = ClusterNode(settings, "n1", tmp_path / "n1")
    await node.connect()
    await node.join("127.0.0.1:1", {})
    return node


async def until(condition, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_lease_survives_an_event_loop_blocked_longer_than_the_ttl(
        tmp_path: Path, etcd: EtcdServer) -> None:
    node = await joined_node(tmp_path, etcd)
    try:
        lease_id = node.lease_id
        assert node.view.lease_alive()
        time.sleep(TTL_S * 2.5)  # the event loop does nothing else meanwhile
        # still inside the blocked stretch: etcd kept the lease and the registration
        assert lease_ttl_in_etcd(etcd, lease_id) > 0
        registered = await node.client.get(node.key("nodes/n1"))
        assert registered is not None and registered.lease == lease_id
        # the refreshes made while the loop was blocked reach the fencing view at once
        await until(node.view.lease_alive, timeout=1.0)
        assert node.lease_id == lease_id
    finally:
        await node.stop()
    assert lease_ttl_in_etcd(etcd, lease_id) == -1  # leaving revokes the lease


async def test_node_stops_acting_for_shards_when_the_lease_cannot_be_refreshed(
        tmp_path: Path, etcd: EtcdServer) -> None:
    node = await joined_node(tmp_path, etcd)
    try:
        assert node.view.lease_alive()
        etcd.kill()
        # no refresh can succeed now: fencing ends within the TTL of the last one
        await until(lambda: not node.view.lease_alive(), timeout=TTL_S + 2)
    finally:
        await node.stop()
