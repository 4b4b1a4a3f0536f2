"""Publishing the messages of one read at once (`Broker.publish_many`, `Edge.publish_many`):
one journal append per shard, and per message exactly what `publish` does — a refused message
gets its own error and the others are stored and acknowledged, order within a shard is kept,
statistics count each accepted message once, and delayed, transient and non-reliable messages
are handled as single publishes handle them. The MQTT connection hands the PUBLISHes of one
read over in one call."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from shardgate.core.broker import Broker
from shardgate.core.edge import Edge
from shardgate.core.errors import PublishRejected, SchemaMismatch, StoreFull
from shardgate.core.message import Message
from shardgate.core.streams import StreamConfig
from shardgate.protocols.mqtt import packets as p
from shardgate.protocols.mqtt.codec import encode
from shardgate.protocols.mqtt.connection import MqttConnection
from shardgate.protocols.mqtt.service import MqttService
from shardgate.protocols.mqtt.settings import MqttSettings
from shardgate.storage.journal import JournalStorage

from tests.unit.test_commit_before_delivery import Recorder
from tests.unit.test_mqtt_connection import Node, Wire

RC = p.ReasonCode


class ResumableWire(Wire):
    def resume(self) -> None:
        pass


class CountingLog:
    """A shard's journal log that counts the `append` calls it gets (everything else is the
    log's own)."""

    def __init__(self, log: object) -> None:
        self._log = log
        self.appends: list[int] = []  # records per call

    def append(self, records: Sequence[tuple[int, bytes]]) -> int:
        self.appends.append(len(records))
        return self._log.append(records)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._log, name)


def count_appends(broker: Broker, stream: str = "default") -> list[CountingLog]:
    logs = []
    for shard in broker.stream(stream).shards:
        shard.log = CountingLog(shard.log)  # type: ignore[assignment]
        logs.append(shard.log)
    return logs  # type: ignore[return-value]


def build(journal: JournalStorage, partitions: int = 1) -> tuple[Broker, Recorder]:
    broker = Broker(
        storage=journal, default_stream=StreamConfig("default", mode="reliable", partitions=partitions)
    )
    broker.create_stream(StreamConfig("json", mode="reliable", schema="json"), routes=["j/#"])
    broker.create_stream(StreamConfig("memory", mode="non-reliable"), routes=["m/#"])
    sub = broker.subscription("live")
    broker.add_filter(sub, "#")
    recorder = Recorder()
    broker.attach(sub, recorder)
    return broker, recorder


async def settle(outcomes: Sequence[object]) -> None:
    """Wait for every commit future, then one loop turn: a future that was done already when
    awaited has not run its callbacks (the broker's delivery of held messages) yet."""
    for outcome in outcomes:
        if isinstance(outcome, asyncio.Future):
            await outcome
    await asyncio.sleep(0)


async def test_one_journal_append_per_shard_and_each_shard_keeps_its_order(
    journal: JournalStorage,
) -> None:
    broker, recorder = build(journal, partitions=4)
    logs = count_appends(broker)
    topics = [f"t/{n}" for n in range(8)]
    messages = [Message(topics[n % 8], f"{n}".encode()) for n in range(64)]
    outcomes = broker.publish_many(messages)
    used = [log for log in logs if log.appends]
    assert len(used) > 1, "the topics spread over several shards"
    assert all(log.appends == [sum(1 for m in messages if m.shard == logs.index(log))] for log in used)
    assert all(isinstance(outcome, asyncio.Future) for outcome in outcomes)
    # One commit future per shard's group, shared by its messages.
    by_shard = {m.shard: outcome for m, outcome in zip(messages, outcomes, strict=True)}
    assert all(outcome is by_shard[m.shard] for m, outcome in zip(messages, outcomes, strict=True))
    await settle(outcomes)
    for index, log in enumerate(logs):
        stored = [r.data for r in log.read(0)]
        mine = [m for m in messages if m.shard == index]
        assert [m.offset for m in mine] == list(range(len(mine))), "dense offsets in order"
        assert len(stored) == len(mine)
    for topic in topics:  # every topic's messages reached the subscriber in publish order
        sent = [m.payload for m in messages if m.topic == topic]
        assert [payload for _, payload in recorder.got if payload in sent] == sent
    assert broker.stats.messages_in == 64


async def test_a_refused_message_does_not_drop_the_others(journal: JournalStorage) -> None:
    broker, recorder = build(journal)
    (log,) = count_appends(broker)
    messages = [
        Message("t/1", b"one"),
        Message("j/1", b"not json"),  # the json stream's schema refuses it
        Message("$internal/x", b"reserved"),  # reserved for the broker
        Message("t/1", b"two"),
        Message("$delayed/bad/t/1", b"bad delay"),
        Message("t/1", b"three"),
    ]
    outcomes = broker.publish_many(messages)
    assert isinstance(outcomes[1], SchemaMismatch)
    assert isinstance(outcomes[2], PublishRejected)
    assert isinstance(outcomes[4], PublishRejected)
    accepted = [outcomes[0], outcomes[3], outcomes[5]]
    assert all(isinstance(o, asyncio.Future) for o in accepted) and len(set(map(id, accepted))) == 1
    assert log.appends == [3]
    await settle(outcomes)
    assert [payload for _, payload in recorder.got] == [b"one", b"two", b"three"]
    assert [r.data != b"" for r in log.read(0)] == [True, True, True]
    stats = broker.stats
    assert stats.messages_in == 3, "counted once, refused ones not at all"
    assert (stats.bytes_in, stats.in_by_stream["default"], stats.bytes_in_by_protocol[""]) == (11, 3, 11)


async def test_what_the_journal_cannot_take_is_refused_message_by_message(tmp_path: Path) -> None:
    journal = JournalStorage(tmp_path / "journal", max_pending_bytes=4096)
    try:
        broker, recorder = build(journal)
        # A large first group fills what may wait for the disk; the next batch is refused
        # there, while a message of a memory stream in the same batch is delivered.
        first = broker.publish_many([Message("t/big", bytes(5000)), Message("t/big", b"x")])
        outcomes = broker.publish_many([Message("t/1", b"a"), Message("m/1", b"memory"), Message("t/1", b"b")])
        assert isinstance(outcomes[0], StoreFull) and isinstance(outcomes[2], StoreFull)
        assert outcomes[1] is None
        assert (-1, b"memory") not in recorder.got and (0, b"memory") in recorder.got
        await settle(first)
        # Once the disk caught up, the journal takes messages again.
        later = broker.publish_many([Message("t/1", b"c"), Message("t/1", b"d")])
        assert all(isinstance(o, asyncio.Future) for o in later)
        await settle(later)
        assert [payload for _, payload in recorder.got][-2:] == [b"c", b"d"]
    finally:
        journal.close()


def mixed_read() -> list[Message]:
    """Stored, non-reliable, transient, retained and delayed messages in one read."""
    return [
        Message("t/1", b"s1"),
        Message("m/1", b"mem1"),
        Message("t/1", b"tr1", transient=True),
        Message("t/1", b"s2", retain=True),
        Message("$delayed/60/t/1", b"later"),
        Message("m/1", b"mem2"),
        Message("t/2", b"s3"),
        Message("t/1", b"tr2", transient=True),
    ]


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh-journal", "reserved-offsets"])
async def test_a_batch_does_what_the_same_single_publishes_do(tmp_path: Path, fresh: bool) -> None:
    seen: dict[str, list[tuple[str, int, bytes]]] = {}
    kinds: dict[str, list[str]] = {}
    for way in ("single", "batch"):
        journal = JournalStorage(tmp_path / way)
        try:
            broker, recorder = build(journal)
            if not fresh:  # the journal has reserved offsets: stored messages go out at once
                await broker.publish(Message("t/0", b"warm-up"))  # type: ignore[misc]
                recorder.got.clear()
            messages = mixed_read()
            if way == "single":
                outcomes: list[object] = [broker.publish(m) for m in messages]
            else:
                outcomes = list(broker.publish_many(messages))
            kinds[way] = [type(o).__name__ for o in outcomes]
            got_now = list(recorder.got)
            await settle(outcomes)
            seen[way] = [(m.topic, m.offset, m.payload) for m in messages]
            seen[way + "-delivered"] = [("", offset, payload) for offset, payload in recorder.got]
            seen[way + "-early"] = [("", offset, payload) for offset, payload in got_now]
            assert broker.retained.get("t/1") is not None
            assert len(broker.delayed) == 1
        finally:
            journal.close()
    assert kinds["single"] == kinds["batch"]
    assert seen["single"] == seen["batch"]
    assert seen["single-early"] == seen["batch-early"]
    # The batch dispatches after its appends: the same deliveries, each shard in its order.
    assert seen["single-delivered"] == seen["batch-delivered"]


async def test_an_mqtt_read_of_publishes_is_one_append_with_per_message_acks(
    journal: JournalStorage,
) -> None:
    broker, recorder = build(journal)
    (log,) = count_appends(broker)
    loop = asyncio.get_running_loop()
    service = MqttService(Edge(broker), MqttSettings(sys_interval=0), scheduler=loop)
    service.start()
    try:
        wire = Wire(5)
        connection = MqttConnection(service, wire, "127.0.0.1:1")
        service.connection_made(connection)
        connection.data_received(encode(p.Connect("MQTT", 5, True, 60, "pub"), 5))
        await until(lambda: wire.out)
        wire.read()
        read = b"".join(encode(packet, 5) for packet in (
            p.Publish("t/1", b"a", qos=1, packet_id=1),
            p.Publish("j/1", b"not json", qos=1, packet_id=2),
            p.Publish("t/1", b"b", qos=0),
            p.Publish("t/1", b"c", qos=1, packet_id=3),
        ))
        connection.data_received(read)
        acks: list[p.Packet] = []
        await until(lambda: len(acks.extend(wire.read()) or acks) >= 3)
        codes = {ack.packet_id: ack.reason_code for ack in acks}  # type: ignore[attr-defined]
        assert codes == {1: RC.SUCCESS, 2: RC.PAYLOAD_FORMAT_INVALID, 3: RC.SUCCESS}
        assert [ack.packet_id for ack in acks if ack.reason_code == RC.SUCCESS] == [1, 3]  # type: ignore[attr-defined]
        assert log.appends == [3], "one append for the read's three stored messages"
        assert [payload for _, payload in recorder.got] == [b"a", b"b", b"c"]
        assert connection.inbound_pending == 0
    finally:
        service.stop()


async def until(condition: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.001)


def test_a_read_larger_than_a_slow_subscribers_queue_loses_nothing() -> None:
    """A read of 200 QoS 1 PUBLISHes to a subscriber with a window of 2 and a queue of 40: the
    read is handed over in batches small enough that the publisher is held before the queue
    can overflow, so no QoS 1 message is dropped."""
    node = Node(max_inflight=2, max_queued_messages=40)
    sub, sub_wire = node.connect("slow", 4)
    pub, pub_wire = node.connect("pub", 4)
    pub.link = pub_wire = ResumableWire(4)
    sub_wire.read(), pub_wire.read()
    node.send(sub, p.Subscribe(1, [p.SubscriptionRequest("work", 1)]), 4)
    assert isinstance(sub_wire.read()[0], p.Suback)
    pub.data_received(b"".join(
        encode(p.Publish("work", str(i).encode(), 1, packet_id=i + 1), 4) for i in range(200)
    ))
    node.clock.run_soon()
    assert pub.held, "held once the subscriber's queue passed half its limit"
    received: list[bytes] = []
    for _ in range(1000):
        packets = sub_wire.read()
        if not packets and len(received) == 200:
            break
        for packet in packets:
            assert isinstance(packet, p.Publish)
            received.append(packet.payload)
            node.send(sub, p.Puback(packet.packet_id), 4)
        node.clock.run_soon()
    assert received == [str(i).encode() for i in range(200)]
    assert node.service.edge.stats.messages_dropped == 0
    acks = pub_wire.read()
    assert sorted(a.packet_id for a in acks) == list(range(1, 201))  # type: ignore[attr-defined]


async def test_messages_held_behind_a_commit_go_out_once_the_reservation_covers_them(
    journal: JournalStorage,
) -> None:
    """A fresh journal holds its first group until it is durable (nothing reserved yet), and
    what is appended meanwhile waits behind it to keep the order. Once that commit has made a
    reservation durable, the messages waiting behind it go out at once, before their own
    commit: a shard that had to hold once does not keep holding under a steady load."""
    broker, recorder = build(journal)
    log = journal.open_shard("default", 0)
    first = broker.publish_many([Message("t/1", b"a0"), Message("t/1", b"a1")])[0]
    assert isinstance(first, asyncio.Future) and recorder.got == []
    later: list[asyncio.Future[None]] = []
    while not first.done():  # publish while the first group is being committed
        await asyncio.sleep(0)
        if len(later) < 1000:  # within the reservation, however slow the fsync
            outcome = broker.publish_many([Message("t/1", b"b"), Message("t/1", b"b")])[0]
            assert isinstance(outcome, asyncio.Future)
            later.append(outcome)
    await asyncio.sleep(0)
    second = later[-1]
    if second is first or second.done():
        pytest.skip("the later messages were committed with the first group")
    assert log.deliverable_end > 2 * len(later) + 1, "the first commit reserved offsets ahead"
    assert len(recorder.got) == 2 + 2 * len(later), "all delivered before their own commit"
    assert [offset for offset, _ in recorder.got] == list(range(len(recorder.got)))
    await settle(later)
    assert len(recorder.got) == 2 + 2 * len(later), "and not delivered twice"


async def test_a_message_the_record_format_cannot_hold_is_refused_alone(journal: JournalStorage) -> None:
    broker, recorder = build(journal)
    too_long = Message("t/1", b"bad", content_type="x" * 70_000)  # a u16 length field
    outcomes = broker.publish_many([Message("t/1", b"a"), too_long, Message("t/1", b"b")])
    assert isinstance(outcomes[1], PublishRejected)
    assert isinstance(outcomes[0], asyncio.Future) and outcomes[2] is outcomes[0]
    await settle(outcomes)
    assert recorder.got == [(0, b"a"), (1, b"b")]


async def test_a_grpc_publish_batch_is_one_append_with_per_message_results(
    journal: JournalStorage,
) -> None:
    from shardgate.proto import shardgate_pb2 as pb
    from shardgate.protocols.grpc.producer_service import ProducerService, ProducerStreamInfo
    from shardgate.protocols.grpc.server import GrpcServer

    broker, recorder = build(journal)
    (log,) = count_appends(broker)
    service = ProducerService(GrpcServer(Edge(broker)))
    batch = pb.PublishBatch(sequence=7, messages=[
        pb.PublishRequest(topic="t/1", payload=b"one"),
        pb.PublishRequest(topic="j/1", payload=b"not json"),  # the json stream refuses it
        pb.PublishRequest(topic="t/+", payload=b"bad topic"),  # refused before the core
        pb.PublishRequest(topic="t/1", payload=b"two"),
    ])
    ack, waiters = service._publish_batch(batch, ProducerStreamInfo(peer="test", name=""))
    assert log.appends == [2]
    await service._await_durable(ack, waiters)
    results = [(r.code, r.stream, r.offset) for r in ack.results]
    assert ack.sequence == 7
    assert results[0] == (0, "default", 0) and results[3] == (0, "default", 1)
    assert results[1][0] == 3 and "JSON" in ack.results[1].error  # INVALID_ARGUMENT
    assert results[2][0] == 3  # INVALID_ARGUMENT
    await asyncio.sleep(0)
    assert [payload for _, payload in recorder.got] == [b"one", b"two"]


async def test_stop_at_refusal_leaves_what_follows_untouched(journal: JournalStorage) -> None:
    broker, recorder = build(journal)
    (log,) = count_appends(broker)
    messages = [
        Message("t/1", b"one"),
        Message("j/1", b"not json"),  # refused: the list ends here
        Message("t/1", b"two", retain=True),
        Message("m/1", b"memory"),
    ]
    outcomes = broker.publish_many(messages, stop_at_refusal=True)
    assert len(outcomes) == 2 and isinstance(outcomes[1], SchemaMismatch)
    await settle(outcomes)
    assert log.appends == [1]
    assert [payload for _, payload in recorder.got] == [b"one"]
    assert broker.stats.messages_in == 1
    assert "t/1" not in broker.retained


async def test_an_mqtt311_read_stops_at_the_publish_whose_refusal_closes_it(
    journal: JournalStorage,
) -> None:
    broker, recorder = build(journal)
    loop = asyncio.get_running_loop()
    service = MqttService(Edge(broker), MqttSettings(sys_interval=0), scheduler=loop)
    service.start()
    try:
        wire = Wire(4)
        connection = MqttConnection(service, wire, "127.0.0.1:1")
        service.connection_made(connection)
        connection.data_received(encode(p.Connect("MQTT", 4, True, 60, "pub"), 4))
        await until(lambda: wire.out)
        wire.read()
        session = connection.session
        assert session is not None
        connection.data_received(b"".join(encode(packet, 4) for packet in (
            p.Publish("t/1", b"a", qos=2, packet_id=1),
            p.Publish("j/1", b"not json", qos=1, packet_id=2),
            p.Publish("t/1", b"b", qos=2, packet_id=3),
            p.Publish("t/1", b"c", qos=1, packet_id=4),
        )))
        assert wire.closed
        await until(lambda: recorder.got)  # stored before the refusal: dispatched once durable
        assert [payload for _, payload in recorder.got] == [b"a"]
        # Packet 3 was never taken: resent on the next connection it is a new message.
        assert 3 not in session.inbound_qos2
        assert connection.inbound_pending == 0
    finally:
        service.stop()


async def test_messages_another_node_counted_are_stored_without_being_counted_again(
    journal: JournalStorage,
) -> None:
    """`counted=False` (a batch a cluster peer forwarded here): the messages are stored and
    delivered in order, and the statistics stay the publishing node's."""
    broker, recorder = build(journal)
    messages = [Message("t/same", f"{n}".encode()) for n in range(5)]
    outcomes = broker.publish_many(messages, counted=False)
    await settle(outcomes)
    assert [m.offset for m in messages] == list(range(5))
    assert [payload for _, payload in recorder.got] == [m.payload for m in messages]
    assert broker.stats.messages_in == 0 and not broker.stats.in_by_stream


async def test_the_brokers_own_state_records_are_stored_but_handed_to_no_subscriber(
        journal: JournalStorage) -> None:
    # the replicated state of a cluster's durable AMQP queues: stored under `$internal/` by
    # the broker itself (its producer), never by a client, never delivered to anyone
    from shardgate.core.kept_state import INTERNAL_PRODUCER

    broker, recorder = build(journal)
    snooper = broker.subscription("snooper")
    broker.add_filter(snooper, "$internal/#")
    snooped = Recorder()
    broker.attach(snooper, snooped)
    with pytest.raises(PublishRejected, match="reserved for the broker"):
        broker.publish(Message("$internal/amqp-queues/q", b"forged", producer_protocol="mqtt"))
    stored = broker.publish(Message("$internal/amqp-queues/q", b"state",
                                    producer_protocol=INTERNAL_PRODUCER))
    await settle([stored])
    log = broker.stream("default").shards[0].log
    assert log is not None
    assert [record.offset for record in log.read(0)] == [0]
    assert snooped.got == [] and recorder.got == []
