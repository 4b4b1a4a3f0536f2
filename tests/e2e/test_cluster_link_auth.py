"""Nodes prove to each other that they belong to the cluster (`shardgate/cluster/link_auth.py`):
`shardgate serve --cluster` processes on a real etcd, a stranger on a raw socket of the
cluster port, a node started with another secret, and a process claiming a registered node's
id. Each attack below worked before the cluster port authenticated anything (issue 26, 12):
the stranger's forwarded message was stored and delivered, `ReleaseSession` kicked a client
and handed out its session, and a hello naming a node took that node's link over."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from shardgate.proto import cluster_pb2 as pb

from tests.conftest import free_port, wait_for
from tests.e2e.cluster_fixtures import CLUSTER_SECRET, ClusterNodeProcess, EtcdServer, settled
from tests.mqtt_clients import V311, Paho

Cluster = Callable[..., list[ClusterNodeProcess]]


def cluster_address(node: ClusterNodeProcess) -> tuple[str, int]:
    entry = next(e for e in node.status()["nodes"] if e["node_id"] == node.node_id)
    host, _, port = entry["cluster_address"].rpartition(":")
    return host, int(port)


def frame(message: pb.PeerFrame) -> bytes:
    data = message.SerializeToString()
    return struct.pack(">I", len(data)) + data


def talk(address: tuple[str, int], data: bytes, then: bytes = b"") -> bytes:
    """Write `data` (and `then` after the first answer), read until the node closes the
    connection (or 10 s pass): every byte the node answered."""
    answer = b""
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(data)
        sent_then = not then
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            answer += chunk
            if not sent_then:
                sent_then = True
                sock.sendall(then)
    return answer


def outcomes(answer: bytes) -> list[int]:
    """The outcomes of forwarded messages among the frames the node answered (a link that
    took the stranger's frames answers each with STORED or a refusal)."""
    found: list[int] = []
    while len(answer) >= 4:
        (size,) = struct.unpack_from(">I", answer)
        try:
            found += [o.code for o in pb.PeerReply.FromString(answer[4:4 + size]).outcomes]
        except Exception:  # noqa: BLE001 - not a reply: a handshake message or HTTP/2
            pass
        answer = answer[4 + size:]
    return found


def attacks_as(node_id: str, frames: list[pb.PeerFrame]) -> list[tuple[bytes, bytes]]:
    """What a stranger writes, without the secret: the version-1 link (no handshake), and the
    authenticated link with a hello claiming `node_id` and a made-up proof."""
    payload = b"".join(frame(f) for f in frames)
    hello = json.dumps({"node": node_id, "instance": "", "nonce": os.urandom(32).hex()}).encode()
    proof = json.dumps({"proof": os.urandom(32).hex()}).encode()
    return [
        (b"SGLINK1\n" + payload, b""),
        (b"SGLINK2\n" + struct.pack(">I", len(hello)) + hello,
         struct.pack(">I", len(proof)) + proof + payload),
    ]


def test_a_stranger_on_the_cluster_port_cannot_forward_a_message_into_a_shard(cluster: Cluster) -> None:
    n1, n2 = cluster(2)
    subscriber = Paho(n1.mqtt_port, "watcher", V311)
    subscriber.subscribe("probe/#", qos=1)
    forward = pb.PeerFrame(sequence=1, forwards=[
        pb.Forward(stream="default", shard=shard, topic="probe/x", payload=b"injected", qos=1)
        for shard in range(8)])
    for address in (cluster_address(n1), cluster_address(n2)):
        for data, then in attacks_as("n9", [
            pb.PeerFrame(sequence=0, from_node="n9", session=1), forward,
        ]):
            answer = talk(address, data, then)
            assert outcomes(answer) == [], answer
    # a real publish on the same topic (same shard, later offset) arrives, and nothing before it
    publisher = Paho(n2.mqtt_port, "publisher", V311)
    publisher.publish("probe/x", b"real", qos=1)
    message = subscriber.messages.get(timeout=20)
    assert message.payload == b"real"
    assert subscriber.messages.empty()
    publisher.disconnect()
    subscriber.disconnect()


def test_internal_calls_on_the_cluster_port_need_the_cluster_secret(cluster: Cluster) -> None:
    """`ReleaseSession` ended a client's connection and returned its session to anyone;
    `ReadShard` returned journal records. Now both answer UNAUTHENTICATED."""
    n1, n2 = cluster(2)
    client = Paho(n1.mqtt_port, "victim", V311, clean=False)
    client.subscribe("victim/#", qos=1)
    host, port = cluster_address(n1)

    async def call(method: str, request: dict[str, object]) -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(f"{host}:{port}") as channel:
            try:
                await channel.unary_unary(f"/shardgate.cluster.v1.ClusterState/{method}")(
                    json.dumps(request).encode(), timeout=10)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

    assert asyncio.run(call("ReleaseSession", {"client_id": "victim", "node": "n2"})) \
        is grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(call("ReadShard", {"stream": "default", "shard": 0, "start": 0,
                                          "filters": ["#"], "node": "n2"})) \
        is grpc.StatusCode.UNAUTHENTICATED
    # the client is still connected and receives
    publisher = Paho(n2.mqtt_port, "p", V311)
    publisher.publish("victim/x", b"still here", qos=1)
    assert client.messages.get(timeout=20).payload == b"still here"
    assert client.disconnects.empty()
    publisher.disconnect()
    client.disconnect()


def test_a_process_claiming_a_registered_node_id_does_not_take_its_link(cluster: Cluster) -> None:
    """A hello naming n2 with an empty route table used to take n2's link on n1 over: n2's
    subscribers stopped receiving what was published on n1. Without the secret, or with it
    but not as the instance registered in etcd, the claim is refused."""
    n1, n2 = cluster(2)
    subscriber = Paho(n2.mqtt_port, "on-n2", V311)
    subscriber.subscribe("imp/#", qos=1)
    publisher = Paho(n1.mqtt_port, "on-n1", V311)
    publisher.publish("imp/before", b"before", qos=1)
    assert subscriber.messages.get(timeout=20).payload == b"before"
    address = cluster_address(n1)
    takeover = [pb.PeerFrame(sequence=0, from_node="n2", session=424242),
                pb.PeerFrame(sequence=1, routes=pb.RouteUpdate(reset=True, generation=1))]
    for data, then in attacks_as("n2", takeover):
        talk(address, data, then)
    publisher.publish("imp/after", b"after", qos=1)
    assert subscriber.messages.get(timeout=20).payload == b"after"
    # with the cluster's secret but another instance than the one registered as n2
    from shardgate.cluster.link_auth import LINK_MAGIC, DialerHandshake, NodeCredentials

    handshake = DialerHandshake(NodeCredentials("n2", "not-the-registered-one", CLUSTER_SECRET.encode()), "n1")
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(LINK_MAGIC + handshake.hello())
        (size,) = struct.unpack(">I", sock.recv(4, socket.MSG_WAITALL))
        challenge = sock.recv(size, socket.MSG_WAITALL)
        sock.sendall(handshake.answer(challenge) + b"".join(frame(f) for f in takeover))
        (size,) = struct.unpack(">I", sock.recv(4, socket.MSG_WAITALL))
        last = json.loads(sock.recv(size, socket.MSG_WAITALL))
    assert "not registered" in last["refused"], last
    publisher.publish("imp/later", b"later", qos=1)
    assert subscriber.messages.get(timeout=20).payload == b"later"
    log = n1.log_path.read_text()
    assert "cluster port: refused a link" in log
    assert "Traceback" not in log
    publisher.disconnect()
    subscriber.disconnect()


def serve_args(node: ClusterNodeProcess, etcd: EtcdServer, *extra: str) -> list[str]:
    return [sys.executable, "-m", "shardgate", "serve", "--data-dir", str(node.data_dir),
            "--cluster", etcd.url, "--node-id", node.node_id, "--cluster-port", "0",
            "--mqtt-port", "0", "--mqtt-ws-port", "0", "--amqp-port", "0", "--grpc-port", "0",
            "--http-port", str(free_port()), *extra]


def test_a_node_with_another_secret_or_none_cannot_join(
    cluster: Cluster, etcd: EtcdServer, tmp_path: Path,
) -> None:
    (n1,) = cluster(1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    other = tmp_path / "other.secret"
    other.write_text("another-secret-of-32-characters!\n")
    stranger = ClusterNodeProcess(tmp_path / "n2", "n2", etcd.url)
    config = tmp_path / "plain.toml"
    config.write_text('[cluster]\nname = "test"\nconnect_timeout_s = 5\n')
    cases = [
        (["--cluster-secret-file", str(other)], "has another cluster secret than this node"),
        ([], "no cluster secret"),
        (["--insecure-cluster"], "has another cluster secret than this node"),
    ]
    for extra, expected in cases:
        result = subprocess.run([*serve_args(stranger, etcd, *extra), "--config", str(config)],
                                capture_output=True, text=True, timeout=60, env=env)
        assert result.returncode != 0, result.stderr
        assert expected in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    assert [entry["node_id"] for entry in n1.status()["nodes"]] == ["n1"]
    # the right secret from a file joins
    right = tmp_path / "right.secret"
    right.write_text(CLUSTER_SECRET + "\n")
    joining = ClusterNodeProcess(tmp_path / "n3", "n3", etcd.url, extra_args=["--cluster-secret-file", str(right)])
    assert joining.config_file is not None
    joining.config_file.write_text(joining.config_file.read_text().replace(f'secret = "{CLUSTER_SECRET}"\n', ""))
    joining.start()
    try:
        wait_for(lambda: settled(n1, {"n1", "n3"}), timeout=30, interval=0.05)
    finally:
        joining.kill()


@pytest.mark.parametrize("secret", ["short"])
def test_a_short_secret_is_refused_at_start(tmp_path: Path, secret: str) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f'[cluster]\nsecret = "{secret}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    result = subprocess.run(
        [sys.executable, "-m", "shardgate", "serve", "--data-dir", str(tmp_path / "d"),
         "--config", str(config), "--cluster", f"http://127.0.0.1:{free_port()}", "--node-id", "n1",
         "--mqtt-port", "0", "--mqtt-ws-port", "0", "--amqp-port", "0", "--grpc-port", "0",
         "--http-port", "0"], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode != 0
    assert "at least 16" in result.stderr, result.stderr
