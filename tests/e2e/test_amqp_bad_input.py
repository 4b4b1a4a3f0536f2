"""Bad AMQP input over real sockets: each gets the spec's reply and close, and the broker keeps
serving every other connection (checked with a pika client after each case)."""

from __future__ import annotations

import socket
import struct

import pika
import pytest
from pamqp import commands, frame

from tests.conftest import free_port

HEADER = b"AMQP\x00\x00\x09\x01"


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    from tests.conftest import ThreadedBroker, make_config

    config = make_config(tmp_path_factory.mktemp("amqp-bad"), listeners={"amqp_port": free_port()})
    broker = ThreadedBroker(config).start()
    yield broker
    broker.stop()


@pytest.fixture
def port(node) -> int:
    return node.app.port("amqp")


def read_frames(sock: socket.socket, until: type | None = None) -> list:
    """Read frames until the socket closes (or a frame of type `until` arrived)."""
    sock.settimeout(5)
    data = b""
    frames: list = []
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return frames
        if not chunk:
            return frames
        data += chunk
        while data:
            if data.startswith(b"AMQP") and len(data) >= 8:
                frames.append(data[:8])
                data = data[8:]
                continue
            if len(data) < 7:
                break
            size = struct.unpack(">I", data[3:7])[0]
            if len(data) < size + 8:
                break
            _, _, value = frame.unmarshal(data[: size + 8])
            data = data[size + 8:]
            frames.append(value)
            if until is not None and isinstance(value, until):
                return frames


def opened(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(HEADER)
    read_frames(sock, commands.Connection.Start)
    sock.sendall(frame.marshal(commands.Connection.StartOk(mechanism="PLAIN", response="\0guest\0guest"), 0))
    read_frames(sock, commands.Connection.Tune)
    sock.sendall(frame.marshal(commands.Connection.TuneOk(channel_max=10, frame_max=4096, heartbeat=0), 0))
    sock.sendall(frame.marshal(commands.Connection.Open(virtual_host="/"), 0))
    read_frames(sock, commands.Connection.OpenOk)
    sock.sendall(frame.marshal(commands.Channel.Open(), 1))
    read_frames(sock, commands.Channel.OpenOk)
    return sock


def still_serving(port: int) -> None:
    params = pika.ConnectionParameters("127.0.0.1", port, heartbeat=0)
    with pika.BlockingConnection(params) as conn:
        channel = conn.channel()
        queue = channel.queue_declare("", exclusive=True).method.queue
        channel.basic_publish("", queue, b"alive")
        _, _, body = channel.basic_get(queue, auto_ack=True)
        assert body == b"alive"


def close_code(frames: list) -> int:
    closes = [f for f in frames if isinstance(f, commands.Connection.Close | commands.Channel.Close)]
    assert closes, frames
    return closes[0].reply_code


def test_garbage_before_header(port):
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"\x16\x03\x01garbage" + HEADER)
        assert read_frames(sock) == [HEADER]
    still_serving(port)


def test_wrong_protocol_version(port):
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"AMQP\x00\x01\x00\x00")
        assert read_frames(sock) == [HEADER]
    still_serving(port)


def test_oversized_frame(port):
    with opened(port) as sock:
        sock.sendall(struct.pack(">BHI", 1, 1, 1_000_000) + b"\x00" * 100)
        assert close_code(read_frames(sock, commands.Connection.Close)) == 501
    still_serving(port)


def test_frame_on_unopened_channel(port):
    with opened(port) as sock:
        sock.sendall(frame.marshal(commands.Queue.Declare(queue="x"), 5))
        assert close_code(read_frames(sock, commands.Connection.Close)) == 504
    still_serving(port)


def test_unknown_method(port):
    with opened(port) as sock:
        payload = struct.pack(">HH", 99, 1)
        sock.sendall(struct.pack(">BHI", 1, 1, len(payload)) + payload + b"\xce")
        assert close_code(read_frames(sock, commands.Connection.Close)) == 540
    still_serving(port)


def test_content_out_of_order(port):
    with opened(port) as sock:
        sock.sendall(struct.pack(">BHI", 3, 1, 5) + b"hello\xce")
        assert close_code(read_frames(sock, commands.Connection.Close)) == 505
    still_serving(port)


def test_publish_to_missing_exchange(port):
    with opened(port) as sock:
        from pamqp import body, header

        sock.sendall(
            frame.marshal(commands.Basic.Publish(exchange="missing", routing_key="k"), 1)
            + frame.marshal(header.ContentHeader(0, 1, commands.Basic.Properties()), 1)
            + frame.marshal(body.ContentBody(b"x"), 1)
        )
        frames = read_frames(sock, commands.Channel.Close)
        assert isinstance(frames[-1], commands.Channel.Close) and frames[-1].reply_code == 404
    still_serving(port)


def test_truncated_method_arguments(port):
    with opened(port) as sock:
        payload = struct.pack(">HH", 50, 10) + b"\x00"  # queue.declare cut short
        sock.sendall(struct.pack(">BHI", 1, 1, len(payload)) + payload + b"\xce")
        assert close_code(read_frames(sock, commands.Connection.Close)) in (502, 501)
    still_serving(port)


def test_client_that_vanishes_mid_frame(port):
    sock = opened(port)
    sock.sendall(struct.pack(">BHI", 1, 1, 100) + b"\x00\x3c")
    sock.close()
    still_serving(port)
