"""A changed ACL keeps an AMQP user from every message it may no longer read, whichever way the
message reaches a queue (issue 26, item 7): through an exchange-to-exchange binding (the queue's
consumer is cancelled, as for its own bindings) and out of a queue by dead-lettering (the
queue's declaring user must be able to read what it dead-letters). The bindings themselves stay,
as in RabbitMQ: the queue is still a queue another reader may have, but no path hands its
messages to a user who may not read them.

A real `shardgate serve`, users added with `shardgate users add`, the ACL changed by rewriting
`acl.toml` as an operator does (re-read within a second), pika as the client."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pika
import pika.exceptions
import pytest

from tests.conftest import BrokerProcess, free_port, wait_for
from tests.e2e.test_login_flood import add_user
from tests.e2e.test_security_changes import publish

WIDE_ACL = ('[[allow]]\nuser = "alice"\nactions = ["publish", "subscribe"]\n'
            'topics = ["a/#", "b/#", "$amqp/#"]\n'
            '[[allow]]\nuser = "carol"\nactions = ["publish", "subscribe"]\n'
            'topics = ["a/#", "$amqp/#"]\n'
            '[[allow]]\nuser = "publisher"\nactions = "publish"\ntopics = ["a/#", "b/#"]\n')
# alice may no longer read a/#; the publisher still publishes there
NARROW_ACL = WIDE_ACL.replace('"a/#", "b/#", "$amqp/#"', '"b/#", "$amqp/#"')


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[BrokerProcess, Path]]:
    data_dir = tmp_path / "data"
    add_user(data_dir, "alice", "alice-pw")
    add_user(data_dir, "carol", "carol-pw")
    add_user(data_dir, "publisher", "pub-pw")
    acl = data_dir / "acl.toml"
    acl.write_text(WIDE_ACL)
    broker = BrokerProcess(data_dir, ["--amqp-port", str(free_port())]).start()
    yield broker, acl
    broker.terminate()


def narrow(broker: BrokerProcess, acl: Path) -> None:
    """Write the narrowed ACL and wait until the broker has applied it."""
    def loads() -> int:
        return broker.log_path.read_text(errors="replace").count("loaded 3 ACL rules")

    before = loads()
    acl.write_text(NARROW_ACL)
    wait_for(lambda: loads() > before, timeout=30)


def connect(broker: BrokerProcess, user: str = "alice") -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", broker.ports["amqp"], credentials=pika.PlainCredentials(user, f"{user}-pw"),
        connection_attempts=1, socket_timeout=30, blocked_connection_timeout=30, stack_timeout=30))


def pump(connection: pika.BlockingConnection) -> Callable[[Callable[[], bool]], bool]:
    def until(condition: Callable[[], bool]) -> bool:
        connection.process_data_events(time_limit=0.2)
        return condition()
    return until


def test_a_consumer_fed_through_an_exchange_binding_is_cancelled_when_its_user_may_no_longer_read(
        secured: tuple[BrokerProcess, Path]) -> None:
    broker, acl = secured
    connection = connect(broker)
    try:
        until = pump(connection)
        channel = connection.channel()
        # alice's own fanout exchange, fed from amq.topic's a.# by an exchange binding: her
        # queue's own binding is to $amqp/alice-x/..., which she may still read afterwards
        channel.exchange_declare("alice-x", "fanout")
        channel.exchange_bind(destination="alice-x", source="amq.topic", routing_key="a.#")
        channel.queue_declare("alice-q")
        channel.queue_bind("alice-q", "alice-x")
        received: list[bytes] = []
        cancelled: list[object] = []
        channel.add_on_cancel_callback(cancelled.append)
        channel.basic_consume("alice-q", lambda ch, method, props, body: received.append(body),
                              auto_ack=True)
        publish(broker.mqtt_port, "a/1", b"before")
        wait_for(lambda: until(lambda: received == [b"before"]), timeout=30)
        narrow(broker, acl)
        wait_for(lambda: until(lambda: bool(cancelled)), timeout=30)
        publish(broker.mqtt_port, "a/2", b"after")
        connection.process_data_events(time_limit=1.0)
        assert received == [b"before"]
        # nor can it come back: what the exchange binding brings is checked at basic.consume
        with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="403"):
            channel.basic_consume("alice-q", lambda *args: None, auto_ack=True)
    finally:
        connection.close()


def test_an_exchange_binding_another_user_makes_cancels_a_consumer_that_may_not_read_it(
        secured: tuple[BrokerProcess, Path]) -> None:
    broker, acl = secured
    narrow(broker, acl)  # alice may not read a/#; carol may
    connection, carols = connect(broker), connect(broker, "carol")
    try:
        until = pump(connection)
        channel = connection.channel()
        channel.exchange_declare("alice-y", "fanout")
        channel.queue_declare("alice-yq")
        channel.queue_bind("alice-yq", "alice-y")
        # alice's own exchange.bind to a.# is refused (403) ...
        with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="403"):
            connection.channel().exchange_bind(destination="alice-y", source="amq.topic",
                                               routing_key="a.#")
        cancelled: list[object] = []
        received: list[bytes] = []
        channel.add_on_cancel_callback(cancelled.append)
        channel.basic_consume("alice-yq", lambda ch, method, props, body: received.append(body),
                              auto_ack=True)
        # ... carol's is not (she reads a/#): alice's consumer, whose queue it now feeds, ends
        carols.channel().exchange_bind(destination="alice-y", source="amq.topic",
                                       routing_key="a.#")
        wait_for(lambda: until(lambda: bool(cancelled)), timeout=30)
        publish(broker.mqtt_port, "a/3", b"never")
        connection.process_data_events(time_limit=1.0)
        assert received == []
    finally:
        carols.close()
        connection.close()


def test_dead_lettering_does_not_hand_on_what_the_queue_owner_may_no_longer_read(
        secured: tuple[BrokerProcess, Path]) -> None:
    broker, acl = secured
    connection = connect(broker)
    try:
        until = pump(connection)
        channel = connection.channel()
        # a queue on a.# whose messages die at once into amq.topic as b.dead, which alice reads
        channel.queue_declare("alice-dead", arguments={
            "x-message-ttl": 0, "x-dead-letter-exchange": "amq.topic",
            "x-dead-letter-routing-key": "b.dead"})
        channel.queue_bind("alice-dead", "amq.topic", "a.#")
        channel.queue_declare("alice-b")
        channel.queue_bind("alice-b", "amq.topic", "b.#")
        received: list[bytes] = []
        channel.basic_consume("alice-b", lambda ch, method, props, body: received.append(body),
                              auto_ack=True)
        publish(broker.mqtt_port, "a/1", b"dead before")
        wait_for(lambda: until(lambda: received == [b"dead before"]), timeout=30)
        narrow(broker, acl)
        publish(broker.mqtt_port, "a/2", b"dead after")
        publish(broker.mqtt_port, "b/3", b"marker")
        wait_for(lambda: until(lambda: b"marker" in received), timeout=30)
        connection.process_data_events(time_limit=1.0)
        assert received == [b"dead before", b"marker"]
        log = broker.log_path.read_text(errors="replace")
        assert "dead-lettering refused, user 'alice' may not read 'a/2'" in log
        assert "Traceback" not in log
    finally:
        connection.close()
