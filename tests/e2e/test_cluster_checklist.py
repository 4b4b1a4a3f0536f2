"""Issue 14's checklist items that no other test proved through the real interface: a slow node
(frozen with SIGSTOP for less than its lease TTL and link timeout) while clients publish on both
nodes and a subscriber reads on the other. A real etcd, two `shardgate serve --cluster`
processes, raw MQTT 5 publishers and a paho subscriber.

The slow node keeps its lease and its shards (no epoch changes), its peer goes on serving its
own shards meanwhile, publishes waiting for the frozen node are answered once it continues
(acknowledged, or refused with a retryable reason), and every acknowledged message is stored
once and reaches the subscriber once, in per-topic order.
"""

from __future__ import annotations

import queue
import signal
import time
from collections import defaultdict

import pytest

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import (
    ClusterNodeProcess,
    ContinuousPublisher,
    EtcdServer,
    topics_of,
    wait_settled,
)
from tests.e2e.test_cluster_cross_node import routes_reach
from tests.e2e.test_cluster_faults import (
    RETRYABLE,
    assert_every_acknowledged_message_is_stored_once,
    nodes,  # noqa: F401  (the fixture: n1, n2, stream `safe`)
    sequence,
)
from tests.mqtt_clients import V5, Paho

# The freeze: well inside the lease TTL (3 s) and the link timeout (3 s).
FROZEN_S = 1.5


def epochs(node: ClusterNodeProcess) -> dict[str, list[list[object]]]:
    return node.status()["placement"]


@pytest.mark.timeout(240)
def test_a_node_frozen_for_less_than_its_lease_delays_clients_but_loses_and_repeats_nothing(
    nodes: list[ClusterNodeProcess],  # noqa: F811
) -> None:
    n1, n2 = nodes
    status = n1.status()
    topics = topics_of(status, "safe", "safe/slow", per_shard=2)
    own = topics_of(status, "safe", "safe/own", owner="n1", per_shard=2)
    reader = Paho(n1.mqtt_port, "reader", V5)
    reader.subscribe("safe/#", 1)
    routes_reach(nodes, n1)
    placement_before = epochs(n1)
    to_n1 = ContinuousPublisher(n1.mqtt_port, "to-n1", own)
    via_n1 = ContinuousPublisher(n1.mqtt_port, "via-n1", topics)
    on_n2 = ContinuousPublisher(n2.mqtt_port, "on-n2", topics)
    wait_for(lambda: min(p.count() for p in (to_n1, via_n1, on_n2)) >= 50, timeout=60)
    assert n2.proc is not None
    n2.proc.send_signal(signal.SIGSTOP)
    at_freeze = to_n1.count()
    try:
        time.sleep(FROZEN_S)  # the fault's length
    finally:
        n2.proc.send_signal(signal.SIGCONT)
    # n1's own shards went on being served while n2 was frozen
    assert to_n1.count() > at_freeze, "n1 stalled with its peer"
    # the publishes that waited for n2 are answered once it continues
    marks = {p.name: p.count() + p.refusals() for p in (via_n1, on_n2)}
    wait_for(lambda: all(p.count() + p.refusals() >= marks[p.name] + 20 for p in (via_n1, on_n2)),
             timeout=30)
    for publisher in (to_n1, via_n1, on_n2):
        publisher.stop()
        assert not publisher.dropped.is_set(), f"{publisher.name}: {publisher.disconnect}"
        assert {code for code, _reason, _topic in publisher.refused} <= RETRYABLE, publisher.refused[:3]
    # a slow node is not a dead one: it kept its lease, so no shard changed owner or epoch
    assert epochs(n1) == placement_before
    assert {entry["node_id"] for entry in n1.status()["nodes"]} == {"n1", "n2"}
    publishers = [to_n1, via_n1, on_n2]
    assert_every_acknowledged_message_is_stored_once(nodes, publishers)
    # the subscriber on n1 gets every acknowledged message once, each publisher's in order per
    # topic (publishes refused while n2 was frozen were not stored and do not come)
    acknowledged = {payload for p in publishers for payload in p.acknowledged}
    got: dict[tuple[str, str], list[int]] = defaultdict(list)
    seen: set[str] = set()

    def take() -> bool:
        while True:
            try:
                message = reader.messages.get_nowait()
            except queue.Empty:
                return acknowledged <= seen
            payload = message.payload.decode()
            assert payload not in seen, f"{payload} came twice"
            seen.add(payload)
            got[(message.topic, payload.rsplit("-", 1)[0])].append(sequence(payload))

    wait_for(take, timeout=60)
    for (topic, publisher_name), numbers in got.items():
        assert numbers == sorted(numbers), f"{publisher_name} on {topic} out of order"
    reader.disconnect()


@pytest.mark.timeout(240)
def test_a_node_that_loses_etcd_serves_its_shards_for_the_lease_ttl_then_refuses_then_rejoins(
    nodes: list[ClusterNodeProcess], etcd: EtcdServer,  # noqa: F811
) -> None:
    """etcd is killed while a client publishes to n1's own reliable shards: n1 keeps
    acknowledging them while its lease can still be alive, then refuses them (it can no longer
    prove it owns them: retryable, with a reason), and acknowledges again once etcd is back and
    it has registered again. Nothing acknowledged is lost or stored twice."""
    n1, _n2 = nodes
    own = topics_of(n1.status(), "safe", "safe/etcd", owner="n1", per_shard=2)
    publisher = ContinuousPublisher(n1.mqtt_port, "own", own)
    wait_for(lambda: publisher.count() >= 50, timeout=60)
    etcd.kill()
    at_kill = publisher.count()
    wait_for(lambda: publisher.refusals() >= 1, timeout=30)
    # the first refusal came only after more acknowledgements: n1 served through its lease TTL
    served_through_ttl = publisher.count() - at_kill
    assert served_through_ttl > 0, "refused at once: the lease TTL was not used"
    wait_for(lambda: not n1.status()["lease_alive"], timeout=30)
    assert {code for code, _reason, _topic in publisher.refused} <= RETRYABLE, publisher.refused[:3]
    assert all(reason for _code, reason, _topic in publisher.refused), "every refusal says why"
    etcd.start()
    wait_settled(nodes)
    # acknowledged again: 50 in a row with no refusal between them
    mark = [publisher.count(), publisher.refusals()]

    def fifty_in_a_row() -> bool:
        if publisher.refusals() != mark[1]:
            mark[:] = [publisher.count(), publisher.refusals()]
        return publisher.count() >= mark[0] + 50

    wait_for(fifty_in_a_row, timeout=60)
    publisher.stop()
    assert not publisher.dropped.is_set(), publisher.disconnect
    assert_every_acknowledged_message_is_stored_once(nodes, [publisher])
