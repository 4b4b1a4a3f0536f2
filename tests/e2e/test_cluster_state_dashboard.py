"""The dashboard's node list in a cluster, in a real headless Chromium: every node with its
addresses, the controller and its shards, from any node's page; a single node has no cluster
section."""

from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.conftest import ThreadedBroker, free_port
from tests.e2e.cluster_fixtures import ClusterNodeProcess

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update"]
TIMEOUT_MS = 20_000

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium browser installed")
Cluster = Callable[..., list[ClusterNodeProcess]]


@pytest.fixture
def page() -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_context().new_page()
            page.set_default_timeout(TIMEOUT_MS)
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.errors = errors
            yield page
        finally:
            browser.close()


def test_the_dashboard_lists_every_node_with_its_addresses_controller_and_shards(
        cluster: Cluster, page: Any) -> None:
    nodes = cluster(3)
    status = nodes[1].status()
    page.goto(f"http://127.0.0.1:{nodes[1].ports['http']}/")
    expect = sync_api.expect
    expect(page.locator("#cluster")).to_be_visible()
    expect(page.locator("#cluster-body tr")).to_have_count(3)
    for node in nodes:
        row = page.locator(f"#cluster-body tr[data-node='{node.node_id}']")
        entry = next(e for e in status["nodes"] if e["node_id"] == node.node_id)
        expect(row).to_contain_text(entry["cluster_address"])
        expect(row).to_contain_text(f"mqtt 127.0.0.1:{node.mqtt_port}")
        expect(row.locator("td.shards")).to_have_text(str(entry["shards"]))
    controller = page.locator("#cluster-body tr[data-controller='yes']")
    expect(controller).to_have_count(1)
    expect(controller).to_have_attribute("data-node", status["controller"])
    expect(controller).to_contain_text("controller")
    expect(page.locator("#cluster-body tr[data-node='n2']")).to_contain_text("this node")
    expect(page.locator("#cluster-summary")).to_contain_text("3 nodes")
    # every node's resources, from n2's page and its admin API
    expect(page.locator("#nodes-body tr")).to_have_count(3)
    for node in nodes:
        row = page.locator(f"#nodes-body tr[data-node='{node.node_id}']")
        expect(row).to_contain_text("MiB")
        expect(row).to_have_attribute("data-alarms", "")
    with urllib.request.urlopen(f"http://127.0.0.1:{nodes[0].ports['http']}/api/nodes",
                                timeout=30) as response:
        table = json.loads(response.read())
    assert [row["node"] for row in table] == ["n1", "n2", "n3"]
    assert all(row["rss_bytes"] > 0 and row["alarms"] == [] for row in table), table
    # the streams table is the cluster's: each shard with the node that owns it
    for stream, shards in status["placement"].items():
        for index, (leader, _epoch) in enumerate(shards):
            shard = page.locator(f"#streams-body tr[data-stream='{stream}'][data-shard='{index}']")
            expect(shard.locator("td.owner")).to_have_text(leader)
    assert page.errors == []


def test_a_single_node_shows_no_cluster_section(
        broker_factory: Callable[..., ThreadedBroker], page: Any) -> None:
    broker = broker_factory(listeners={"http_port": free_port(), "grpc_port": free_port()},
                            archive={"enabled": False})
    page.goto(f"http://127.0.0.1:{broker.app.port('http')}/")
    expect = sync_api.expect
    expect(page.locator("#streams-body tr[data-stream='default']")).to_have_count(1)
    expect(page.locator("#cluster")).to_be_hidden()
    expect(page.locator("#cluster-link")).to_be_hidden()
    assert page.errors == []
