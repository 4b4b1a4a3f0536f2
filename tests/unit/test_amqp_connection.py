"""The sans-IO AMQP connection fed raw frames: handshake, channels, errors, publish/consume."""

from __future__ import annotations

import struct
from typing import Any

import pytest
from pamqp import body as pbody
from pamqp import commands, frame, header
from shardgate.core.broker import Broker
from shardgate.core.edge import Action, Edge, Principal
from shardgate.protocols.amqp.connection import PROTOCOL_HEADER, AmqpConnection, State
from shardgate.protocols.amqp.service import AmqpService
from shardgate.protocols.amqp.settings import AmqpSettings

from tests.manual_clock import ManualClock


class FakeLink:
    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    def close(self) -> None:
        self.closed = True


class Client:
    """Drives one AmqpConnection with frames and reads what it answers."""

    def __init__(self, service: AmqpService, loopback: bool = True) -> None:
        self.service = service
        self.link = FakeLink()
        self.conn = AmqpConnection(service, self.link, "127.0.0.1:1", loopback)
        service.connection_made(self.conn)

    def feed(self, data: bytes) -> list[tuple[int, Any]]:
        self.conn.data_received(data)
        return self.read()

    def send(self, channel: int, *values: Any) -> list[tuple[int, Any]]:
        return self.feed(b"".join(frame.marshal(v, channel) for v in values))

    def read(self) -> list[tuple[int, Any]]:
        self.service._flush()
        data = bytes(self.link.data)
        self.link.data.clear()
        frames = []
        while data:
            if data.startswith(b"AMQP"):
                frames.append((0, data[:8]))
                data = data[8:]
                continue
            used, channel, value = frame.unmarshal(data)
            frames.append((channel, value))
            data = data[used:]
        return frames

    def handshake(self, user: str = "guest", password: str = "guest") -> None:
        out = self.feed(PROTOCOL_HEADER)
        assert isinstance(out[0][1], commands.Connection.Start)
        out = self.send(0, commands.Connection.StartOk(
            client_properties={"capabilities": {"consumer_cancel_notify": True, "connection.blocked": True}},
            mechanism="PLAIN", response=f"\0{user}\0{password}"))
        assert isinstance(out[0][1], commands.Connection.Tune), out
        out = self.send(0, commands.Connection.TuneOk(channel_max=100, frame_max=131072, heartbeat=0))
        assert out == []
        out = self.send(0, commands.Connection.Open(virtual_host="/"))
        assert isinstance(out[0][1], commands.Connection.OpenOk)

    def open_channel(self, number: int = 1) -> None:
        out = self.send(number, commands.Channel.Open())
        assert isinstance(out[0][1], commands.Channel.OpenOk)

    def publish(self, channel: int, exchange: str, key: str, body: bytes, mandatory: bool = False,
                **props: Any) -> list[tuple[int, Any]]:
        return self.send(
            channel,
            commands.Basic.Publish(exchange=exchange, routing_key=key, mandatory=mandatory),
            header.ContentHeader(0, len(body), commands.Basic.Properties(**props)),
            pbody.ContentBody(body),
        )


class Loopless(AmqpService):
    """Service whose flush is driven by the test instead of the event loop."""

    def request_flush(self, connection: AmqpConnection) -> None:
        self.output.add(connection)


@pytest.fixture
def service() -> AmqpService:
    return Loopless(Edge(Broker()), AmqpSettings(), scheduler=ManualClock())


@pytest.fixture
def client(service: AmqpService) -> Client:
    c = Client(service)
    c.handshake()
    c.open_channel(1)
    return c


def close_of(frames: list[tuple[int, Any]]) -> Any:
    closes = [v for _, v in frames if isinstance(v, commands.Connection.Close | commands.Channel.Close)]
    assert closes, frames
    return closes[0]


def test_wrong_protocol_version_gets_supported_header_and_close(service: AmqpService) -> None:
    c = Client(service)
    out = c.feed(b"AMQP\x01\x01\x00\x0a")
    assert out == [(0, PROTOCOL_HEADER)]
    assert c.link.closed


def test_garbage_before_header_gets_supported_header_and_close(service: AmqpService) -> None:
    c = Client(service)
    out = c.feed(b"GET / HTTP/1.1\r\n")
    assert out == [(0, PROTOCOL_HEADER)]
    assert c.link.closed


def test_header_split_over_reads(service: AmqpService) -> None:
    c = Client(service)
    assert c.feed(PROTOCOL_HEADER[:3]) == []
    out = c.feed(PROTOCOL_HEADER[3:])
    assert isinstance(out[0][1], commands.Connection.Start)
    assert "PLAIN" in out[0][1].mechanisms and "AMQPLAIN" in out[0][1].mechanisms


def test_bad_password_is_refused_with_403(service: AmqpService) -> None:
    c = Client(service)
    c.feed(PROTOCOL_HEADER)
    out = c.send(0, commands.Connection.StartOk(mechanism="PLAIN", response="\0guest\0nope"))
    assert close_of(out).reply_code == 403
    assert c.link.closed


def test_guest_refused_from_a_remote_address(service: AmqpService) -> None:
    c = Client(service, loopback=False)
    c.feed(PROTOCOL_HEADER)
    out = c.send(0, commands.Connection.StartOk(mechanism="PLAIN", response="\0guest\0guest"))
    close = close_of(out)
    assert close.reply_code == 403 and "localhost" in close.reply_text


def test_amqplain_login(service: AmqpService) -> None:
    from pamqp import encode

    c = Client(service)
    c.feed(PROTOCOL_HEADER)
    table = encode.field_table({"LOGIN": "guest", "PASSWORD": "guest"})[4:]
    out = c.send(0, commands.Connection.StartOk(mechanism="AMQPLAIN", response=table.decode()))
    assert isinstance(out[0][1], commands.Connection.Tune)


def test_unknown_vhost_is_530(service: AmqpService) -> None:
    c = Client(service)
    c.feed(PROTOCOL_HEADER)
    c.send(0, commands.Connection.StartOk(mechanism="PLAIN", response="\0guest\0guest"))
    c.send(0, commands.Connection.TuneOk(channel_max=0, frame_max=0, heartbeat=0))
    out = c.send(0, commands.Connection.Open(virtual_host="nope"))
    assert close_of(out).reply_code == 530


def test_frame_max_below_minimum_is_refused(service: AmqpService) -> None:
    """As RabbitMQ: an error while tuning closes the socket without a connection.close
    (tests/e2e/test_amqp_differential.py compares it with a real node)."""
    c = Client(service)
    c.feed(PROTOCOL_HEADER)
    c.send(0, commands.Connection.StartOk(mechanism="PLAIN", response="\0guest\0guest"))
    out = c.send(0, commands.Connection.TuneOk(channel_max=0, frame_max=1024, heartbeat=0))
    assert out == [] and c.link.closed


def test_oversized_frame_is_frame_error(client: Client) -> None:
    data = struct.pack(">BHI", 1, 1, 10_000_000)
    out = client.feed(data)
    assert close_of(out).reply_code == 501
    assert client.conn.state is State.CLOSING


def test_bad_frame_end_is_frame_error(client: Client) -> None:
    raw = bytearray(frame.marshal(commands.Basic.Qos(prefetch_count=1), 1))
    raw[-1] = 0
    assert close_of(client.feed(bytes(raw))).reply_code == 501


def test_method_on_unopened_channel_is_504(client: Client) -> None:
    out = client.send(7, commands.Basic.Qos(prefetch_count=1))
    assert close_of(out).reply_code == 504


def test_unknown_method_is_540(client: Client) -> None:
    raw = struct.pack(">HH", 60, 999) + b"\x00" * 4
    data = struct.pack(">BHI", 1, 1, len(raw)) + raw + b"\xce"
    assert close_of(client.feed(data)).reply_code == 540


def test_body_without_header_is_unexpected_frame(client: Client) -> None:
    out = client.send(1, pbody.ContentBody(b"hello"))
    assert close_of(out).reply_code == 505


def test_method_while_content_expected_is_unexpected_frame(client: Client) -> None:
    out = client.send(1, commands.Basic.Publish(exchange="", routing_key="q"),
                      commands.Basic.Qos(prefetch_count=1))
    assert close_of(out).reply_code == 505


def test_publish_to_missing_exchange_closes_channel_404(client: Client) -> None:
    out = client.publish(1, "nope", "k", b"x")
    close = close_of(out)
    assert isinstance(close, commands.Channel.Close)
    assert close.reply_code == 404 and (close.class_id, close.method_id) == (60, 40)
    # Frames for the closing channel are dropped until close-ok; then it can reopen.
    assert client.publish(1, "", "k", b"x") == []
    assert client.send(1, commands.Channel.CloseOk()) == []
    client.open_channel(1)


def test_tx_publishes_and_acks_take_effect_at_commit(client: Client) -> None:
    declare(client, "tx")
    client.publish(1, "", "tx", b"before")
    assert isinstance(client.send(1, commands.Tx.Select())[0][1], commands.Tx.SelectOk)
    get_ok = client.send(1, commands.Basic.Get(queue="tx"))[0][1]
    assert client.send(1, commands.Basic.Ack(delivery_tag=get_ok.delivery_tag)) == []
    assert client.publish(1, "", "tx", b"inside") == []
    assert isinstance(client.send(1, commands.Basic.Get(queue="tx"))[0][1], commands.Basic.GetEmpty)
    assert isinstance(client.send(1, commands.Tx.Rollback())[0][1], commands.Tx.RollbackOk)
    # Rolled back: the publish is gone, the ack undone (the delivery is unacked again).
    assert isinstance(client.send(1, commands.Basic.Get(queue="tx"))[0][1], commands.Basic.GetEmpty)
    client.send(1, commands.Basic.Ack(delivery_tag=get_ok.delivery_tag))
    client.publish(1, "", "tx", b"committed")
    assert isinstance(client.send(1, commands.Tx.Commit())[0][1], commands.Tx.CommitOk)
    out = client.send(1, commands.Basic.Get(queue="tx"))
    assert [v.value for _, v in out if isinstance(v, pbody.ContentBody)] == [b"committed"]


def test_tx_methods_need_a_transactional_channel(client: Client) -> None:
    close = close_of(client.send(1, commands.Tx.Commit()))
    assert (close.reply_code, close.reply_text) == (406, "PRECONDITION_FAILED - channel is not transactional")
    client.send(1, commands.Channel.CloseOk())
    client.open_channel(1)
    client.send(1, commands.Confirm.Select())
    close = close_of(client.send(1, commands.Tx.Select()))
    assert close.reply_text == "PRECONDITION_FAILED - cannot switch from confirm to tx mode"


def test_channel_numbers_are_free_but_their_count_is_limited(client: Client) -> None:
    client.open_channel(65535)  # above channel-max (100): only the count is limited
    for number in range(2, 100):
        client.open_channel(number)
    close = close_of(client.send(100, commands.Channel.Open()))
    assert isinstance(close, commands.Connection.Close) and close.reply_code == 530
    assert close.reply_text == (
        "NOT_ALLOWED - number of channels opened (100) has reached the negotiated channel_max (100)"
    )


def test_connection_close_handshake(client: Client) -> None:
    out = client.send(0, commands.Connection.Close(200, "bye", 0, 0))
    assert isinstance(out[0][1], commands.Connection.CloseOk)
    assert client.link.closed


def declare(client: Client, name: str, **kwargs: Any) -> Any:
    out = client.send(1, commands.Queue.Declare(queue=name, **kwargs))
    return out[0][1]


def test_publish_via_default_exchange_and_basic_get(client: Client) -> None:
    ok = declare(client, "q1")
    assert isinstance(ok, commands.Queue.DeclareOk) and ok.queue == "q1"
    assert client.publish(1, "", "q1", b"hello", content_type="text/plain",
                          headers={"n": 1}) == []
    out = client.send(1, commands.Basic.Get(queue="q1"))
    get_ok, content, body = (v for _, v in out)
    assert isinstance(get_ok, commands.Basic.GetOk)
    assert get_ok.routing_key == "q1" and get_ok.exchange == ""
    assert content.properties.content_type == "text/plain"
    assert content.properties.headers == {"n": 1}
    assert body.value == b"hello"
    out = client.send(1, commands.Basic.Get(queue="q1"))
    assert isinstance(out[0][1], commands.Basic.GetEmpty)


def test_consume_on_amq_topic_binding(client: Client) -> None:
    declare(client, "q2")
    out = client.send(1, commands.Queue.Bind(queue="q2", exchange="amq.topic", routing_key="a.*.c"))
    assert isinstance(out[0][1], commands.Queue.BindOk)
    out = client.send(1, commands.Basic.Consume(queue="q2", consumer_tag="t1", no_ack=True))
    assert isinstance(out[0][1], commands.Basic.ConsumeOk)
    out = client.publish(1, "amq.topic", "a.b.c", b"m1")
    deliver = out[0][1]
    assert isinstance(deliver, commands.Basic.Deliver)
    assert (deliver.consumer_tag, deliver.exchange, deliver.routing_key) == ("t1", "amq.topic", "a.b.c")
    assert client.publish(1, "amq.topic", "a.b.d", b"m2") == []


def test_mandatory_unroutable_is_returned(client: Client) -> None:
    client.send(1, commands.Confirm.Select())
    out = client.publish(1, "amq.direct", "nobody", b"x", mandatory=True)
    kinds = [type(v) for _, v in out]
    assert kinds[0] is commands.Basic.Return and out[0][1].reply_code == 312
    assert isinstance(out[-1][1], commands.Basic.Ack) and out[-1][1].delivery_tag == 1


def test_prefetch_limits_and_requeue_order(client: Client) -> None:
    declare(client, "q3")
    for i in range(5):
        client.publish(1, "", "q3", str(i).encode())
    client.send(1, commands.Basic.Qos(prefetch_count=2))
    out = client.send(1, commands.Basic.Consume(queue="q3", consumer_tag="c"))
    delivers = [v for _, v in out if isinstance(v, commands.Basic.Deliver)]
    assert [d.delivery_tag for d in delivers] == [1, 2]
    out = client.send(1, commands.Basic.Nack(delivery_tag=2, multiple=True, requeue=True))
    delivers = [v for _, v in out if isinstance(v, commands.Basic.Deliver)]
    bodies = [v.value for _, v in out if isinstance(v, pbody.ContentBody)]
    assert all(d.redelivered for d in delivers) and bodies == [b"0", b"1"]
    out = client.send(1, commands.Basic.Ack(delivery_tag=4, multiple=True))
    bodies = [v.value for _, v in out if isinstance(v, pbody.ContentBody)]
    assert bodies == [b"2", b"3"]


def test_unknown_delivery_tag_is_406(client: Client) -> None:
    close = close_of(client.send(1, commands.Basic.Ack(delivery_tag=42)))
    assert isinstance(close, commands.Channel.Close) and close.reply_code == 406


def test_exclusive_queue_locked_for_other_connections(service: AmqpService, client: Client) -> None:
    declare(client, "mine", exclusive=True)
    other = Client(service)
    other.handshake()
    other.open_channel(1)
    out = other.send(1, commands.Queue.Declare(queue="mine", passive=True))
    assert close_of(out).reply_code == 405
    client.send(0, commands.Connection.Close(200, "bye", 0, 0))
    assert "mine" not in service.vhosts["/"].queues


def test_passive_declare_of_missing_queue_is_404(client: Client) -> None:
    out = client.send(1, commands.Queue.Declare(queue="missing", passive=True))
    assert close_of(out).reply_code == 404


def test_exchange_redeclare_with_other_type_is_406(client: Client) -> None:
    out = client.send(1, commands.Exchange.Declare(exchange="amq.topic", exchange_type="direct"))
    assert close_of(out).reply_code == 406


def test_server_named_queue(client: Client) -> None:
    ok = declare(client, "")
    assert ok.queue.startswith("amq.gen-")


def test_heartbeat_frames_are_accepted(client: Client) -> None:
    assert client.feed(frame.marshal(frame.heartbeat.Heartbeat(), 0)) == []


def test_hot_path_codecs_match_pamqp():
    from shardgate.protocols.amqp import hotpath

    publish = frame.marshal(commands.Basic.Publish(exchange="ex.1", routing_key="k/ü", mandatory=True), 3)
    decoded = hotpath.decode_publish(publish)
    assert (decoded.exchange, decoded.routing_key, decoded.mandatory, decoded.immediate) == (
        "ex.1", "k/ü", True, False)
    ack = frame.marshal(commands.Basic.Ack(delivery_tag=2**40 + 5, multiple=True), 2)
    decoded_ack = hotpath.decode_ack(ack)
    assert (decoded_ack.delivery_tag, decoded_ack.multiple) == (2**40 + 5, True)
    assert hotpath.encode_ack(2, 2**40 + 5, True) == ack
    deliver = commands.Basic.Deliver("ctag", 77, True, "amq.topic", "a.b")
    assert hotpath.encode_deliver(4, hotpath.shortstr("ctag"), 77, True, "amq.topic", "a.b") == \
        frame.marshal(deliver, 4)
    assert hotpath.decode_publish(publish[:-3] + b"\xce") is None


@pytest.mark.parametrize("props", [
    {},
    {"delivery_mode": 2},
    {"content_type": "application/json", "content_encoding": "gzip", "delivery_mode": 1,
     "priority": 7, "correlation_id": "c-1", "reply_to": "amq.rabbitmq.reply-to",
     "expiration": "60000", "message_id": "m-ü", "message_type": "t", "user_id": "guest",
     "app_id": "app"},
    {"headers": {"n": 1, "s": "x", "nested": {"l": [1, "two", 3.5]}, "flag": True},
     "timestamp": __import__("datetime").datetime(2026, 1, 2, 3, 4, 5,
                                                  tzinfo=__import__("datetime").UTC)},
])
def test_content_header_fast_decode_matches_pamqp(props: dict[str, Any]) -> None:
    from shardgate.protocols.amqp import hotpath

    raw = frame.marshal(header.ContentHeader(0, 12345, commands.Basic.Properties(**props)), 1)
    body_size, decoded = hotpath.decode_content_header(raw)
    _, _, expected = frame.unmarshal(raw)
    assert body_size == 12345
    for name in hotpath._PROPERTY_NAMES:
        assert getattr(decoded, name) == getattr(expected.properties, name), name
    assert decoded.marshal() == expected.properties.marshal()


def test_content_header_fast_decode_leaves_odd_input_to_pamqp() -> None:
    from shardgate.protocols.amqp import hotpath

    raw = frame.marshal(header.ContentHeader(0, 1, commands.Basic.Properties(app_id="a")), 1)
    assert hotpath.decode_content_header(raw[:-4] + b"\xce") is None  # truncated
    bad_utf8 = raw.replace(b"\x01a", b"\x01\xff")
    assert hotpath.decode_content_header(bad_utf8) is None
    other_class = raw[:7] + struct.pack(">H", 50) + raw[9:]
    assert hotpath.decode_content_header(other_class) is None


def test_confirms_merge_into_one_multiple_ack(client: Client) -> None:
    client.send(1, commands.Confirm.Select())
    declare(client, "cq")
    chunk = b"".join(
        frame.marshal(commands.Basic.Publish(exchange="", routing_key="cq"), 1)
        + frame.marshal(header.ContentHeader(0, 1, commands.Basic.Properties()), 1)
        + frame.marshal(pbody.ContentBody(b"x"), 1)
        for _ in range(10)
    )
    out = client.feed(chunk)
    acks = [v for _, v in out if isinstance(v, commands.Basic.Ack)]
    assert [(a.delivery_tag, a.multiple) for a in acks] == [(10, True)]


def test_server_sends_heartbeats_and_drops_a_silent_peer(service: AmqpService) -> None:
    c = Client(service)
    c.feed(PROTOCOL_HEADER)
    c.send(0, commands.Connection.StartOk(mechanism="PLAIN", response="\0guest\0guest"))
    c.send(0, commands.Connection.TuneOk(channel_max=0, frame_max=0, heartbeat=2))
    c.send(0, commands.Connection.Open(virtual_host="/"))
    start = c.conn.last_received
    c.conn.tick(start + 1.5)
    out = c.read()
    assert [type(v).__name__ for _, v in out] == ["Heartbeat"]
    assert not c.link.closed
    c.conn.tick(start + 4.5)
    assert c.link.closed


def test_heartbeats_run_on_the_services_timers_with_a_manual_clock() -> None:
    clock = ManualClock()
    service = Loopless(Edge(Broker()), AmqpSettings(), scheduler=clock)
    service.start()  # its tick and sweep timers go to the clock, no event loop
    c = Client(service)
    c.feed(PROTOCOL_HEADER)
    c.send(0, commands.Connection.StartOk(mechanism="PLAIN", response="\0guest\0guest"))
    c.send(0, commands.Connection.TuneOk(channel_max=0, frame_max=0, heartbeat=2))
    c.send(0, commands.Connection.Open(virtual_host="/"))
    clock.advance(1.5)
    assert [type(v).__name__ for _, v in c.read()] == ["Heartbeat"]
    assert not c.link.closed
    clock.advance(3.6)  # over two heartbeat intervals without a frame from the client
    assert c.link.closed
    service.stop()


def test_heartbeat_negotiation_follows_tune_ok(service: AmqpService) -> None:
    c = Client(service)
    out = c.feed(PROTOCOL_HEADER)
    out = c.send(0, commands.Connection.StartOk(mechanism="PLAIN", response="\0guest\0guest"))
    tune = out[0][1]
    assert (tune.frame_max, tune.channel_max, tune.heartbeat) == (131072, 2047, 60)
    c.send(0, commands.Connection.TuneOk(channel_max=5, frame_max=8192, heartbeat=0))
    c.send(0, commands.Connection.Open(virtual_host="/"))
    assert (c.conn.frame_max, c.conn.channel_max, c.conn.heartbeat) == (8192, 5, 0)
    # RabbitMQ limits the number of open channels, not their numbers.
    assert isinstance(c.send(6, commands.Channel.Open())[0][1], commands.Channel.OpenOk)


def test_channel_wide_prefetch(client: Client) -> None:
    declare(client, "qa")
    declare(client, "qb")
    for name in ("qa", "qb"):
        for i in range(3):
            client.publish(1, "", name, b"%d" % i)
    client.send(1, commands.Basic.Qos(prefetch_count=2, global_=True))
    out = client.send(1, commands.Basic.Consume(queue="qa", consumer_tag="a"),
                      commands.Basic.Consume(queue="qb", consumer_tag="b"))
    delivers = [v for _, v in out if isinstance(v, commands.Basic.Deliver)]
    assert len(delivers) == 2  # two consumers share the channel's window of 2


def test_deleting_a_queue_cancels_its_consumers(service: AmqpService, client: Client) -> None:
    declare(client, "gone")
    client.send(1, commands.Basic.Consume(queue="gone", consumer_tag="c1"))
    other = Client(service)
    other.handshake()
    other.open_channel(1)
    out = other.send(1, commands.Queue.Delete(queue="gone"))
    assert isinstance(out[0][1], commands.Queue.DeleteOk)
    cancels = [v for _, v in client.read() if isinstance(v, commands.Basic.Cancel)]
    assert [c.consumer_tag for c in cancels] == ["c1"]


def test_delete_if_unused_refused_while_consumed(client: Client) -> None:
    declare(client, "busy")
    client.send(1, commands.Basic.Consume(queue="busy", consumer_tag="c"))
    close = close_of(client.send(1, commands.Queue.Delete(queue="busy", if_unused=True)))
    assert close.reply_code == 406


def test_consumer_tag_reuse_is_a_connection_error(client: Client) -> None:
    declare(client, "tags")
    client.send(1, commands.Basic.Consume(queue="tags", consumer_tag="same"))
    close = close_of(client.send(1, commands.Basic.Consume(queue="tags", consumer_tag="same")))
    assert isinstance(close, commands.Connection.Close) and close.reply_code == 530


def test_user_id_must_match_the_login(client: Client) -> None:
    declare(client, "uid")
    close = close_of(client.publish(1, "", "uid", b"x", user_id="mallory"))
    assert isinstance(close, commands.Channel.Close) and close.reply_code == 406


def test_large_body_is_split_into_frame_max_frames(client: Client) -> None:
    declare(client, "big")
    payload = bytes(range(256)) * 2000  # 512 000 bytes, four times frame-max
    chunks = [payload[i:i + 100_000] for i in range(0, len(payload), 100_000)]
    client.send(1, commands.Basic.Publish(exchange="", routing_key="big"),
                header.ContentHeader(0, len(payload), commands.Basic.Properties()),
                *[pbody.ContentBody(chunk) for chunk in chunks])
    out = client.send(1, commands.Basic.Get(queue="big", no_ack=True))
    bodies = [v.value for _, v in out if isinstance(v, pbody.ContentBody)]
    assert b"".join(bodies) == payload and max(len(b) for b in bodies) <= 131072 - 8


def test_authenticator_hook_decides_logins(service: AmqpService) -> None:
    service.authenticator = lambda user, password: None if (user, password) == ("app", "s3cret") else "no"
    ok = Client(service, loopback=False)
    ok.handshake("app", "s3cret")
    bad = Client(service)
    bad.feed(PROTOCOL_HEADER)
    out = bad.send(0, commands.Connection.StartOk(mechanism="PLAIN", response="\0guest\0guest"))
    assert close_of(out).reply_code == 403


class SecretRefused:
    """A security policy that leaves logins to the AMQP layer's built-in users and refuses
    every topic under `secret`."""

    allow_anonymous = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None, str]] = []

    def checks_credentials(self) -> bool:
        return False

    def authenticate_principal(self, principal: Principal, password: bytes | str | None) -> str | None:
        return None

    def authorize_principal(self, principal: Principal, action: Action, topic: str) -> bool:
        self.calls.append((action, principal.username, topic))
        return not topic.startswith("secret")

    def count_denial(self, principal: Principal, action: Action) -> None:
        pass


class UsersOnly(SecretRefused):
    """A policy that checks credentials: only app / s3cret logs in."""

    def __init__(self) -> None:
        super().__init__()
        self.denied: list[Action] = []

    def checks_credentials(self) -> bool:
        return True

    def authenticate_principal(self, principal: Principal, password: bytes | str | None) -> str | None:
        return None if (principal.username, password) == ("app", "s3cret") else "bad-credentials"


def test_a_policy_that_checks_credentials_decides_logins_instead_of_the_built_in_users(
        service: AmqpService) -> None:
    service.edge.security.install(UsersOnly())
    ok = Client(service, loopback=False)
    ok.handshake("app", "s3cret")
    guest = Client(service)  # the built-in guest/guest no longer logs in
    guest.feed(PROTOCOL_HEADER)
    out = guest.send(0, commands.Connection.StartOk(mechanism="PLAIN", response="\0guest\0guest"))
    assert close_of(out).reply_code == 403
    # installed again (a policy that checks none): the built-in users decide the next login
    service.edge.security.install(SecretRefused())
    Client(service).handshake("guest", "guest")


def test_memory_alarm_blocks_publishers_until_queues_drain(service: AmqpService, client: Client) -> None:
    service.settings.memory_high_watermark = 1000
    declare(client, "mem")
    for _ in range(3):
        client.publish(1, "", "mem", b"x" * 400)
    service._check_memory()
    out = client.read()
    assert [type(v) for _, v in out] == [commands.Connection.Blocked]
    client.publish(1, "", "mem", b"held")
    assert len(service.vhosts["/"].queues["mem"].messages) == 3  # the 4th waits unread
    consumer = Client(service)  # frames behind the held publish wait too: drain from elsewhere
    consumer.handshake()
    consumer.open_channel(1)
    for _ in range(3):
        consumer.send(1, commands.Basic.Get(queue="mem", no_ack=True))
    service._check_memory()
    out = client.read()
    assert isinstance(out[0][1], commands.Connection.Unblocked)
    got = client.send(1, commands.Basic.Get(queue="mem", no_ack=True))
    assert got[-1][1].value == b"held"


def test_authorizer_refuses_publish_and_bind_with_403(service: AmqpService, client: Client) -> None:
    policy = SecretRefused()
    service.edge.security.install(policy)  # after the client logged in: it asks this one
    calls = policy.calls
    declare(client, "az")
    close = close_of(client.send(1, commands.Queue.Bind(queue="az", exchange="amq.topic",
                                                        routing_key="secret.#")))
    assert close.reply_code == 403
    client.send(1, commands.Channel.CloseOk())
    client.open_channel(1)
    close = close_of(client.publish(1, "amq.topic", "secret.x", b"x"))
    assert close.reply_code == 403
    assert ("subscribe", "guest", "secret/#") in calls and ("publish", "guest", "secret/x") in calls
