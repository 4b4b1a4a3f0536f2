"""Reliable streams deliver a message to subscribers only once its journal commit group is
durable: a commit that fails (disk full) is never seen by anyone, so the offsets it rolls back
and hands out again never name two different messages."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from shardgate.core.broker import Broker
from shardgate.core.errors import PublishRejected
from shardgate.core.message import Message
from shardgate.core.streams import StreamConfig
from shardgate.storage.interfaces import StorageFull
from shardgate.storage.journal import JournalStorage
from shardgate.storage.journal import segment as segment_module


class Recorder:
    """A live consumer that keeps (offset, payload) of what it is handed."""

    consumer_id = "recorder"
    available = True

    def __init__(self) -> None:
        self.got: list[tuple[int, bytes]] = []

    def deliver(self, message: Message, subscription: object, filters: tuple[str, ...]) -> None:
        self.got.append((message.offset, message.payload))


@pytest.fixture
def journal(tmp_path: Path):
    storage = JournalStorage(tmp_path / "journal")
    yield storage
    storage.close()


def reliable_broker(journal: JournalStorage) -> tuple[Broker, Recorder]:
    broker = Broker(storage=journal, default_stream=StreamConfig("default", mode="reliable"))
    sub = broker.subscription("live")
    broker.add_filter(sub, "t/#")
    recorder = Recorder()
    broker.attach(sub, recorder)
    return broker, recorder


async def test_subscriber_sees_a_reliable_message_only_after_its_commit(journal: JournalStorage) -> None:
    broker, recorder = reliable_broker(journal)
    waiter = broker.publish(Message("t/1", b"one"))
    assert waiter is not None
    assert recorder.got == []  # appended, not durable yet: nobody sees it
    await waiter
    assert recorder.got == [(0, b"one")]


async def test_a_failed_commit_is_never_delivered_and_its_offset_is_not_seen_twice(
    journal: JournalStorage, monkeypatch: pytest.MonkeyPatch,
) -> None:
    broker, recorder = reliable_broker(journal)

    def disk_full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(segment_module.os, "write", disk_full)
        lost = broker.publish(Message("t/1", b"lost"))
        assert lost is not None
        with pytest.raises((StorageFull, PublishRejected)):
            await lost

    kept = broker.publish(Message("t/1", b"kept"))
    assert kept is not None
    await kept
    # The failed message's offset 0 went to "kept"; the subscriber saw offset 0 once, as "kept".
    assert recorder.got == [(0, b"kept")]
