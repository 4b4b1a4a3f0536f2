"""The client commands of the CLI, run as real processes against a running broker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

import pytest
from shardgate.client import SyncClient

from tests.conftest import ThreadedBroker, free_port, wait_for


def _cli_prefix() -> list[str]:
    """`python -m shardgate` once the CLI wires the client commands in, until then the module."""
    probe = subprocess.run([sys.executable, "-m", "shardgate", "streams", "--help"],
                           capture_output=True, timeout=30)
    if probe.returncode == 0:
        return [sys.executable, "-m", "shardgate"]
    return [sys.executable, "-m", "shardgate.cli_client"]


CLI: list[str] = []


def cli() -> list[str]:
    if not CLI:
        CLI.extend(_cli_prefix())
    return CLI


@pytest.fixture
def url(broker_factory: Callable[..., ThreadedBroker]) -> str:
    broker = broker_factory(listeners={"grpc_port": free_port()})
    return f"127.0.0.1:{broker.app.port('grpc')}"


def run(url: str | None, *args: str, stdin: str | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [*cli(), *args] + (["--url", url] if url else [])
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    full_env.update(env or {})
    return subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=60,
                          env=full_env)


def test_streams_create_list_describe_delete(url: str) -> None:
    created = run(url, "streams", "create", "orders", "--partitions", "2", "--schema", "json")
    assert created.returncode == 0, created.stderr
    assert "created stream orders" in created.stdout
    listed = run(url, "streams", "list")
    assert listed.stdout.splitlines()[0].split()[:3] == ["NAME", "MODE", "PARTITIONS"]
    assert any(line.split()[:4] == ["orders", "reliable", "2", "json"]
               for line in listed.stdout.splitlines())
    described = json.loads(run(url, "streams", "describe", "orders", "--json").stdout)
    assert [shard["index"] for shard in described["shards"]] == [0, 1]
    assert sorted(described["routes"]) == ["orders", "orders/#"]
    assert run(url, "streams", "delete", "orders").returncode == 0
    missing = run(url, "streams", "describe", "orders")
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr


def test_pub_and_sub_with_headers_and_json_output(url: str) -> None:
    consumer = subprocess.Popen(
        [*cli(), "sub", "events/#", "--subscription", "tail", "--count", "3",
         "--json", "--url", url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    with SyncClient(url) as client:
        wait_for(lambda: any(s.name == "tail" for s in client.admin.list_subscriptions()), 20)
    one = run(url, "pub", "events/a", "first", "--key", "k1", "--header", "source=cli",
              "--header", "n=1")
    assert one.returncode == 0, one.stderr
    assert "published to default shard" in one.stdout
    many = run(url, "pub", "events/b", stdin="second\nthird\n")
    assert many.returncode == 0 and "published 2 messages" in many.stderr
    out, err = consumer.communicate(timeout=30)
    assert consumer.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [m["payload"] for m in lines] == ["first", "second", "third"]
    assert lines[0]["headers"] == [["source", "cli"], ["n", "1"]] and lines[0]["key"] == "k1"
    assert {"offset", "shard", "stream", "topic"} <= lines[0].keys()


def test_sub_prints_one_payload_per_line(url: str) -> None:
    consumer = subprocess.Popen(
        [*cli(), "sub", "plain", "--subscription", "p", "--type", "shared",
         "--count", "2", "--url", url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    with SyncClient(url) as client:
        wait_for(lambda: any(s.name == "p" for s in client.admin.list_subscriptions()), 20)
    assert run(url, "pub", "plain", stdin="x 1\ny 2\n").returncode == 0
    out, _ = consumer.communicate(timeout=30)
    assert out.splitlines() == ["x 1", "y 2"]


def test_schema_refusal_is_reported(url: str) -> None:
    assert run(url, "streams", "create", "counts", "--schema", "int64").returncode == 0
    refused = run(url, "pub", "counts", "not a number bytes")
    assert refused.returncode == 1 and "INVALID_ARGUMENT" in refused.stderr
    assert "8 bytes" in refused.stderr
    assert run(url, "pub", "counts", "42", "--int64").returncode == 0


def test_subs_and_clients_lists(url: str) -> None:
    with SyncClient(url) as client:
        consumer = client.consumer("watchers", ["w/#"], type="failover")
        consumer.subscribe()
        subs = run(url, "subs", "list")
        assert any(line.split()[:3] == ["watchers", "failover", "grpc"]
                   for line in subs.stdout.splitlines())
        described = json.loads(run(url, "subs", "describe", "watchers", "--json").stdout)
        assert described["topic_filters"] == ["w/#"] and len(described["consumers"]) == 1
        clients = json.loads(run(url, "clients", "list", "--json").stdout)
        assert any(c["detail"] == "consumer of watchers" for c in clients)
        assert run(url, "subs", "delete", "watchers").returncode == 0
        assert run(url, "subs", "describe", "watchers").returncode == 1


def test_unreachable_broker_is_a_clear_error() -> None:
    result = run(f"127.0.0.1:{free_port()}", "streams", "list")
    assert result.returncode == 1
    assert "cannot reach the broker" in result.stderr and "Traceback" not in result.stderr


def test_url_from_environment(url: str) -> None:
    result = run(None, "streams", "list", "--json", env={"SHARDGATE_URL": url})
    assert result.returncode == 0, result.stderr
    assert "default" in [s["name"] for s in json.loads(result.stdout)]


def test_clients_alone_lists_amqp_mqtt_and_grpc_clients(
    broker_factory: Callable[..., ThreadedBroker],
) -> None:
    import pika

    from tests.mqtt_clients import Paho

    broker = broker_factory(listeners={"grpc_port": free_port(), "amqp_port": free_port()})
    url = f"127.0.0.1:{broker.app.port('grpc')}"
    connection = pika.BlockingConnection(pika.URLParameters(
        f"amqp://guest:guest@127.0.0.1:{broker.app.port('amqp')}/?client_properties="
        "{'connection_name':'billing'}"))
    device = Paho(broker.mqtt_port, "device-7")
    try:
        channel = connection.channel()
        channel.basic_publish("amq.topic", "bills.new", b"1")
        listed = run(url, "clients")
        assert listed.returncode == 0, listed.stderr
        rows = [line.split() for line in listed.stdout.splitlines()[1:]]
        assert any(row[0] == "mqtt" and row[1] == "device-7" for row in rows)
        amqp = [row for row in rows if row[0] == "amqp"]
        assert len(amqp) == 1 and amqp[0][2] == "guest"
        as_json = json.loads(run(url, "clients", "list", "--json").stdout)
        entry = next(c for c in as_json if c["protocol"] == "amqp")
        assert entry["detail"] == "amqp 0-9-1 billing" and entry["messages_in"] == 1
    finally:
        connection.close()
        device.disconnect()


def test_streams_create_refuses_a_partition_count_below_one_as_a_usage_error() -> None:
    for count in ("0", "-3", "many"):
        result = run(None, "streams", "create", "orders", "--partitions", count)
        assert result.returncode == 2, result.stderr
        assert "--partitions" in result.stderr and "Traceback" not in result.stderr
