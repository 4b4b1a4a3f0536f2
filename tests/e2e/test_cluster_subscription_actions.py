"""An administrator's purge and replay of a durable subscription act on the node that holds it,
whichever node is asked (the admin HTTP API and `shardgate subs reset` over gRPC Admin), and
the answer names that node; a name no node holds is a 404 / NOT_FOUND from any node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess

Cluster = Callable[..., list[ClusterNodeProcess]]
SESSION = "away"
NAME = f"mqtt:{SESSION}"


def cli(node: ClusterNodeProcess, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    return subprocess.run([sys.executable, "-m", "shardgate", *args, "--url", node.grpc_url],
                          capture_output=True, text=True, timeout=120, env=env)


def post(node: ClusterNodeProcess, path: str, body: Any = None) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{node.ports['http']}{path}", method="POST",
        data=json.dumps(body or {}).encode(),
        headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def lag(node: ClusterNodeProcess) -> tuple[int, str] | None:
    """The session subscription's lag and node, from `node`'s cluster-wide listing."""
    with urllib.request.urlopen(f"http://127.0.0.1:{node.ports['http']}/api/subscriptions",
                                timeout=60) as response:
        for row in json.loads(response.read()):
            if row["name"] == NAME:
                return row["lag"], row["node"]
    return None


def session(node: ClusterNodeProcess, clean: bool) -> tuple[mqtt.Client, list[bytes]]:
    got: list[bytes] = []
    connected: list[bool] = []
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=SESSION,
                         clean_session=clean)
    client.on_message = lambda _c, _u, message: got.append(message.payload)
    client.on_connect = lambda *args: connected.append(True)
    client.connect("127.0.0.1", node.ports["mqtt"])
    client.loop_start()
    wait_for(lambda: connected, timeout=30)
    return client, got


@pytest.mark.timeout(600)  # two nodes, a stream placed, CLI processes
def test_purge_and_replay_act_on_the_node_holding_the_subscription(cluster: Cluster) -> None:
    n1, n2 = cluster(2)
    created = cli(n1, "streams", "create", "orders", "--partitions", "2", "--mode", "reliable",
                  "--replicas", "1")
    assert created.returncode == 0, created.stderr
    for node in (n1, n2):
        wait_for(lambda node=node: len(node.status()["placement"].get("orders", [])) == 2,
                 timeout=30)
    # a persistent session on n2, offline, with 5 messages waiting
    away, _ = session(n2, clean=False)
    subscribed: list[bool] = []
    away.on_subscribe = lambda *args: subscribed.append(True)
    away.subscribe("orders/#", qos=1)
    wait_for(lambda: subscribed, timeout=30)
    away.disconnect()
    away.loop_stop()
    publisher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="feeder")
    publisher.connect("127.0.0.1", n1.ports["mqtt"])
    publisher.loop_start()
    try:
        for index in range(5):
            publisher.publish(f"orders/{index}", b"old", qos=1).wait_for_publish(30)
        wait_for(lambda: lag(n1) == (5, "n2"), timeout=30)

        # asked on n1, n2 acts and is named
        path = f"/api/subscriptions/{urllib.parse.quote(NAME, safe='')}"
        status, body = post(n1, f"{path}/purge")
        assert status == 200, body
        assert body["node"] == "n2" and body["purged"] == 5, body
        assert body["subscription"]["lag"] == 0, body
        assert lag(n2) == (0, "n2")

        status, body = post(n1, f"{path}/cursor", {"position": "earliest"})
        assert status == 200 and body["node"] == "n2" and body["lag"] >= 5, body

        # the CLI (gRPC Admin ResetCursor) asked on n1 as well
        reset = cli(n1, "subs", "reset", NAME, "--position", "latest")
        assert reset.returncode == 0, reset.stderr
        assert reset.stdout.strip() == f"reset subscription {NAME} on node n2", reset.stdout
        assert lag(n1) == (0, "n2")
        described = cli(n1, "subs", "reset", NAME, "--position", "earliest", "--json")
        assert described.returncode == 0, described.stderr
        answer = json.loads(described.stdout)
        assert answer["node"] == "n2" and int(answer["lag"]) >= 5, answer
        # the session, back on n2, is handed the 5 messages again
        back, got = session(n2, clean=False)
        try:
            wait_for(lambda: len(got) >= 5, timeout=30)
            assert got == [b"old"] * 5
        finally:
            back.disconnect()
            back.loop_stop()

        # a name no node holds: 404 from either node, NOT_FOUND over gRPC
        for node in (n1, n2):
            status, body = post(node, "/api/subscriptions/nothing-anywhere/purge")
            assert status == 404 and "nothing-anywhere" in body["error"], body
        missing = cli(n1, "subs", "reset", "nothing-anywhere")
        assert missing.returncode != 0 and "nothing-anywhere" in missing.stderr, missing

        # a live-only subscription is refused by its holder with 409
        live, _ = session(n2, clean=True)
        try:
            live.subscribe("orders/#", qos=1)
            wait_for(lambda: lag(n1) is not None and lag(n1)[1] == "n2", timeout=30)
            status, body = post(n1, f"{path}/purge")
            assert status == 409 and "live-only" in body["error"], body
        finally:
            live.disconnect()
            live.loop_stop()
    finally:
        publisher.disconnect()
        publisher.loop_stop()


@pytest.mark.timeout(600)
def test_a_share_group_on_two_nodes_is_one_subscription_row(cluster: Cluster) -> None:
    n1, n2 = cluster(2)
    group = "$share/workers/jobs/#"
    members = []
    for node, client_id in ((n1, "w1"), (n2, "w2")):
        member = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id)
        subscribed: list[bool] = []
        member.on_subscribe = lambda *args, subscribed=subscribed: subscribed.append(True)
        member.connect("127.0.0.1", node.ports["mqtt"])
        member.loop_start()
        member.subscribe(group, qos=1)
        wait_for(lambda subscribed=subscribed: subscribed, timeout=30)
        members.append(member)
    try:
        for node in (n1, n2):
            with urllib.request.urlopen(f"http://127.0.0.1:{node.ports['http']}/api/subscriptions",
                                        timeout=60) as response:
                rows = [row for row in json.loads(response.read()) if row["name"] == group]
            assert len(rows) == 1, rows
            (row,) = rows
            assert row["node"] == "n1,n2" and row["nodes"] == ["n1", "n2"], row
            assert sorted((c["id"], c["node"]) for c in row["consumers"]) == [
                ("w1", "n1"), ("w2", "n2")], row
            listed = cli(node, "subs", "list", "--json")
            assert listed.returncode == 0, listed.stderr
            assert [s["node"] for s in json.loads(listed.stdout) if s["name"] == group] == ["n1,n2"]
    finally:
        for member in members:
            member.disconnect()
            member.loop_stop()
