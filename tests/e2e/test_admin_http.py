"""The admin HTTP API end to end: real clients of every protocol, JSON read over real HTTP."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pika
import pytest
from shardgate.client import SyncClient

from shardgate.admin.admin_http import create_web_app
from shardgate.config import StreamEntry
from tests.conftest import ThreadedBroker, free_port, serve_admin, wait_for
from tests.mqtt_clients import V311, Paho

MQTT_ADMINISTRATIVE_ACTION = 0x98


@dataclass
class Node:
    broker: ThreadedBroker
    url: str

    def request(self, method: str, path: str, body: Any = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        request = urllib.request.Request(self.url + path, method=method, data=data)
        if headers is not None:
            for name, value in headers.items():
                request.add_header(name, value)
        elif method not in ("GET", "HEAD"):
            request.add_header("X-Requested-With", "test")  # what the API wants of a change
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                status, headers, body = response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as error:
            status, headers, body = error.code, dict(error.headers), error.read()
        is_json = headers.get("Content-Type", "").startswith("application/json")
        return status, headers, json.loads(body) if is_json else body

    def get(self, path: str) -> Any:
        status, _, body = self.request("GET", path)
        assert status == 200, body
        return body


@pytest.fixture
def node(broker_factory: Callable[..., ThreadedBroker]) -> Iterator[Node]:
    broker = broker_factory(
        listeners={"http_port": free_port(), "grpc_port": free_port(), "amqp_port": free_port()},
        streams=[StreamEntry("telemetry", mode="reliable", partitions=2)],
        archive={"enabled": False},  # archive tests below install their own
    )
    for url in serve_admin(broker):
        yield Node(broker, url)


def test_info_reports_version_listeners_and_message_counters(node: Node) -> None:
    info = node.get("/api/info")
    assert info["version"]
    assert {"mqtt", "grpc", "amqp"} <= {listener["name"] for listener in info["listeners"]}
    before = info["messages_in"]
    client = Paho(node.broker.mqtt_port, "counter")
    try:
        for _ in range(3):
            client.publish("telemetry/a", b"12345", qos=1)
        info = node.get("/api/info")
        assert info["messages_in"] >= before + 3
        assert info["bytes_in"] >= 15
        assert info["connections"]["mqtt"] == 1
        assert info["journal"]["records"] >= 3
        assert info["uptime_s"] >= 0
    finally:
        client.client.disconnect()


def test_info_reports_the_nodes_memory_descriptors_disk_and_alarms(
    node: Node, broker_factory: Callable[..., ThreadedBroker],
) -> None:
    resources = node.get("/api/info")["node"]
    assert resources["rss_bytes"] > 1 << 20
    assert 3 <= resources["open_descriptors"] <= resources["descriptor_limit"]
    assert resources["disk_free_bytes"] > 0
    assert resources["data_dir"] == str(node.broker.app.config.data_dir)
    assert resources["alarms"] == []
    # a node whose disk is below disk_free_limit names the disk alarm
    full = broker_factory(disk_free_limit=1 << 60)
    for url in serve_admin(full):
        alarmed = Node(full, url)
        wait_for(lambda: alarmed.get("/api/info")["node"]["alarms"] == ["disk"])  # noqa: B023
        assert alarmed.get("/api/info")["node"]["disk_free_limit_bytes"] == 1 << 60


def test_stream_shows_each_shard_with_its_offsets(node: Node) -> None:
    client = Paho(node.broker.mqtt_port, "producer")
    try:
        for i in range(10):
            client.publish(f"telemetry/device-{i}", b"x", qos=1)
    finally:
        client.client.disconnect()
    names = {stream["name"] for stream in node.get("/api/streams")}
    assert {"default", "sys", "telemetry"} <= names
    stream = node.get("/api/streams/telemetry")
    assert stream["mode"] == "reliable" and stream["partitions"] == 2
    assert "telemetry/#" in stream["routes"]
    shards = stream["shards"]
    assert [shard["index"] for shard in shards] == [0, 1]
    assert sum(shard["next_offset"] for shard in shards) == 10 == stream["messages"]
    for shard in shards:
        assert shard["low_watermark"] == 0
        assert shard["committed_offset"] == shard["next_offset"]
        assert shard["segments"] >= 1
        assert "cursors" in shard


def test_unknown_stream_is_a_json_404_with_a_message(node: Node) -> None:
    status, headers, body = node.request("GET", "/api/streams/nope")
    assert status == 404
    assert headers["Content-Type"].startswith("application/json")
    assert body == {"error": "stream 'nope' does not exist", "status": 404}
    status, _, body = node.request("GET", "/api/no-such-thing")
    assert status == 404 and "no such endpoint" in body["error"]
    status, headers, body = node.request("POST", "/api/info")
    assert status == 405 and "not allowed" in body["error"]
    assert "GET" in headers["Allow"]


def test_offline_persistent_session_shows_lag_on_its_subscription(node: Node) -> None:
    subscriber = Paho(node.broker.mqtt_port, "sleepy", session_expiry=3600)
    subscriber.subscribe("telemetry/#", qos=1)
    subscriber.client.disconnect()
    subscriber.client.loop_stop()
    publisher = Paho(node.broker.mqtt_port, "pub")
    try:
        for _ in range(5):
            publisher.publish("telemetry/x", b"m", qos=1)
    finally:
        publisher.client.disconnect()

    def lag_of_sleepy() -> dict[str, Any] | None:
        subs = {sub["name"]: sub for sub in node.get("/api/subscriptions")}
        sub = subs.get("mqtt:sleepy")
        return sub if sub and sub["lag"] == 5 else None

    sub = wait_for(lag_of_sleepy)
    assert sub["durable"] is True and sub["protocol"] == "mqtt"
    assert sub["filters"] == ["telemetry/#"]
    assert node.get("/api/subscriptions/mqtt:sleepy")["lag"] == 5
    stream = node.get("/api/streams/telemetry")
    cursors = [c for shard in stream["shards"] for c in shard["cursors"]
               if c["subscription"] == "mqtt:sleepy"]
    assert sum(cursor["lag"] for cursor in cursors) == 5
    sessions = {session["client_id"]: session for session in node.get("/api/sessions")}
    assert sessions["sleepy"]["connected"] is False
    assert sessions["sleepy"]["expiry_interval"] == 3600
    status, _, body = node.request("GET", "/api/subscriptions/missing")
    assert status == 404 and "missing" in body["error"]


def test_nodes_lists_this_nodes_resources_and_connections(node: Node) -> None:
    client = Paho(node.broker.mqtt_port, "resources")
    try:
        (row,) = node.get("/api/nodes")
        assert row["node"] is None  # a single node: no cluster node id
        assert row["rss_bytes"] > 0 and row["open_descriptors"] > 0
        assert row["disk_free_bytes"] > 0 and row["alarms"] == []
        assert row["connections"]["mqtt"] == 1
    finally:
        client.client.disconnect()


def test_purge_and_reset_cursor_move_a_durable_subscriptions_cursors(node: Node) -> None:
    subscriber = Paho(node.broker.mqtt_port, "backlogged", session_expiry=3600)
    subscriber.subscribe("telemetry/#", qos=1)
    subscriber.client.disconnect()
    subscriber.client.loop_stop()
    publisher = Paho(node.broker.mqtt_port, "feeder")
    try:
        for i in range(5):
            publisher.publish("telemetry/x", f"old-{i}", qos=1)
        wait_for(lambda: node.get("/api/subscriptions/mqtt:backlogged")["lag"] == 5)

        status, _, body = node.request("POST", "/api/subscriptions/mqtt:backlogged/purge")
        assert status == 200, body
        assert body["purged"] == 5 and body["subscription"]["lag"] == 0
        publisher.publish("telemetry/x", "new", qos=1)
        wait_for(lambda: node.get("/api/subscriptions/mqtt:backlogged")["lag"] == 1)

        # to the earliest: the purged messages are there again
        path = "/api/subscriptions/mqtt:backlogged/cursor"
        status, _, body = node.request("POST", path, {"position": "earliest"},
                                       {"Content-Type": "application/json"})
        assert status == 200 and body["lag"] == 6, body
        # to a time after the last message: nothing left; to offset 0: everything again
        status, _, body = node.request("POST", path, {"timestamp_ms": 2 ** 62})
        assert status == 200 and body["lag"] == 0, body
        status, _, body = node.request("POST", path, {"offset": 0})
        assert status == 200 and body["lag"] == 6, body
        status, _, body = node.request("POST", "/api/subscriptions/mqtt:backlogged/purge")
        assert status == 200 and body["purged"] == 6
        publisher.publish("telemetry/x", "after", qos=1)
    finally:
        publisher.client.disconnect()
    # the resumed session gets only what came after the purge
    resumed = Paho(node.broker.mqtt_port, "backlogged", session_expiry=3600, clean=False)
    try:
        assert resumed.expect().payload == b"after"
    finally:
        resumed.client.disconnect()


@pytest.mark.parametrize("body", [
    b"not json", [], {}, {"position": "middle"}, {"offset": -1}, {"offset": "3"},
    {"offset": True}, {"position": "earliest", "offset": 3},
])
def test_reset_cursor_refuses_a_bad_body_with_400(node: Node, body: Any) -> None:
    subscriber = Paho(node.broker.mqtt_port, "steady", session_expiry=3600)
    try:
        subscriber.subscribe("telemetry/#", qos=1)
        status, _, answer = node.request("POST", "/api/subscriptions/mqtt:steady/cursor", body)
        assert status == 400 and answer["status"] == 400 and answer["error"], answer
    finally:
        subscriber.client.disconnect()


def test_purge_refuses_unknown_live_only_and_unprotected_requests(node: Node) -> None:
    status, _, body = node.request("POST", "/api/subscriptions/nothing-here/purge")
    assert status == 404 and "nothing-here" in body["error"]
    live = Paho(node.broker.mqtt_port, "live-only")  # MQTT 5, session expiry 0: no cursor
    try:
        live.subscribe("telemetry/#", qos=1)
        status, _, body = node.request("POST", "/api/subscriptions/mqtt:live-only/purge")
        assert status == 409 and "live-only" in body["error"], body
        status, _, body = node.request("POST", "/api/subscriptions/mqtt:live-only/cursor",
                                       {"position": "earliest"})
        assert status == 409, body
    finally:
        live.client.disconnect()
    # a change a form or a simple cross-site fetch could send is refused
    status, _, body = node.request("POST", "/api/subscriptions/nothing-here/purge", headers={})
    assert status == 403, body
    status, _, body = node.request("POST", "/api/subscriptions/nothing-here/purge",
                                   headers={"X-Requested-With": "x", "Origin": "http://evil.example"})
    assert status == 403, body


def test_purge_and_reset_cursor_need_the_admin_role(tmp_path: Path) -> None:
    import base64

    from shardgate.security.auth import User, hash_password, save_users
    from tests.conftest import make_config

    data = tmp_path / "secured"
    data.mkdir()
    (data / "acl.toml").write_text(
        '[[allow]]\nuser = "alice"\nactions = ["publish", "subscribe"]\ntopics = ["#"]\n')
    save_users(data / "users.json", {
        "root": User("root", hash_password("root-pw"), ["admin"]),
        "alice": User("alice", hash_password("alice-pw")),
    })
    broker = ThreadedBroker(make_config(data, listeners={"http_port": free_port()},
                                        archive={"enabled": False})).start()
    try:
        secured = Node(broker, f"http://127.0.0.1:{broker.app.port('http')}")

        def as_user(user: str, password: str) -> dict[str, str]:
            token = base64.b64encode(f"{user}:{password}".encode()).decode()
            return {"Authorization": f"Basic {token}", "Content-Type": "application/json"}

        for path, body in (("/api/subscriptions/any/purge", None),
                           ("/api/subscriptions/any/cursor", {"position": "earliest"})):
            assert secured.request("POST", path, body, {"X-Requested-With": "t"})[0] == 401
            assert secured.request("POST", path, body, as_user("alice", "alice-pw"))[0] == 403
            assert secured.request("POST", path, body, as_user("root", "root-pw"))[0] == 404
    finally:
        broker.stop()


def test_mqtt_client_is_listed_and_kicked_with_administrative_action(node: Node) -> None:
    client = Paho(node.broker.mqtt_port, "device/with spaces&odd?chars")
    legacy = Paho(node.broker.mqtt_port, "legacy-311", protocol=V311)
    try:
        clients = {(c["protocol"], c["client_id"]): c for c in node.get("/api/clients")}
        entry = clients[("mqtt", "device/with spaces&odd?chars")]
        assert entry["detail"] == "MQTT 5.0" and entry["kickable"] is True
        assert entry["remote"].startswith("127.0.0.1")
        assert clients[("mqtt", "legacy-311")]["detail"] == "MQTT 3.1.1"

        quoted = urllib.parse.quote("device/with spaces&odd?chars", safe="")
        status, _, body = node.request("DELETE", f"/api/clients/mqtt/{quoted}")
        assert status == 200 and body["kicked"] is True
        reason, _props = client.disconnects.get(timeout=10)
        assert reason == MQTT_ADMINISTRATIVE_ACTION

        status, _, _ = node.request("DELETE", "/api/clients/mqtt/legacy-311")
        assert status == 200
        legacy.disconnects.get(timeout=10)
        wait_for(lambda: not [c for c in node.get("/api/clients") if c["protocol"] == "mqtt"])
    finally:
        client.client.loop_stop()
        legacy.client.loop_stop()


def test_kicking_an_unknown_client_or_protocol_is_a_404(node: Node) -> None:
    status, _, body = node.request("DELETE", "/api/clients/mqtt/ghost")
    assert status == 404 and body["error"] == "no mqtt client 'ghost' is connected"
    status, _, body = node.request("DELETE", "/api/clients/smtp/ghost")
    assert status == 404 and "unknown protocol" in body["error"]


def test_amqp_connection_is_listed_and_kicked(node: Node) -> None:
    params = pika.ConnectionParameters(
        "127.0.0.1", node.broker.app.port("amqp"),
        client_properties={"connection_name": "billing-worker"},
    )
    connection = pika.BlockingConnection(params)
    try:
        amqp = [c for c in node.get("/api/clients") if c["protocol"] == "amqp"]
        assert len(amqp) == 1 and "billing-worker" in amqp[0]["detail"]
        status, _, _ = node.request("DELETE", f"/api/clients/amqp/{amqp[0]['client_id']}")
        assert status == 200
        with pytest.raises(pika.exceptions.ConnectionClosed) as closed:
            connection.process_data_events(time_limit=5)
            connection.process_data_events(time_limit=5)
        assert closed.value.reply_code == 320
    finally:
        if connection.is_open:
            connection.close()


def test_grpc_consumer_is_listed_and_kicked(node: Node) -> None:
    with SyncClient(f"127.0.0.1:{node.broker.app.port('grpc')}") as sdk:
        consumer = sdk.consumer("grpc-admin-sub", stream="telemetry")
        consumer.subscribe()
        grpc_clients = wait_for(lambda: [c for c in node.get("/api/clients") if c["protocol"] == "grpc"])
        assert grpc_clients[0]["detail"] == "consumer of grpc-admin-sub"
        subs = {sub["name"]: sub for sub in node.get("/api/subscriptions")}
        assert subs["grpc-admin-sub"]["protocol"] == "grpc"
        assert subs["grpc-admin-sub"]["consumers"][0]["protocol"] == "grpc"
        status, _, _ = node.request("DELETE", f"/api/clients/grpc/{grpc_clients[0]['client_id']}")
        assert status == 200
        wait_for(lambda: not [c for c in node.get("/api/clients") if c["protocol"] == "grpc"])


def test_retained_messages_are_listed_with_payload_previews(node: Node) -> None:
    client = Paho(node.broker.mqtt_port, "retainer")
    try:
        client.publish("status/door", b"open", qos=1, retain=True)
        client.publish("status/blob", bytes([0xFF, 0x00, 0x80]), qos=1, retain=True)
        client.publish("other/x", b"1", qos=1, retain=True)
    finally:
        client.client.disconnect()
    retained = node.get("/api/retained?prefix=status/")
    assert retained["total"] == 2
    by_topic = {m["topic"]: m for m in retained["messages"]}
    assert by_topic["status/door"]["payload"] == "open"
    assert by_topic["status/door"]["payload_encoding"] == "utf-8"
    assert by_topic["status/blob"]["payload"] == "/wCA"
    assert by_topic["status/blob"]["payload_encoding"] == "base64"
    assert node.get("/api/retained?prefix=status/&limit=1")["messages"][0]["topic"] == "status/blob"
    status, _, body = node.request("GET", "/api/retained?limit=many")
    assert status == 400 and "limit" in body["error"]


def test_archive_status_comes_from_the_archiver(node: Node, tmp_path: Path) -> None:
    assert node.get("/api/archive") == {"enabled": False}

    class Archiver:
        def status(self) -> dict[str, Any]:
            return {"url": f"file://{tmp_path}", "files_written": 3, "lag_records": 12,
                    "last_error": None}

    node.broker.app.archiver = Archiver()
    try:
        archive = node.get("/api/archive")
        assert archive["enabled"] is True
        assert archive["files_written"] == 3 and archive["lag_records"] == 12
        assert node.get("/api/info")["archive"] is True
    finally:
        node.broker.app.archiver = None


def test_openapi_document_describes_every_api_route(node: Node) -> None:
    document = node.get("/api/openapi.json")
    assert document["openapi"].startswith("3.")
    assert document["info"]["title"] == "Shardgate admin API"
    documented = {
        (method.upper(), path) for path, item in document["paths"].items() for method in item
    }
    served = set()
    web_app = create_web_app(node.broker.app)
    for route in web_app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter") or ""
        if path.startswith("/api/") and route.method != "HEAD":
            served.add((route.method, path.replace("{client_id:.+}", "{client_id}")))
    assert served == documented and len(served) == 19
    for path, item in document["paths"].items():
        for operation in item.values():
            for ref in json.dumps(operation).split('"$ref": "')[1:]:
                name = ref.split('"')[0].rsplit("/", 1)[-1]
                assert name in document["components"]["schemas"], (path, name)


def test_archive_status_of_the_real_archiver(broker_factory: Callable[..., ThreadedBroker]) -> None:
    broker = broker_factory(listeners={"http_port": free_port()})
    for url in serve_admin(broker):
        node = Node(broker, url)
        archive = node.get("/api/archive")
        assert archive["enabled"] is True
        assert any(shard["stream"] == "default" for shard in archive["shards"])
