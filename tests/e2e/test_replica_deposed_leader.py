"""A replicated shard's leader frozen (SIGSTOP) past its lease with publishes waiting, then let
go (SIGCONT): what it had appended and its followers had fetched is in the shard (the new
leader kept it), so it is acknowledged, not refused: refused, its client would send it again
and the shard would hold it twice. What its followers had not fetched is refused, retryably,
and stored once when sent again. Three nodes and a real etcd on loopback, a stream of three
replicas, an MQTT 5 client on the leader's node with many QoS 1 publishes in flight, which
sends a refused publish again (same payload, new packet id), as a client that wants its
message stored does.
"""

from __future__ import annotations

import asyncio
import select
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess, EtcdServer, read_back, topics_of
from tests.e2e.test_replica_failover import SAFE, STREAM, epoch_in_etcd, fully_replicated, shard

WINDOW = 32  # publishes in flight at a time


class WindowedPublisher:
    """A raw MQTT 5 client in a thread with up to `WINDOW` QoS 1 publishes in flight, each
    payload unique (`<name>-<seq>`); a refused one (reason >= 0x80) is sent again with a new
    packet id until acknowledged. `sent_at_stop` freezes what was sent when `pause` is set;
    `finish` stops new payloads and waits until every one sent is acknowledged."""

    def __init__(self, port: int, name: str, topics: list[str]) -> None:
        from tests.mqtt_clients import RawClient  # (tests.mqtt_clients imports paho)
        self.name = name
        self.topics = topics
        self.client = RawClient(port, version=5)
        self.client.connect(name)
        self.acknowledged: dict[str, int] = {}  # payload -> PUBACKs with reason 0
        self.refused: dict[str, list[tuple[int, str]]] = {}  # payload -> (reason, why)
        self.sent: list[str] = []
        self.in_flight: dict[int, str] = {}  # packet id -> payload
        self.error: BaseException | None = None
        self._resend: list[str] = []
        self._no_new = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._next_id = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _send(self, payload: str) -> None:
        from shardgate.protocols.mqtt import packets as p
        self._next_id = self._next_id % 65535 + 1
        while self._next_id in self.in_flight:
            self._next_id = self._next_id % 65535 + 1
        with self._lock:
            self.in_flight[self._next_id] = payload
        topic = self.topics[int(payload.rsplit("-", 1)[1]) % len(self.topics)]
        self.client.send(p.Publish(topic, payload.encode(), 1, packet_id=self._next_id))

    def _run(self) -> None:
        from shardgate.protocols.mqtt import packets as p
        sequence = 0
        try:
            while not self._stop.is_set():
                while len(self.in_flight) < WINDOW and (self._resend or not self._no_new.is_set()):
                    if self._resend:
                        with self._lock:
                            payload = self._resend.pop(0)
                    else:
                        payload = f"{self.name}-{sequence}"
                        sequence += 1
                        with self._lock:
                            self.sent.append(payload)
                    self._send(payload)
                if not self.client.pending and not select.select([self.client.sock], [], [], 0.2)[0]:
                    continue
                puback = self.client.receive(30)
                assert isinstance(puback, p.Puback), puback
                with self._lock:
                    payload = self.in_flight.pop(puback.packet_id)
                    if puback.reason_code == 0:
                        self.acknowledged[payload] = self.acknowledged.get(payload, 0) + 1
                    else:
                        self.refused.setdefault(payload, []).append(
                            (puback.reason_code, puback.properties.reason_string or ""))
                        self._resend.append(payload)
        except BaseException as exc:  # noqa: BLE001  (reported by finish())
            self.error = exc

    def count(self) -> int:
        with self._lock:
            return len(self.acknowledged)

    def waiting(self) -> set[str]:
        """The payloads sent and not answered yet."""
        with self._lock:
            return set(self.in_flight.values())

    def finish(self, timeout: float = 120) -> None:
        self._no_new.set()
        deadline = time.monotonic() + timeout
        while self.error is None:
            with self._lock:
                done = not self.in_flight and not self._resend
            if done:
                break
            assert time.monotonic() < deadline, f"{len(self.in_flight)} publishes never acknowledged"
            time.sleep(0.05)
        self._stop.set()
        self._thread.join(10)
        self.client.close()
        if self.error is not None:
            raise AssertionError(f"publisher {self.name} failed: {self.error!r}") from self.error


@pytest.mark.timeout(400)
def test_a_leader_frozen_with_publishes_waiting_acknowledges_what_the_new_leader_kept_and_stores_each_once(
        cluster: Callable[..., list[ClusterNodeProcess]], etcd: EtcdServer) -> None:
    nodes = {node.node_id: node for node in cluster(3, extra_config=SAFE)}
    placed = wait_for(lambda: fully_replicated(nodes["n1"]), timeout=60, interval=0.1)
    leader = nodes[placed["leader"]]
    other = next(node for name, node in nodes.items() if name != leader.node_id)
    topics = topics_of(leader.status(), STREAM, f"{STREAM}/w", per_shard=4)
    publisher = WindowedPublisher(leader.mqtt_port, "frozen-window", topics)
    wait_for(lambda: publisher.count() >= 300, timeout=60)
    assert leader.proc is not None
    leader.proc.send_signal(signal.SIGSTOP)
    try:
        def replaced() -> dict[str, Any] | None:
            now = shard(other)
            return now if now is not None and now["leader"] != leader.node_id else None
        wait_for(replaced, timeout=60, interval=0.05)
        waiting = publisher.waiting()  # (nothing is answered while the node is frozen)
    finally:
        leader.proc.send_signal(signal.SIGCONT)
    assert waiting, "no publish was waiting when the leader froze"
    resumed = publisher.count()
    wait_for(lambda: publisher.count() >= resumed + 300, timeout=120)
    publisher.finish()
    new_leader, epoch = epoch_in_etcd(etcd)
    assert new_leader != leader.node_id and epoch > placed["leader_epoch"]

    sent = set(publisher.sent)
    assert set(publisher.acknowledged) == sent
    got = asyncio.run(read_back(other.grpc_url, [f"{STREAM}/#"], sent, timeout=90))
    kept = [payload for payload in waiting if payload not in publisher.refused]
    print(f"{len(waiting)} publishes waited on the frozen leader: {len(kept)} acknowledged after "
          f"SIGCONT, {len(waiting) - len(kept)} refused and sent again; "
          f"{len(publisher.refused)} refused in all, {len(sent)} sent")
    missing = sent - set(got)
    assert not missing, f"{len(missing)} acknowledged messages lost, e.g. {sorted(missing)[:5]}"
    twice = {payload: count for payload, count in got.items() if count > 1}
    refused_twice = {payload: publisher.refused.get(payload) for payload in twice}
    assert not twice, (f"{len(twice)} messages stored more than once (refused although "
                       f"stored, then sent again): {sorted(refused_twice.items())[:5]}")
