"""Wills of a dead node's clients survive the death of the controller publishing them (issue
14): the controller claims a will in etcd under its own lease before publishing it, and a new
controller publishes again the claims of one that died (shardgate/cluster/wills.py), unless the
will's reliable shard shows it published already. Real etcd, real nodes, paho clients; the
controller is SIGKILLed between claim and publish, or between publish and deleting its claim,
held there by the test hooks `SG_TEST_PAUSE_AFTER_WILL_CLAIM` / `..._PUBLISH`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardgate.cluster.wills import CLAIM_PAUSE_ENV, PUBLISH_PAUSE_ENV
from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import (
    ClusterNodeProcess,
    EtcdServer,
    protocol_node,
    settled_nodes,
    start_together,
    topics_of,
    wills_in_etcd,
)
from tests.mqtt_clients import V5, Paho

# Non-reliable, so a dead node's shards move to a survivor.
PRESENCE = '[[streams]]\nname = "presence"\nmode = "non-reliable"\npartitions = 2\nroutes = ["presence/#"]\n'


@pytest.fixture
def trio(etcd: EtcdServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[ClusterNodeProcess]]:
    monkeypatch.setenv(CLAIM_PAUSE_ENV, str(tmp_path / "pause-after-will-claim"))
    monkeypatch.setenv(PUBLISH_PAUSE_ENV, str(tmp_path / "pause-after-will-publish"))
    nodes = [protocol_node(tmp_path, name, etcd.url, PRESENCE) for name in ("n1", "n2", "n3")]
    start_together(nodes)
    with settled_nodes(nodes):
        yield nodes


def test_a_will_claimed_by_a_controller_killed_before_publishing_it_is_published_by_the_next(
    trio: list[ClusterNodeProcess], etcd: EtcdServer, tmp_path: Path,
) -> None:
    by_id = {node.node_id: node for node in trio}
    controller = by_id[trio[0].status()["controller"]]
    holder, survivor = [node for node in trio if node is not controller]
    watcher = Paho(survivor.mqtt_port, "watcher", V5)
    watcher.subscribe("presence/#", 1)
    topic = "presence/device-7"
    Paho(holder.mqtt_port, "device-7", V5,
         will={"topic": topic, "payload": "offline", "qos": 1, "retain": False, "properties": None})
    assert wait_for(lambda: "device-7" in wills_in_etcd(etcd), timeout=10, interval=0.1)

    pause = tmp_path / "pause-after-will-claim"
    pause.touch()  # the claimer stops between claim and publish
    holder.kill()
    claim = wait_for(lambda: wills_in_etcd(etcd).get("device-7", {}).get("claim"), timeout=20, interval=0.1)
    assert claim["node"] == controller.node_id
    controller.kill()  # SIGKILL between claim and publish
    pause.unlink()

    message = watcher.expect(timeout=20)  # the next controller, after the lease TTL (3 s)
    assert (message.topic, message.payload) == (topic, b"offline")
    assert wait_for(lambda: "device-7" not in wills_in_etcd(etcd), timeout=10, interval=0.1)
    watcher.expect_none(within=2)  # and once
    assert [node["node_id"] for node in survivor.status()["nodes"]] == [survivor.node_id]


async def create_reliable_stream(grpc_url: str, name: str) -> None:
    from shardgate.client import Client

    async with Client(grpc_url) as client:
        await client.admin.create_stream(name, partitions=6, mode="reliable", routes=[f"{name}/#"])


def test_a_will_published_by_a_controller_killed_before_deleting_its_claim_is_not_published_again(
    trio: list[ClusterNodeProcess], etcd: EtcdServer, tmp_path: Path,
) -> None:
    by_id = {node.node_id: node for node in trio}
    controller = by_id[trio[0].status()["controller"]]
    holder, survivor = [node for node in trio if node is not controller]
    # a reliable stream created at runtime (its shards spread over the nodes), and a topic whose
    # shard the survivor owns: its journal, where the will is, is readable once both others die
    asyncio.run(create_reliable_stream(survivor.grpc_url, "alerts"))
    topics = wait_for(lambda: "alerts" in survivor.status()["placement"] and topics_of(
        survivor.status(), "alerts", "alerts/device", owner=survivor.node_id), timeout=20, interval=0.1)
    assert topics, "the survivor owns no shard of alerts"
    topic = topics[0]
    watcher = Paho(survivor.mqtt_port, "watcher", V5)
    watcher.subscribe("alerts/#", 1)
    Paho(holder.mqtt_port, "device-9", V5,
         will={"topic": topic, "payload": "gone", "qos": 1, "retain": False, "properties": None})
    assert wait_for(lambda: "device-9" in wills_in_etcd(etcd), timeout=10, interval=0.1)

    pause = tmp_path / "pause-after-will-publish"
    pause.touch()  # the controller stops between publishing and deleting its claim
    holder.kill()
    message = watcher.expect(timeout=20)
    assert (message.topic, message.payload) == (topic, b"gone")
    claim = wills_in_etcd(etcd)["device-9"]["claim"]
    assert claim["node"] == controller.node_id
    controller.kill()  # SIGKILL between publish and delete
    pause.unlink()

    # the survivor becomes controller, finds the claim of a dead controller, finds the will in
    # its journal, and only deletes the claim
    assert wait_for(lambda: "device-9" not in wills_in_etcd(etcd), timeout=30, interval=0.1)
    watcher.expect_none(within=2)
    assert survivor.status()["controller"] == survivor.node_id
