"""A node whose cluster port refuses every dial has its lease ended by the peer that saw it
(`ClusterNode.peer_gone`), against a real etcd: the lease of the registration the refusals
were seen against, never a later registration's (the node restarted: a new process under a
new lease). No clock is compared, so two machines' clocks that disagree change nothing.
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

TTL_S = 5


def lease_ttl_in_etcd(etcd: EtcdServer, lease_id: int) -> int:
    """What etcd itself says is left of the lease (-1: gone)."""
    with grpc.insecure_channel(f"127.0.0.1:{etcd.client_port}") as channel:
        reply = rpc.LeaseStub(channel).LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=lease_id),
                                                       timeout=5)
    return int(reply.TTL)


async def joined_node(tmp_path: Path, etcd: EtcdServer, node_id: str, address: str) -> ClusterNode:
    settings = ClusterSettings(etcd=etcd.url, name="gone", lease_ttl_s=TTL_S, connect_timeout_s=5,
                               secret=CLUSTER_SECRET)
    node = ClusterNode(settings, node_id, tmp_path / node_id)
    await node.connect()
    await node.join(address, {})
    return node


async def until(condition, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_a_refusing_peer_loses_the_lease_it_was_seen_under_and_a_restart_keeps_its_own(
        tmp_path: Path, etcd: EtcdServer) -> None:
    a = await joined_node(tmp_path, etcd, "a", "127.0.0.1:1")
    first = await joined_node(tmp_path, etcd, "b", "127.0.0.1:2")
    again: ClusterNode | None = None
    try:
        await until(lambda: a.view.nodes().get("b") is not None
                    and a.view.nodes()["b"].lease == first.lease_id)
        seen = a.view.nodes()["b"]  # as a's links saw b when its port began to refuse
        # b restarts before a is told: a new process registers under a new lease
        await first.stop()
        again = await joined_node(tmp_path, etcd, "b", "127.0.0.1:2")
        restarted = again.lease_id
        assert restarted != seen.lease
        await until(lambda: a.view.registrations.get("b") is not None
                    and a.view.registrations["b"].lease == restarted)
        revocations = len(a._tasks)
        a.peer_gone(seen)  # the refusals were the old process's: the new one keeps its lease
        assert len(a._tasks) == revocations  # no revocation started
        assert lease_ttl_in_etcd(etcd, restarted) > 0
        assert a.view.registrations["b"].lease == restarted
        # the new process's port refuses too (it died): its own lease ends at once
        a.peer_gone(a.view.nodes()["b"])
        await until(lambda: lease_ttl_in_etcd(etcd, restarted) == -1, timeout=10)
        # a's view drops that registration (b, still running here, may register again under
        # a newer lease: that is its own, not the one ended)
        await until(lambda: a.view.registrations.get("b") is None
                    or a.view.registrations["b"].lease != restarted, timeout=10)
    finally:
        if again is not None:
            await again.stop()
        await a.stop()
