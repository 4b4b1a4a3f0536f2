"""A persistent MQTT session whose node is frozen (SIGSTOP past its lease) while its client
resumes it on another node, then continues (SIGCONT): when the client later comes back to that
node, it gets the session as the other node left it, not the copy the frozen node still held.
A real etcd, three `shardgate serve --cluster` processes, paho MQTT 5 clients.

What is promised (QoS 1, at least once): no acknowledged message is lost, and a session that
moves between live nodes sends again only what its client had not acknowledged when it moved
(here nothing: each move comes once the client acknowledged everything it was sent).
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Callable

import pytest
from shardgate.protocols.mqtt.snapshot import SessionSnapshot

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess, EtcdServer, wait_settled
from tests.e2e.test_cluster_state_sessions import etcd_get, spread_stream, topics_under
from tests.mqtt_clients import V5, Paho

Cluster = Callable[..., list[ClusterNodeProcess]]
SNAPSHOT = "/shardgate/test.state/sessions/"
CLIENT = "frozen-home"


def everything_acknowledged_in_etcd(etcd: EtcdServer, holder: str, since_ms: int) -> bool:
    """Whether etcd's snapshot of the session, taken on `holder` while its client was connected
    and after `since_ms`, has nothing unacknowledged."""
    state = etcd_get(etcd, SNAPSHOT + CLIENT)
    if not state or not state.get("online") or state.get("node") != holder:
        return False
    snapshot = SessionSnapshot.decode(state)
    return snapshot.taken_ms >= since_ms and not any(cursor.unacked for cursor in snapshot.cursors)


def resume(node: ClusterNodeProcess) -> Paho:
    """The session's client connected to `node` (clean start 0), with its session there: a
    CONNECT refused while the session cannot be brought yet (server unavailable) is tried
    again."""
    deadline = time.monotonic() + 60
    while True:
        client = Paho(node.mqtt_port, CLIENT, V5, clean=False, session_expiry=3600,
                      connect=False, reconnect=False)
        flags, reason, _props = client.connect()
        if not reason.is_failure:
            assert flags.session_present
            return client
        client.disconnect()
        assert time.monotonic() < deadline, f"the session did not resume on {node.node_id}: {reason}"
        time.sleep(0.5)


def publish(publisher: Paho, topics: list[str], tag: str, rounds: int) -> list[str]:
    sent = []
    for number in range(rounds):
        for topic in topics:
            payload = f"{tag}-{number}-{topic}"
            publisher.publish(topic, payload, qos=1)
            sent.append(payload)
    return sent


def take(client: Paho, expected: list[str], got: Counter[str]) -> None:
    """Collect `client`'s messages into `got` until every one of `expected` came."""
    def arrived() -> bool:
        while not client.messages.empty():
            got[client.messages.get().payload.decode()] += 1
        return all(payload in got for payload in expected)
    wait_for(arrived, timeout=60, interval=0.05)


@pytest.mark.timeout(300)
def test_a_session_whose_home_was_frozen_comes_back_there_as_the_other_node_left_it(
        cluster: Cluster, etcd: EtcdServer) -> None:
    n1, n2, n3 = cluster(3)
    spread_stream([n1, n2, n3], name="frz")
    topics = topics_under("frz")
    publisher = Paho(n3.mqtt_port, "frz-publisher", V5)
    got: Counter[str] = Counter()

    session = Paho(n1.mqtt_port, CLIENT, V5, clean=False, session_expiry=3600, reconnect=False)
    session.subscribe("frz/#", qos=1)
    before = publish(publisher, topics, "before", 10)
    take(session, before, got)
    # paho acknowledged them all; etcd's checkpoint of the connected session says so
    mark = int(time.time() * 1000)
    wait_for(lambda: everything_acknowledged_in_etcd(etcd, "n1", mark), timeout=20)

    # n1 freezes past its lease; the client gives up on it and resumes on n2
    assert n1.proc is not None
    n1.proc.send_signal(signal.SIGSTOP)
    try:
        session.drop()
        wait_for(lambda: "n1" not in {e["node_id"] for e in n2.status()["nodes"]}, timeout=30)
        session = resume(n2)
        while_frozen = publish(publisher, topics, "frozen", 5)
        take(session, while_frozen, got)
    finally:
        n1.proc.send_signal(signal.SIGCONT)
    wait_settled([n1, n2, n3])

    # the session lives on n2 now: what is published goes there
    on_n2 = publish(publisher, topics, "on-n2", 10)
    take(session, on_n2, got)
    mark = int(time.time() * 1000)
    wait_for(lambda: everything_acknowledged_in_etcd(etcd, "n2", mark), timeout=20)

    # the client comes back to n1, whose copy of the session stopped at the freeze
    session.disconnect()
    session = resume(n1)
    after = publish(publisher, topics, "after", 5)
    take(session, after, got)
    session.expect_none(within=1.0)
    session.disconnect()
    publisher.disconnect()

    sent = before + while_frozen + on_n2 + after
    assert not [payload for payload in sent if payload not in got]
    # nothing was unacknowledged at either move: nothing comes twice
    twice = sorted(payload for payload, count in got.items() if count > 1)
    assert not twice, f"{len(twice)} of {len(sent)} messages came twice: {twice[:10]}"


@pytest.mark.timeout(300)
def test_a_session_connected_through_its_nodes_freeze_comes_back_there_as_the_other_node_left_it(
        cluster: Cluster, etcd: EtcdServer) -> None:
    """The client stays connected through n1's freeze past its lease (its keep alive outlasts
    it), which takes the session's registry entry with the lease. It then moves to n2, which
    finds no holder named and resumes the session from etcd, and later back to n1."""
    n1, n2, n3 = cluster(3)
    spread_stream([n1, n2, n3], name="frc")
    topics = topics_under("frc")
    publisher = Paho(n3.mqtt_port, "frc-publisher", V5)
    got: Counter[str] = Counter()

    session = Paho(n1.mqtt_port, CLIENT, V5, clean=False, session_expiry=3600, reconnect=False)
    session.subscribe("frc/#", qos=1)
    before = publish(publisher, topics, "before", 10)
    take(session, before, got)
    assert n1.proc is not None
    n1.proc.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: "n1" not in {e["node_id"] for e in n2.status()["nodes"]}, timeout=30)
    finally:
        n1.proc.send_signal(signal.SIGCONT)
    wait_settled([n1, n2, n3])
    while_back = publish(publisher, topics, "back", 5)
    take(session, while_back, got)
    mark = int(time.time() * 1000)
    wait_for(lambda: everything_acknowledged_in_etcd(etcd, "n1", mark), timeout=20)

    session.disconnect()
    session = resume(n2)
    on_n2 = publish(publisher, topics, "on-n2", 10)
    take(session, on_n2, got)
    mark = int(time.time() * 1000)
    wait_for(lambda: everything_acknowledged_in_etcd(etcd, "n2", mark), timeout=20)

    session.disconnect()
    session = resume(n1)
    after = publish(publisher, topics, "after", 5)
    take(session, after, got)
    session.expect_none(within=1.0)
    session.disconnect()
    publisher.disconnect()

    sent = before + while_back + on_n2 + after
    assert not [payload for payload in sent if payload not in got]
    twice = sorted(payload for payload, count in got.items() if count > 1)
    assert not twice, f"{len(twice)} of {len(sent)} messages came twice: {twice[:10]}"
