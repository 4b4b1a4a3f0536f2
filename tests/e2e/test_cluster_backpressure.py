"""Back-pressure across nodes (issue 27, bug 2): a QoS 1 subscriber on one node, slower than
the publisher on the shard's owner, holds the peer's link (and through the link's credit the
publisher) instead of having acknowledged messages dropped as `slow_subscriber`. Real etcd,
real `shardgate serve` processes, real paho clients."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable

import paho.mqtt.client as mqtt

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess, topics_of
from tests.mqtt_clients import V5, Paho

Cluster = Callable[..., list[ClusterNodeProcess]]

SMALL_QUEUES = """
[mqtt]
max_queued_messages = 40
"""
COUNT = 1_500


def slow_subscriber_drops(node: ClusterNodeProcess) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{node.ports['http']}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found = re.search(r'^shardgate_messages_dropped_by_reason_total\{[^}]*reason="slow_subscriber"'
                      r'[^}]*\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_slow_qos1_subscriber_on_another_node_holds_the_publisher_and_loses_nothing(
    cluster: Cluster,
) -> None:
    n1, n2 = cluster(2, extra_config=SMALL_QUEUES)
    topic = topics_of(n1.status(), "default", "load", owner="n1")[0]
    # a subscriber that takes about a millisecond per message, with a window of 5: its
    # session's queue on n2 (40 at most) fills far faster than it reads
    subscriber = Paho(n2.mqtt_port, "slow-reader", V5, connect_properties={"ReceiveMaximum": 5})
    seen: list[bytes] = []

    def slow(client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        time.sleep(0.001)
        seen.append(message.payload)

    subscriber.client.on_message = slow
    subscriber.subscribe(topic, qos=1)  # SUBACK once n1 knows the route
    publisher = Paho(n1.mqtt_port, "fast-writer", V5, connect=False)
    publisher.client.max_inflight_messages_set(200)
    publisher.connect()
    infos = [publisher.client.publish(topic, str(index).encode(), qos=1) for index in range(COUNT)]
    for info in infos:
        info.wait_for_publish(120)
    assert all(info.is_published() for info in infos)  # every message acknowledged
    try:
        wait_for(lambda: len(seen) >= COUNT or slow_subscriber_drops(n2) > 0, timeout=60,
                 interval=0.2)
    except AssertionError:
        raise AssertionError(f"{len(seen)} of {COUNT} messages arrived, "
                             f"{slow_subscriber_drops(n2)} dropped, subscriber disconnected "
                             f"{subscriber.disconnects.qsize()} times") from None
    assert slow_subscriber_drops(n2) == 0
    assert sorted(int(payload) for payload in set(seen)) == list(range(COUNT))
    publisher.disconnect()
    subscriber.disconnect()

