"""Bounded, seeded fuzzing of every protocol of `shardgate serve`: MQTT, AMQP, gRPC and the admin
HTTP API get malformed input (valid requests with bytes flipped, cut or appended, random
bytes, out-of-range values); the broker stays up, still serves a real client, and logs no
traceback and no ERROR. Each protocol's run is bounded in time (FUZZ_S) and count; the seed is
fixed so that a failure can be replayed (SHARDGATE_FUZZ_SEED to try others).
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from pamqp import commands, frame
from shardgate.protocols.mqtt import packets as p
from shardgate.protocols.mqtt.codec import encode

from tests.conftest import BrokerProcess, free_port

SEED = int(os.environ.get("SHARDGATE_FUZZ_SEED", "26"))
FUZZ_S = 6.0
MAX_CASES = 600


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    data_dir = tmp_path_factory.mktemp("fuzz") / "data"
    process = BrokerProcess(data_dir, ["--amqp-port", str(free_port()), "--grpc-port", str(free_port()),
                                       "--http-port", str(free_port())])
    process.start()
    yield process
    process.terminate()


def mutate(rng: random.Random, data: bytes) -> bytes:
    """`data` with a few bytes flipped, cut, repeated or appended."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.random()
        if choice < 0.4 and out:
            out[rng.randrange(len(out))] = rng.randrange(256)
        elif choice < 0.55 and out:
            del out[rng.randrange(len(out)):]
        elif choice < 0.7 and out:
            start = rng.randrange(len(out))
            out[start:start] = out[start:start + rng.randint(1, 16)]
        elif choice < 0.85:
            out += rng.randbytes(rng.randint(1, 64))
        else:
            position = rng.randrange(len(out) + 1)
            out[position:position] = rng.choice([b"\xff\xff\xff\x7f", b"\x00", b"\x80\x80\x80\x80\x01"])
    return bytes(out)


def send_and_drop(port: int, chunks: list[bytes]) -> None:
    """Send `chunks` on a fresh connection, read what comes back for a moment, close."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            for chunk in chunks:
                sock.sendall(chunk)
            sock.settimeout(0.05)
            try:
                sock.recv(65536)
            except (TimeoutError, OSError):
                pass
    except OSError:
        pass  # closed by the broker while sending: a refusal


def fuzz(case: Callable[[random.Random], None]) -> int:
    rng = random.Random(SEED)
    deadline = time.monotonic() + FUZZ_S
    count = 0
    while count < MAX_CASES and time.monotonic() < deadline:
        case(rng)
        count += 1
    return count


def assert_healthy(broker: BrokerProcess, since: int) -> None:
    """The broker process runs, answers a real MQTT round trip, and logged nothing bad."""
    assert broker.proc is not None and broker.proc.poll() is None, "the broker exited"
    with socket.create_connection(("127.0.0.1", broker.mqtt_port), timeout=10) as sock:
        sock.sendall(encode(p.Connect("MQTT", 4, True, 60, "healthy", None), 4))
        assert sock.recv(4)[:2] == b"\x20\x02"
    log = Path(broker.log_path).read_bytes()[since:].decode(errors="replace")
    assert "Traceback" not in log, log[log.index("Traceback") - 300:][:3000]
    errors = [line for line in log.splitlines() if " ERROR " in line or " CRITICAL " in line]
    assert not errors, errors[:5]


def log_size(broker: BrokerProcess) -> int:
    return Path(broker.log_path).stat().st_size


def test_mqtt_fuzz(broker: BrokerProcess) -> None:
    since = log_size(broker)
    connect5 = encode(p.Connect("MQTT", 5, True, 30, "fz", None, properties=p.Properties()), 5)
    connect4 = encode(p.Connect("MQTT", 4, True, 30, "fz4", p.Will("w/t", b"x", 1, True)), 4)
    packets = [
        encode(p.Publish("a/b", b"payload", 1, False, False, 7, p.Properties()), 5),
        encode(p.Subscribe(3, [p.SubscriptionRequest("a/#", 1)]), 5),
        encode(p.Unsubscribe(4, ["a/#"]), 5),
        encode(p.Pingreq(), 5),
        bytes([0x62, 0x02, 0x00, 0x01]),  # PUBREL
        bytes([0xF0, 0x00]),  # AUTH without a method
    ]

    def case(rng: random.Random) -> None:
        connect = rng.choice([connect5, connect4])
        if rng.random() < 0.3:
            send_and_drop(broker.mqtt_port, [mutate(rng, connect)])
        else:
            body = [mutate(rng, rng.choice(packets)) for _ in range(rng.randint(1, 4))]
            send_and_drop(broker.mqtt_port, [connect, *body])

    assert fuzz(case) > 10
    assert_healthy(broker, since)


def test_amqp_fuzz(broker: BrokerProcess) -> None:
    since = log_size(broker)
    port = broker.ports["amqp"]
    header = b"AMQP\x00\x00\x09\x01"
    start_ok = frame.marshal(commands.Connection.StartOk(
        client_properties={"product": "fuzz"}, mechanism="PLAIN", response="\x00guest\x00guest",
        locale="en_US"), 0)
    tune_ok = frame.marshal(commands.Connection.TuneOk(channel_max=16, frame_max=131072, heartbeat=0), 0)
    open_ = frame.marshal(commands.Connection.Open(virtual_host="/"), 0)
    after_open = [
        frame.marshal(commands.Channel.Open(), 1),
        frame.marshal(commands.Queue.Declare(queue="fz", durable=False), 1),
        frame.marshal(commands.Exchange.Declare(exchange="fzx", exchange_type="topic"), 1),
        frame.marshal(commands.Basic.Publish(exchange="amq.topic", routing_key="a.b"), 1),
        frame.marshal(commands.Basic.Consume(queue="fz"), 1),
        frame.marshal(commands.Basic.Qos(prefetch_count=5), 1),
    ]

    def case(rng: random.Random) -> None:
        stage = rng.randrange(4)
        good = [header, start_ok, tune_ok, open_][:stage + 1]
        if stage < 3:
            good[-1] = mutate(rng, good[-1])
            send_and_drop(port, good)
        else:
            body = [mutate(rng, rng.choice(after_open)) for _ in range(rng.randint(1, 4))]
            send_and_drop(port, [*good, after_open[0], *body])

    assert fuzz(case) > 10
    assert_healthy(broker, since)


def test_grpc_fuzz(broker: BrokerProcess) -> None:
    from shardgate.proto import shardgate_pb2 as pb

    since = log_size(broker)
    channel = grpc.insecure_channel(f"127.0.0.1:{broker.ports['grpc']}")
    methods = ["/shardgate.v1.Producer/Publish", "/shardgate.v1.Admin/CreateStream",
               "/shardgate.v1.Admin/DescribeStream", "/shardgate.v1.Admin/AddRoute",
               "/shardgate.v1.Admin/ResetCursor", "/shardgate.v1.Admin/DeleteSubscription",
               "/shardgate.v1.Admin/UpdateStream", "/shardgate.v1.Nope/Nothing"]
    valid = [
        pb.PublishRequest(topic="a/b", payload=b"x", ttl_ms=2**63 - 1).SerializeToString(),
        pb.PublishRequest(topic="a/b", payload=b"x",
                          headers=[pb.Header(key="x-delay", value="-1")]).SerializeToString(),
        pb.PublishRequest(topic="a/b", payload=b"x",
                          headers=[pb.Header(key="x-deliver-at", value=str(2**70))]).SerializeToString(),
        pb.PublishRequest(topic="a/+/b", payload=b"x").SerializeToString(),
        pb.StreamSpec(name="fz", partitions=2**31 - 1).SerializeToString(),
        pb.StreamName(name="").SerializeToString(),
    ]

    def case(rng: random.Random) -> None:
        call = channel.unary_unary(rng.choice(methods), request_serializer=None, response_deserializer=None)
        request = rng.choice(valid)
        if rng.random() < 0.7:
            request = mutate(rng, request)
        try:
            call(request, timeout=5)
        except grpc.RpcError as exc:
            assert exc.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), \
                (exc.code(), exc.details())

    try:
        assert fuzz(case) > 10
    finally:
        channel.close()
    assert_healthy(broker, since)


def test_http_fuzz(broker: BrokerProcess) -> None:
    since = log_size(broker)
    port = broker.ports["http"]
    requests = [
        b"GET /api/info HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        b"GET /api/streams/%ff%fe HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        b"DELETE /api/clients/mqtt/x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\r\n",
        b"POST /api/archive/flush HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 4\r\n"
        b"Content-Type: application/json\r\n\r\n{}{}",
        b"GET /api/history?seconds=-1&step=abc HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        b"GET /api/retained?limit=99999999999999999999 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        b"GET /api/subscriptions/x HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Basic !!!\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n",
    ]

    def case(rng: random.Random) -> None:
        request = rng.choice(requests)
        send_and_drop(port, [mutate(rng, request) if rng.random() < 0.8 else request])

    assert fuzz(case) > 10
    assert_healthy(broker, since)
