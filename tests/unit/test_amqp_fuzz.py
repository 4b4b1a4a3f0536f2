"""Malformed bytes fed to the sans-IO AMQP connection: it answers with a close (or nothing) and
never raises, before and after the handshake."""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import commands, frame
from shardgate.core.broker import Broker
from shardgate.core.edge import Edge
from shardgate.protocols.amqp.connection import PROTOCOL_HEADER, State
from shardgate.protocols.amqp.settings import AmqpSettings

from tests.manual_clock import ManualClock
from tests.unit.test_amqp_connection import Client, Loopless

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pamqp on basic.recover-async

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def opened() -> Client:
    client = Client(Loopless(Edge(Broker()), AmqpSettings(), scheduler=ManualClock()))
    client.handshake()
    client.open_channel(1)
    return client


def frames_of(method_index: int, args: bytes, frame_type: int = 1, channel: int = 1) -> bytes:
    payload = struct.pack(">I", method_index) + args if frame_type == 1 else args
    return struct.pack(">BHI", frame_type, channel, len(payload)) + payload + b"\xce"


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_before_the_header(data: bytes) -> None:
    client = Client(Loopless(Edge(Broker()), AmqpSettings(), scheduler=ManualClock()))
    client.conn.data_received(data)
    client.service._flush()


@FUZZ
@given(st.binary(max_size=300), st.integers(min_value=1, max_value=64))
def test_random_bytes_after_the_handshake(data: bytes, split: int) -> None:
    client = opened()
    for start in range(0, len(data), split):
        client.conn.data_received(data[start:start + split])
    client.service._flush()
    assert client.conn.state in (State.OPEN, State.CLOSING, State.CLOSED)


@FUZZ
@given(
    st.sampled_from(sorted(commands.INDEX_MAPPING)),
    st.binary(max_size=64),
    st.sampled_from([1, 2, 3]),
    st.integers(min_value=0, max_value=3),
)
def test_known_methods_with_garbage_arguments(index: int, args: bytes, frame_type: int, channel: int) -> None:
    client = opened()
    client.conn.data_received(frames_of(index, args, frame_type, channel))
    client.service._flush()
    # the connection either carries on or closes with a reply; it never raises
    client.conn.data_received(frame.marshal(commands.Basic.Qos(prefetch_count=1), 1))
    client.service._flush()


def test_header_then_garbage_in_one_read() -> None:
    client = Client(Loopless(Edge(Broker()), AmqpSettings(), scheduler=ManualClock()))
    client.conn.data_received(PROTOCOL_HEADER + b"\xff" * 40)
    client.service._flush()
    assert client.conn.state in (State.CLOSING, State.CLOSED)


@FUZZ
@given(st.binary(max_size=80), st.binary(max_size=40))
def test_garbage_content_header_after_a_publish(properties: bytes, body: bytes) -> None:
    client = opened()
    client.send(1, commands.Queue.Declare(queue="fz"))
    client.conn.data_received(
        frame.marshal(commands.Basic.Publish(exchange="", routing_key="fz"), 1)
        + frames_of(0, struct.pack(">HHQ", 60, 0, len(body)) + properties, frame_type=2)
        + frames_of(0, body, frame_type=3)
    )
    client.service._flush()


def test_non_utf8_short_string_property_is_a_syntax_error() -> None:
    client = opened()
    client.send(1, commands.Queue.Declare(queue="bin"))
    # property flags: content-type (bit 15), correlation-id (bit 10), reply-to (bit 9)
    props = struct.pack(">H", 0x8000 | 0x0400 | 0x0200) + b"\x02\xff\xfe" + b"\x01\xff" + b"\x01\xfe"
    out = client.feed(
        frame.marshal(commands.Basic.Publish(exchange="", routing_key="bin"), 1)
        + frames_of(0, struct.pack(">HHQ", 60, 0, 1) + props, frame_type=2)
        + frames_of(0, b"x", frame_type=3)
    )
    close = out[0][1]
    assert isinstance(close, commands.Connection.Close) and close.reply_code == 502
    assert client.conn.state is State.CLOSING
