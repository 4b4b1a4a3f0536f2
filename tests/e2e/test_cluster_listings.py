"""A cluster looks like one broker: `streams list`, `streams describe`, `subs` and `clients` (the
CLI over gRPC Admin, and the admin HTTP API the dashboard reads) give the same answer whichever
node is asked, with the node that owns each shard and the node each subscription and client is
on; a node that does not answer is named, never silently left out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess

Cluster = Callable[..., list[ClusterNodeProcess]]
MESSAGES = 30


def cli(node: ClusterNodeProcess, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    return subprocess.run([sys.executable, "-m", "shardgate", *args, "--url", node.grpc_url],
                          capture_output=True, text=True, timeout=120, env=env)


def cli_json(node: ClusterNodeProcess, *args: str) -> Any:
    result = cli(node, *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def http(node: ClusterNodeProcess, path: str) -> tuple[Any, dict[str, str]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{node.ports['http']}{path}",
                                timeout=60) as response:
        return json.loads(response.read()), dict(response.headers)


def connect(node: ClusterNodeProcess, client_id: str) -> mqtt.Client:
    """A persistent MQTT session on `node` with one subscription, left connected."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                         clean_session=False)
    subscribed: list[bool] = []
    client.on_subscribe = lambda *args: subscribed.append(True)
    client.connect("127.0.0.1", node.ports["mqtt"])
    client.loop_start()
    client.subscribe(f"watch/{client_id}/#", qos=1)
    wait_for(lambda: subscribed, timeout=30)
    return client


def owners(node: ClusterNodeProcess, stream: str) -> list[str]:
    return [leader for leader, _epoch in node.status()["placement"][stream]]


@pytest.mark.timeout(600)  # three nodes, a stream placed, CLI processes, a stopped node
def test_every_node_lists_the_whole_cluster(cluster: Cluster) -> None:
    nodes = cluster(3, lease_ttl_s=30)  # a stopped node stays registered: it does not answer
    n1, n2, n3 = nodes
    created = cli(n1, "streams", "create", "data", "--partitions", "6", "--mode", "reliable",
                  "--replicas", "1")
    assert created.returncode == 0, created.stderr
    for node in nodes:
        wait_for(lambda node=node: len(node.status()["placement"].get("data", [])) == 6,
                 timeout=30)
    clients = [connect(node, f"dev-{node.node_id}") for node in nodes]
    try:
        publisher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="publisher")
        publisher.connect("127.0.0.1", n1.ports["mqtt"])
        publisher.loop_start()
        for index in range(MESSAGES):  # distinct topics: spread over every node's shards
            publisher.publish(f"data/{index}", b"x", qos=1).wait_for_publish(30)
        publisher.disconnect()
        publisher.loop_stop()
        placed = owners(n1, "data")
        assert len(set(placed)) > 1, placed  # the stream is spread over several nodes

        # streams list and describe, from every node, over gRPC Admin (the CLI) and HTTP
        def data_from(node: ClusterNodeProcess) -> tuple[Any, Any, Any]:
            listed = next(s for s in cli_json(node, "streams", "list") if s["name"] == "data")
            described = cli_json(node, "streams", "describe", "data")
            over_http = next(s for s in http(node, "/api/streams")[0] if s["name"] == "data")
            return listed, described, over_http

        for node in nodes:
            listed, described, over_http = data_from(node)
            for view in (listed, described, over_http):
                assert [shard["owner"] for shard in view["shards"]] == placed, node.node_id
                assert sum(int(shard["next_offset"]) for shard in view["shards"]) == MESSAGES
            assert over_http["messages"] == MESSAGES and over_http["complete"] is True
        detail = [http(node, "/api/streams/data")[0] for node in nodes]
        assert all(view["shards"] == detail[0]["shards"] for view in detail)
        table = cli(n2, "streams", "describe", "data")
        assert table.returncode == 0 and "OWNER" in table.stdout, table.stdout

        # clients and subscriptions: every node's, each with its node, from every node
        expected = {(f"dev-{node.node_id}", node.node_id) for node in nodes}
        for node in nodes:
            over_grpc = {(c["client_id"], c["node"]) for c in cli_json(node, "clients", "list")
                         if c["protocol"] == "mqtt"}
            over_http = {(c["client_id"], c["node"]) for c in http(node, "/api/clients")[0]
                         if c["protocol"] == "mqtt"}
            assert over_grpc == over_http == expected, node.node_id
            subs_grpc = sorted((s["name"], s["node"]) for s in cli_json(node, "subs", "list"))
            subs_http = sorted((s["name"], s["node"]) for s in http(node, "/api/subscriptions")[0])
            assert subs_grpc == subs_http, node.node_id
            assert {held for _, held in subs_grpc} == {"n1", "n2", "n3"}, subs_grpc
        assert len({tuple(sorted((s["name"], s["node"]) for s in cli_json(node, "subs", "list")))
                    for node in nodes}) == 1

        # a node that does not answer (stopped, still registered) is named, its shards unknown
        assert n3.proc is not None
        os.kill(n3.proc.pid, signal.SIGSTOP)
        try:
            streams, headers = http(n1, "/api/streams")
            data = next(s for s in streams if s["name"] == "data")
            assert "n3" in headers.get("Shardgate-Unanswered-Nodes", ""), headers
            assert data["complete"] is False
            assert all(shard["unavailable"] == (shard["owner"] == "n3") for shard in data["shards"])
            listed = cli(n1, "clients", "list")
            assert listed.returncode == 0, listed.stderr
            assert "node n3 did not answer" in listed.stderr, listed.stderr
            assert "dev-n1" in listed.stdout and "dev-n3" not in listed.stdout
            described = cli(n2, "streams", "describe", "data")
            assert "no answer" in described.stdout, described.stdout
            assert "node n3 did not answer" in described.stderr, (
                described, http(n2, "/api/streams/data"), n2.log_path.read_text()[-5000:])
        finally:
            os.kill(n3.proc.pid, signal.SIGCONT)
    finally:
        for client in clients:
            client.loop_stop()
            client.disconnect()


def ready(node: ClusterNodeProcess) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{node.ports['http']}/readyz",
                                    timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.timeout(300)
def test_readyz_and_cluster_status_follow_the_placement(cluster: Cluster) -> None:
    n1, n2 = cluster(2)
    created = cli(n1, "streams", "create", "data", "--partitions", "4", "--mode", "reliable",
                  "--replicas", "1")
    assert created.returncode == 0, created.stderr
    for node in (n1, n2):
        wait_for(lambda node=node: len(node.status()["placement"].get("data", [])) == 4,
                 timeout=30)
    # each node is ready once it serves every shard placed on it, and says how many
    for node in (n1, n2):
        counts = {entry["node_id"]: entry["shards"] for entry in node.status()["nodes"]}
        status, body = wait_for(lambda node=node: (answer := ready(node))[0] == 200 and answer,
                                timeout=30)
        assert body["checks"]["placement"] == {
            "ok": True, "detail": f"serves its {counts[node.node_id]} shards"}, body
    shown = cli(n1, "cluster", "status")
    assert shown.returncode == 0, shown.stderr

    # n2 is gone: its reliable shards stay placed on it, unavailable; `cluster status` says so
    # with a non-zero exit code, while n1 (serving its own shards) stays ready
    lost = [f"data/{index}" for index, leader in enumerate(owners(n1, "data")) if leader == "n2"]
    assert lost, owners(n1, "data")
    n2.kill()
    wait_for(lambda: set(lost) <= set(n1.status()["unavailable_shards"]), timeout=60)
    shown = cli(n1, "cluster", "status")
    assert shown.returncode == 3, (shown.returncode, shown.stdout, shown.stderr)
    assert "unavailable" in shown.stdout and lost[0] in shown.stdout
    assert ready(n1)[0] == 200
