"""Pushes from a shard's leader to another node's subscribers lost in flight (issue 28): three
`shardgate serve` nodes, a reliable stream on two of them (both in sync), and on the third a
persistent QoS 1 MQTT 5 session and a durable AMQP queue (declared there, so homed there, with
a consumer acking each message): every message reaches them by the leader's pushes. A QoS 1
publisher on the leader goes on publishing while the pushes to that node go astray:

- in network namespaces (`test_cluster_partition.py`), iptables drops, where they arrive, the
  packets between the leader and that node both ways; or only the leader's; or only the
  leader's packets of 100 bytes or more (as a path-MTU black hole does: its frames are lost,
  while the node's heartbeats and both ends' bare acknowledgements pass);
- or that node is frozen (SIGSTOP) within its lease.

What was written to the connection never arrives or is never answered, and the leader gives
the pushes up (its `shardgate_cluster_pushes_dropped` counts them) while it goes on
acknowledging. Then the path returns (or the node runs again): the session and the queue must
still get every acknowledged message (the node reads what it missed from the leader's journal),
each once, and the publisher is never refused.

The black hole found a defect: the leader's link heard the node's heartbeats all along, so it
never gave up on its connection (TCP sends lost bytes again for about 15 minutes), and the
node's subscribers got nothing more for as long as the path lost the big packets (over 60 s
here). The link's sockets now have the kernel end a connection whose bytes went unacknowledged
for the link timeout (TCP_USER_TIMEOUT, `link.give_up_unacknowledged`).

The namespace cases skip where namespaces cannot be made or iptables is absent; all skip
where etcd is absent.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pika
import pytest

from tests.conftest import free_port, wait_for
from tests.e2e.cluster_fixtures import (
    ClusterNodeProcess,
    ContinuousPublisher,
    linked,
    running_etcd,
    start_together,
    wait_settled,
)
from tests.e2e.netns_fixtures import iptables_in_netns
from tests.e2e.test_cluster_partition import STREAMS, NamespacedNode, partitionable_cluster
from tests.mqtt_clients import V5, Paho

# A stream on two of the three nodes, so that the third one's subscribers get every message
# by the leader's pushes, and the leader goes on committing (pushing) while they go astray.
STREAM = "lost"
TOPIC = f"{STREAM}/a"
LOST_STREAM = (f'\n[[streams]]\nname = "{STREAM}"\nmode = "reliable"\npartitions = 1\n'
               "replicas = 2\nmin_insync_replicas = 2\n")
QUEUE = "lost-push-q"
AMQP_USER, AMQP_PASSWORD = "lost", "lost-pw"
# the frozen node's lease: longer than it stays frozen, so that it stays a member meanwhile
FROZEN_LEASE_TTL_S = 20


class SessionSubscriber:
    """A persistent QoS 1 MQTT 5 session subscribed to the stream, counting each payload."""

    def __init__(self, host: str, port: int, client_id: str) -> None:
        self.client = Paho(port, client_id, V5, clean=False, session_expiry=600, host=host)
        self.client.subscribe(f"{STREAM}/#", qos=1)
        self.got: collections.Counter[str] = collections.Counter()

    def receive(self, wanted: set[str], timeout: float) -> set[str]:
        """Take what comes until every payload of `wanted` did or `timeout` passed; what of
        `wanted` did not come."""
        deadline = time.monotonic() + timeout
        while not wanted <= self.got.keys() and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                self.got[self.client.expect(0.5).payload.decode()] += 1
        return wanted - self.got.keys()

    def drain(self) -> None:
        while True:
            try:
                self.got[self.client.messages.get_nowait().payload.decode()] += 1
            except queue.Empty:
                return

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.disconnect()


class QueueConsumer:
    """A pika consumer, on its own thread, of a durable queue declared on the node it connects
    to (its home) and bound to `amq.topic` with the stream's topics; it acks each message and
    counts it."""

    def __init__(self, host: str, port: int, credentials: tuple[str, str]) -> None:
        self.got: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(host, port, credentials),
                                        daemon=True)
        self._thread.start()
        if not self.ready.wait(30):
            raise AssertionError(f"the AMQP consumer did not start: {self.error!r}")

    def _run(self, host: str, port: int, credentials: tuple[str, str]) -> None:
        try:
            connection = pika.BlockingConnection(pika.ConnectionParameters(
                host, port, credentials=pika.PlainCredentials(*credentials),
                blocked_connection_timeout=60, heartbeat=0))
            try:
                channel = connection.channel()
                channel.basic_qos(prefetch_count=50)
                channel.queue_declare(QUEUE, durable=True)
                channel.queue_bind(QUEUE, "amq.topic", f"{STREAM}.#")

                def on_message(ch: Any, method: Any, _properties: Any, body: bytes) -> None:
                    with self.lock:
                        self.got[body.decode()] += 1
                    ch.basic_ack(method.delivery_tag)

                channel.basic_consume(QUEUE, on_message)
                self.ready.set()
                while not self._stop.is_set():
                    connection.process_data_events(time_limit=0.1)
            finally:
                with contextlib.suppress(Exception):
                    connection.close()
        except BaseException as exc:  # noqa: BLE001  (reported by the test)
            self.error = exc
            self.ready.set()

    def received(self) -> collections.Counter[str]:
        with self.lock:
            return collections.Counter(self.got)

    def missing(self, wanted: set[str], timeout: float) -> set[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.error is None:
            if wanted <= self.received().keys():
                break
            time.sleep(0.1)
        return wanted - self.received().keys()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


class AmqpNamespacedNode(NamespacedNode):
    """A node of the partition tests with an AMQP listener too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.extra_args += ["--amqp-port", str(free_port())]
        # a user that may log in from the front bridge (guest may only over loopback)
        with (self.data_dir.parent / f"{self.data_dir.name}.toml").open("a") as config:
            config.write(LOST_STREAM + f'\n[amqp]\nusers = {{ {AMQP_USER} = "{AMQP_PASSWORD}" }}\n')


def pushes_dropped(node: ClusterNodeProcess) -> int:
    text = node.http_get("/metrics").decode()
    found = re.search(r"^shardgate_cluster_pushes_dropped(?:_total)?(?:\{[^}]*\})? (\d+(?:\.\d+)?)$", text,
                      re.MULTILINE)
    assert found is not None, "no shardgate_cluster_pushes_dropped metric"
    return int(float(found.group(1)))


def placed(node: ClusterNodeProcess) -> dict[str, Any] | None:
    """The stream's shard as `node` shows it, once its two replicas are in sync."""
    try:
        shard = node.status()["replicated_shards"].get(f"{STREAM}/0")
    except (OSError, ValueError):
        return None
    return shard if shard is not None and len(shard["isr"]) == 2 else None


def leader_and_away(nodes: list[ClusterNodeProcess]) -> tuple[ClusterNodeProcess, ClusterNodeProcess]:
    """The stream's leader, and the node that holds no replica of it."""
    shard = wait_for(lambda: placed(nodes[0]), timeout=60, interval=0.1)
    by_id = {node.node_id: node for node in nodes}
    (away,) = (node for node in nodes if node.node_id not in shard["replicas"])
    return by_id[shard["leader"]], away


def duplicates(got: collections.Counter[str]) -> dict[str, int]:
    return {payload: count for payload, count in got.items() if count > 1}


def lose_pushes_then_restore(leader: ClusterNodeProcess, away: ClusterNodeProcess,
                             publisher: ContinuousPublisher, session: SessionSubscriber,
                             consumer: QueueConsumer, lose: Callable[[], None],
                             restore: Callable[[], None], how: str) -> None:
    """The scenario of both tests (see the module docstring): `lose()` makes the pushes from
    `leader` to `away` go astray until `restore()`."""
    wait_for(lambda: publisher.count() >= 50, timeout=60)
    # both subscribers are served by the leader's pushes by now
    first = set(list(publisher.acknowledged)[:10])
    assert not session.receive(first, timeout=30)
    assert not consumer.missing(first, timeout=30)
    dropped_before = pushes_dropped(leader)

    lose()
    lost_at, before = time.monotonic(), publisher.count()
    # the leader gave up pushes to `away`, and acknowledged on meanwhile
    wait_for(lambda: pushes_dropped(leader) > dropped_before
             and publisher.count() >= before + 50, timeout=60, interval=0.1)
    lost = pushes_dropped(leader) - dropped_before
    during = publisher.count() - before
    restore()
    lost_s = time.monotonic() - lost_at

    wait_for(lambda: away.node_id in linked(leader) and leader.node_id in linked(away),
             timeout=60, interval=0.1)
    restored = publisher.count()
    wait_for(lambda: publisher.count() >= restored + 50, timeout=60)
    publisher.stop()
    assert not publisher.dropped.is_set()
    assert publisher.refusals() == 0, sorted(
        {(code, reason) for code, reason, _topic in publisher.refused})[:3]

    everything = set(publisher.acknowledged)
    missing = session.receive(everything, timeout=60)
    assert not missing, (f"the MQTT session lacks {len(missing)} of {len(everything)} "
                         f"acknowledged, e.g. {sorted(missing)[:5]}")
    missing = consumer.missing(everything, timeout=60)
    assert consumer.error is None, repr(consumer.error)
    assert not missing, (f"the AMQP queue lacks {len(missing)} of {len(everything)} "
                         f"acknowledged, e.g. {sorted(missing)[:5]}")
    session.drain()
    twice = duplicates(session.got)
    assert not twice, f"the session got {len(twice)} twice or more, e.g. {sorted(twice)[:5]}"
    twice = duplicates(consumer.received())
    assert not twice, f"the queue got {len(twice)} twice or more, e.g. {sorted(twice)[:5]}"
    print(f"{how}: {lost} pushes to {away.node_id} dropped by the leader in {lost_s:.1f} s "
          f"({during} acknowledged meanwhile); {len(everything)} acknowledged in all, each "
          f"received once by the session and the queue")


CUTS = {
    "both-ways": ("both ways", True, None),
    "leader-to-node": ("what the leader sends", False, None),
    # the leader's frames (a few hundred bytes and more) are lost, the node's heartbeats and
    # both ends' bare acknowledgements pass: the leader's link hears the node all along
    "mtu-black-hole": ("the leader's packets of 100 bytes or more", False, 100),
}


@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.timeout(240)
def test_pushes_lost_on_a_cut_link_reach_the_subscribers_once_it_returns(
        tmp_path: Path, cut: str) -> None:
    what, both_ways, from_bytes = CUTS[cut]
    iptables, why_not = iptables_in_netns()
    if iptables is None:
        pytest.skip(why_not)
    with partitionable_cluster(tmp_path, AmqpNamespacedNode) as by_id:
        leader, away = leader_and_away(list(by_id.values()))
        assert isinstance(leader, NamespacedNode) and isinstance(away, NamespacedNode)
        session = SessionSubscriber(away.front, away.mqtt_port, "lost-push-session")
        consumer = QueueConsumer(away.front, away.ports["amqp"], (AMQP_USER, AMQP_PASSWORD))
        publisher = ContinuousPublisher(leader.mqtt_port, "lp", [TOPIC], host=leader.front,
                                        pause_s=0.005, ack_timeout_s=60)
        try:
            lose_pushes_then_restore(
                leader, away, publisher, session, consumer,
                lambda: leader.net.cut_between(leader.index, away.index, both_ways, from_bytes),
                lambda: leader.net.heal_between(leader.index, away.index),
                f"the link cut (iptables DROP of {what})")
        finally:
            with contextlib.suppress(Exception):
                leader.net.heal_between(leader.index, away.index)
            with contextlib.suppress(AssertionError):
                publisher.stop()
            session.close()
            consumer.close()


@pytest.mark.timeout(240)
def test_pushes_lost_to_a_frozen_node_reach_its_subscribers_once_it_runs_again(
        tmp_path: Path) -> None:
    """The same with the subscribers' node frozen (SIGSTOP) instead, within its lease: the
    leader's link to it falls silent, with pushes written to its socket and not answered."""
    with running_etcd(tmp_path / "etcd") as etcd:
        nodes = [ClusterNodeProcess(tmp_path / f"n{index}", f"n{index}", etcd.url,
                                    lease_ttl_s=FROZEN_LEASE_TTL_S,
                                    extra_config=STREAMS + LOST_STREAM,
                                    extra_args=["--amqp-port", str(free_port())])
                 for index in (1, 2, 3)]
        frozen: list[ClusterNodeProcess] = []
        try:
            start_together(nodes)
            wait_settled(nodes)
            leader, away = leader_and_away(nodes)
            session = SessionSubscriber("127.0.0.1", away.mqtt_port, "lost-push-frozen")
            consumer = QueueConsumer("127.0.0.1", away.ports["amqp"], ("guest", "guest"))
            publisher = ContinuousPublisher(leader.mqtt_port, "lf", [TOPIC], pause_s=0.005,
                                            ack_timeout_s=60)

            def freeze() -> None:
                assert away.proc is not None
                away.proc.send_signal(signal.SIGSTOP)
                frozen.append(away)

            def thaw() -> None:
                assert away.proc is not None
                away.proc.send_signal(signal.SIGCONT)
                frozen.remove(away)

            try:
                lose_pushes_then_restore(leader, away, publisher, session, consumer, freeze, thaw,
                                         "the subscribers' node frozen (SIGSTOP)")
            finally:
                with contextlib.suppress(AssertionError):
                    publisher.stop()
                session.close()
                consumer.close()
        finally:
            for node in frozen:
                assert node.proc is not None
                node.proc.send_signal(signal.SIGCONT)
            for node in nodes:
                if node.alive():
                    node.kill()
