"""Fixtures for cluster tests: a real etcd (Debian's etcd-server) on ephemeral loopback ports in
a temporary directory, and `shardgate serve --cluster` processes with every listener on an
ephemeral port. Tests import the fixtures by name (tests/e2e/conftest.py makes them available).

`cluster(3)` starts three nodes (n1, n2, n3) and waits until all are registered and every
shard is placed; `node.status()` is the node's `/api/cluster`. Tests skip when etcd is absent.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import shutil
import signal
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    BrokerProcess,
    ThreadedBroker,
    free_port,
    make_config,
    track_process,
    wait_for,
)

ETCD = shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)
# Every fixture node proves this cluster secret to the others (`[cluster] secret`).
CLUSTER_SECRET = "test-cluster-secret-7f3a9c2e5b1d"


class EtcdServer:
    """One etcd member on loopback: `start()`, `stop()` (SIGTERM), `kill()`, `start()` again
    (same data directory and ports, as an etcd restart)."""

    def __init__(self, directory: Path, tls: tuple[Path, Path] | None = None,
                 host: str = "127.0.0.1") -> None:
        self.directory = directory
        # (certificate, key): clients must use https:// and trust the certificate
        self.tls = tls
        self.host = host  # the address clients reach it at
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = directory / "etcd.log"

    @property
    def url(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{self.host}:{self.client_port}"

    def start(self) -> EtcdServer:
        assert ETCD is not None
        self.directory.mkdir(parents=True, exist_ok=True)
        peer = f"http://127.0.0.1:{self.peer_port}"
        args = [
            ETCD, "--name", "test", "--data-dir", str(self.directory / "data"),
            "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"test={peer}", "--initial-cluster-state", "new",
            "--heartbeat-interval", "50", "--election-timeout", "500",
        ]
        if self.tls is not None:
            args += ["--cert-file", str(self.tls[0]), "--key-file", str(self.tls[1])]
        log_file = open(self.log_path, "ab")  # noqa: SIM115
        self.proc = track_process(subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT))
        log_file.close()
        wait_for(self.healthy, timeout=20, interval=0.05)
        return self

    def keys(self, containing: str = "") -> list[str]:
        """Every key in etcd (all Shardgate's start with "/") that contains `containing`. A
        connection etcd refuses at once (UNAVAILABLE: seen on a loaded machine) is tried again
        for up to 10 s, as the nodes' own clients do, rather than failing the caller's wait."""
        import asyncio

        from shardgate.cluster.etcd import EtcdClient, EtcdUnavailable

        async def read() -> list[str]:
            deadline = time.monotonic() + 10
            while True:
                client = EtcdClient([self.url])
                try:
                    kvs, _revision = await client.get_prefix("/")
                    return [kv.key for kv in kvs if containing in kv.key]
                except EtcdUnavailable:
                    if time.monotonic() > deadline:
                        raise
                finally:
                    await client.close()
                await asyncio.sleep(0.1)  # poll interval of the retry, as wait_for's

        return asyncio.run(read())

    def healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"etcd exited:\n{self.log_path.read_text()[-3000:]}")
        try:
            context = ssl.create_default_context(cafile=str(self.tls[0])) if self.tls else None
            with urllib.request.urlopen(f"{self.url}/health", timeout=1, context=context) as response:
                return json.loads(response.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


class ClusterNodeProcess(BrokerProcess):
    """`shardgate serve --cluster URL --node-id ID --cluster-port 0` as a subprocess."""

    def __init__(self, data_dir: Path, node_id: str, etcd_url: str, *,
                 lease_ttl_s: int = 3, cluster_name: str = "test", extra_config: str = "",
                 extra_args: list[str] | None = None) -> None:
        config = data_dir.parent / f"{data_dir.name}.toml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(
            f'[cluster]\nname = "{cluster_name}"\nlease_ttl_s = {lease_ttl_s}\n'
            f'secret = "{CLUSTER_SECRET}"\n'
            f"connect_timeout_s = 5\nleave_timeout_s = 10\n\n{extra_config}"
            # a cluster refuses an archive in each node's data directory unless told so: the
            # tests that look at the archive give their nodes one shared URL
            + ("" if "[archive]" in extra_config else "\n[archive]\nper_node = true\n"))
        super().__init__(
            data_dir,
            ["--cluster", etcd_url, "--node-id", node_id, "--cluster-port", "0",
             "--http-port", str(free_port()), "--grpc-port", str(free_port()), *(extra_args or [])],
            config_file=config,
        )
        self.node_id = node_id

    # Listeners whose port is picked by free_port() (0 would turn them off).
    PICKED_PORTS = ("--http-port", "--grpc-port", "--amqp-port")

    def start(self, mqtt_port: int | None = None) -> ClusterNodeProcess:
        """Start the node. Another process may take a port picked for it before the node binds
        it (the loaded machine runs many tests): then the ports are picked again, three times
        at most."""
        for attempt in range(3):
            try:
                super().start(mqtt_port)
                return self
            except AssertionError as exc:
                if "already in use" not in str(exc).rsplit("shardgate started", 1)[-1] or attempt == 2:
                    raise
            args = self.extra_args
            for index, arg in enumerate(args[:-1]):
                if arg in self.PICKED_PORTS and args[index + 1] != "0":
                    args[index + 1] = str(free_port())
        return self

    def status(self) -> dict[str, Any]:
        """This node's `/api/cluster`."""
        return json.loads(self.http_get("/api/cluster"))

    def http_get(self, path: str) -> bytes:
        """The body of GET `path` from this node's admin API (OSError if it fails)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ports['http']}{path}",
                                    timeout=5) as response:
            return response.read()

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def settled(node: ClusterNodeProcess, nodes: set[str]) -> dict[str, Any] | None:
    """The node's status once it sees exactly `nodes`, a controller, and every live-owned
    shard placed; else None (for `wait_for`)."""
    try:
        status = node.status()
    except (OSError, urllib.error.URLError):
        return None
    seen = {entry["node_id"] for entry in status["nodes"]}
    if seen != nodes or status["controller"] not in nodes:
        return None
    if any(entry["leaving"] for entry in status["nodes"]) or len(status["placement"]) < status["streams"]:
        return None
    return status


def linked(node: ClusterNodeProcess) -> set[str]:
    """The peers `node`'s links are up to (its metrics)."""
    try:
        text = node.http_get("/metrics").decode()
    except (OSError, urllib.error.URLError):
        return set()
    return set(re.findall(r'^shardgate_cluster_link_up\{[^}]*peer="([^"]+)"[^}]*\} 1', text, re.M))


def start_together(nodes: list[ClusterNodeProcess]) -> None:
    """Start `nodes`: the first alone, so that it registers first (the controller of a new
    cluster, as when they start one after another), then the others at once. A start is mostly
    the interpreter's and the broker's imports, which run on every core this way. Raises the
    first failure once every start has ended (the caller kills the nodes that did start)."""
    if not nodes:
        return
    nodes[0].start()
    if len(nodes) > 1:
        with ThreadPoolExecutor(len(nodes) - 1) as pool:
            for future in [pool.submit(node.start) for node in nodes[1:]]:
                future.result()


@contextlib.contextmanager
def running_etcd(directory: Path) -> Iterator[EtcdServer]:
    """An etcd in `directory` for the block's body (the test skips when etcd is absent)."""
    if ETCD is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    server = EtcdServer(directory).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    with running_etcd(tmp_path / "etcd") as server:
        yield server


@pytest.fixture(scope="module")
def module_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd for the tests of a module that share a cluster (see `shared_cluster`)."""
    with running_etcd(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture
def cluster(tmp_path: Path, etcd: EtcdServer) -> Iterator[Callable[..., list[ClusterNodeProcess]]]:
    started: list[ClusterNodeProcess] = []

    def start(count: int, *, lease_ttl_s: int = 3, first: int = 1,
              extra_config: str = "") -> list[ClusterNodeProcess]:
        nodes = [ClusterNodeProcess(tmp_path / f"n{index}", f"n{index}", etcd.url,
                                    lease_ttl_s=lease_ttl_s, extra_config=extra_config)
                 for index in range(first, first + count)]
        started.extend(nodes)
        start_together(nodes)
        everyone = {n.node_id for n in started if n.alive()}
        for node in nodes:
            wait_for(lambda node=node: settled(node, everyone), timeout=30, interval=0.05)
        # and linked: a node forwards to a peer only once its link to it is up
        for node in (n for n in started if n.alive()):
            wait_for(lambda node=node: linked(node) >= everyone - {node.node_id},
                     timeout=30, interval=0.05)
        return nodes

    yield start
    for node in started:
        if node.alive():
            node.kill()


# ---------------------------------------------------------------- fault tests (additive)

class ProtocolNode(ClusterNodeProcess):
    """A cluster node with its AMQP and gRPC listeners on too (ports kept on restart). A port
    picked free here can be taken by another process before the node binds it (the machine is
    shared): `start()` then picks new listener ports and starts again."""

    def start(self, mqtt_port: int | None = None) -> ProtocolNode:
        for attempt in range(3):
            try:
                super().start(mqtt_port)
                return self
            except AssertionError as exc:
                if "already in use" not in str(exc) or attempt == 2:
                    raise
                for index, arg in enumerate(self.extra_args[:-1]):
                    if arg in ("--http-port", "--grpc-port", "--amqp-port"):
                        self.extra_args[index + 1] = str(free_port())
                if "mqtt" in self.ports:
                    del self.ports["mqtt"]
        raise AssertionError("unreachable")


def protocol_node(directory: Path, node_id: str, etcd_url: str, extra_config: str = "",
                  lease_ttl_s: int = 3) -> ProtocolNode:
    """A cluster node with its AMQP and gRPC listeners on too (fixed ports, kept on restart)."""
    return ProtocolNode(
        directory / node_id, node_id, etcd_url, lease_ttl_s=lease_ttl_s, extra_config=extra_config,
        extra_args=["--amqp-port", str(free_port()), "--grpc-port", str(free_port())],
    )


def replicas_caught_up(status: dict[str, Any], live: set[str]) -> bool:
    """In `status` (a node's `/api/cluster`), every replicated shard is led by a live node, has
    as many replicas on live nodes as its stream wants (as far as the live nodes that are not
    draining allow), and each of those placed replicas is in the in-sync set. Counting the
    placement's replicas matters: a cluster that has just started places its new replicas out
    of sync (`adding`), and a shard placed while only one node was up is in sync with one
    replica until the others are added."""
    capacity = len(live - set(status.get("draining", {})))
    for shard in status["replicated_shards"].values():
        placed = [replica for replica in shard["replicas"] if replica in live]
        if (shard["leader"] not in live or not set(placed) <= set(shard["isr"])
                or len(placed) < min(shard["wanted_replicas"], capacity)):
            return False
    return True


def wait_settled(nodes: list[ClusterNodeProcess], timeout: float = 30) -> None:
    """Every live node sees exactly the live nodes, a controller, every shard placed, can prove
    its own lease alive, has its links up to every other live node, and sees every replicated
    shard's replicas on live nodes in sync (`replicas_caught_up`), all in one round of checks.
    (A node resumed after a freeze past its lease still looks settled to its peers and
    answers their links until etcd ends its lease and it registers again: the peers then drop
    it for a moment. Its `lease_alive` is False meanwhile; checking every node again after
    that one turns True sees the peers once they took it back.) Without the replicas' wait, a
    test that stops a node just after a start could leave a shard whose other replicas were
    still catching up below `min_insync_replicas`, and its publishes refused."""
    live = [node for node in nodes if node.alive()]
    everyone = {node.node_id for node in live}

    def node_settled(node: ClusterNodeProcess) -> bool:
        status = settled(node, everyone)
        return (status is not None and status["lease_alive"]
                and replicas_caught_up(status, everyone)
                and linked(node) >= everyone - {node.node_id})

    try:
        wait_for(lambda: all(node_settled(node) for node in live), timeout=timeout * len(live),
                 interval=0.05)
    except AssertionError:
        raise AssertionError(f"nodes not settled within {timeout * len(live)}s: "
                             + "; ".join(unsettled(node, everyone) for node in live)) from None


def unsettled(node: ClusterNodeProcess, everyone: set[str]) -> str:
    """What `wait_settled` still waits for on `node`, for the failure's message."""
    try:
        status = node.status()
    except (OSError, urllib.error.URLError) as exc:
        return f"{node.node_id}: no status ({exc})"
    waiting = []
    if settled(node, everyone) is None:
        waiting.append(f"sees {sorted(entry['node_id'] for entry in status['nodes'])}, "
                       f"controller {status['controller']}, "
                       f"{len(status['placement'])} of {status['streams']} streams placed")
    if not status["lease_alive"]:
        waiting.append("lease not proven alive")
    if not replicas_caught_up(status, everyone):
        waiting.append("replicas: " + ", ".join(
            f"{key} leader {shard['leader']} replicas {shard['replicas']} isr {shard['isr']}"
            for key, shard in status["replicated_shards"].items()))
    links = linked(node)
    if not links >= everyone - {node.node_id}:
        waiting.append(f"links up to {sorted(links)}")
    return f"{node.node_id}: " + (", ".join(waiting) or "settled")


def topics_of(status: dict[str, Any], stream: str, prefix: str, owner: str | None = None,
              per_shard: int = 1) -> list[str]:
    """Topics `prefix/<i>` that land on the shards of `stream` (crc32 of the topic, as
    `Stream.shard_for` places them), `per_shard` of each, only shards `owner` owns if given."""
    placement = status["placement"][stream]
    wanted = {shard: per_shard for shard, (node, _epoch) in enumerate(placement)
              if owner is None or node == owner}
    found: list[str] = []
    for index in range(100_000):
        if not any(wanted.values()):
            return found
        topic = f"{prefix}/{index}"
        shard = zlib.crc32(topic.encode()) % len(placement)
        if wanted.get(shard):
            wanted[shard] -= 1
            found.append(topic)
    raise AssertionError(f"no topics for every shard of {stream}")


class ContinuousPublisher:
    """A raw MQTT 5 client publishing QoS 1 in a thread, one message at a time, round robin
    over `topics`, each payload unique (`<name>-<seq>`). It keeps what each PUBACK said:
    `acknowledged` (reason 0, with the topic), `refused` (reason code, reason string, topic).
    A publish whose PUBACK never came (the connection dropped) is neither; the publisher stops
    on a dropped connection (`dropped` is set)."""

    def __init__(self, port: int, name: str, topics: list[str], *, pause_s: float = 0.0,
                 ack_timeout_s: float = 30.0, host: str = "127.0.0.1") -> None:
        from tests.mqtt_clients import RawClient  # (tests.mqtt_clients imports paho)
        self.name = name
        self.topics = list(topics)
        self.pause_s = pause_s
        self.ack_timeout_s = ack_timeout_s
        self.acknowledged: dict[str, str] = {}  # payload -> topic
        self.refused: list[tuple[int, str, str]] = []
        self.unanswered: list[str] = []
        self.dropped = threading.Event()
        self.disconnect: Any = None  # the server's DISCONNECT, when it sent one
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.client = RawClient(port, version=5, host=host)
        self.client.connect(name)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from shardgate.protocols.mqtt import packets as p
        sequence = 0
        try:
            while not self._stop.is_set():
                topic = self.topics[sequence % len(self.topics)]
                payload = f"{self.name}-{sequence}"
                sequence += 1
                try:
                    self.client.send(p.Publish(topic, payload.encode(), 1,
                                               packet_id=sequence % 65535 + 1))
                    puback = self.client.receive(self.ack_timeout_s)
                except OSError:
                    puback = None
                if puback is None or isinstance(puback, p.Disconnect):
                    self.disconnect = puback
                    self.unanswered.append(payload)
                    self.dropped.set()
                    return
                assert isinstance(puback, p.Puback), puback
                with self._lock:
                    if puback.reason_code == 0:
                        self.acknowledged[payload] = topic
                    else:
                        self.refused.append((puback.reason_code,
                                             puback.properties.reason_string or "", topic))
                if self.pause_s:
                    time.sleep(self.pause_s)
        except BaseException as exc:  # noqa: BLE001  (reported by stop())
            self.error = exc

    def count(self) -> int:
        with self._lock:
            return len(self.acknowledged)

    def refusals(self) -> int:
        with self._lock:
            return len(self.refused)

    def latest_acknowledged(self, count: int) -> list[tuple[str, str]]:
        """The last `count` (payload, topic) acknowledged, taken while the publisher runs."""
        with self._lock:
            return list(self.acknowledged.items())[-count:]

    def stop(self) -> ContinuousPublisher:
        self._stop.set()
        self._thread.join(self.ack_timeout_s + 5)
        assert not self._thread.is_alive(), f"publisher {self.name} is stuck"
        with contextlib.suppress(OSError):
            self.client.close()
        if self.error is not None:
            raise AssertionError(f"publisher {self.name} failed: {self.error!r}") from self.error
        return self


_READS = itertools.count(1)


async def read_back(grpc_url: str, filters: list[str], expected: set[str],
                    timeout: float = 60, durable: bool = False) -> Counter[str]:
    """Every message under `filters` from the earliest offset, through the gRPC SDK on one
    node (shards owned elsewhere are read from their owners): the payloads and how often each
    came, once `expected` were all seen and then either every shard they came from was read
    to its end (the last offset the stream reports for it came, and a shard's messages come in
    offset order), or nothing more came within a few seconds (a shard whose last messages are
    under other topics), or after the timeout."""
    from shardgate.client import Client
    got: Counter[str] = Counter()
    last: dict[tuple[str, int], int] = {}  # (stream, shard) -> the highest offset received
    deadline = time.monotonic() + timeout
    async with Client(grpc_url) as client:
        consumer = client.consumer(f"read-back-{next(_READS)}", filters, position="earliest",
                                   durable=durable)
        await consumer.subscribe()
        ends: dict[tuple[str, int], int] | None = None  # the shards' last offsets, once asked
        while time.monotonic() < deadline:
            if expected <= set(got):
                if ends is None:
                    ends = await _last_offsets(client, {stream for stream, _ in last})
                if ends and all(last.get(shard, -1) >= end for shard, end in ends.items()):
                    break
            quiet = 3.0 if expected <= set(got) else max(0.1, deadline - time.monotonic())
            try:
                message = await consumer.receive(quiet)
            except TimeoutError:
                break
            got[message.text()] += 1
            shard = (message.stream, message.shard)
            last[shard] = max(last.get(shard, -1), message.offset)
            message.ack()
        await consumer.close()
    return got


async def _last_offsets(client: Any, streams: set[str]) -> dict[tuple[str, int], int]:
    """The last offset of each non-empty shard of `streams`, as their owners report it; {}
    (so: wait for a quiet spell instead) when an owner did not answer."""
    from shardgate.client import ShardgateError
    ends: dict[tuple[str, int], int] = {}
    for stream in streams:
        try:
            info = await client.admin.describe_stream(stream)
        except ShardgateError:
            return {}
        if info.unanswered:
            return {}
        for shard in info.shards:
            if shard.unavailable:
                return {}
            if shard.next_offset > 0:
                ends[(stream, shard.index)] = shard.next_offset - 1
    return ends


# ---------------------------------------------------------------- shared node sets (additive)

@contextlib.contextmanager
def settled_nodes(nodes: list[ClusterNodeProcess]) -> Iterator[list[ClusterNodeProcess]]:
    """Waits until the started `nodes` are settled and linked, gives them, and kills the live
    ones at the end, whatever happened: `with settled_nodes([...]) as nodes: yield nodes`."""
    try:
        wait_settled(nodes)
        yield nodes
    finally:
        for node in nodes:
            if node.alive():
                node.kill()


@contextlib.contextmanager
def shared_cluster(nodes: list[ClusterNodeProcess]) -> Iterator[list[ClusterNodeProcess]]:
    """Starts `nodes` (the first alone, then the others together), waits until they are
    settled and linked, gives them to the tests of a module (a module-scoped fixture: one
    start for every test that leaves the cluster as it found it), and kills them at the end.
    Those tests name their clients, topics, queues and subscriptions uniquely, and take the
    nodes through `ready_shared` so that a test never starts on a cluster an earlier one
    broke."""
    try:
        start_together(nodes)
        wait_settled(nodes)
        yield nodes
    finally:
        for node in nodes:
            if node.alive():
                node.kill()


def ready_shared(nodes: list[ClusterNodeProcess]) -> list[ClusterNodeProcess]:
    """`nodes` of a `shared_cluster`, once every one is alive, settled and linked (an earlier
    test of the module left them so, or this one fails at its start, saying so)."""
    dead = [node.node_id for node in nodes if not node.alive()]
    assert not dead, f"the module's shared cluster lost {dead} in an earlier test"
    wait_settled(nodes)
    return nodes


def amqp_node(directory: Path, node_id: str, etcd_url: str) -> ClusterNodeProcess:
    """A cluster node with its AMQP listener on too."""
    return ClusterNodeProcess(directory / node_id, node_id, etcd_url,
                              extra_args=["--amqp-port", str(free_port())])


def amqp_url(node: ClusterNodeProcess) -> str:
    return f"amqp://guest:guest@127.0.0.1:{node.ports['amqp']}/"


async def amqp_exchange_exists(url: str, name: str) -> bool:
    """Whether a passive declare of exchange `name` succeeds on the broker at `url`."""
    import aio_pika

    async with await aio_pika.connect(url) as connection:
        try:
            await (await connection.channel()).declare_exchange(name, passive=True)
            return True
        except aio_pika.exceptions.ChannelNotFoundEntity:
            return False


async def eventually(check: Callable[[], Any], timeout: float = 20) -> None:
    """Awaits `check()` every 50 ms until it is true; fails the test after `timeout` seconds."""
    import asyncio

    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def start_with_free_ports(data_dir: Path) -> ThreadedBroker:
    """An in-process broker (default stream of four journaled shards) with its AMQP and gRPC
    listeners on free ports, for data-plane tests with a fixed shard map. Another process may
    take a port between its pick and the bind (0 would turn the listener off): then again."""
    for attempt in range(3):
        config = make_config(
            data_dir, default_stream_partitions=4,
            listeners={"amqp_port": free_port(), "grpc_port": free_port()},
        )
        config.mqtt.sys_interval = 0
        server = ThreadedBroker(config)
        try:
            return server.start()
        except Exception as exc:
            with contextlib.suppress(Exception):
                server.stop()
            if "already in use" not in str(exc) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def wills_in_etcd(etcd: EtcdServer) -> dict[str, dict[str, Any]]:
    """Every will etcd keeps, by client id."""
    from shardgate.cluster.etcd import EtcdClient

    async def read() -> dict[str, dict[str, Any]]:
        client = EtcdClient([etcd.url])
        try:
            kvs, _revision = await client.get_prefix("/")
        finally:
            await client.close()
        return {kv.key.rsplit("/", 1)[1]: json.loads(kv.value) for kv in kvs if ".state/wills/" in kv.key}

    return asyncio.run(read())
