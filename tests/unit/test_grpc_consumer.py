"""The gRPC consumer's push path without sockets: batches, credit, expiry, the wire form."""

from __future__ import annotations

from shardgate.core.message import Message, now_ms
from shardgate.core.subscriptions import Subscription, SubscriptionType
from shardgate.proto import shardgate_pb2 as pb
from shardgate.protocols.grpc.consumer import GrpcConsumer, to_consumed


def consumer(credit: int = 10, max_batch: int = 4) -> GrpcConsumer:
    sub = Subscription("s", SubscriptionType.EXCLUSIVE)
    return GrpcConsumer(sub, "c", "peer", credit=credit, max_pending=100, max_batch=max_batch)


def test_wire_form_carries_every_field() -> None:
    message = Message("a/b", b"p", key=b"k", headers=[("h", "v")], content_type="text/plain",
                      correlation_data=b"c", reply_to="r", expires_at_ms=now_ms() + 60_000,
                      producer_protocol="mqtt", producer_id="dev", stream="st", shard=2, offset=7)
    out = to_consumed(message, 5, 1)
    assert isinstance(out, pb.ConsumedMessage)
    assert (out.delivery_id, out.topic, out.payload, out.key) == (5, "a/b", b"p", b"k")
    assert [(h.key, h.value) for h in out.headers] == [("h", "v")]
    assert (out.content_type, out.correlation_data, out.reply_to) == ("text/plain", b"c", "r")
    assert (out.stream, out.shard, out.offset, out.redelivery_count) == ("st", 2, 7, 1)
    assert (out.producer_protocol, out.producer_id) == ("mqtt", "dev")
    assert out.expires_at_ms == message.expires_at_ms
    bare = to_consumed(Message("t", b""), 1, 0)
    assert not bare.HasField("key") and bare.offset == 0 and not bare.headers


async def test_take_batch_respects_batch_size_credit_and_expiry() -> None:
    c = consumer(credit=6, max_batch=4)
    for i in range(8):
        c.enqueue(Message("t", str(i).encode()), 0)
    c.enqueue(Message("t", b"expired", expires_at_ms=now_ms() - 1), 0)
    first = c.take_batch()
    assert first is not None and first.WhichOneof("response") == "messages"
    assert [m.payload for m in first.messages.messages] == [b"0", b"1", b"2", b"3"]
    second = c.take_batch()
    assert second is not None and [m.payload for m in second.messages.messages] == [b"4", b"5"]
    assert c.take_batch() is None and c.credit == 0 and c.unacked == 6
    ids = [m.delivery_id for m in first.messages.messages] + [m.delivery_id for m in second.messages.messages]
    assert c.ack(ids + [999]) == [999] and c.unacked == 0
    c.add_credit(5)
    third = c.take_batch()
    assert third is not None and [m.payload for m in third.messages.messages] == [b"6", b"7"]
    assert c.delivered == 8  # the expired message was skipped, not pushed


async def test_kick_closes_with_a_reason() -> None:
    c = consumer()
    c.kick("kicked by administrator: maintenance")
    assert c.closed and c.kicked == "kicked by administrator: maintenance" and c.wakeup.is_set()
    assert not c.available
