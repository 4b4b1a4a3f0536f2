"""One archive for a cluster (issue 29): a node refuses to start with an archive in its own data
directory (the default) unless `[archive] per_node = true` says so, and a shared URL is taken;
a new owner of a shard's log (here: its node lost its disk) continues the archive's sequence
of files, so that pyarrow reads every acknowledged message once."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import urllib.request
import zlib
from collections import Counter, defaultdict
from pathlib import Path

import pyarrow.dataset as ds
from shardgate.client import Client
from shardgate.protocols.mqtt import packets as p

from tests.conftest import free_port, wait_for
from tests.e2e.cluster_fixtures import (
    CLUSTER_SECRET,
    ClusterNodeProcess,
    EtcdServer,
    protocol_node,
    settled,
    wait_settled,
)
from tests.mqtt_clients import RawClient


def serve(tmp_path: Path, etcd: EtcdServer, *extra: str) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "node.toml"
    config.write_text(f'[cluster]\nsecret = "{CLUSTER_SECRET}"\nconnect_timeout_s = 5\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    return subprocess.run(
        [sys.executable, "-m", "shardgate", "serve", "--data-dir", str(tmp_path / "n1"),
         "--config", str(config), "--cluster", etcd.url, "--node-id", "n1", "--cluster-port", "0",
         "--mqtt-port", "0", "--mqtt-ws-port", "0", "--amqp-port", "0", "--grpc-port", "0",
         "--http-port", str(free_port()), *extra],
        capture_output=True, text=True, timeout=120, env=env)


def test_a_node_refuses_an_archive_in_its_data_dir_and_takes_a_shared_url(
    etcd: EtcdServer, tmp_path: Path,
) -> None:
    refused = serve(tmp_path, etcd)
    assert refused.returncode == 2, refused.stderr
    assert "split across machines" in refused.stderr, refused.stderr
    assert "per_node = true" in refused.stderr and "Traceback" not in refused.stderr
    assert not etcd.keys("/nodes/"), "a refused node never registers"
    inside = serve(tmp_path, etcd, "--archive-url", f"file://{tmp_path / 'n1' / 'archive'}")
    assert inside.returncode == 2 and "split across machines" in inside.stderr, inside.stderr
    # `shardgate config check` says the same of a cluster configuration
    bad = tmp_path / "bad.toml"
    bad.write_text(f'data_dir = "{tmp_path / "n1"}"\n[cluster]\netcd = "{etcd.url}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    checked = subprocess.run([sys.executable, "-m", "shardgate", "config", "check", str(bad)],
                             capture_output=True, text=True, timeout=60, env=env)
    assert checked.returncode == 2, checked
    assert "split across machines" in checked.stderr
    # one shared directory (or object storage) is what a cluster wants
    shared = tmp_path / "shared-archive"
    node = ClusterNodeProcess(tmp_path / "n2", "n2", etcd.url, extra_config="[archive]\n",
                              extra_args=["--archive-url", f"file://{shared}"])
    node.start()
    try:
        wait_for(lambda: settled(node, {"n2"}), timeout=60)
        assert shared.is_dir() and not (tmp_path / "n2" / "archive").exists()
    finally:
        node.kill()
    # and `per_node = true` keeps the archive in the data directory, as said
    local = ClusterNodeProcess(tmp_path / "n3", "n3", etcd.url)
    local.start()
    try:
        wait_for(lambda: settled(local, {"n3"}), timeout=60)
        assert (tmp_path / "n3" / "archive").is_dir()
    finally:
        local.kill()


def flush(node: ClusterNodeProcess) -> None:
    request = urllib.request.Request(f"http://127.0.0.1:{node.ports['http']}/api/archive/flush",
                                     method="POST", data=b"{}",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=150) as reply:
        json.loads(reply.read())


def owners(node: ClusterNodeProcess) -> list[str]:
    return [owner for owner, _epoch in node.status()["placement"].get("safe", [])]


def topic_on(shard: int) -> str:
    return next(t for t in (f"safe/t/{i}" for i in range(1000)) if zlib.crc32(t.encode()) % 2 == shard)


def publish(node: ClusterNodeProcess, count: int, tag: str) -> set[str]:
    """`count` QoS 1 messages to each shard of `safe` through `node`; the acknowledged payloads."""
    client = RawClient(node.mqtt_port, version=5)
    client.connect(f"pub-{tag}")
    acknowledged = set()
    for index in range(count):
        for shard in (0, 1):
            payload = f"{tag}-{shard}-{index}"
            client.send(p.Publish(topic_on(shard), payload.encode(), 1, packet_id=1 + index * 2 + shard))
            puback = client.receive()
            assert isinstance(puback, p.Puback) and puback.reason_code == 0, (
                payload, puback.reason_code, puback.properties.reason_string)
            acknowledged.add(payload)
    client.close()
    return acknowledged


def archived_rows(archive: Path) -> list[tuple[int, int, str]]:
    table = ds.dataset(str(archive / "stream=safe"), format="parquet",
                       partitioning="hive").to_table(columns=["shard", "offset", "payload"])
    return [(shard, offset, bytes(payload).decode()) for shard, offset, payload in zip(
        table.column("shard").to_pylist(), table.column("offset").to_pylist(),
        table.column("payload").to_pylist(), strict=True)]


def test_a_new_owner_of_a_shard_continues_the_archive_with_no_duplicate_and_no_gap(
    etcd: EtcdServer, tmp_path: Path,
) -> None:
    archive = tmp_path / "shared-archive"
    config = f'[archive]\nurl = "file://{archive}"\nmax_delay_s = 0.2\n'
    n1 = protocol_node(tmp_path, "n1", etcd.url, config).start()
    n2 = protocol_node(tmp_path, "n2", etcd.url, config).start()
    nodes = [n1, n2]
    try:
        wait_settled(nodes)

        async def create() -> None:
            async with Client(n1.grpc_url) as client:
                await client.admin.create_stream("safe", partitions=2, mode="reliable")

        asyncio.run(create())
        wait_for(lambda: all(set(owners(node)) == {"n1", "n2"} for node in nodes), timeout=60)
        on_n2 = owners(n1).index("n2")
        acknowledged = publish(n1, 30, "first")
        for node in nodes:
            flush(node)
        assert len(archived_rows(archive)) == 60
        # n2 loses its disk: killed, its data directory gone, started again with a new journal.
        # With one copy per shard it owns its shard again (placement keeps a reliable shard on
        # its node); replicated (the default: here two replicas per shard, n1 and n2), n1 leads
        # it now, and n2 copies the log of every shard back before each shard (both replicas
        # needed in sync) takes publishes again
        n2.kill()
        shutil.rmtree(n2.data_dir)
        wait_for(lambda: not etcd.keys("/nodes/n2"), timeout=60)  # its registration expired
        n2.start()
        wait_settled(nodes)

        def n2_holds_its_shard_again() -> bool:
            status = n1.status()
            replicated = status.get("replicated_shards", {}).get(f"safe/{on_n2}")
            holders = replicated["isr"] if replicated else [owners(n1)[on_n2]]
            # every replicated shard of the stream with all its replicas in sync again
            in_sync = all(set(shard["replicas"]) <= set(shard["isr"])
                          for name, shard in status.get("replicated_shards", {}).items()
                          if name.startswith("safe/"))
            return not status["unavailable_shards"] and "n2" in holders and in_sync

        wait_for(n2_holds_its_shard_again, timeout=60)
        acknowledged |= publish(n1, 30, "second")
        for node in nodes:
            flush(node)
        rows = archived_rows(archive)
        counted = Counter(payload for _shard, _offset, payload in rows)
        assert not [payload for payload, times in counted.items() if times > 1], "archived twice"
        assert set(counted) == acknowledged, (
            f"missing: {sorted(acknowledged - set(counted))[:5]}, "
            f"unexpected: {sorted(set(counted) - acknowledged)[:5]}")
        offsets: dict[int, list[int]] = defaultdict(list)
        for shard, offset, _payload in rows:
            offsets[shard].append(offset)
        # each shard's offsets go on from where the archive stopped: one sequence, no reuse
        assert {shard: sorted(found) for shard, found in offsets.items()} == {
            0: list(range(60)), 1: list(range(60))}
        assert "Traceback" not in n2.log_path.read_text()
    finally:
        for node in nodes:
            if node.alive():
                node.kill()
