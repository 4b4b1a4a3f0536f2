"""A replicated shard's leader on a slow, lossy link (issue 28): three `shardgate serve` nodes
in network namespaces as in `test_cluster_partition.py`, a reliable stream of one shard with
three replicas of which two must be in sync, and the leader's peer link made slow and lossy
each way: 200 ms of delay and 5 % loss with netem (`tc qdisc add ... netem delay 200ms loss
5%`) where the kernel has it; else a 60 kbit/s token bucket (a full packet waits about 200 ms,
and none more than 400 ms: `tc ... tbf`) and 5 % of the packets dropped at random by
iptables' `statistic` match (`netns_fixtures.link_impairment`). The link stays impaired until
the kernel counted at least `DROPS_WANTED` packets dropped on it. etcd and the clients are not
slowed.

Publishes to the leader go on being acknowledged, only slower (each waits for a follower's
fetch over the slow link); none is refused; nothing acknowledged is lost: every replica's
journal ends byte-identical, and a persistent QoS 1 subscriber on a follower (its messages
pushed to it over the slow link) gets every acknowledged message exactly once: the README
promises that a pushed message in flight when a link's connection breaks is neither lost nor
delivered twice, and nothing here fails a node over.

Skips where a link cannot be impaired by either means (checked at run time, in a namespace
of its own: no `tc`, neither netem nor tbf, no iptables), as well as where namespaces cannot
be made or etcd is absent.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import time
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ContinuousPublisher
from tests.e2e.netns_fixtures import LinkImpairment, link_impairment
from tests.e2e.test_cluster_partition import (
    STREAM,
    TOPIC,
    NamespacedNode,
    fully_in_sync,
    identical,
    partitionable_cluster,
)
from tests.mqtt_clients import V5, Paho

DELAY_MS = 200
LOSS_PERCENT = 5
# packets the impairment must have dropped before it is lifted: the link was really lossy
DROPS_WANTED = 10


class CountingSubscriber:
    """A persistent QoS 1 MQTT 5 subscriber to the stream that counts each payload it got."""

    def __init__(self, node: NamespacedNode, client_id: str) -> None:
        self.client = Paho(node.mqtt_port, client_id, V5, clean=False, session_expiry=600,
                           host=node.front)
        self.client.subscribe(f"{STREAM}/#", qos=1)
        self.got: collections.Counter[str] = collections.Counter()

    def receive(self, wanted: set[str], timeout: float) -> set[str]:
        """Take what came until every payload of `wanted` did, or `timeout` seconds passed;
        what of `wanted` did not come."""
        deadline = time.monotonic() + timeout
        while not wanted <= self.got.keys() and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                self.got[self.client.expect(0.5).payload.decode()] += 1
        return wanted - self.got.keys()

    def drain(self) -> None:
        """Take what is already here (a copy that came late)."""
        while True:
            try:
                self.got[self.client.messages.get_nowait().payload.decode()] += 1
            except queue.Empty:
                return

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.disconnect()


@pytest.mark.timeout(240)
def test_a_leader_on_a_slow_lossy_link_goes_on_acknowledging_and_loses_or_repeats_nothing(
        tmp_path: Path) -> None:
    means = link_impairment()
    if not isinstance(means, LinkImpairment):
        pytest.skip(means)
    with partitionable_cluster(tmp_path) as nodes:
        placed = wait_for(lambda: fully_in_sync(nodes["n1"]), timeout=60, interval=0.1)
        leader = nodes[placed["leader"]]
        followers = [nodes[name] for name in placed["replicas"] if name != leader.node_id]
        subscriber = CountingSubscriber(followers[0], "part-netem-sub")
        publisher = ContinuousPublisher(leader.mqtt_port, "pn", [TOPIC], host=leader.front,
                                        pause_s=0.005, ack_timeout_s=60)
        impaired = False
        try:
            wait_for(lambda: publisher.count() >= 50, timeout=60)

            leader.net.impair_peer_link(leader.index, DELAY_MS, LOSS_PERCENT)
            impaired = True
            impaired_at, before = time.monotonic(), publisher.count()

            def dropped() -> int:
                counts = leader.net.impairment_counts(leader.index)
                return counts["qdisc_dropped"] + counts["random_drops"]

            wait_for(lambda: publisher.count() >= before + 40 and dropped() >= DROPS_WANTED,
                     timeout=60, interval=0.2)
            slow_s = time.monotonic() - impaired_at
            slowed = publisher.count() - before
            counts = leader.net.impairment_counts(leader.index)
            assert publisher.refusals() == 0, sorted(
                {(code, reason) for code, reason, _topic in publisher.refused})[:3]
            leader.net.restore_peer_link(leader.index)
            impaired = False

            wait_for(lambda: fully_in_sync(leader), timeout=60, interval=0.1)
            restored = publisher.count()
            wait_for(lambda: publisher.count() >= restored + 50, timeout=60)
            publisher.stop()
            assert not publisher.dropped.is_set()
            assert publisher.refusals() == 0, sorted(
                {(code, reason) for code, reason, _topic in publisher.refused})[:3]

            everything = set(publisher.acknowledged)
            wait_for(lambda: identical([leader, *followers]), timeout=60, interval=0.2)
            missing = subscriber.receive(everything, timeout=60)
            assert not missing, (f"the subscriber lacks {len(missing)} of {len(everything)} "
                                 f"acknowledged, e.g. {sorted(missing)[:5]}")
            subscriber.drain()
            twice = {payload: count for payload, count in subscriber.got.items() if count > 1}
            assert not twice, f"{len(twice)} delivered more than once, e.g. {sorted(twice)[:5]}"
            print(f"{means}: {slowed} acknowledged over the slow link in {slow_s:.1f} s "
                  f"({counts}); {len(everything)} acknowledged in all, none refused, each "
                  f"received once, journals identical")
        finally:
            if impaired:
                with contextlib.suppress(Exception):
                    leader.net.restore_peer_link(leader.index)
            with contextlib.suppress(AssertionError):
                publisher.stop()
            subscriber.close()
