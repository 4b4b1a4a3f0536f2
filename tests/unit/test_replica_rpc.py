"""The replica protocol over real gRPC on loopback: each node's `ReplicaService` served by a
grpc.aio server behind the cluster port's `CallAuthenticator`, each node's `ReplicaManager`
fetching through it from its leader. A publish is acknowledged once the in-sync replicas hold
it, the followers' journals end byte-identical to the leader's, a follower restarted with an
empty data directory catches up, and a node without the cluster secret fetches nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
from shardgate.storage.journal import JournalStorage

from shardgate.cluster.link_auth import CallAuthenticator, NodeCredentials
from shardgate.cluster.membership import NodeInfo, ShardAssignment, StaticClusterView
from shardgate.cluster.replica_manager import ReplicaManager
from shardgate.cluster.replica_rpc import ReplicaService

NODES = ("a", "b", "c")
KEY = ("s", 0)
SECRET = b"a cluster secret of the test"
# how long a restarted node waits for its earlier port to be free again
PORT_WAIT_S = 10.0


class Node:
    def __init__(self, name: str, directory: Path, nodes: dict[str, NodeInfo],
                 assignments: dict[tuple[str, int], ShardAssignment], secret: bytes) -> None:
        self.name = name
        self.directory = directory
        self.view = StaticClusterView(name, node_infos=nodes, assignments=assignments)
        self.credentials = NodeCredentials(name, f"{name}-instance", secret)
        self.journal = JournalStorage(directory)
        self.service = ReplicaService(self.view, lambda s, i: self.manager.leading(s, i),
                                      self.credentials, fetch_wait_s=0.1)
        self.manager = ReplicaManager(name, self.view, self.journal, self.service.transport,
                                      min_insync=lambda _s: 2, tick_s=0.05)
        self.server: grpc.aio.Server | None = None

    async def start(self, port: int = 0) -> int:
        """Serve on `port` (0: a free one). A node restarted on its earlier port may find it
        still held for a moment by the stopped server's socket (grpc closes it after `stop`
        returns): the bind is tried again until it is free (at most `PORT_WAIT_S`)."""
        deadline = time.monotonic() + PORT_WAIT_S
        while True:
            server = grpc.aio.server(interceptors=[
                CallAuthenticator(self.credentials, lambda node, instance: instance == f"{node}-instance")])
            server.add_generic_rpc_handlers((self.service.handler(),))
            try:
                bound = server.add_insecure_port(f"127.0.0.1:{port}")
                break
            except RuntimeError:  # "Failed to bind": the port is in use
                await server.stop(grace=None)
                if port == 0 or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        port = bound
        await server.start()
        self.server = server
        self.manager.start()
        self.manager.watch(*KEY)
        return port

    async def stop(self) -> None:
        await self.manager.close()
        await self.service.close()
        if self.server is not None:
            await self.server.stop(grace=None)
        self.journal.close()

    def publish(self, payload: bytes) -> asyncio.Future[None] | None:
        shard_log = self.manager.shard_log(*KEY)
        shard_log.append([(int(time.time() * 1000), payload)])
        return shard_log.commit_waiter()

    def segments(self) -> bytes:
        """The shard's journal data as bytes, every segment in order."""
        shard_dir = self.journal.shard_directory(*KEY)
        return b"".join(path.read_bytes() for path in sorted(shard_dir.glob("*.log")))

    def records(self) -> list[bytes]:
        return [bytes(r.data) for r in self.journal.open_shard(*KEY).read(0, 100_000)]


class Cluster:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.infos: dict[str, NodeInfo] = {}
        self.assignments: dict[tuple[str, int], ShardAssignment] = {}
        self.nodes: dict[str, Node] = {}

    async def start(self, name: str, secret: bytes = SECRET, directory: str | None = None) -> Node:
        node = Node(name, self.tmp_path / (directory or name), self.infos, self.assignments, secret)
        previous = self.infos.get(name)
        port = await node.start(int(previous.cluster_address.rsplit(":", 1)[1]) if previous else 0)
        self.infos[name] = NodeInfo(name, f"127.0.0.1:{port}", f"{name}-instance")
        self.nodes[name] = node
        return node

    async def stop(self, name: str) -> None:
        await self.nodes.pop(name).stop()

    def place(self, leader: str, epoch: int, isr: tuple[str, ...]) -> None:
        self.assignments[KEY] = ShardAssignment("s", 0, leader, epoch, NODES, isr)
        for node in self.nodes.values():
            node.view.changed()


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    made = Cluster(tmp_path)
    yield made
    for name in list(made.nodes):
        await made.stop(name)


def described(cluster: Cluster) -> str:
    """Each node's side of the shard: what the leader knows of its followers (in sync, how
    far each holds the log durably) and each follower's task, for a wait that timed out."""
    lines = []
    for name, node in cluster.nodes.items():
        entry = node.manager._shards.get(KEY)
        if entry is None:
            lines.append(f"{name}: no shard")
            continue
        leader = entry.log.leader
        task = entry.follower_task
        ended = (None if task is None or not task.done()
                 else "cancelled" if task.cancelled() else repr(task.exception()))
        line = (f"{name}: role {entry.role}, wanted {entry.wanted}, changing {entry.changing}, "
                f"log end {entry.log.log.next_offset}, committed {entry.log.log.committed_offset}, "
                f"follower task {'none' if task is None else 'ended: ' + str(ended) if ended else 'running'}")
        if leader is not None:
            followers = {replica: leader.follower(replica).durable_end
                         for replica in NODES if replica != name}
            line += (f"; leads epoch {leader.epoch}: in sync {sorted(leader.isr)}, high watermark "
                     f"{leader.high_watermark}, durable end {leader.durable_end}, fenced "
                     f"{leader.fenced}, followers' durable ends {followers}, proposal "
                     f"{leader.pending_proposal}")
        lines.append(line)
    return "\n".join(lines)


async def acknowledged(cluster: Cluster, futures: list[asyncio.Future[None] | None],
                       timeout: float = 60.0) -> None:
    """Wait until every publish is acknowledged; on a timeout, say where each node stands."""
    waiting = [future for future in futures if future is not None]
    if not waiting:
        return
    done, _pending = await asyncio.wait(waiting, timeout=timeout)
    if len(done) < len(waiting):
        raise AssertionError(f"{len(waiting) - len(done)} of {len(waiting)} publishes not "
                             f"acknowledged in {timeout:g} s:\n{described(cluster)}")
    for future in done:
        future.result()


async def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_followers_fetch_over_grpc_and_end_byte_identical_to_the_leader(
    cluster: Cluster,
) -> None:
    for name in NODES:
        await cluster.start(name)
    cluster.place("a", 1, NODES)
    leader = cluster.nodes["a"]
    await wait_for(lambda: leader.manager.leading(*KEY) is not None)
    futures = [leader.publish(f"m{i}".encode() * 50) for i in range(300)]
    await acknowledged(cluster, futures)
    expected = [f"m{i}".encode() * 50 for i in range(300)]
    for name in ("b", "c"):
        await wait_for(lambda name=name: cluster.nodes[name].records() == expected)  # type: ignore[misc]
    await asyncio.gather(*(node.journal.flush() for node in cluster.nodes.values()))
    assert cluster.nodes["b"].segments() == cluster.nodes["c"].segments() == leader.segments()


async def refuse_proposals_naming(cluster: Cluster, leader: str, stopped: str) -> None:
    """What the controller does with a proposal to take a stopped node back into the in-sync
    set: refuse it (`proposal_failed`), until cancelled."""
    while True:
        log = cluster.nodes[leader].manager.leading(*KEY)
        state = log.leader if log is not None else None
        proposal = state.pending_proposal if state is not None else None
        if state is not None and proposal is not None and stopped in proposal.isr:
            state.proposal_failed()
        await asyncio.sleep(0.02)


async def test_a_follower_restarted_with_an_empty_data_dir_catches_up(cluster: Cluster) -> None:
    for name in NODES:
        await cluster.start(name)
    cluster.place("a", 1, NODES)
    leader = cluster.nodes["a"]
    await wait_for(lambda: leader.manager.leading(*KEY) is not None)
    first = [leader.publish(f"x{i}".encode()) for i in range(100)]
    await acknowledged(cluster, first)
    await cluster.stop("c")
    cluster.place("a", 1, ("a", "b"))  # the controller took c out of the in-sync set
    # c's last fetch may reach the leader only now, showing c caught up: the leader then
    # proposes it back into the in-sync set, and counts it until the controller answers. The
    # controller refuses a node that is down; this test has none, so it answers so itself.
    refusing = asyncio.create_task(refuse_proposals_naming(cluster, "a", "c"))
    more = [leader.publish(f"y{i}".encode()) for i in range(100)]
    try:
        await acknowledged(cluster, more)
    finally:
        refusing.cancel()
    await cluster.start("c", directory="c-empty")
    cluster.place("a", 1, ("a", "b"))
    await wait_for(lambda: cluster.nodes["c"].records() == leader.records())
    await asyncio.gather(*(node.journal.flush() for node in cluster.nodes.values()))
    assert cluster.nodes["c"].segments() == leader.segments()


async def test_without_the_cluster_secret_a_follower_gets_nothing_and_nothing_is_acknowledged(
    cluster: Cluster,
) -> None:
    await cluster.start("a")
    await cluster.start("b", secret=b"another secret")
    cluster.place("a", 1, ("a", "b"))
    leader = cluster.nodes["a"]
    await wait_for(lambda: leader.manager.leading(*KEY) is not None)
    future = leader.publish(b"secret")
    assert future is not None
    await asyncio.sleep(1.0)  # fetches are refused (UNAUTHENTICATED) meanwhile
    assert not future.done()  # b is in sync and does not hold it: no acknowledgement
    assert cluster.nodes["b"].records() == []
