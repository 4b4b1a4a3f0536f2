"""A publish its client sends again under the same producer identity is stored once
(`core/resends.py`): the broker looks for it in the shard's log before storing, on a real
journal; and the gRPC layer's identity (`protocols/grpc/identity.py`)."""

from __future__ import annotations

import grpc
import pytest
from shardgate.core.broker import Broker
from shardgate.core.message import Message
from shardgate.core.resends import (
    FORWARD_ID,
    MAX_SCAN,
    PRODUCER_ID,
    PRODUCER_RESENT,
    RESENT_ID,
    SEARCH_BEFORE_MS,
    is_resent,
)
from shardgate.core.streams import StreamConfig
from shardgate.proto import shardgate_pb2 as pb
from shardgate.protocols.grpc.convert import Refusal
from shardgate.protocols.grpc.identity import MAX_RESEND_AGE_MS, Identity, identify
from shardgate.storage.journal import JournalStorage


def reliable_broker(journal: JournalStorage) -> Broker:
    broker = Broker(storage=journal, default_stream=StreamConfig("default", mode="reliable"))
    broker.create_stream(StreamConfig("fast", mode="non-reliable"), routes=["fast/#"])
    return broker


def sent(payload: bytes, identity: bytes, *, resent: bool = False, topic: str = "t/1",
         time_ms: int | None = None) -> Message:
    message = Message(topic, payload, qos=1)
    if time_ms is not None:
        message.publish_time_ms = time_ms
    message.native_properties = {PRODUCER_RESENT if resent else PRODUCER_ID: identity}
    return message


async def stored(broker: Broker, receipt: object) -> None:
    if receipt is not None:
        await receipt  # type: ignore[misc]


def payloads(broker: Broker, stream: str = "default") -> list[bytes]:
    from shardgate.core.records import decode_message

    shard_log = broker.streams[stream].shards[0].log
    assert shard_log is not None
    return [decode_message(record.data).payload for record in shard_log.read(0, 100)]


async def test_a_resend_found_in_the_log_is_answered_with_the_first_copy(journal: JournalStorage) -> None:
    broker = reliable_broker(journal)
    first = sent(b"one", b"p1-1")
    await stored(broker, broker.publish(first))
    await stored(broker, broker.publish(sent(b"two", b"p1-2")))
    again = sent(b"one", b"p1-1", resent=True)
    assert broker.publish(again) is None  # stored and durable already
    assert (again.stream, again.shard, again.offset) == (first.stream, first.shard, first.offset)
    assert payloads(broker) == [b"one", b"two"]
    assert broker.resends.duplicates == 1


async def test_a_resend_not_found_is_stored_under_its_identity(journal: JournalStorage) -> None:
    broker = reliable_broker(journal)
    await stored(broker, broker.publish(sent(b"one", b"p1-1")))
    never = sent(b"lost", b"p1-2", resent=True)
    await stored(broker, broker.publish(never))
    assert never.offset == 1 and not is_resent(never)
    assert never.native_properties == {PRODUCER_ID: b"p1-2"}
    # sent once more: found now
    again = sent(b"lost", b"p1-2", resent=True)
    assert broker.publish(again) is None and again.offset == 1
    assert payloads(broker) == [b"one", b"lost"]


async def test_a_forwarded_copy_sent_again_is_found_by_its_clients_identity_too(
        journal: JournalStorage) -> None:
    """A node held the client's first send through a failover; meanwhile the client sent it
    again through another node, and that copy was stored first: the held one, sent again by
    its node under the node's identity, is found by the client's."""
    broker = reliable_broker(journal)
    retry = sent(b"one", b"p1-1", resent=True)
    retry.native_properties = {PRODUCER_RESENT: b"p1-1", FORWARD_ID: b"n2:x:1"}
    await stored(broker, broker.publish(retry))
    held = Message("t/1", b"one", qos=1)
    held.native_properties = {PRODUCER_ID: b"p1-1", RESENT_ID: b"n1:y:7"}
    assert broker.publish(held) is None and held.offset == retry.offset
    assert payloads(broker) == [b"one"]


async def test_a_batch_with_a_resend_in_it_stores_the_others_and_not_the_resend(
        journal: JournalStorage) -> None:
    broker = reliable_broker(journal)
    await stored(broker, broker.publish(sent(b"one", b"p1-1")))
    batch = [sent(b"one", b"p1-1", resent=True), sent(b"two", b"p1-2", resent=True),
             sent(b"three", b"p1-3")]
    outcomes = broker.publish_many(batch)
    for outcome in outcomes:
        assert not isinstance(outcome, Exception)
        await stored(broker, outcome)
    assert [message.offset for message in batch] == [0, 1, 2]
    assert payloads(broker) == [b"one", b"two", b"three"]


async def test_the_look_up_reaches_back_a_bounded_time(journal: JournalStorage) -> None:
    """The bound: a first copy stored more than SEARCH_BEFORE_MS before the resend's publish
    time is not looked at, and the resend is stored (at least once)."""
    broker = reliable_broker(journal)
    old = sent(b"old", b"p1-1")
    await stored(broker, broker.publish(old))
    late = sent(b"old", b"p1-1", resent=True, time_ms=old.publish_time_ms + SEARCH_BEFORE_MS + 1000)
    await stored(broker, broker.publish(late))
    assert late.offset == 1
    within = sent(b"old", b"p1-1", resent=True, time_ms=old.publish_time_ms + SEARCH_BEFORE_MS - 1000)
    assert broker.publish(within) is None and within.offset == 0


async def test_a_shard_without_a_log_stores_the_resend(journal: JournalStorage) -> None:
    broker = reliable_broker(journal)
    broker.publish(sent(b"one", b"p1-1", topic="fast/1"))
    again = sent(b"one", b"p1-1", resent=True, topic="fast/1")
    broker.publish(again)
    assert again.offset == 1  # memory only: nothing to look in, at least once


async def test_what_was_read_is_kept_per_shard_and_dropped_once_the_look_ups_move_on(
        journal: JournalStorage, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardgate.core import resends

    monkeypatch.setattr(resends, "MAX_SCAN", 4)
    broker = reliable_broker(journal)
    base = 1_000_000_000_000
    for index in range(10):
        await stored(broker, broker.publish(sent(b"x", b"p-%d" % index, time_ms=base + index * 1000)))
    probe = sent(b"x", b"p-0", resent=True, time_ms=base + 1000)
    assert broker.publish(probe) is None and probe.offset == 0
    [read] = broker.resends._read.values()
    assert (read.start, read.end) == (0, 4)  # MAX_SCAN records at most per look-up
    late = SEARCH_BEFORE_MS + 9000
    probe = sent(b"x", b"p-9", resent=True, time_ms=base + late)
    assert broker.publish(probe) is None and probe.offset == 9
    [read] = broker.resends._read.values()
    assert read.start == 9 and set(read.produced) == {b"p-9"}
    assert MAX_SCAN == 200_000


def test_the_grpc_identity_is_the_producer_id_and_the_sequence() -> None:
    identity = pb.ProducerIdentity(producer_id=b"\x01" * 16, sequence=41)
    message = Message("t", b"x")
    identify(message, Identity(identity, 2), 1)
    assert message.native_properties == {PRODUCER_ID: b"\x01" * 16 + (42).to_bytes(8, "big")}
    resent = pb.ProducerIdentity(producer_id=b"\x01" * 16, sequence=41, resent=True,
                                 first_sent_ms_ago=2500)
    message = Message("t", b"x")
    published = message.publish_time_ms
    identify(message, Identity(resent), 0)
    assert message.native_properties == {PRODUCER_RESENT: b"\x01" * 16 + (41).to_bytes(8, "big")}
    assert message.publish_time_ms == published - 2500  # dated from its first send
    resent.first_sent_ms_ago = 10 * MAX_RESEND_AGE_MS
    message = Message("t", b"x")
    published = message.publish_time_ms
    identify(message, Identity(resent), 0)
    assert message.publish_time_ms == published - MAX_RESEND_AGE_MS


@pytest.mark.parametrize("producer_id", [b"", b"x" * 65])
def test_a_producer_id_of_a_bad_length_is_refused(producer_id: bytes) -> None:
    with pytest.raises(Refusal) as refused:
        Identity(pb.ProducerIdentity(producer_id=producer_id))
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT


def test_a_batch_whose_numbers_would_pass_the_largest_sequence_is_refused() -> None:
    identity = pb.ProducerIdentity(producer_id=b"p", sequence=(1 << 64) - 2)
    Identity(identity, 2)
    with pytest.raises(Refusal):
        Identity(identity, 3)


class _Context:
    """What a gRPC servicer asks of its call here: who calls (no one in particular)."""

    def peer(self) -> str:
        return "test"

    def invocation_metadata(self) -> tuple[()]:
        return ()


async def test_a_client_gone_while_its_publish_waits_for_the_commit_cancels_no_one_else(
        journal: JournalStorage) -> None:
    """A unary Publish and a publish stream whose client left while their messages waited for
    the commit: the commit future they share with the other messages of the group is not
    cancelled (before, it was: the others were refused and held messages never delivered)."""
    import asyncio

    from shardgate.core.edge import Edge
    from shardgate.protocols.grpc.producer_service import ProducerService, ProducerStreamInfo
    from shardgate.protocols.grpc.server import GrpcServer

    broker = reliable_broker(journal)
    service = ProducerService(GrpcServer(Edge(broker)))
    shard_log = broker.streams["default"].shards[0].log
    assert shard_log is not None
    call = asyncio.ensure_future(service.Publish(pb.PublishRequest(topic="t/1", payload=b"gone"),
                                                 _Context()))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    first = shard_log.commit_waiter()  # what the call waits on, shared by its commit group
    assert first is not None
    call.cancel()
    batch = pb.PublishBatch(sequence=1, messages=[pb.PublishRequest(topic="t/1", payload=b"too")])
    ack, waiters = service._publish_batch(batch, ProducerStreamInfo(peer="test", name=""))
    second = shard_log.commit_waiter()
    assert second is not None
    stream = asyncio.ensure_future(service._await_durable(ack, waiters))
    await asyncio.sleep(0)
    stream.cancel()
    await asyncio.gather(first, second)  # not cancelled: committed
    assert payloads(broker) == [b"gone", b"too"]
