"""Transient messages (an AMQP delivery-mode 1 publish) on a reliable stream: journaled only
when a durable subscription wants them, otherwise delivered from memory in their place among
the stored messages, as RabbitMQ keeps transient messages out of its message store."""

from __future__ import annotations

from shardgate.core.message import Message
from shardgate.storage.journal import JournalStorage

from tests.unit.test_commit_before_delivery import reliable_broker


async def test_a_transient_message_waits_behind_stored_messages_held_for_their_commit(
    journal: JournalStorage,
) -> None:
    broker, recorder = reliable_broker(journal)
    # A fresh journal holds its first message until the commit (no reservation yet).
    first = broker.publish(Message("t/1", b"stored"))
    assert first is not None and recorder.got == []
    held = broker.publish(Message("t/1", b"transient", transient=True))
    assert held is first, "the caller can wait until it is delivered"
    assert recorder.got == [], "it must not overtake the message published before it"
    await first
    assert recorder.got == [(0, b"stored"), (-1, b"transient")]
    # Nothing held now: delivered at once, and never written to the journal.
    assert broker.publish(Message("t/1", b"later", transient=True)) is None
    assert recorder.got[-1] == (-1, b"later")
    log = journal.open_shard("default", 0)
    assert log.next_offset == 1


async def test_a_durable_subscription_gets_transient_messages_journaled(
    journal: JournalStorage,
) -> None:
    broker, _ = reliable_broker(journal)
    durable = broker.durable_subscription("keeps")
    broker.add_filter(durable, "t/#")
    pending = broker.publish(Message("t/1", b"transient", transient=True))
    assert pending is not None, "journaled, so the publisher can wait for it"
    await pending
    assert journal.open_shard("default", 0).next_offset == 1
