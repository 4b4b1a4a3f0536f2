"""A randomized fault run against a real cluster, with real clients, and a checker that no
acknowledged message was lost.

A one-member etcd and three nodes (`tests/e2e/cluster_fixtures.py`, the processes the cluster
tests start) serve a reliable stream `chaos` (6 shards, spread over the nodes). Real clients,
spread across the nodes, publish and consume while the run applies faults chosen by a seeded
random generator:

- publishers: two paho MQTT 5 clients (QoS 1, one publish in flight, each acknowledged one
  recorded on its PUBACK with a success reason), an aio-pika publisher with confirms (to
  `amq.topic`, recorded on the confirm's ack) and a gRPC SDK producer (recorded on the
  `Publish` answer);
- subscribers: two paho MQTT 5 persistent sessions (QoS 1 on `chaos/#`), an aio-pika consumer
  on a durable queue bound to `chaos.#`, and a gRPC SDK consumer of a durable subscription on
  `chaos/#`;
- faults: SIGKILL a node and start it again, SIGTERM a node and start it again, SIGSTOP a node
  for a few seconds then SIGCONT (a frozen node, sometimes past its lease), restart etcd, and a
  client told to reconnect to another node; with `--mixes` also faults at once (half the
  faults): two nodes SIGKILLed or SIGTERMed together, etcd down while a node starts again, a
  node frozen across an etcd restart. A client whose connection fails reconnects to the
  next node (a persistent session resumes there).

At the end every node is running and the cluster settled; the publishers stop, and the checker
waits until each subscriber has everything acknowledged (or a quiet timeout), then checks:

- no acknowledged message lost: every acknowledged publish reached every subscriber;
- duplicates only across a fault: a second delivery is excused only when a fault or a
  reconnect of that subscriber happened between the first delivery and it (at least once);
- order: for each subscriber, the first deliveries of each publisher's messages on each topic
  (one shard) come in publish order;
- no traceback in any node's log, no client stuck (each stops in time, each publisher made
  progress after the last fault).

`tests/e2e/test_cluster_chaos.py` runs a short fixed-seed run in CI; longer runs:

    python bench/cluster_chaos.py --seed 7 --minutes 5

prints the faults it applied, the counts and the findings, and exits 1 if a check failed.
`--faults etcd,term` draws only those single faults (to chase one kind). With
`--dump-on-hang`, a cluster that does not settle after a fault is examined before anything is
stopped: `hang/` in the work directory gets each node's thread stacks (`py-spy dump`, with
`--locals`), its `/api/cluster` status and its metrics, and etcd's keys; the run then ends as
HUNG (exit 2) instead of with the settle's traceback.
Uses the test fixtures' process classes (it needs the repository's `tests/` on the path).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.e2e.cluster_fixtures import (  # noqa: E402
    EtcdServer,
    ProtocolNode,
    protocol_node,
    wait_settled,
)

STREAM = "chaos"
PARTITIONS = 6
TOPICS = 4  # topics per publisher: chaos/<kind>/<name>/<k>


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


# ---------------------------------------------------------------- what the clients saw

@dataclass
class Delivery:
    payload: str
    at: float
    connection: int  # the subscriber's connection number when it came


@dataclass
class Journal:
    """What every client saw, written by the client threads (under `lock`)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    # publisher -> [(payload, topic)] in acknowledgement order
    acknowledged: dict[str, list[tuple[str, str]]] = field(default_factory=lambda: defaultdict(list))
    deliveries: dict[str, list[Delivery]] = field(default_factory=lambda: defaultdict(list))
    # (time, what) of each fault's start and each client's reconnect
    events: list[tuple[float, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    fault_times: list[float] = field(default_factory=list)

    def acked(self, publisher: str, payload: str, topic: str) -> None:
        with self.lock:
            self.acknowledged[publisher].append((payload, topic))

    def delivered(self, subscriber: str, payload: str, connection: int) -> None:
        with self.lock:
            self.deliveries[subscriber].append(Delivery(payload, time.monotonic(), connection))

    def event(self, what: str, fault: bool = False) -> None:
        with self.lock:
            self.events.append((time.monotonic(), what))
            if fault:
                self.fault_times.append(time.monotonic())

    def dump(self, path: Path) -> None:
        """Write what the clients saw as JSON (for looking into a finding)."""
        with self.lock:
            path.write_text(json.dumps({
                "acknowledged": self.acknowledged,
                "deliveries": {name: [[d.payload, round(d.at, 3), d.connection] for d in items]
                               for name, items in self.deliveries.items()},
                "events": [[round(at, 3), what] for at, what in self.events],
                "errors": self.errors,
            }))

    def error(self, what: str) -> None:
        with self.lock:
            self.errors.append(what)


class ClientThread:
    """A client running in its own thread against one node at a time; `move()` asks it to
    reconnect to the next node, `stop()` ends it (it must end in time: else it is stuck)."""

    def __init__(self, name: str, nodes: list[ProtocolNode], journal: Journal, start: int) -> None:
        self.name = name
        self.nodes = nodes
        self.journal = journal
        self.index = start % len(nodes)
        self.connection = 0
        self.progress = 0  # acknowledged publishes or deliveries
        self.stopping = threading.Event()
        self.moving = threading.Event()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)

    @property
    def node(self) -> ProtocolNode:
        return self.nodes[self.index]

    def next_node(self) -> None:
        self.index = (self.index + 1) % len(self.nodes)

    def start(self) -> ClientThread:
        self.thread.start()
        return self

    def move(self) -> None:
        self.moving.set()

    def stop(self, timeout: float = 30) -> bool:
        self.stopping.set()
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def _main(self) -> None:
        try:
            self.run()
        except BaseException as exc:  # noqa: BLE001  (reported by the checker)
            self.journal.error(f"{self.name} crashed: {exc!r}")

    def run(self) -> None:
        raise NotImplementedError

    def reconnected(self, why: str) -> None:
        self.connection += 1
        self.journal.event(f"{self.name} reconnects to {self.node.node_id} ({why})")


# ---------------------------------------------------------------- MQTT (paho 5)

def paho_client(client_id: str) -> Any:
    import paho.mqtt.client as mqtt
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                         protocol=mqtt.MQTTv5, reconnect_on_failure=False)
    return client


class MqttPublisher(ClientThread):
    """QoS 1, one publish in flight; acknowledged on a PUBACK with a success reason code."""

    def run(self) -> None:
        import paho.mqtt.client as mqtt
        sequence = 0
        while not self.stopping.is_set():
            client = paho_client(self.name)
            answers: dict[int, int] = {}
            answered = threading.Condition()
            closed = threading.Event()

            def on_publish(_c: Any, _u: Any, mid: int, reason: Any, _p: Any,
                           answers: dict[int, int] = answers, answered: threading.Condition = answered) -> None:
                with answered:
                    answers[mid] = int(getattr(reason, "value", reason))
                    answered.notify_all()

            def on_disconnect(*_args: Any, closed: threading.Event = closed,
                              answered: threading.Condition = answered) -> None:
                closed.set()
                with answered:
                    answered.notify_all()

            client.on_publish = on_publish
            client.on_disconnect = on_disconnect
            try:
                client.connect("127.0.0.1", self.node.mqtt_port, keepalive=10, clean_start=True)
            except OSError:
                self.next_node()
                time.sleep(0.2)
                continue
            client.loop_start()
            self.reconnected("connect")
            try:
                while not (self.stopping.is_set() or closed.is_set() or self.moving.is_set()):
                    topic = f"chaos/m/{self.name}/{sequence % TOPICS}"
                    payload = f"{self.name}:{sequence}"
                    sequence += 1
                    info = client.publish(topic, payload, qos=1)
                    deadline = time.monotonic() + 15
                    with answered:
                        while info.mid not in answers and not closed.is_set() and time.monotonic() < deadline:
                            answered.wait(0.2)
                        reason = answers.pop(info.mid, None)
                    if reason is None:
                        break  # no PUBACK: reconnect (elsewhere)
                    if reason < 0x80:
                        self.journal.acked(self.name, payload, topic)
                        self.progress += 1
                    else:
                        time.sleep(0.05)  # refused (retryable while a shard moves)
                    time.sleep(0.01)
            finally:
                self.moving.clear()
                with contextlib.suppress(Exception):
                    client.disconnect()
                client.loop_stop()
                if not self.stopping.is_set():
                    self.next_node()
        del mqtt


class MqttSubscriber(ClientThread):
    """A persistent session (clean start once, session expiry 1 h) subscribed QoS 1 to
    `chaos/#`; it resumes on the next node whenever its connection ends."""

    def run(self) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties
        first = True
        while not self.stopping.is_set():
            client = paho_client(self.name)
            connected = threading.Event()
            closed = threading.Event()
            refused: list[Any] = []
            connection = self.connection + 1

            def on_connect(_c: Any, _u: Any, flags: Any, reason: Any, _p: Any,
                           connected: threading.Event = connected, refused: list[Any] = refused,
                           resuming: bool = not first) -> None:
                if reason.is_failure:
                    refused.append(reason)
                elif resuming and not flags.session_present:
                    self.journal.error(f"{self.name}: its session was gone at a resume on "
                                       f"{self.node.node_id} (CONNACK session present 0)")
                connected.set()

            def on_message(_c: Any, _u: Any, message: Any, connection: int = connection) -> None:
                self.journal.delivered(self.name, message.payload.decode(), connection)
                self.progress += 1

            def on_disconnect(*_args: Any, closed: threading.Event = closed,
                              connected: threading.Event = connected) -> None:
                closed.set()
                connected.set()

            client.on_connect = on_connect
            client.on_message = on_message
            client.on_disconnect = on_disconnect
            properties = Properties(PacketTypes.CONNECT)
            properties.SessionExpiryInterval = 3600
            try:
                client.connect("127.0.0.1", self.node.mqtt_port, keepalive=10,
                               clean_start=first, properties=properties)
            except OSError:
                self.next_node()
                time.sleep(0.2)
                continue
            client.loop_start()
            try:
                if not connected.wait(15) or refused or closed.is_set():
                    continue
                self.reconnected("connect" if first else "resume")
                if first:
                    done = threading.Event()
                    client.on_subscribe = lambda *_a, done=done: done.set()
                    client.subscribe("chaos/#", qos=1)
                    if not done.wait(15):
                        continue
                    first = False
                while not (self.stopping.is_set() or closed.is_set() or self.moving.is_set()):
                    time.sleep(0.05)
            finally:
                self.moving.clear()
                with contextlib.suppress(Exception):
                    client.disconnect()
                client.loop_stop()
                if not self.stopping.is_set():
                    self.next_node()
        del mqtt


# ---------------------------------------------------------------- asyncio clients (AMQP, SDK)

class AsyncClientThread(ClientThread):
    """A client whose connection runs on its own asyncio loop; `session()` serves one node
    until its connection fails, the client is moved, or the run stops."""

    def run(self) -> None:
        asyncio.run(self._loop())

    async def _loop(self) -> None:
        while not self.stopping.is_set():
            try:
                await asyncio.wait_for(self.session(), timeout=None)
            except Exception as exc:  # noqa: BLE001  (a failed connection: go elsewhere)
                self.journal.event(f"{self.name} on {self.node.node_id}: {type(exc).__name__}")
                await asyncio.sleep(0.2)
            finally:
                self.moving.clear()
            if not self.stopping.is_set():
                self.next_node()

    async def session(self) -> None:
        raise NotImplementedError

    async def until_told(self) -> None:
        while not (self.stopping.is_set() or self.moving.is_set()):
            await asyncio.sleep(0.05)


def amqp_url(node: ProtocolNode) -> str:
    return f"amqp://guest:guest@127.0.0.1:{node.ports['amqp']}/"


class AmqpPublisher(AsyncClientThread):
    """aio-pika with publisher confirms, to `amq.topic` (`chaos.a.<name>.<k>`), one at a time.
    A nack (the shard's owner is down) is a refusal: the publisher goes on."""

    sequence = 0

    async def session(self) -> None:
        import aio_pika
        from aio_pika.exceptions import DeliveryError
        from pamqp.commands import Basic
        connection = await asyncio.wait_for(aio_pika.connect(amqp_url(self.node)), 10)
        try:
            channel = await connection.channel(publisher_confirms=True)
            exchange = await channel.get_exchange("amq.topic")
            self.reconnected("connect")
            while not (self.stopping.is_set() or self.moving.is_set()):
                key = f"chaos.a.{self.name}.{self.sequence % TOPICS}"
                payload = f"{self.name}:{self.sequence}"
                self.sequence += 1
                try:
                    confirmation = await asyncio.wait_for(
                        exchange.publish(aio_pika.Message(payload.encode(), delivery_mode=2),
                                         routing_key=key), 15)
                except DeliveryError:
                    await asyncio.sleep(0.05)
                    continue
                if isinstance(confirmation, Basic.Ack):
                    self.journal.acked(self.name, payload, key.replace(".", "/"))
                    self.progress += 1
                await asyncio.sleep(0.01)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(connection.close(), 5)


class AmqpConsumer(AsyncClientThread):
    """A consumer of the durable queue `chaos-q` (bound to `amq.topic` with `chaos.#`),
    manual acks, prefetch 50. A basic.cancel from the broker (the queue's home node left)
    ends the session: it consumes again from the next node."""

    async def session(self) -> None:
        import aio_pika
        connection = await asyncio.wait_for(aio_pika.connect(amqp_url(self.node)), 10)
        try:
            channel = await connection.channel()
            await channel.set_qos(prefetch_count=50)
            queue = await channel.declare_queue("chaos-q", durable=True)
            await queue.bind("amq.topic", "chaos.#")
            connection_number = self.connection + 1

            async def on_message(message: Any) -> None:
                self.journal.delivered(self.name, message.body.decode(), connection_number)
                self.progress += 1
                await message.ack()

            tag = await queue.consume(on_message)
            underlay = await channel.get_underlay_channel()
            self.reconnected("connect")
            while not (self.stopping.is_set() or self.moving.is_set()):
                if connection.is_closed or channel.is_closed or tag not in underlay.consumers:
                    self.journal.event(f"{self.name} on {self.node.node_id}: consumer ended")
                    return
                await asyncio.sleep(0.05)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(connection.close(), 5)


class SdkProducer(AsyncClientThread):
    """The gRPC SDK's unary `publish` (one at a time), to `chaos/g/<name>/<k>`."""

    sequence = 0

    async def session(self) -> None:
        from shardgate.client import Client
        async with Client(self.node.grpc_url) as client:
            producer = client.producer(self.name, retries=0)
            self.reconnected("connect")
            while not (self.stopping.is_set() or self.moving.is_set()):
                topic = f"chaos/g/{self.name}/{self.sequence % TOPICS}"
                payload = f"{self.name}:{self.sequence}"
                self.sequence += 1
                await asyncio.wait_for(producer.publish(topic, payload), 15)
                self.journal.acked(self.name, payload, topic)
                self.progress += 1
                await asyncio.sleep(0.01)


class SdkConsumer(AsyncClientThread):
    """A consumer of the durable gRPC subscription `chaos-sdk` on `chaos/#` (acks each)."""

    async def session(self) -> None:
        from shardgate.client import Client
        async with Client(self.node.grpc_url) as client:
            consumer = client.consumer("chaos-sdk", ["chaos/#"], durable=True, reconnect=False)
            await asyncio.wait_for(consumer.subscribe(), 15)
            self.reconnected("connect")
            connection_number = self.connection
            try:
                while not (self.stopping.is_set() or self.moving.is_set()):
                    try:
                        message = await consumer.receive(0.2)
                    except TimeoutError:
                        continue
                    self.journal.delivered(self.name, message.text(), connection_number)
                    self.progress += 1
                    message.ack()
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(consumer.close(), 5)


# ---------------------------------------------------------------- the cluster and the faults

class Cluster:
    """etcd and three nodes; `replicas` (when given) is each node's `[cluster] default_replicas`,
    so the stream `chaos`, the AMQP queue and every other replicated shard get that many copies."""

    def __init__(self, workdir: Path, replicas: int | None = None) -> None:
        self.workdir = workdir
        self.etcd = EtcdServer(workdir / "etcd")
        self.nodes: list[ProtocolNode] = []
        self.extra_config = "" if replicas is None else f"default_replicas = {replicas}\n"

    def start(self) -> None:
        self.etcd.start()
        self.nodes = [protocol_node(self.workdir, f"n{i}", self.etcd.url, extra_config=self.extra_config).start()
                      for i in (1, 2, 3)]
        self.settle()

        async def create() -> None:
            from shardgate.client import Client
            async with Client(self.nodes[0].grpc_url) as client:
                await client.admin.create_stream(STREAM, partitions=PARTITIONS, mode="reliable")

        asyncio.run(create())

        def placed() -> bool:
            for node in self.nodes:
                owners = {owner for owner, _epoch in node.status()["placement"].get(STREAM, [])}
                if len(owners) != len(self.nodes):
                    return False
            return True

        from tests.conftest import wait_for
        wait_for(placed, timeout=60, interval=0.1)

    def settle(self, timeout: float = 60) -> None:
        wait_settled(self.nodes, timeout=timeout)

    def examine(self, into: Path, report: Callable[[str], None] = log) -> None:
        """What a hung cluster's processes are doing, into `into`: per node, its thread stacks
        (py-spy, when installed), its cluster status and its metrics; etcd's keys."""
        into.mkdir(parents=True, exist_ok=True)
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not Path(spy).exists():
            report("py-spy is not installed: no thread stacks in the hang's dump")
        for node in self.nodes:
            name = node.node_id
            if node.proc is None or node.proc.poll() is not None:
                (into / f"{name}.txt").write_text("not running\n")
                continue
            if Path(spy).exists():
                for flags, suffix in ((["--locals"], "stacks"), (["--native"], "native")):
                    try:
                        done = subprocess.run([spy, "dump", "--pid", str(node.proc.pid), *flags],
                                              capture_output=True, text=True, timeout=60)
                        text = done.stdout + done.stderr
                    except (OSError, subprocess.TimeoutExpired) as exc:
                        text = f"py-spy failed: {exc!r}"
                    (into / f"{name}.{suffix}.txt").write_text(text)
            for what, fetch in (("status.json", lambda n=node: json.dumps(n.status(), indent=1)),
                                ("metrics.txt", lambda n=node: _metrics(n))):
                try:
                    (into / f"{name}.{what}").write_text(fetch())
                except Exception as exc:  # a hung node may not answer: say so
                    (into / f"{name}.{what}").write_text(f"no answer: {exc!r}\n")
        try:
            (into / "etcd-keys.txt").write_text("\n".join(self.etcd.keys()) + "\n")
        except Exception as exc:
            (into / "etcd-keys.txt").write_text(f"no answer: {exc!r}\n")
        report(f"hang examined: {into}")

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                with contextlib.suppress(Exception):
                    node.proc.send_signal(signal.SIGCONT)
                    node.kill()
        self.etcd.stop()

    def tracebacks(self) -> list[str]:
        found = []
        for node in self.nodes:
            if node.log_path.exists():
                text = node.log_path.read_text(errors="replace")
                for match in re.finditer(r"Traceback \(most recent call last\):", text):
                    start = text.rfind("\n", 0, max(0, match.start() - 1))
                    found.append(f"{node.node_id}: {text[start + 1:match.start() + 2500]}")
        return found


def _metrics(node: ProtocolNode) -> str:
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{node.ports['http']}/metrics",
                                timeout=5) as response:
        return str(response.read().decode())


class ClusterHung(Exception):
    """The cluster did not settle after a fault (see `--dump-on-hang`)."""


FAULTS = ("kill", "term", "freeze", "etcd", "move")
# With --mixes: faults at once too (the single ones stay as likely as the mixes together).
MIXES = ("two-down", "etcd-during-restart", "freeze-across-etcd")


def apply_fault(rng: random.Random, cluster: Cluster, clients: list[ClientThread],
                journal: Journal, max_freeze_s: float = 6.0, mixes: bool = False,
                kinds: tuple[str, ...] = FAULTS) -> str:
    kind = rng.choice(kinds)
    if mixes and rng.random() < 0.5:
        kind = rng.choice(MIXES)
    node = rng.choice(cluster.nodes)
    if kind == "two-down":
        first, second = rng.sample(cluster.nodes, 2)
        how = rng.choice(("SIGKILL", "SIGTERM"))
        what = (f"{how} {first.node_id} and {second.node_id} at once, start them after "
                f"{(pause := rng.uniform(0.5, 4)):.1f}s")
        journal.event(what, fault=True)
        for down in (first, second):
            if how == "SIGKILL":
                down.kill()
            else:
                assert down.proc is not None
                down.proc.send_signal(signal.SIGTERM)
        for down in (first, second):
            if how == "SIGTERM":
                assert down.proc is not None
                down.proc.wait(30)
        time.sleep(pause)
        for down in (first, second):
            down.start()
    elif kind == "etcd-during-restart":
        how = rng.choice(("SIGKILL", "SIGTERM"))
        what = f"{how} {node.node_id}, etcd down while it starts again"
        journal.event(what, fault=True)
        if how == "SIGKILL":
            node.kill()
        else:
            node.terminate(30)
        cluster.etcd.stop()
        starting = threading.Thread(target=node.start, daemon=True)
        starting.start()  # it waits for etcd to join (at most cluster.connect_timeout_s)
        time.sleep(rng.uniform(1, 3))
        cluster.etcd.start()
        starting.join(120)
    elif kind == "freeze-across-etcd":
        what = f"SIGSTOP {node.node_id} across an etcd restart"
        journal.event(what, fault=True)
        assert node.proc is not None
        node.proc.send_signal(signal.SIGSTOP)
        time.sleep(rng.uniform(0.5, 2))
        cluster.etcd.stop()
        time.sleep(rng.uniform(0.5, 3))
        cluster.etcd.start()
        time.sleep(rng.uniform(0.5, 2))
        node.proc.send_signal(signal.SIGCONT)
    elif kind == "kill":
        what = f"SIGKILL {node.node_id}, start it after {(pause := rng.uniform(0.5, 4)):.1f}s"
        journal.event(what, fault=True)
        node.kill()
        time.sleep(pause)
        node.start()
    elif kind == "term":
        what = f"SIGTERM {node.node_id}, start it again"
        journal.event(what, fault=True)
        node.terminate(30)
        node.start()
    elif kind == "freeze":
        what = f"SIGSTOP {node.node_id} for {(pause := rng.uniform(1, max_freeze_s)):.1f}s"
        journal.event(what, fault=True)
        assert node.proc is not None
        node.proc.send_signal(signal.SIGSTOP)
        time.sleep(pause)
        node.proc.send_signal(signal.SIGCONT)
    elif kind == "etcd":
        what = f"restart etcd (down {(pause := rng.uniform(0.5, 3)):.1f}s)"
        journal.event(what, fault=True)
        cluster.etcd.stop()
        time.sleep(pause)
        cluster.etcd.start()
    else:
        client = rng.choice(clients)
        what = f"move {client.name} to another node"
        journal.event(what, fault=True)
        client.move()
    return what


# ---------------------------------------------------------------- the checks

@dataclass
class Findings:
    lost: dict[str, list[str]] = field(default_factory=dict)
    unexcused_duplicates: dict[str, list[str]] = field(default_factory=dict)
    duplicates: Counter[str] = field(default_factory=Counter)
    out_of_order: dict[str, list[str]] = field(default_factory=dict)
    tracebacks: list[str] = field(default_factory=list)
    stuck: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return bool(self.lost or self.unexcused_duplicates or self.out_of_order or self.tracebacks
                    or self.stuck or self.errors)

    def summary(self) -> str:
        lines = []
        for subscriber, payloads in self.lost.items():
            lines.append(f"LOST at {subscriber}: {len(payloads)} acknowledged, e.g. {payloads[:8]}")
        for subscriber, payloads in self.unexcused_duplicates.items():
            lines.append(f"DUPLICATE without a fault at {subscriber}: {len(payloads)}, e.g. {payloads[:8]}")
        for subscriber, problems in self.out_of_order.items():
            lines.append(f"OUT OF ORDER at {subscriber}: {len(problems)}, e.g. {problems[:5]}")
        lines += [f"TRACEBACK {text[:1500]}" for text in self.tracebacks[:5]]
        lines += [f"STUCK {name}" for name in self.stuck]
        lines += [f"ERROR {text}" for text in self.errors]
        return "\n".join(lines) or "no findings"


def sequence_of(payload: str) -> int:
    return int(payload.rsplit(":", 1)[1])


def check(journal: Journal, subscribers: list[ClientThread]) -> Findings:
    findings = Findings(errors=list(journal.errors))
    topic_of = {payload: topic for acked in journal.acknowledged.values() for payload, topic in acked}
    fault_times = sorted(journal.fault_times)
    for subscriber in subscribers:
        deliveries = journal.deliveries[subscriber.name]
        seen = {delivery.payload for delivery in deliveries}
        lost = [payload for payload in topic_of if payload not in seen]
        if lost:
            findings.lost[subscriber.name] = sorted(lost, key=lambda p: (p.split(":")[0], sequence_of(p)))
        first: dict[str, Delivery] = {}
        unexcused = []
        order: dict[tuple[str, str], list[int]] = defaultdict(list)
        for delivery in deliveries:
            earlier = first.get(delivery.payload)
            if earlier is None:
                first[delivery.payload] = delivery
                if delivery.payload in topic_of:
                    publisher = delivery.payload.split(":")[0]
                    order[(publisher, topic_of[delivery.payload])].append(sequence_of(delivery.payload))
                continue
            findings.duplicates[subscriber.name] += 1
            excused = delivery.connection != earlier.connection or any(
                earlier.at - 1.0 <= at <= delivery.at for at in fault_times)
            if not excused:
                unexcused.append(delivery.payload)
        if unexcused:
            findings.unexcused_duplicates[subscriber.name] = unexcused
        problems = []
        for (publisher, topic), sequences in order.items():
            for before, after in zip(sequences, sequences[1:], strict=False):
                if after < before:
                    problems.append(f"{publisher} on {topic}: {after} after {before}")
        if problems:
            findings.out_of_order[subscriber.name] = problems
    return findings


# ---------------------------------------------------------------- the run

@dataclass
class Result:
    seed: int
    faults: list[str]
    acknowledged: dict[str, int]
    delivered: dict[str, int]
    findings: Findings


def run(workdir: Path, seed: int, seconds: float, *, gap_s: tuple[float, float] = (1.0, 4.0),
        drain_timeout_s: float = 60.0, overlap: bool = False, max_freeze_s: float = 6.0,
        mixes: bool = False, min_faults: int = 0, replicas: int | None = None,
        kinds: tuple[str, ...] = FAULTS, dump_on_hang: bool = False,
        report: Callable[[str], None] = log) -> Result:
    """Start the cluster and the clients, apply faults for `seconds` (and until `min_faults`
    were applied: on a loaded machine each settle takes longer), settle, check. Each fault
    waits for the cluster to settle before the next, unless `overlap`. `replicas` sets the
    nodes' `[cluster] default_replicas` (the nodes' own default when None); `kinds` are the
    single faults drawn from. With `dump_on_hang`, a settle that fails examines the cluster
    (`Cluster.examine`, into `workdir/hang`) and raises ClusterHung."""
    rng = random.Random(seed)
    journal = Journal()
    cluster = Cluster(workdir, replicas)
    clients: list[ClientThread] = []
    faults: list[str] = []

    def settle() -> None:
        try:
            cluster.settle()
        except AssertionError as exc:
            if not dump_on_hang:
                raise
            after = faults[-1] if faults else "the start"
            report(f"HUNG: the cluster did not settle after {after} ({exc}); examining it")
            cluster.examine(workdir / "hang", report)
            raise ClusterHung(f"the cluster did not settle after {after}") from None

    try:
        cluster.start()
        nodes = cluster.nodes
        subscribers: list[ClientThread] = [
            MqttSubscriber("msub1", nodes, journal, 0), MqttSubscriber("msub2", nodes, journal, 1),
            AmqpConsumer("aconsumer", nodes, journal, 2), SdkConsumer("sconsumer", nodes, journal, 0),
        ]
        for subscriber in subscribers:
            subscriber.start()
        from tests.conftest import wait_for
        wait_for(lambda: all(s.connection for s in subscribers), timeout=60, interval=0.05)
        time.sleep(1.0)  # let the subscriptions' routes reach every node (SUBACK waits for it too)
        publishers: list[ClientThread] = [
            MqttPublisher("mpub1", nodes, journal, 0), MqttPublisher("mpub2", nodes, journal, 1),
            AmqpPublisher("apub", nodes, journal, 2), SdkProducer("gpub", nodes, journal, 1),
        ]
        clients = subscribers + publishers
        for publisher in publishers:
            publisher.start()
        wait_for(lambda: all(p.progress for p in publishers), timeout=60, interval=0.05)
        report(f"seed {seed}: clients running, faults for {seconds:.0f}s")
        end = time.monotonic() + seconds
        while time.monotonic() < end or len(faults) < min_faults:
            time.sleep(rng.uniform(*gap_s))
            faults.append(apply_fault(rng, cluster, clients, journal, max_freeze_s, mixes, kinds))
            report(f"fault: {faults[-1]}")
            if not overlap:
                settle()
        settle()
        marks = {p.name: p.progress for p in publishers}
        stuck = []
        try:
            wait_for(lambda: all(p.progress >= marks[p.name] + 5 for p in publishers),
                     timeout=60, interval=0.1)
        except AssertionError:
            stuck += [f"{p.name} made no progress after the last fault"
                      for p in publishers if p.progress < marks[p.name] + 5]
        stuck += [p.name for p in publishers if not p.stop()]
        expected = {payload for acked in journal.acknowledged.values() for payload, _ in acked}
        deadline = time.monotonic() + drain_timeout_s
        while time.monotonic() < deadline:
            with journal.lock:
                if all(expected <= {d.payload for d in journal.deliveries[s.name]} for s in subscribers):
                    break
            time.sleep(0.2)
        stuck += [s.name for s in subscribers if not s.stop()]
        findings = check(journal, subscribers)
        journal.dump(workdir / "journal.json")
        findings.stuck += stuck
        findings.tracebacks = cluster.tracebacks()
        return Result(seed, faults,
                      {name: len(acked) for name, acked in journal.acknowledged.items()},
                      {name: len(d) for name, d in journal.deliveries.items()}, findings)
    finally:
        for client in clients:
            client.stopping.set()
        cluster.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the node and etcd logs go (default: a temporary directory, kept)")
    parser.add_argument("--overlap", action="store_true",
                        help="do not wait for the cluster to settle between faults")
    parser.add_argument("--max-freeze", type=float, default=6.0,
                        help="longest SIGSTOP in seconds (past 15 s the clients' keep alive ends)")
    parser.add_argument("--mixes", action="store_true",
                        help="also faults at once: two nodes down, etcd down while a node "
                             "restarts, a node frozen across an etcd restart")
    parser.add_argument("--replicas", type=int, default=None, metavar="N",
                        help="the nodes' [cluster] default_replicas: copies of each shard of the "
                             "stream and of the AMQP queue (default: the nodes' default)")
    parser.add_argument("--faults", default=",".join(FAULTS),
                        help="the single faults to draw from, comma-separated "
                             f"(default: all of {','.join(FAULTS)})")
    parser.add_argument("--dump-on-hang", action="store_true",
                        help="when the cluster does not settle after a fault, write each node's "
                             "py-spy stacks, status and metrics and etcd's keys into "
                             "WORKDIR/hang before stopping, and exit 2")
    args = parser.parse_args()
    kinds = tuple(kind.strip() for kind in args.faults.split(",") if kind.strip())
    if not kinds or set(kinds) - set(FAULTS):
        parser.error(f"--faults: choose from {','.join(FAULTS)}")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="cluster-chaos-"))
    log(f"work directory {workdir}")
    try:
        result = run(workdir, args.seed, args.minutes * 60, overlap=args.overlap,
                     max_freeze_s=args.max_freeze, mixes=args.mixes, replicas=args.replicas,
                     kinds=kinds, dump_on_hang=args.dump_on_hang)
    except ClusterHung as exc:
        log(f"HUNG: {exc}; see {workdir / 'hang'}")
        return 2
    log(f"faults applied: {len(result.faults)}")
    log(f"acknowledged: {result.acknowledged}")
    log(f"delivered (with duplicates): {result.delivered}; duplicates {dict(result.findings.duplicates)}")
    log(result.findings.summary())
    return 1 if result.findings.failed else 0


if __name__ == "__main__":
    sys.exit(main())
