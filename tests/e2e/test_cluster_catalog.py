"""Cluster metadata in etcd: a stream or route created at run time on one node is known to
every node, which places, forwards and serves it; deleting it on another node removes it
everywhere."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

from shardgate.client import SyncClient, Unavailable

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess, EtcdServer

Cluster = Callable[..., list[ClusterNodeProcess]]


def shardgate(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    return subprocess.run([sys.executable, "-m", "shardgate", *args, "--url", url],
                          capture_output=True, text=True, timeout=60, env=env)


def stored(nodes: list[ClusterNodeProcess], stream: str) -> int:
    """Messages the stream holds (each shard is stored by its owner): every node gives the
    cluster's figures, each shard's from its owner, so every node says the same."""
    totals = set()
    for node in nodes:
        with SyncClient(node.grpc_url) as client:
            totals.add(sum(shard.next_offset for shard in client.admin.describe_stream(stream).shards))
    assert len(totals) == 1, totals
    return totals.pop()


def test_a_stream_created_on_node_1_is_used_on_node_3(cluster: Cluster) -> None:
    n1, n2, n3 = cluster(3)
    created = shardgate(n1.grpc_url, "streams", "create", "orders", "--partitions", "3",
                        "--mode", "reliable")
    assert created.returncode == 0, created.stderr
    # every node learns it from etcd, and the controller places its three shards
    for node in (n2, n3):
        wait_for(lambda node=node: len(node.status()["placement"].get("orders", [])) == 3, timeout=20)
    for index in range(6):
        published = shardgate(n3.grpc_url, "pub", f"orders/{index}", f"order {index}")
        assert published.returncode == 0, published.stderr
        assert published.stdout.startswith("published to orders shard"), published.stdout
    # each message is stored once, by the owner of its shard, wherever that is
    assert stored([n1, n2, n3], "orders") == 6


def test_routes_and_deletes_made_on_one_node_reach_the_others(cluster: Cluster) -> None:
    n1, n2 = cluster(2)
    with SyncClient(n1.grpc_url) as client:
        client.admin.create_stream("metrics", mode="non-reliable", routes=["metrics/#"])
        client.admin.add_route("telemetry/+/cpu", "metrics")

    def routed_on_n2() -> bool:
        with SyncClient(n2.grpc_url) as client:
            try:
                return client.producer().send("telemetry/h1/cpu", b"1").stream == "metrics"
            except Unavailable:  # known, but its shard not placed yet: a retryable error
                return False

    wait_for(routed_on_n2, timeout=20)
    with SyncClient(n2.grpc_url) as client:
        client.admin.delete_stream("metrics")

    def gone_on_n1() -> bool:
        with SyncClient(n1.grpc_url) as client:
            return "metrics" not in {stream.name for stream in client.admin.list_streams()}

    wait_for(gone_on_n1, timeout=20)
    # and the controller drops its shards from the placement
    wait_for(lambda: "metrics" not in n1.status()["placement"], timeout=20)


def test_a_stream_created_while_etcd_is_down_reaches_the_other_nodes_when_it_returns(
    cluster: Cluster, etcd: EtcdServer,
) -> None:
    n1, n2 = cluster(2)
    etcd.stop()
    with SyncClient(n1.grpc_url) as client:
        client.admin.create_stream("offline", mode="non-reliable", partitions=2)
    etcd.start()

    def listed_on_n2() -> bool:
        with SyncClient(n2.grpc_url) as client:
            return "offline" in {stream.name for stream in client.admin.list_streams()}

    wait_for(listed_on_n2, timeout=30)
    wait_for(lambda: len(n2.status()["placement"].get("offline", [])) == 2, timeout=30)
