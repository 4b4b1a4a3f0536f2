"""A persistent session that resumes behind many topics' traffic gets exactly its messages, in
order: its replay reads the journal through the segments' key index (`shardgate serve` keys
the journal by topic prefix), and after a SIGKILL the index is rebuilt from the recovered
segment. A session whose filter matches every key (`fleet/+/dev/7`) is served by scanning
blocks, and gets exactly its messages too."""

from __future__ import annotations

from collections.abc import Callable

from tests.conftest import BrokerProcess
from tests.mqtt_clients import V5, Paho

SUBTREES = 30
PER_PHASE = 1500


def topic(i: int) -> str:
    return f"fleet/{i % SUBTREES}/dev/{i % 11}"


def publish_traffic(port: int, first: int, count: int) -> None:
    """QoS 1 messages over every subtree, each acknowledged before this returns."""
    publisher = Paho(port, "traffic", V5)
    infos = [publisher.publish(topic(i), b"%d" % i, qos=1, wait=False)
             for i in range(first, first + count)]
    for info in infos:
        info.wait_for_publish(30)
        assert info.is_published()
    publisher.disconnect()


def resume(port: int, client_id: str, expected: list[int]) -> list[tuple[str, int]]:
    """Resume the session, take `expected` many messages, check nothing else comes."""
    session = Paho(port, client_id, V5, clean=False, session_expiry=3600)
    got = [(m.topic, int(m.payload)) for m in session.expect_n(len(expected), timeout=30)]
    session.expect_none(0.5)
    session.disconnect()
    return got


def test_resumed_sessions_get_exactly_their_messages_through_the_key_index(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    node = broker_process().start()
    filters = {"subtree": "fleet/7/#", "device": "fleet/+/dev/7"}
    for client_id, topic_filter in filters.items():
        session = Paho(node.mqtt_port, client_id, V5, clean=False, session_expiry=3600)
        session.subscribe(topic_filter, 1)
        session.disconnect()

    def wanted(client_id: str, first: int) -> list[tuple[str, int]]:
        if client_id == "subtree":
            return [(topic(i), i) for i in range(first, first + PER_PHASE) if i % SUBTREES == 7]
        return [(topic(i), i) for i in range(first, first + PER_PHASE) if i % 11 == 7]

    publish_traffic(node.mqtt_port, 0, PER_PHASE)
    for client_id in filters:
        expected = wanted(client_id, 0)
        assert resume(node.mqtt_port, client_id, [i for _, i in expected]) == expected

    # Acknowledged while the sessions are away, then the broker is killed: the active
    # segment is recovered, its key index rebuilt, and the replay reads through it.
    publish_traffic(node.mqtt_port, PER_PHASE, PER_PHASE)
    node.kill()
    node.start()
    for client_id in filters:
        expected = wanted(client_id, PER_PHASE)
        assert resume(node.mqtt_port, client_id, [i for _, i in expected]) == expected
    node.terminate()
