"""The one outbox policy (core.outbox): reliable messages never dropped and deduplicated,
others bounded with the oldest dropped, every drop counted by reason in the outbox and in the
broker's statistics, entries settled wherever they stand."""

from __future__ import annotations

from shardgate.core.broker import BrokerStats
from shardgate.core.message import Message
from shardgate.core.outbox import EXPIRED, QUEUE_FULL, Outbox
from shardgate.core.subscriptions import Subscription


class RecordingSubscription(Subscription):
    """A live subscription that remembers what was acknowledged to it."""

    __slots__ = ("acked",)

    def __init__(self) -> None:
        super().__init__("out")
        self.acked: list[Message] = []

    def ack(self, message: Message) -> None:
        self.acked.append(message)


def reliable_message(offset: int) -> Message:
    message = Message(f"r/{offset}", b"x")
    message.stream, message.shard, message.offset = "journal", 0, offset
    return message


def live_message(n: int) -> Message:
    return Message(f"l/{n}", b"y")


def outbox(max_queued: int = 3) -> tuple[Outbox, BrokerStats, RecordingSubscription]:
    stats = BrokerStats()
    return (Outbox(max_queued, lambda m: m.offset >= 0, stats), stats, RecordingSubscription())


def test_a_full_outbox_drops_the_oldest_non_reliable_message_and_counts_it() -> None:
    box, stats, sub = outbox()
    first = live_message(1)
    box.put(first, sub)
    box.put(reliable_message(7), sub)
    box.put(live_message(2), sub)
    box.put(live_message(3), sub)
    assert [e.message.topic for e in box] == ["r/7", "l/2", "l/3"]
    assert box.drops == {QUEUE_FULL: 1}
    assert stats.messages_dropped == 1 and stats.dropped_by_reason[QUEUE_FULL] == 1


def test_reliable_messages_are_never_dropped_and_a_redelivery_is_ignored() -> None:
    box, stats, sub = outbox(max_queued=2)
    for offset in range(4):
        assert box.put(reliable_message(offset), sub) is not None
    assert box.put(reliable_message(2), sub) is None  # still waiting: a redelivery
    assert len(box) == 4 and box.dropped == 0
    # Full of reliable messages: a non-reliable one is the one dropped (and acknowledged).
    late = live_message(9)
    assert box.put(late, sub) is None
    assert sub.acked == [late] and box.drops == {QUEUE_FULL: 1}


def test_settle_removes_an_entry_wherever_it_stands_and_acknowledges_it() -> None:
    box, _, sub = outbox(max_queued=10)
    entries = [box.put(reliable_message(n), sub) for n in range(3)]
    middle = entries[1]
    assert middle is not None
    box.settle(middle)
    assert [e.message.offset for e in box] == [0, 2]
    assert sub.acked == [middle.message]
    # Settled: the same offset is taken again when it is redelivered.
    assert box.put(reliable_message(1), sub) is not None


def test_a_skipped_entry_is_counted_under_its_reason_and_settled() -> None:
    box, stats, sub = outbox()
    entry = box.put(live_message(1), sub)
    assert entry is not None
    box.skip(entry, EXPIRED)
    assert len(box) == 0 and sub.acked == [entry.message]
    assert box.drops == {EXPIRED: 1} and stats.dropped_by_reason[EXPIRED] == 1


def test_the_wire_form_is_kept_on_the_entry_for_a_resend() -> None:
    box, _, sub = outbox()
    entry = box.put(reliable_message(1), sub)
    assert entry is not None and entry.encoded is None
    entry.encoded = b"wire"
    assert box.head(1)[0].encoded == b"wire"
