"""Changes of users and ACL rules apply at once to a running `shardgate serve`, on every surface:
`shardgate users add NAME --role admin` closes the admin HTTP API and gRPC to anonymous clients
at the next request (no MQTT or gRPC client needs to connect first), removing the last user
opens both again, a removed user's connected clients are disconnected, and a subscription the
changed ACL no longer allows stops receiving."""

from __future__ import annotations

import http.client
import queue
import subprocess
import sys
import threading
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from tests.conftest import BrokerProcess, free_port, wait_for
from tests.e2e.test_login_flood import add_user


def users(data_dir: Path, *args: str) -> None:
    subprocess.run([sys.executable, "-m", "shardgate", "users", *args, "--data-dir", str(data_dir)],
                   check=True, capture_output=True, timeout=60)


def http_status(port: int, method: str, path: str) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        connection.request(method, path, headers={"Content-Type": "application/json",
                                                  "X-Requested-With": "shardgate"})
        return connection.getresponse().status
    finally:
        connection.close()


def grpc_anonymous_ok(port: int) -> bool:
    from shardgate.client import SyncClient, Unauthenticated

    client = SyncClient(f"127.0.0.1:{port}")
    try:
        client.producer().publish("open/x", b"1")
        return True
    except Unauthenticated:
        return False
    finally:
        client.close()


@pytest.fixture
def broker(tmp_path: Path) -> BrokerProcess:
    process = BrokerProcess(tmp_path / "data", ["--grpc-port", str(free_port()),
                                                "--http-port", str(free_port())])
    process.start()
    yield process
    process.terminate()


def test_adding_and_removing_the_admin_applies_at_once_to_http_and_grpc(broker: BrokerProcess) -> None:
    http_port, grpc_port = broker.ports["http"], broker.ports["grpc"]
    assert http_status(http_port, "POST", "/api/archive/flush") == 200
    assert grpc_anonymous_ok(grpc_port)
    users(broker.data_dir, "add", "root", "--role", "admin", "--password", "root-pw")
    # At once: no other client connected in between.
    assert http_status(http_port, "POST", "/api/archive/flush") == 401
    assert http_status(http_port, "DELETE", "/api/clients/mqtt/nobody") == 401
    assert not grpc_anonymous_ok(grpc_port)
    users(broker.data_dir, "remove", "root")
    assert http_status(http_port, "POST", "/api/archive/flush") == 200
    assert grpc_anonymous_ok(grpc_port)


class Subscriber:
    def __init__(self, port: int, user: str, password: str) -> None:
        self.messages: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.disconnected = threading.Event()
        subscribed = threading.Event()
        connected = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"{user}-sub",
                                  protocol=mqtt.MQTTv5)
        self.client.username_pw_set(user, password)
        self.client.on_message = lambda c, u, m: self.messages.put((m.topic, m.payload))
        self.client.on_connect = lambda *args: connected.set()
        self.client.on_subscribe = lambda *args: subscribed.set()
        self.client.on_disconnect = lambda *args: self.disconnected.set()
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        assert connected.wait(20)
        self.client.subscribe([("a/#", 1), ("b/#", 1)])
        assert subscribed.wait(20)

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def publish(port: int, topic: str, payload: bytes) -> None:
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="pub", protocol=mqtt.MQTTv311)
    client.username_pw_set("publisher", "pub-pw")
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        client.publish(topic, payload, qos=1).wait_for_publish(20)
    finally:
        client.loop_stop()
        client.disconnect()


def test_changed_acl_stops_a_subscription_and_a_removed_user_is_disconnected(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    add_user(data_dir, "alice", "alice-pw")
    add_user(data_dir, "publisher", "pub-pw")
    acl = data_dir / "acl.toml"
    acl.write_text('[[allow]]\nactions = ["publish", "subscribe"]\ntopics = ["a/#", "b/#"]\n')
    broker = BrokerProcess(data_dir).start()
    try:
        alice = Subscriber(broker.mqtt_port, "alice", "alice-pw")
        publish(broker.mqtt_port, "a/1", b"before")
        assert alice.messages.get(timeout=20) == ("a/1", b"before")
        # alice may no longer read a/#; the publisher still may publish there.
        acl.write_text('[[allow]]\nactions = ["publish", "subscribe"]\ntopics = ["b/#"]\n'
                       '[[allow]]\nuser = "publisher"\nactions = "publish"\ntopics = ["a/#"]\n')
        log = broker.log_path

        def removed() -> bool:
            return "subscriptions no longer allowed were removed" in log.read_text(errors="replace")

        wait_for(removed, timeout=20)
        publish(broker.mqtt_port, "a/2", b"after")
        publish(broker.mqtt_port, "b/2", b"still allowed")
        # One shard, in order: a/2, had it been delivered, would have come first.
        assert alice.messages.get(timeout=20) == ("b/2", b"still allowed")
        users(data_dir, "remove", "alice")
        assert alice.disconnected.wait(20), "a removed user stays connected"
        alice.close()
    finally:
        broker.terminate()


NARROWED_ACL = ('[[allow]]\nactions = ["publish", "subscribe"]\ntopics = ["b/#"]\n'
                '[[allow]]\nuser = "publisher"\nactions = "publish"\ntopics = ["a/#"]\n')


def acl_broker(tmp_path: Path) -> tuple[BrokerProcess, Path]:
    data_dir = tmp_path / "data"
    add_user(data_dir, "alice", "alice-pw")
    add_user(data_dir, "publisher", "pub-pw")
    acl = data_dir / "acl.toml"
    acl.write_text('[[allow]]\nactions = ["publish", "subscribe"]\ntopics = ["a/#", "b/#"]\n')
    broker = BrokerProcess(data_dir, ["--grpc-port", str(free_port()), "--amqp-port", str(free_port())])
    return broker.start(), acl


def logged(broker: BrokerProcess, text: str) -> bool:
    return text in broker.log_path.read_text(errors="replace")


def test_an_offline_persistent_session_loses_what_the_changed_acl_no_longer_allows(tmp_path: Path) -> None:
    from tests.mqtt_clients import V5, Paho

    broker, acl = acl_broker(tmp_path)
    try:
        alice = Paho(broker.mqtt_port, "alice-away", V5, clean=False, session_expiry=3600,
                     username="alice", password="alice-pw")
        alice.subscribe([("a/#", 1), ("b/#", 1)])
        alice.disconnect()
        publish(broker.mqtt_port, "a/1", b"while away, before the change")
        acl.write_text(NARROWED_ACL)
        wait_for(lambda: logged(broker, "loaded 2 ACL rules"), timeout=30)
        publish(broker.mqtt_port, "a/2", b"after the change")
        publish(broker.mqtt_port, "b/2", b"still allowed")
        back = Paho(broker.mqtt_port, "alice-away", V5, clean=False, session_expiry=3600,
                    username="alice", password="alice-pw")
        # the session's stored messages for a/# are not handed over either: b/2 comes first
        assert back.expect(timeout=30).payload == b"still allowed"
        back.expect_none(1.0)
        back.disconnect()
    finally:
        broker.terminate()


def test_a_grpc_consumer_that_may_no_longer_read_is_ended_with_permission_denied(tmp_path: Path) -> None:
    from shardgate.client import PermissionDenied, SyncClient

    broker, acl = acl_broker(tmp_path)
    client = SyncClient(f"127.0.0.1:{broker.ports['grpc']}", username="alice", password="alice-pw")
    try:
        consumer = client.consumer("alice-reads", ["a/#"], reconnect=False)
        publish(broker.mqtt_port, "a/1", b"before")
        # the first message arrives once the stream is subscribed (publish again until then)
        def got_one() -> bool:
            try:
                return consumer.receive(timeout=1).payload == b"before"
            except TimeoutError:
                publish(broker.mqtt_port, "a/1", b"before")
                return False

        wait_for(got_one, timeout=60)
        acl.write_text(NARROWED_ACL)
        with pytest.raises(PermissionDenied, match="may no longer subscribe to 'a/#'"):
            while True:
                consumer.receive(timeout=30)
    finally:
        client.close()
        broker.terminate()


def test_an_amqp_consumer_that_may_no_longer_read_its_queue_gets_basic_cancel(tmp_path: Path) -> None:
    import pika

    broker, acl = acl_broker(tmp_path)
    connection = pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", broker.ports["amqp"], credentials=pika.PlainCredentials("alice", "alice-pw"),
        connection_attempts=1, socket_timeout=30, blocked_connection_timeout=30, stack_timeout=30))
    try:
        channel = connection.channel()
        channel.queue_declare("alice-q")
        channel.queue_bind("alice-q", "amq.topic", "a.#")
        received: list[bytes] = []
        cancelled: list[object] = []
        channel.add_on_cancel_callback(cancelled.append)
        channel.basic_consume("alice-q", lambda ch, method, props, body: received.append(body),
                              auto_ack=True)
        publish(broker.mqtt_port, "a/1", b"before")

        def until(condition) -> bool:
            connection.process_data_events(time_limit=0.2)
            return condition()

        wait_for(lambda: until(lambda: received == [b"before"]), timeout=30)
        acl.write_text(NARROWED_ACL)
        wait_for(lambda: until(lambda: bool(cancelled)), timeout=30)
        publish(broker.mqtt_port, "a/2", b"after")
        connection.process_data_events(time_limit=1.0)
        assert received == [b"before"]
        assert channel.is_open  # the consumer ended, not the channel
        # and it cannot come back: basic.consume checks what the queue's bindings bring
        with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="403"):
            channel.basic_consume("alice-q", lambda *args: None, auto_ack=True)
    finally:
        connection.close()
        broker.terminate()


GRANTS = ('[[allow]]\nuser = "alice"\nactions = ["publish", "subscribe"]\ntopics = ["a/#", "b/#"]\n'
          '[[allow]]\nuser = "watcher"\nactions = "subscribe"\ntopics = ["#"]\n')
# alice's grant on a/# is gone, nothing else changes
GRANT_REMOVED = GRANTS.replace('"a/#", "b/#"', '"b/#"')


def test_a_removed_grant_refuses_the_next_publish_and_subscribe_of_clients_already_connected(
        tmp_path: Path) -> None:
    """alice is connected by MQTT, a gRPC producer stream and an AMQP channel, each of which
    has published to a/ already; the operator removes her grant on a/# from `acl.toml`. Her
    very next publish there, on the same connection and the same topic, is refused on every
    protocol, and so is a new subscription; b/ still works."""
    import pika
    import pika.exceptions
    from shardgate.client import PermissionDenied, SyncClient

    from tests.mqtt_clients import V5, Paho

    data_dir = tmp_path / "data"
    add_user(data_dir, "alice", "alice-pw")
    add_user(data_dir, "watcher", "watcher-pw")
    acl = data_dir / "acl.toml"
    acl.write_text(GRANTS)
    broker = BrokerProcess(data_dir, ["--grpc-port", str(free_port()),
                                      "--amqp-port", str(free_port())]).start()
    grpc_client = SyncClient(f"127.0.0.1:{broker.ports['grpc']}", username="alice",
                             password="alice-pw")
    amqp = pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", broker.ports["amqp"], credentials=pika.PlainCredentials("alice", "alice-pw"),
        connection_attempts=1, socket_timeout=30, blocked_connection_timeout=30, stack_timeout=30))
    try:
        watcher = Paho(broker.mqtt_port, "watcher", V5, username="watcher", password="watcher-pw")
        assert [code.value for code in watcher.subscribe("#", qos=1)] == [1]
        alice = Paho(broker.mqtt_port, "alice-mqtt", V5, username="alice", password="alice-pw")
        acks: queue.Queue[tuple[int, int]] = queue.Queue()
        alice.client.on_publish = lambda c, u, mid, rc, props: acks.put((mid, rc.value))

        def mqtt_publish(topic: str) -> int:
            info = alice.publish(topic, b"mqtt", qos=1)
            mid, code = acks.get(timeout=20)
            assert mid == info.mid
            return code

        producer = grpc_client.producer("alice-producer")
        channel = amqp.channel()
        channel.confirm_delivery()

        assert mqtt_publish("a/mqtt") == 0
        producer.send("a/grpc", b"grpc")
        channel.basic_publish("amq.topic", "a.amqp", b"amqp")
        before = {watcher.expect(timeout=20).topic for _ in range(3)}
        assert before == {"a/mqtt", "a/grpc", "a/amqp"}

        def loads() -> int:
            return broker.log_path.read_text(errors="replace").count("ACL rules from")

        loaded = loads()
        acl.write_text(GRANT_REMOVED)
        wait_for(lambda: loads() > loaded, timeout=30)

        assert mqtt_publish("a/mqtt") == 0x87  # the same topic as before, on the same connection
        assert [code.value for code in alice.subscribe("a/#", qos=1)] == [0x87]
        assert [code.value for code in alice.subscribe("b/#", qos=1)] == [1]
        with pytest.raises(PermissionDenied):
            producer.send("a/grpc", b"grpc")
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            channel.basic_publish("amq.topic", "a.amqp", b"amqp")
        assert refused.value.reply_code == 403
        # still allowed on b/, on the same connections; one shard, in order: nothing of a/
        # was delivered before the last of these
        producer.send("b/grpc", b"grpc")
        channel = amqp.channel()
        channel.confirm_delivery()  # confirmed: stored before the MQTT publish below
        channel.basic_publish("amq.topic", "b.amqp", b"amqp")
        assert mqtt_publish("b/mqtt") == 0
        after = [watcher.expect(timeout=20).topic for _ in range(3)]
        assert after == ["b/grpc", "b/amqp", "b/mqtt"]
        watcher.expect_none(1.0)
        alice.disconnect()
        watcher.disconnect()
    finally:
        grpc_client.close()
        if amqp.is_open:
            amqp.close()
        broker.terminate()
