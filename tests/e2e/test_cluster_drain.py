"""`shardgate cluster drain NODE`: the controller moves what a node holds off it, and `cluster
status` says when it holds nothing (so it can be removed); `--cancel` stops it. Real etcd, three
real `shardgate serve` processes, the real CLI.

The shards here are of a non-reliable stream (moved at once); replicated shards are moved by
copying first (`tests/e2e/test_replica_controller.py` proves the controller's steps).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess

STREAM = '[[streams]]\nname = "fast"\nmode = "non-reliable"\npartitions = 6\n'


def cli(node: ClusterNodeProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardgate", "cluster", *args,
         "--http-url", f"http://127.0.0.1:{node.ports['http']}"],
        capture_output=True, text=True, timeout=60)


def leaders(status: dict[str, Any]) -> list[str]:
    return [leader for leader, _epoch in status["placement"].get("fast", [])]


@pytest.mark.timeout(300)
def test_drain_moves_every_shard_off_the_node_and_status_says_when_it_holds_nothing(
        cluster: Callable[..., list[ClusterNodeProcess]]) -> None:
    n1, n2, n3 = cluster(3, extra_config=STREAM)
    wait_for(lambda: len(leaders(n2.status())) == 6 and "n1" in leaders(n2.status()), timeout=60)
    done = cli(n2, "drain", "n1")
    assert done.returncode == 0, done.stderr
    assert "draining n1" in done.stdout
    wait_for(lambda: "n1" not in leaders(n3.status()), timeout=60)
    status = n3.status()
    # what stays is a reliable shard of the default stream, if n1 led it: its log is on n1's
    # disk alone, and moves only by copying (nodes that run the replication data path)
    assert [shard for shard in status["draining"]["n1"] if not shard.startswith("default/")] == []
    assert sorted(set(leaders(status))) == ["n2", "n3"]
    shown = cli(n3, "status")
    assert shown.returncode == 0, shown.stderr
    assert "draining n1: " in shown.stdout
    # stopping the drain: the node takes shards again (the controller balances them back)
    cancelled = cli(n3, "drain", "n1", "--cancel")
    assert cancelled.returncode == 0, cancelled.stderr
    wait_for(lambda: "n1" in leaders(n3.status()), timeout=60)
    assert n3.status()["draining"] == {}
    # a node that is not in the cluster is refused with a clear message
    refused = cli(n3, "drain", "n9")
    assert refused.returncode == 1 and "no live node 'n9'" in refused.stderr
    assert n1.alive() and n2.alive()
