"""Read access to an AMQP queue of another node (issue 26, item 7 in a cluster): a consumer on
node n2 of a queue whose home is n1 is checked at n1, as a local one is: after the ACL changes
so that its user may no longer read what the queue's bindings bring, it is cancelled, and a new
basic.consume or basic.get from n2 answers 403. Real etcd, two `shardgate serve --cluster`
processes, users added with `shardgate users add`, the ACL changed by rewriting `acl.toml` on
one node (the cluster keeps it equal on every node), pika as the client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pika
import pika.exceptions
import pytest

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess, EtcdServer, amqp_node
from tests.e2e.test_amqp_acl_changes import NARROW_ACL, WIDE_ACL
from tests.e2e.test_cluster_amqp_queues import wait_joined
from tests.e2e.test_cluster_session_owner import add_users
from tests.mqtt_clients import V311, Paho


@pytest.fixture
def nodes(etcd: EtcdServer, tmp_path: Path) -> Iterator[list[ClusterNodeProcess]]:
    started = [amqp_node(tmp_path, f"n{index}", etcd.url).start() for index in (1, 2)]
    wait_joined(started)
    yield started
    for node in started:
        if node.alive():
            node.kill()


def loads(node: ClusterNodeProcess) -> int:
    return node.log_path.read_text(errors="replace").count("loaded 3 ACL rules")


def set_acl(nodes: list[ClusterNodeProcess], text: str) -> None:
    """Write `text` as n1's ACL and wait until every node has loaded it."""
    before = [loads(node) for node in nodes]
    (nodes[0].data_dir / "acl.toml").write_text(text)
    for node, count in zip(nodes, before, strict=True):
        wait_for(lambda node=node, count=count: loads(node) > count, timeout=60, interval=0.1)


def alice(node: ClusterNodeProcess) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", node.ports["amqp"], credentials=pika.PlainCredentials("alice", "alice-pw"),
        connection_attempts=1, socket_timeout=30, blocked_connection_timeout=30, stack_timeout=30))


@pytest.mark.timeout(300)
def test_a_consumer_on_another_node_is_checked_and_cancelled_at_the_queues_home(
        nodes: list[ClusterNodeProcess]) -> None:
    n1, n2 = nodes
    add_users(n1.data_dir)  # alice, bob, sender
    set_acl(nodes, WIDE_ACL.replace('user = "publisher"', 'user = "sender"'))
    home, there = alice(n1), alice(n2)
    try:
        declaring = home.channel()
        declaring.queue_declare("alice-remote", durable=True)
        declaring.queue_bind("alice-remote", "amq.topic", "a.#")
        channel = there.channel()
        received: list[bytes] = []
        cancelled: list[object] = []
        channel.add_on_cancel_callback(cancelled.append)
        channel.basic_consume("alice-remote", lambda ch, method, props, body: received.append(body),
                              auto_ack=True)
        sender = Paho(n1.mqtt_port, "sender", V311, username="sender", password="sender-pw")
        sender.publish("a/1", b"before", qos=1)

        def pumped(condition) -> bool:  # type: ignore[no-untyped-def]
            there.process_data_events(time_limit=0.2)
            return bool(condition())

        wait_for(lambda: pumped(lambda: received == [b"before"]), timeout=30)
        set_acl(nodes, NARROW_ACL.replace('user = "publisher"', 'user = "sender"'))
        wait_for(lambda: pumped(lambda: cancelled), timeout=30)
        sender.publish("a/2", b"after", qos=1)
        there.process_data_events(time_limit=1.0)
        assert received == [b"before"]
        sender.disconnect()
        # nor can it come back from n2, by basic.consume or basic.get
        with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="403"):
            there.channel().basic_consume("alice-remote", lambda *args: None, auto_ack=True)
        with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="403"):
            there.channel().basic_get("alice-remote", auto_ack=True)
    finally:
        for connection in (there, home):
            if connection.is_open:
                connection.close()
    for node in nodes:
        assert "Traceback" not in node.log_path.read_text(errors="replace")
