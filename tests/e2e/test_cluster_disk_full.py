"""A replica's disk fills up (issue 28, "disk full on one replica"): three `shardgate serve`
nodes and a real etcd on loopback, each node's data directory on its own tmpfs, a reliable
stream of three replicas of which two must be in sync. A tmpfs is shrunk to a little more
than it holds to fill that node's disk, and grown again to give the room back. With the disk
alarm off (`disk_free_limit = 0`) the journal's writes themselves fail with ENOSPC, as when a
disk fills faster than the alarm's check; with it on (1 MiB here) the node refuses to store
once less is free.

- A follower's disk fills under QoS 1 publishing (ENOSPC, and the alarm): its process stays
  up, the leader drops it from the in-sync set (`/api/cluster`) and acknowledges with the
  other in-sync replica; once the disk has room again the follower fetches what it missed, is
  back in the in-sync set, and its journal is byte-identical to the leader's; every
  acknowledged message is in the shard.
- The leader's disk fills (ENOSPC): no publish it could not store is acknowledged; it gives up
  the shard's leadership (as a Kafka broker whose log directory fails), the controller elects
  an in-sync replica with room in a newer epoch, and publishes are acknowledged again; once
  the old leader's disk has room it catches up as a follower and rejoins the in-sync set,
  byte-identical; every acknowledged message is in the shard.
- The leader's disk alarm is raised: it keeps the shard and refuses publishes with the quota
  error (MQTT 5 PUBACK 0x97), acknowledging none, until the alarm clears; then publishes are
  acknowledged again, and nothing acknowledged is lost.

Mounting needs root (CAP_SYS_ADMIN): the tests skip when a mount is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import (
    ClusterNodeProcess,
    ContinuousPublisher,
    EtcdServer,
    read_back,
    start_together,
    topics_of,
    wait_settled,
)

STREAM = "full"
CONFIG = (f'[[streams]]\nname = "{STREAM}"\nmode = "reliable"\npartitions = 1\nreplicas = 3\n'
          "min_insync_replicas = 2\n")
ROOMY = 64 << 20  # each data directory's tmpfs, in bytes
FILL_LEFT = 192 << 10  # room left on a disk that is made to fill, in bytes
ALARM = 1 << 20  # disk_free_limit of the tests with the disk alarm on, in bytes


def _mount(directory: Path, size: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                               str(directory)], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        pytest.skip("no mount command to mount a tmpfs with")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {done.stderr.strip()}")


def _resize(directory: Path, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(directory)], check=True,
                   capture_output=True)


def _fill(directory: Path, left: int = FILL_LEFT) -> None:
    """Shrink `directory`'s tmpfs to what it holds plus `left` bytes: it fills soon."""
    used = os.statvfs(directory)
    held = (used.f_blocks - used.f_bfree) * used.f_frsize
    _resize(directory, held + left)


def _free(directory: Path) -> int:
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


@pytest.fixture
def tmpfs_cluster(tmp_path: Path, etcd: EtcdServer
                  ) -> Iterator[Callable[..., dict[str, ClusterNodeProcess]]]:
    """Starts three nodes, each data directory on a tmpfs of ROOMY bytes, with the disk alarm
    at `disk_free_limit` (0: off); kills them, then unmounts every tmpfs, whatever
    happened."""
    nodes: list[ClusterNodeProcess] = []
    mounted: list[Path] = []

    def start(disk_free_limit: int = 0) -> dict[str, ClusterNodeProcess]:
        for index in (1, 2, 3):
            node = ClusterNodeProcess(tmp_path / f"n{index}", f"n{index}", etcd.url,
                                      extra_config=CONFIG)
            assert node.config_file is not None
            # a top-level setting: before the file's first table
            node.config_file.write_text(f"disk_free_limit = {disk_free_limit}\n"
                                        + node.config_file.read_text())
            _mount(node.data_dir, ROOMY)
            mounted.append(node.data_dir)
            nodes.append(node)
        start_together(nodes)
        wait_settled(nodes)
        return {node.node_id: node for node in nodes}

    try:
        yield start
    finally:
        for node in nodes:
            if node.alive():
                node.kill()
        for directory in mounted:
            subprocess.run(["umount", str(directory)], check=False, capture_output=True)


def _shard(node: ClusterNodeProcess) -> dict[str, Any] | None:
    try:
        return node.status()["replicated_shards"].get(f"{STREAM}/0")
    except OSError:
        return None


def _fully_in_sync(node: ClusterNodeProcess) -> dict[str, Any] | None:
    placed = _shard(node)
    if placed is None or len(placed["replicas"]) != 3 or len(placed["isr"]) != 3:
        return None
    return placed


def _segments(node: ClusterNodeProcess) -> bytes:
    shard_dir = Path(node.data_dir) / "journal" / STREAM / "0"
    return b"".join(path.read_bytes() for path in sorted(shard_dir.glob("*.log")))


def _all_stored(node: ClusterNodeProcess, *publishers: ContinuousPublisher) -> None:
    acknowledged = {payload for publisher in publishers for payload in publisher.acknowledged}
    assert acknowledged
    got = asyncio.run(read_back(node.grpc_url, [f"{STREAM}/#"], acknowledged, timeout=90))
    missing = acknowledged - set(got)
    assert not missing, f"{len(missing)} acknowledged messages lost, e.g. {sorted(missing)[:5]}"


def _identical(nodes: list[ClusterNodeProcess]) -> bool:
    with contextlib.suppress(OSError):
        first = _segments(nodes[0])
        return first != b"" and all(_segments(node) == first for node in nodes[1:])
    return False


@pytest.mark.timeout(400)
@pytest.mark.parametrize("disk_free_limit", [0, ALARM], ids=["enospc", "alarm"])
def test_a_follower_whose_disk_fills_leaves_the_in_sync_set_and_rejoins_once_it_has_room(
        tmpfs_cluster: Callable[..., dict[str, ClusterNodeProcess]], disk_free_limit: int) -> None:
    nodes = tmpfs_cluster(disk_free_limit)
    placed = wait_for(lambda: _fully_in_sync(nodes["n1"]), timeout=60, interval=0.1)
    leader = nodes[placed["leader"]]
    full, other = (nodes[name] for name in placed["replicas"] if name != leader.node_id)
    topics = topics_of(leader.status(), STREAM, f"{STREAM}/f")
    publisher = ContinuousPublisher(leader.mqtt_port, "follower-full-writer", topics,
                                    ack_timeout_s=60)
    wait_for(lambda: publisher.count() >= 100, timeout=60)

    if disk_free_limit:
        _fill(full.data_dir, ALARM // 2)  # below the limit: the follower's alarm is raised
    else:
        _fill(full.data_dir)
        wait_for(lambda: _free(full.data_dir) < 16 << 10, timeout=120, interval=0.1)
    # the follower cannot store what it fetches: the leader drops it from the in-sync set and
    # goes on with two
    wait_for(lambda: full.node_id not in (_shard(leader) or {"isr": [full.node_id]})["isr"],
             timeout=90, interval=0.1)
    shown = _shard(leader)
    assert shown is not None and shown["under_replicated"]
    assert sorted(shown["isr"]) == sorted([leader.node_id, other.node_id])
    dropped_at = publisher.count()
    wait_for(lambda: publisher.count() >= dropped_at + 200, timeout=60)
    assert full.alive(), "the node whose disk filled exited"
    assert not publisher.dropped.is_set()

    # room again: the follower catches up and is back in the in-sync set
    _resize(full.data_dir, ROOMY)
    wait_for(lambda: full.node_id in (_shard(leader) or {"isr": []})["isr"], timeout=90,
             interval=0.1)
    back_at = publisher.count()
    wait_for(lambda: publisher.count() >= back_at + 100, timeout=60)
    publisher.stop()
    assert not publisher.dropped.is_set()
    print(f"{publisher.count()} acknowledged, {publisher.refusals()} refused")
    _all_stored(other, publisher)
    wait_for(lambda: _identical([leader, full, other]), timeout=90, interval=0.2)


@pytest.mark.timeout(400)
def test_a_leader_whose_disk_fills_gives_up_the_shard_and_acknowledges_nothing_it_did_not_store(
        tmpfs_cluster: Callable[..., dict[str, ClusterNodeProcess]]) -> None:
    nodes = tmpfs_cluster()
    placed = wait_for(lambda: _fully_in_sync(nodes["n1"]), timeout=60, interval=0.1)
    full = nodes[placed["leader"]]
    first, second = (nodes[name] for name in placed["replicas"] if name != full.node_id)
    topics = topics_of(full.status(), STREAM, f"{STREAM}/l")
    # one publisher on the leader itself, one on a follower (forwarded to the leader)
    on_leader = ContinuousPublisher(full.mqtt_port, "leader-full-writer", topics,
                                    ack_timeout_s=60)
    elsewhere = ContinuousPublisher(first.mqtt_port, "leader-full-other", topics,
                                    ack_timeout_s=60)
    wait_for(lambda: on_leader.count() >= 100 and elsewhere.count() >= 100, timeout=60)

    _fill(full.data_dir)
    # the leader's journal cannot write: it gives the shard up, and the controller elects an
    # in-sync replica in a newer epoch, without the full node in the in-sync set
    def moved() -> dict[str, Any] | None:
        shown = _shard(first)
        return shown if shown is not None and shown["leader"] != full.node_id else None

    shown = wait_for(moved, timeout=90, interval=0.1)
    assert shown["leader"] in (first.node_id, second.node_id)
    assert shown["leader_epoch"] > placed["leader_epoch"]
    assert full.node_id not in shown["isr"]
    new_leader = nodes[shown["leader"]]
    # publishes are acknowledged again, through both nodes (the full one forwards them)
    moved_at = (on_leader.count(), elsewhere.count())
    wait_for(lambda: on_leader.count() >= moved_at[0] + 100
             and elsewhere.count() >= moved_at[1] + 100, timeout=90)
    assert full.alive(), "the node whose disk filled exited"

    # room again: the old leader catches up as a follower and is back in the in-sync set
    _resize(full.data_dir, ROOMY)
    wait_for(lambda: full.node_id in (_shard(new_leader) or {"isr": []})["isr"], timeout=90,
             interval=0.1)
    back_at = elsewhere.count()
    wait_for(lambda: elsewhere.count() >= back_at + 100, timeout=60)
    on_leader.stop()
    elsewhere.stop()
    for publisher in (on_leader, elsewhere):
        assert not publisher.dropped.is_set(), publisher.disconnect
        # a publish the shard could not take was refused with a retryable reason, if at all
        codes = {code for code, _reason, _topic in publisher.refused}
        assert codes <= {0x80, 0x97}, publisher.refused[:5]
        print(f"{publisher.name}: {publisher.count()} acknowledged, "
              f"{publisher.refusals()} refused {sorted(codes)}")
    _all_stored(new_leader, on_leader, elsewhere)
    wait_for(lambda: _identical([new_leader, full, first if new_leader is second else second]),
             timeout=90, interval=0.2)


@pytest.mark.timeout(400)
def test_a_leader_under_the_disk_alarm_keeps_the_shard_and_refuses_with_the_quota_error(
        tmpfs_cluster: Callable[..., dict[str, ClusterNodeProcess]]) -> None:
    nodes = tmpfs_cluster(ALARM)
    placed = wait_for(lambda: _fully_in_sync(nodes["n1"]), timeout=60, interval=0.1)
    full = nodes[placed["leader"]]
    followers = [nodes[name] for name in placed["replicas"] if name != full.node_id]
    topics = topics_of(full.status(), STREAM, f"{STREAM}/a")
    publisher = ContinuousPublisher(full.mqtt_port, "leader-alarm-writer", topics,
                                    ack_timeout_s=60)
    wait_for(lambda: publisher.count() >= 100, timeout=60)

    _fill(full.data_dir, ALARM // 2)
    # refused with the quota error (the alarm is checked every second), acknowledging nothing
    wait_for(lambda: any(code == 0x97 for code, _reason, _topic in list(publisher.refused)),
             timeout=30, interval=0.05)
    refused_at, acknowledged_at = publisher.refusals(), publisher.count()
    wait_for(lambda: publisher.refusals() >= refused_at + 50, timeout=30)
    assert publisher.count() == acknowledged_at
    shown = _shard(full)
    assert shown is not None and shown["leader"] == full.node_id
    assert shown["leader_epoch"] == placed["leader_epoch"]

    _resize(full.data_dir, ROOMY)  # the alarm clears: acknowledged again, by the same leader
    wait_for(lambda: publisher.count() >= acknowledged_at + 100, timeout=30)
    publisher.stop()
    assert not publisher.dropped.is_set(), publisher.disconnect
    codes = {code for code, _reason, _topic in publisher.refused}
    assert codes <= {0x80, 0x97}, publisher.refused[:5]
    print(f"{publisher.count()} acknowledged, {publisher.refusals()} refused {sorted(codes)}")
    assert (_shard(full) or {}).get("leader") == full.node_id
    _all_stored(full, publisher)
    wait_for(lambda: _identical([full, *followers]), timeout=90, interval=0.2)
