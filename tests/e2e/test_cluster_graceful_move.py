"""A persistent session whose node leaves gracefully (issue 27, bug 3): its client was on the
leaving node, subscribed QoS 1 to a non-reliable stream while a publisher on the node that
stays publishes QoS 1 continuously. The leaving node hands the session (offline, with what it
holds) to the node that stays, so everything published after it left is kept there for the
client, who comes back later. Real etcd, real `shardgate serve` processes, real clients.

What is published during the hand-off itself, between the leaving node's snapshot and the new
node's serving the session's routes, is taken by the leaving node's stand-in and handed over
too: `test_cluster_rolling_restart.py` checks that nothing acknowledged is lost."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import (
    ClusterNodeProcess,
    ContinuousPublisher,
    EtcdServer,
    protocol_node,
    topics_of,
    wait_settled,
)
from tests.mqtt_clients import V5, Paho

# (an offline session keeps at most `max_queued_messages` of a non-reliable stream, as on one
# node: room for everything published while it is away)
FAST = ('[mqtt]\nmax_queued_messages = 100000\n\n'
        '[[streams]]\nname = "fast"\nmode = "non-reliable"\npartitions = 6\n')


@pytest.fixture
def started(etcd: EtcdServer, tmp_path: Path) -> Iterator[list[ClusterNodeProcess]]:
    nodes: list[ClusterNodeProcess] = []
    yield nodes
    for node in nodes:
        if node.alive():
            node.kill()


@pytest.mark.timeout(300)
def test_a_persistent_session_keeps_what_is_published_after_its_node_left_gracefully(
    started: list[ClusterNodeProcess], etcd: EtcdServer, tmp_path: Path,
) -> None:
    n1 = protocol_node(tmp_path, "n1", etcd.url, FAST).start()
    n2 = protocol_node(tmp_path, "n2", etcd.url, FAST).start()
    started += [n1, n2]
    wait_settled(started)
    topics = topics_of(n1.status(), "fast", "fast/m", per_shard=2)
    received: list[str] = []
    mover = Paho(n2.mqtt_port, "mover", V5, clean=False, session_expiry=300)
    mover.client.reconnect_delay_set(300, 300)  # it comes back to n1, below
    mover.subscribe("fast/m/#", 1)
    publisher = ContinuousPublisher(n1.mqtt_port, "steady", topics)

    def take(client: Paho) -> None:
        while True:
            try:
                received.append(client.expect(timeout=0).payload.decode())
            except queue.Empty:
                return

    wait_for(lambda: publisher.count() >= 200 and (take(mover) or True), timeout=60, interval=0.05)
    assert n2.terminate() == 0  # graceful: it hands its shards and its sessions over
    left = publisher.count()  # acknowledged before n2 had exited
    mover.client.loop_stop()
    take(mover)
    wait_settled([n1])
    # the client comes back a while after its node left
    wait_for(lambda: publisher.count() >= left + 500, timeout=60, interval=0.05)
    back = Paho(n1.mqtt_port, "mover", V5, clean=False, session_expiry=300, connect=False)
    assert back.connect()[0].session_present
    mark = publisher.count()
    wait_for(lambda: publisher.count() >= mark + 200 and (take(back) or True), timeout=60,
             interval=0.05)
    publisher.stop()
    after_leaving = set(list(publisher.acknowledged)[left:])
    try:
        wait_for(lambda: (take(back) or True) and after_leaving <= set(received), timeout=30,
                 interval=0.05)
    except AssertionError:
        missing = sorted(after_leaving - set(received), key=lambda p: int(p.rsplit("-", 1)[1]))
        raise AssertionError(f"{len(missing)} of the {len(after_leaving)} messages acknowledged "
                             f"after n2 left never reached the session: {missing[:20]}") from None
    back.disconnect()
