"""Archive exactly once across owner changes (issue 14: "every node archives the shards it owns
to the one object-store URL, exactly once across owner changes"). Two nodes archive to one
shared URL; a node leaves with SIGTERM (its empty reliable shard is handed over, the others
wait for it), returns, then the other node crashes (SIGKILL) and returns; messages are
published between each step. pyarrow then reads every acknowledged message exactly once from
that URL, and no two files of a shard overlap."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
import zlib
from collections import Counter, defaultdict
from pathlib import Path

import pyarrow.dataset as ds
import pytest
from shardgate.client import Client
from shardgate.protocols.mqtt import packets as p

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess, EtcdServer, protocol_node, wait_settled
from tests.mqtt_clients import RawClient


def flush(node: ClusterNodeProcess) -> None:
    request = urllib.request.Request(f"http://127.0.0.1:{node.ports['http']}/api/archive/flush",
                                     method="POST", data=b"{}",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=150) as reply:
        json.loads(reply.read())


def owners(node: ClusterNodeProcess) -> list[str]:
    return [owner for owner, _epoch in node.status()["placement"]["safe"]]


def topic_on(shard: int) -> str:
    return next(t for t in (f"safe/a/{i}" for i in range(1000)) if zlib.crc32(t.encode()) % 4 == shard)


def publish(node: ClusterNodeProcess, shards: list[int], count: int, tag: str) -> set[str]:
    """`count` QoS 1 messages to each of `shards` through `node`; the acknowledged payloads."""
    client = RawClient(node.mqtt_port, version=5)
    client.connect(f"pub-{tag}")
    acknowledged = set()
    packet_id = 0
    for index in range(count):
        for shard in shards:
            packet_id += 1
            payload = f"{tag}-{shard}-{index}"
            client.send(p.Publish(topic_on(shard), payload.encode(), 1, packet_id=packet_id))
            puback = client.receive()
            assert isinstance(puback, p.Puback) and puback.reason_code == 0, (
                payload, puback.reason_code, puback.properties.reason_string)
            acknowledged.add(payload)
    client.close()
    return acknowledged


@pytest.mark.timeout(300)
def test_every_node_archives_its_shards_to_one_url_exactly_once_across_owner_changes(
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
                # one copy per shard: on two nodes a replicated shard (2 replicas, both in
                # sync to acknowledge) refuses publishes while either node is away, and here
                # publishes go on while n2 is away (replicated shards: the test below)
                await client.admin.create_stream("safe", partitions=4, mode="reliable", replicas=1)

        asyncio.run(create())
        # (both nodes must know the new stream: an owner that has not learned it yet refuses a
        # forwarded publish for it, retryably)
        wait_for(lambda: all("safe" in node.status()["placement"] for node in nodes)
                 and set(owners(n1)) == {"n1", "n2"}, timeout=30)
        placed = owners(n1)
        on_n2 = [shard for shard, owner in enumerate(placed) if owner == "n2"]
        empty = on_n2[0]  # nothing is published to it before n2 leaves: it is handed over
        acknowledged = publish(n1, [s for s in range(4) if s != empty], 30, "first")
        # n2 leaves gracefully: it archives what it holds, hands its empty shard to n1
        assert n2.terminate() == 0
        assert owners(n1)[empty] == "n1"
        acknowledged |= publish(n1, [s for s, owner in enumerate(owners(n1)) if owner == "n1"], 30,
                                "while-n2-away")
        n2.start()
        wait_settled(nodes)
        wait_for(lambda: not n1.status()["unavailable_shards"], timeout=30)
        acknowledged |= publish(n2, list(range(4)), 30, "n2-back")
        # n1 crashes and returns (its archiver resumes from the files at the URL)
        n1.kill()
        n1.start()
        wait_settled(nodes)
        wait_for(lambda: not n2.status()["unavailable_shards"], timeout=30)
        acknowledged |= publish(n2, list(range(4)), 30, "n1-back")
        for node in nodes:
            flush(node)

        def archived() -> dict[str, list[int]] | None:
            files = list(archive.rglob("*.parquet"))
            if not files:
                return None
            table = ds.dataset(str(archive / "stream=safe"), format="parquet",
                               partitioning="hive").to_table(columns=["shard", "offset", "payload"])
            rows = [(shard, offset, bytes(payload).decode()) for shard, offset, payload in zip(
                table.column("shard").to_pylist(), table.column("offset").to_pylist(),
                table.column("payload").to_pylist(), strict=True)]
            if not acknowledged <= {payload for _s, _o, payload in rows}:
                return None
            by_payload: dict[str, list[int]] = defaultdict(list)
            for shard, offset, payload in rows:
                by_payload[payload].append(shard * 1_000_000 + offset)
            return by_payload

        by_payload = wait_for(archived, timeout=60, interval=0.5)
        twice = {payload: places for payload, places in by_payload.items() if len(places) > 1}
        assert not twice, f"{len(twice)} messages archived more than once: {list(twice.items())[:5]}"
        assert set(by_payload) == acknowledged, "only what was published, and all of it"
        # per shard, the files' offset ranges do not overlap
        ranges: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for path in archive.rglob("*.parquet"):
            match = re.fullmatch(r"shard(\d+)-(\d+)-(\d+)\.parquet", path.name)
            assert match, path.name
            ranges[int(match.group(1))].append((int(match.group(2)), int(match.group(3))))
        for shard, spans in ranges.items():
            spans.sort()
            overlapping = [(a, b) for a, b in zip(spans, spans[1:], strict=False) if b[0] <= a[1]]
            assert not overlapping, f"shard {shard}: {overlapping}"
        assert Counter(payload.split("-")[0] for payload in by_payload)["first"] == 3 * 30
    finally:
        for node in nodes:
            if node.alive():
                node.kill()


def replicated(node: ClusterNodeProcess) -> dict[int, dict] | None:
    """The shards of `safe` as `cluster status` shows replicated shards, when all are."""
    found = {int(name.rsplit("/", 1)[1]): entry
             for name, entry in node.status()["replicated_shards"].items() if name.startswith("safe/")}
    return found if len(found) == 4 else None


def all_in_sync(node: ClusterNodeProcess, replicas: set[str]) -> bool:
    shards = replicated(node)
    return shards is not None and all(set(entry["isr"]) == replicas for entry in shards.values())


@pytest.mark.timeout(300)
def test_a_replicated_shards_archive_goes_on_after_its_leaders_sigkill_with_no_duplicate_and_no_gap(
    etcd: EtcdServer, tmp_path: Path,
) -> None:
    """Three nodes, three replicas per shard, one archive URL: only a shard's leader archives
    it, and after the SIGKILL of a leader its successor goes on from where the archive stopped,
    so pyarrow reads every acknowledged message once, each shard's offsets one sequence."""
    archive = tmp_path / "shared-archive"
    config = f'[archive]\nurl = "file://{archive}"\nmax_delay_s = 0.2\n'
    nodes = [protocol_node(tmp_path, f"n{index}", etcd.url, config).start() for index in (1, 2, 3)]
    n1, n2, n3 = nodes
    everyone = {"n1", "n2", "n3"}
    try:
        wait_settled(nodes)

        async def create() -> None:
            async with Client(n1.grpc_url) as client:
                await client.admin.create_stream("safe", partitions=4, mode="reliable", replicas=3)

        asyncio.run(create())
        wait_for(lambda: all(all_in_sync(node, everyone) for node in nodes), timeout=60)
        acknowledged = publish(n3, list(range(4)), 20, "first")
        for node in nodes:
            flush(node)
        # the leader of shard 0 dies; another in-sync replica leads it in a higher epoch
        before = replicated(n3)
        assert before is not None
        leader = next(node for node in nodes if node.node_id == before[0]["leader"])
        others = [node for node in nodes if node is not leader]
        leader.kill()
        wait_for(lambda: (now := replicated(others[0])) is not None
                 and now[0]["leader"] != leader.node_id
                 and now[0]["leader_epoch"] > before[0]["leader_epoch"]
                 and not others[0].status()["unavailable_shards"], timeout=60)
        wait_settled(others)
        acknowledged |= publish(others[0], list(range(4)), 20, "after-kill")
        leader.start()
        wait_settled(nodes)
        wait_for(lambda: all(all_in_sync(node, everyone) for node in nodes), timeout=60)
        acknowledged |= publish(leader, list(range(4)), 20, "back")
        for node in nodes:
            flush(node)

        def rows() -> list[tuple[int, int, str]] | None:
            if not list(archive.rglob("*.parquet")):
                return None
            table = ds.dataset(str(archive / "stream=safe"), format="parquet",
                               partitioning="hive").to_table(columns=["shard", "offset", "payload"])
            found = [(shard, offset, bytes(payload).decode()) for shard, offset, payload in zip(
                table.column("shard").to_pylist(), table.column("offset").to_pylist(),
                table.column("payload").to_pylist(), strict=True)]
            return found if acknowledged <= {payload for _s, _o, payload in found} else None

        archived = wait_for(rows, timeout=60, interval=0.5)
        counted = Counter(payload for _shard, _offset, payload in archived)
        assert not [payload for payload, times in counted.items() if times > 1], "archived twice"
        assert set(counted) == acknowledged, "only what was acknowledged, and all of it"
        offsets: dict[int, list[int]] = defaultdict(list)
        for shard, offset, _payload in archived:
            offsets[shard].append(offset)
        assert {shard: sorted(found) for shard, found in offsets.items()} == {
            shard: list(range(60)) for shard in range(4)}
        for node in nodes:
            assert "Traceback" not in node.log_path.read_text()
    finally:
        for node in nodes:
            if node.alive():
                node.kill()
