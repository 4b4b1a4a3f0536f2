"""Cluster membership and placement against a real etcd: nodes register under leases, one
controller places every shard, joins take a fair share, a SIGTERM'd node hands its shards
over, a dead node's non-reliable shards move within the lease TTL while its one-copy reliable ones wait
for it, and bad starts (same node id, no etcd) fail clearly."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from shardgate.client import SyncClient

from tests.conftest import free_port, wait_for
from tests.e2e.cluster_fixtures import (
    CLUSTER_SECRET,
    ETCD,
    ClusterNodeProcess,
    EtcdServer,
    read_back,
    settled,
)

STREAMS = """
[[streams]]
name = "fast"
mode = "non-reliable"
partitions = 6

[[streams]]
name = "safe"
mode = "reliable"
partitions = 2
"""

Cluster = Callable[..., list[ClusterNodeProcess]]


def owners(status: dict[str, Any], stream: str) -> list[str]:
    return [node for node, _epoch in status["placement"][stream]]


def shard_counts(status: dict[str, Any]) -> list[int]:
    """Shards per live node, fewest first."""
    return sorted(entry["shards"] for entry in status["nodes"])


def status_when(node: ClusterNodeProcess, predicate: Callable[[dict[str, Any]], bool]
                ) -> Callable[[], dict[str, Any] | None]:
    """For `wait_for`: the node's status once `predicate` holds for it."""
    def check() -> dict[str, Any] | None:
        status = node.status()
        return status if predicate(status) else None
    return check


def epochs(status: dict[str, Any], stream: str) -> list[int]:
    return [epoch for _node, epoch in status["placement"][stream]]


def test_three_nodes_register_elect_one_controller_and_share_the_shards(cluster: Cluster) -> None:
    nodes = cluster(3, extra_config=STREAMS)
    everyone = {"n1", "n2", "n3"}
    # every node ends up with the same view: three nodes, one controller, and the nine shards
    # (default 1, fast 6, safe 2) spread three per node
    def balanced(node: ClusterNodeProcess) -> dict[str, Any] | None:
        status = settled(node, everyone)
        if status is None or "fast" not in status["placement"]:
            return None
        return status if shard_counts(status) == [3, 3, 3] else None

    views = [wait_for(lambda node=node: balanced(node), timeout=20) for node in nodes]
    assert len({view["controller"] for view in views}) == 1
    assert all(view["lease_alive"] for view in views)
    assert {view["placement"]["fast"] == views[0]["placement"]["fast"] for view in views} == {True}
    # reliable shards were placed too, and addresses of every listener are published
    assert set(owners(views[0], "safe")) <= everyone
    assert all(entry["listeners"]["mqtt"].startswith("127.0.0.1:") for entry in views[0]["nodes"])


def test_a_second_node_with_the_same_id_refuses_to_start_naming_the_first(
    cluster: Cluster, etcd: EtcdServer, tmp_path: Path,
) -> None:
    (first,) = cluster(1)
    twin = ClusterNodeProcess(tmp_path / "twin", "n1", etcd.url)
    port_file = tmp_path / "twin.ports.json"
    result = subprocess.run(
        [sys.executable, "-m", "shardgate", "serve", "--data-dir", str(twin.data_dir),
         "--config", str(twin.config_file), "--cluster", etcd.url, "--node-id", "n1",
         "--cluster-port", "0", "--mqtt-port", "0", "--mqtt-ws-port", "0", "--amqp-port", "0",
         "--grpc-port", "0", "--http-port", "0", "--port-file", str(port_file)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert "node id 'n1' is already in use" in result.stderr, result.stderr
    # it names the running node by its internal address, and starts nothing
    (registered,) = first.status()["nodes"]
    assert f"(internal address {registered['cluster_address']})" in result.stderr, result.stderr
    assert not port_file.exists()
    # the first node is untouched
    assert [entry["node_id"] for entry in first.status()["nodes"]] == ["n1"]


def test_an_unreachable_etcd_is_a_clear_error_after_a_bounded_wait(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    config = tmp_path / "c.toml"
    config.write_text(f'[cluster]\nconnect_timeout_s = 2\nsecret = "{CLUSTER_SECRET}"\n')
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "shardgate", "serve", "--data-dir", str(tmp_path / "d"),
         "--config", str(config), "--cluster", dead, "--node-id", "n1",
         "--mqtt-port", "0", "--mqtt-ws-port", "0", "--amqp-port", "0", "--grpc-port", "0",
         "--http-port", "0"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert f"cannot reach etcd at {dead} after 2 s" in result.stderr, result.stderr
    assert time.monotonic() - started < 30


def test_a_joining_node_takes_its_fair_share(cluster: Cluster) -> None:
    (n1,) = cluster(1, extra_config=STREAMS)
    wait_for(lambda: n1.status()["placement"].get("fast") and owners(n1.status(), "fast") == ["n1"] * 6,
             timeout=30)
    before = epochs(n1.status(), "fast")
    cluster(1, first=2, extra_config=STREAMS)

    def split() -> dict[str, Any] | None:
        status = n1.status()
        return status if shard_counts(status) == [4, 5] else None

    status = wait_for(split, timeout=30)
    # every shard that changed node has a higher epoch; the others kept theirs
    for shard, (owner, epoch) in enumerate(status["placement"]["fast"]):
        assert epoch == (before[shard] + 1 if owner == "n2" else before[shard])
    # the reliable shards stay on the node that holds their logs
    assert owners(status, "safe") == ["n1", "n1"]


def test_sigterm_hands_the_shards_over_before_the_node_exits(cluster: Cluster) -> None:
    n1, n2, n3 = cluster(3, extra_config=STREAMS)
    wait_for(lambda: shard_counts(n1.status()) == [3, 3, 3])
    assert Counter(owners(n1.status(), "fast"))["n3"] == 3
    assert n3.terminate() == 0
    # by the time n3 has exited, its shards were already given to the others
    status = n1.status()
    assert "n3" not in owners(status, "fast")
    assert sorted(Counter(owners(status, "fast") + owners(status, "safe")
                          + owners(status, "default")).values()) == [4, 5]


def test_a_dead_node_loses_its_non_reliable_shards_within_the_ttl_and_keeps_its_reliable_ones(
    cluster: Cluster,
) -> None:
    (n1,) = cluster(1, extra_config=STREAMS)
    # a reliable stream first declared by n2 once it is a member: some of its shards go to n2;
    # one copy of each (`replicas = 1`: a replicated shard's leadership moves instead, see
    # test_cluster_replication_default.py)
    late = '\n[[streams]]\nname = "late"\nmode = "reliable"\npartitions = 4\nreplicas = 1\n'
    (n2,) = cluster(1, first=2, extra_config=STREAMS + late)

    def late_placed() -> dict[str, Any] | None:
        status = n1.status()
        if "late" not in status["placement"] or shard_counts(status) not in ([6, 7], [7, 6]):
            return None
        return status

    status = wait_for(late_placed, timeout=20)
    late_on_n2 = [shard for shard, owner in enumerate(owners(status, "late")) if owner == "n2"]
    assert late_on_n2 and "n2" in owners(status, "fast")
    n2.kill()
    killed = time.monotonic()
    status = wait_for(status_when(n1, lambda s: "n2" not in owners(s, "fast")), timeout=20)
    # the lease TTL is 3 s; the move is the controller's next step after etcd expires it
    assert time.monotonic() - killed < 3 + 3
    assert owners(status, "fast") == ["n1"] * 6
    # n2's reliable shards still name n2, and are reported unavailable, not moved to an empty log
    assert [owners(status, "late")[shard] for shard in late_on_n2] == ["n2"] * len(late_on_n2)
    assert {f"late/{shard}" for shard in late_on_n2} <= set(status["unavailable_shards"])
    # n2 comes back (same data directory): its reliable shards are available again
    n2.start()
    wait_for(lambda: not n1.status()["unavailable_shards"], timeout=20)
    assert [owners(n1.status(), "late")[shard] for shard in late_on_n2] == ["n2"] * len(late_on_n2)


def test_a_node_cut_off_from_etcd_stops_acting_after_its_ttl_and_rejoins(
    cluster: Cluster, etcd: EtcdServer,
) -> None:
    (n1,) = cluster(1, extra_config=STREAMS)
    assert n1.status()["lease_alive"]
    etcd.stop()
    stopped = time.monotonic()
    wait_for(lambda: not n1.status()["lease_alive"], timeout=15)
    assert time.monotonic() - stopped < 3 + 3
    assert n1.alive()  # still serving, only no longer acting for its shards
    etcd.start()
    # rejoined: registered again, and its shards placed on it again (the placement is written
    # anew once the node is back, so wait for it rather than read it at the first status)
    status = wait_for(
        lambda: (status := settled(n1, {"n1"})) is not None and status["lease_alive"]
        and "fast" in status["placement"] and owners(status, "fast") == ["n1"] * 6 and status,
        timeout=20)
    assert [entry["node_id"] for entry in status["nodes"]] == ["n1"]


def test_cluster_status_command_and_metrics_show_every_node(cluster: Cluster) -> None:
    n1, n2 = cluster(2, extra_config=STREAMS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    shown = subprocess.run(
        [sys.executable, "-m", "shardgate", "cluster", "status",
         "--http-url", f"http://127.0.0.1:{n2.ports['http']}"],
        capture_output=True, text=True, timeout=60, env=env)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    controller = n1.status()["controller"]
    assert lines[0] == f"cluster test: 2 nodes, controller {controller}, 9 shards in 3 streams"
    rows = {line.split()[0]: line.split() for line in lines[2:4]}
    assert set(rows) == {"n1", "n2"}
    assert rows["n1"][2] == f"127.0.0.1:{n1.mqtt_port}"
    assert sorted(int(row[-2]) for row in rows.values()) == [4, 5]
    with urllib.request.urlopen(f"http://127.0.0.1:{n1.ports['http']}/metrics", timeout=5) as reply:
        metrics = reply.read().decode()
    assert 'shardgate_cluster_nodes{node="n1"} 2.0' in metrics
    assert 'shardgate_cluster_lease_alive{node="n1"} 1.0' in metrics


def test_cluster_status_finds_the_node_by_shardgate_url_and_takes_credentials(
    etcd: EtcdServer, tmp_path: Path,
) -> None:
    """Like every client command, `cluster status` asks the node at $SHARDGATE_URL (its gRPC
    listener; no --http-url) and authenticates with --username/--password."""
    from shardgate.security.auth import User, hash_password, save_users

    node = ClusterNodeProcess(tmp_path / "n1", "n1", etcd.url, extra_config=STREAMS)
    (tmp_path / "n1").mkdir(parents=True, exist_ok=True)
    save_users(tmp_path / "n1" / "users.json",
               {"root": User("root", hash_password("root-pw"), ["admin"])})
    node.start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
        env["SHARDGATE_URL"] = node.grpc_url
        command = [sys.executable, "-m", "shardgate", "cluster", "status"]

        def status(*extra: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([*command, *extra], capture_output=True, text=True,
                                  timeout=60, env=env)

        shown = wait_for(
            lambda: (done := status("--username", "root", "--password", "root-pw")).returncode == 0
            and "controller n1" in done.stdout and done, timeout=60, interval=0.2)
        assert shown.stdout.splitlines()[0] == "cluster test: 1 nodes, controller n1, 9 shards in 3 streams"
        refused = status()
        assert refused.returncode == 1
        assert "--username" in refused.stderr and "Traceback" not in refused.stderr
    finally:
        node.kill()


def test_nodes_authenticate_to_an_etcd_with_users_and_a_wrong_password_is_a_clear_error(
    etcd: EtcdServer, tmp_path: Path,
) -> None:
    if shutil.which("etcdctl") is None:
        pytest.skip("etcdctl is not installed (apt-get install etcd-client)")
    for command in (["user", "add", "root:rootpw", "--interactive=false"], ["role", "add", "root"],
                    ["user", "grant-role", "root", "root"], ["auth", "enable"]):
        done = subprocess.run(["etcdctl", "--endpoints", etcd.url, *command],
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
    login = 'username = "root"\npassword = "rootpw"\n'
    node = ClusterNodeProcess(tmp_path / "n1", "n1", etcd.url, extra_config="")
    assert node.config_file is not None
    node.config_file.write_text(node.config_file.read_text().replace("[cluster]\n", "[cluster]\n" + login))
    node.start()
    try:
        status = wait_for(lambda: settled(node, {"n1"}), timeout=30)
        assert status["lease_alive"]
    finally:
        node.kill()
    node.config_file.write_text(node.config_file.read_text().replace("rootpw", "wrong"))
    refused = subprocess.run(
        [sys.executable, "-m", "shardgate", "serve", "--data-dir", str(tmp_path / "n2"),
         "--config", str(node.config_file), "--cluster", etcd.url, "--node-id", "n2",
         "--mqtt-port", "0", "--mqtt-ws-port", "0", "--amqp-port", "0", "--grpc-port", "0",
         "--http-port", "0"], capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0
    assert "etcd refused the connection" in refused.stderr, refused.stderr
    assert "invalid user ID or password" in refused.stderr


def test_nodes_reach_etcd_over_tls_with_the_configured_ca(tmp_path: Path) -> None:
    if ETCD is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    cert, key = tmp_path / "etcd.crt", tmp_path / "etcd.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
         str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext",
         "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True, timeout=60)
    server = EtcdServer(tmp_path / "etcd", tls=(cert, key)).start()
    try:
        assert server.url.startswith("https://")
        node = ClusterNodeProcess(tmp_path / "n1", "n1", server.url, extra_config="")
        assert node.config_file is not None
        node.config_file.write_text(
            node.config_file.read_text().replace("[cluster]\n", f'[cluster]\nca_file = "{cert}"\n'))
        node.start()
        try:
            assert wait_for(lambda: settled(node, {"n1"}), timeout=30)["lease_alive"]
        finally:
            node.kill()
        # without the CA, the certificate is not trusted: a clear error, not a hang
        (tmp_path / "short.toml").write_text(
            f'[cluster]\nconnect_timeout_s = 2\nsecret = "{CLUSTER_SECRET}"\n')
        untrusted = subprocess.run(
            [sys.executable, "-m", "shardgate", "serve", "--data-dir", str(tmp_path / "n2"),
             "--cluster", server.url, "--node-id", "n2", "--mqtt-port", "0", "--mqtt-ws-port", "0",
             "--amqp-port", "0", "--grpc-port", "0", "--http-port", "0",
             "--config", str(tmp_path / "short.toml")],
            capture_output=True, text=True, timeout=60)
        assert untrusted.returncode != 0
        assert "cannot reach etcd" in untrusted.stderr, untrusted.stderr
    finally:
        server.stop()


def test_when_the_controller_dies_another_node_takes_over_within_the_ttl(cluster: Cluster) -> None:
    n1, n2, n3 = cluster(3, extra_config=STREAMS)
    status = wait_for(lambda: (s := settled(n2, {"n1", "n2", "n3"})) and shard_counts(s) == [3, 3, 3] and s,
                      timeout=30)
    controller = {"n1": n1, "n2": n2, "n3": n3}[status["controller"]]
    survivors = [node for node in (n1, n2, n3) if node is not controller]
    controller.kill()
    killed = time.monotonic()

    def taken_over() -> dict[str, Any] | None:
        s = survivors[0].status()
        if s["controller"] not in {node.node_id for node in survivors}:
            return None
        return s if controller.node_id not in owners(s, "fast") else None

    status = wait_for(taken_over, timeout=20)
    assert time.monotonic() - killed < 3 + 3
    # one controller for both survivors, and the dead node's fast shards spread over them
    assert survivors[1].status()["controller"] == status["controller"]
    assert set(owners(status, "fast")) <= {node.node_id for node in survivors}


def test_sigterm_hands_over_empty_reliable_shards_and_moves_the_ones_with_messages_by_copying(
    cluster: Cluster,
) -> None:
    n1, n2 = cluster(2, extra_config=STREAMS)
    status = wait_for(lambda: (s := settled(n2, {"n1", "n2"})) and shard_counts(s) == [4, 5] and s,
                      timeout=30)
    assert owners(status, "safe") == ["n1", "n1"]  # declared before n2 joined
    with SyncClient(n1.grpc_url) as client:
        kept = client.producer().send("safe/a", b"acknowledged").shard
    assert n1.terminate() == 0
    # n1's leave waited (within leave_timeout_s) for both reliable shards to move: the empty
    # one handed over, the one holding the acknowledged message copied to n2 first and moved
    # once the copy was in sync; so nothing is unavailable while n1 is away, and the message
    # is there to read on n2
    assert "n1 handed its shards over" in n1.log_path.read_text()
    status = n2.status()
    assert owners(status, "safe") == ["n2", "n2"]
    assert status["unavailable_shards"] == []
    got = asyncio.run(read_back(n2.grpc_url, ["safe/#"], {"acknowledged"}, timeout=30))
    assert got == {"acknowledged": 1}
    # publishes to that shard go on there (n1's journal is no longer its log)
    with SyncClient(n2.grpc_url) as client:
        assert client.producer().send("safe/a", b"after the leave").shard == kept
