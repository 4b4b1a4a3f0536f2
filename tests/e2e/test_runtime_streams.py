"""Streams and routes created at run time (CLI, gRPC Admin) survive a restart like the ones of
the configuration file; one default stream mode everywhere."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from shardgate.client import SyncClient

from tests.conftest import BrokerProcess, free_port


def shardgate(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    return subprocess.run([sys.executable, "-m", "shardgate", *args, "--url", url],
                          capture_output=True, text=True, timeout=60, env=env)


def stream_rows(url: str) -> dict[str, list[str]]:
    listed = shardgate(url, "streams", "list")
    assert listed.returncode == 0, listed.stderr
    return {line.split()[0]: line.split() for line in listed.stdout.splitlines()[1:]}


def test_stream_created_with_the_cli_survives_sigterm(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    grpc_port = free_port()
    url = f"127.0.0.1:{grpc_port}"
    process = broker_process(extra_args=["--grpc-port", str(grpc_port)]).start()
    created = shardgate(url, "streams", "create", "pc", "--partitions", "2", "--mode", "reliable")
    assert created.returncode == 0, created.stderr
    added = shardgate(url, "pub", "pc/a", "before")
    assert "published to pc" in added.stdout, added.stderr
    assert process.terminate() == 0

    process.start()
    rows = stream_rows(url)
    assert rows["pc"][:3] == ["pc", "reliable", "2"]
    published = shardgate(url, "pub", "pc/a", "x")
    assert published.returncode == 0, published.stderr
    assert published.stdout.startswith("published to pc shard"), published.stdout
    # the journal kept what was published before the restart, in the same stream
    with SyncClient(url) as client:
        info = client.admin.describe_stream("pc")
    assert sum(shard.next_offset for shard in info.shards) == 2
    assert process.terminate() == 0


def test_routes_and_deletes_at_run_time_are_kept(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    grpc_port = free_port()
    url = f"127.0.0.1:{grpc_port}"
    process = broker_process(extra_args=["--grpc-port", str(grpc_port)]).start()
    with SyncClient(url) as client:
        client.admin.create_stream("metrics", mode="non-reliable", routes=["metrics/#"])
        client.admin.add_route("telemetry/+/cpu", "metrics")
        client.admin.create_stream("scratch")
        client.admin.delete_stream("scratch")
    assert process.terminate() == 0
    process.start()
    with SyncClient(url) as client:
        names = {s.name: s for s in client.admin.list_streams()}
        assert "scratch" not in names
        assert names["metrics"].mode.value == "non-reliable"
        assert client.producer().send("telemetry/h1/cpu", b"1").stream == "metrics"
        client.admin.remove_route("telemetry/+/cpu")
    assert process.terminate() == 0
    process.start()
    with SyncClient(url) as client:
        assert client.producer().send("telemetry/h1/cpu", b"1").stream == "default"
    assert process.terminate() == 0


def test_config_file_wins_over_a_runtime_stream_of_the_same_name(
    broker_process: Callable[..., BrokerProcess], tmp_path: Path,
) -> None:
    grpc_port = free_port()
    url = f"127.0.0.1:{grpc_port}"
    process = broker_process(extra_args=["--grpc-port", str(grpc_port)]).start()
    assert shardgate(url, "streams", "create", "orders", "--partitions", "2").returncode == 0
    assert process.terminate() == 0
    config = tmp_path / "shardgate.toml"
    config.write_text('[[streams]]\nname = "orders"\nmode = "reliable"\npartitions = 4\n')
    process.config_file = config
    process.start()
    assert stream_rows(url)["orders"][:3] == ["orders", "reliable", "4"]
    assert process.terminate() == 0
    log = process.log_path.read_text()
    assert "stream 'orders' is declared in the configuration file" in log
    assert "the configuration file wins" in log


def test_one_default_stream_mode_for_cli_sdk_and_unrouted_topics(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    grpc_port = free_port()
    url = f"127.0.0.1:{grpc_port}"
    process = broker_process(extra_args=["--grpc-port", str(grpc_port)]).start()
    assert shardgate(url, "streams", "create", "cli-made").returncode == 0
    with SyncClient(url) as client:
        client.admin.create_stream("sdk-made")
    rows = stream_rows(url)
    assert rows["cli-made"][1] == rows["sdk-made"][1] == rows["default"][1] == "reliable"
    assert process.terminate() == 0


def test_replica_settings_given_to_the_cli_are_kept_across_a_restart(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    grpc_port = free_port()
    url = f"127.0.0.1:{grpc_port}"
    process = broker_process(extra_args=["--grpc-port", str(grpc_port)]).start()
    created = shardgate(url, "streams", "create", "orders", "--replicas", "3", "--min-insync", "2")
    assert created.returncode == 0, created.stderr
    refused = shardgate(url, "streams", "create", "bad", "--replicas", "2", "--min-insync", "3")
    assert refused.returncode != 0
    assert "min_insync_replicas (3) cannot exceed replicas (2)" in refused.stderr
    # a single node keeps one copy at no cost: a publish is acknowledged as before
    published = shardgate(url, "pub", "orders/a", "x")
    assert published.stdout.startswith("published to orders shard"), published.stderr
    assert process.terminate() == 0

    process.start()
    with SyncClient(url) as client:
        info = client.admin.describe_stream("orders")
        default = client.admin.describe_stream("default")
    assert (info.replicas, info.min_insync_replicas) == (3, 2)
    assert (default.replicas, default.min_insync_replicas) == (None, None)
    assert process.terminate() == 0
