"""The replica protocol on the peer links: three in-process nodes, each with its real data
plane (the cluster port, authenticated links on loopback) and a `ReplicaManager` whose
`ReplicaService` sends its followers' requests on those links and answers the peers' there.
A publish is acknowledged once the in-sync replicas hold it, the followers end byte-identical
to the leader, a follower whose link breaks mid-fetch asks again on the next connection, and a
request naming another replica than the node it came from is refused."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from shardgate.core.broker import Broker
from shardgate.proto import cluster_pb2 as pb
from shardgate.storage.journal import JournalStorage

from shardgate.cluster.data_plane import DataPlane
from shardgate.cluster.link_auth import NodeCredentials
from shardgate.cluster.membership import NodeInfo, ShardAssignment, StaticClusterView
from shardgate.cluster.peer_link import PeerLink
from shardgate.cluster.replica_epochs import FetchRequest
from shardgate.cluster.replica_manager import ReplicaManager
from shardgate.cluster.replica_rpc import ReplicaService

NODES = ("a", "b", "c")
KEY = ("s", 0)
SECRET = b"a cluster secret of the test"


class Node:
    def __init__(self, name: str, directory: Path) -> None:
        self.name = name
        self.view = StaticClusterView(name, node_infos={}, assignments={})
        self.credentials = NodeCredentials(name, f"{name}-instance", SECRET)
        self.journal = JournalStorage(directory)
        self.broker = Broker(storage=self.journal)
        links: dict[str, PeerLink] = {}  # the plane's, which the replica requests travel on
        self.service = ReplicaService(self.view, lambda s, i: self.manager.leading(s, i),
                                      self.credentials, fetch_wait_s=0.2, links=links)
        self.plane = DataPlane(self.broker, self.view, credentials=self.credentials,
                               replicas=self.service, links=links)
        self.manager = ReplicaManager(name, self.view, self.journal, self.service.transport,
                                      min_insync=lambda _s: 2, tick_s=0.05)

    def publish(self, payload: bytes) -> asyncio.Future[None] | None:
        shard_log = self.manager.shard_log(*KEY)
        shard_log.append([(int(time.time() * 1000), payload)])
        return shard_log.commit_waiter()

    def segments(self) -> bytes:
        shard_dir = self.journal.shard_directory(*KEY)
        return b"".join(path.read_bytes() for path in sorted(shard_dir.glob("*.log")))

    def records(self) -> list[bytes]:
        return [bytes(r.data) for r in self.journal.open_shard(*KEY).read(0, 100_000)]


async def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@pytest.fixture
async def nodes(tmp_path: Path) -> AsyncIterator[dict[str, Node]]:
    made = {name: Node(name, tmp_path / name) for name in NODES}
    for node in made.values():
        await node.plane.start()
    infos = {name: NodeInfo(name, f"127.0.0.1:{node.plane.port}", f"{name}-instance")
             for name, node in made.items()}
    assignment = ShardAssignment("s", 0, "a", 1, NODES, NODES)
    for node in made.values():
        node.view.node_infos = dict(infos)
        node.view.assignments = {KEY: assignment}
        node.view.changed()
        node.manager.start()
        node.manager.watch(*KEY)
    await wait_for(lambda: all(link.connected for node in made.values()
                               for link in node.plane.links.values()))
    yield made
    for node in made.values():
        await node.manager.close()
        await node.service.close()
        await node.plane.stop()
        node.journal.close()


async def test_followers_fetch_on_the_links_and_end_byte_identical_to_the_leader(nodes) -> None:
    leader = nodes["a"]
    await wait_for(lambda: leader.manager.leading(*KEY) is not None)
    futures = [leader.publish(f"m{i}".encode() * 50) for i in range(300)]
    await asyncio.wait_for(asyncio.gather(*[f for f in futures if f is not None]), 60)
    expected = [f"m{i}".encode() * 50 for i in range(300)]
    for name in ("b", "c"):
        await wait_for(lambda name=name: nodes[name].records() == expected)  # type: ignore[misc]
    await asyncio.gather(*(node.journal.flush() for node in nodes.values()))
    assert nodes["b"].segments() == nodes["c"].segments() == leader.segments()
    # every fetch went on the links: no gRPC channel was ever opened
    assert not any(node.service._channels for node in nodes.values())


async def test_a_fetch_whose_link_breaks_is_asked_again_and_replication_goes_on(nodes) -> None:
    leader = nodes["a"]
    await wait_for(lambda: leader.manager.leading(*KEY) is not None)
    first = leader.publish(b"before")
    assert first is not None
    await asyncio.wait_for(first, 30)
    # b's fetch is parked at the leader now: break b's link to it under that fetch
    link = nodes["b"].plane.links["a"]
    await wait_for(lambda: bool(link._replica_waiting))
    connection = link._connection
    assert connection is not None
    connection.close()
    await wait_for(lambda: link._connection is not connection and link.connected)
    after = leader.publish(b"after")
    assert after is not None
    await asyncio.wait_for(after, 30)
    await wait_for(lambda: nodes["b"].records() == [b"before", b"after"])


async def test_a_request_naming_another_replica_is_refused(nodes) -> None:
    leader = nodes["a"]
    await wait_for(lambda: leader.manager.leading(*KEY) is not None)
    link = nodes["b"].plane.links["a"]
    # b asks as if it were c (which follows the shard too): refused, nothing served
    asked = pb.ReplicaRequest(id=10**9, stream="s", shard=0, replica="c", leader_epoch=1,
                              fetch_offset=0, durable_end=0)
    answer = await asyncio.wait_for(link.replica_call(asked), 10)
    assert answer.id == asked.id
    assert answer.error == "unknown_replica"
    assert not answer.records


async def test_a_request_without_a_link_fails_at_once_as_a_connection_error(nodes) -> None:
    service = nodes["b"].service
    transport = service.transport(*KEY)
    link = nodes["b"].plane.links.pop("a")
    try:
        with pytest.raises(ConnectionError):
            await transport.fetch("a", FetchRequest("b", 1, 0, 0))
    finally:
        nodes["b"].plane.links["a"] = link


class FailingOnce:
    """A shard's transport whose first fetch fails with an error no follower expects."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.failed = False

    async def epoch_end(self, leader: str, request: object) -> object:
        return await self.inner.epoch_end(leader, request)  # type: ignore[attr-defined]

    async def fetch(self, leader: str, request: object) -> object:
        if not self.failed:
            self.failed = True
            raise RuntimeError("an answer this follower cannot use")
        return await self.inner.fetch(leader, request)  # type: ignore[attr-defined]


@pytest.fixture
def failing_once(monkeypatch: pytest.MonkeyPatch) -> list[FailingOnce]:
    made: list[FailingOnce] = []
    transport = ReplicaService.transport

    def failing(self: ReplicaService, stream: str, shard: int) -> FailingOnce:
        made.append(FailingOnce(transport(self, stream, shard)))
        return made[-1]

    monkeypatch.setattr(ReplicaService, "transport", failing)
    return made


async def test_a_follower_whose_fetch_fails_unexpectedly_follows_on(failing_once, nodes) -> None:
    """An error the follower does not expect (not the disk's, not the link's) is logged and
    fetched past: the follower goes on, and the publishes waiting for it are acknowledged."""
    leader = nodes["a"]
    await wait_for(lambda: leader.manager.leading(*KEY) is not None)
    futures = [leader.publish(f"m{i}".encode()) for i in range(20)]
    await asyncio.wait_for(asyncio.gather(*[f for f in futures if f is not None]), 30)
    expected = [f"m{i}".encode() for i in range(20)]
    for name in ("b", "c"):
        await wait_for(lambda name=name: nodes[name].records() == expected)  # type: ignore[misc]
    assert any(transport.failed for transport in failing_once)
