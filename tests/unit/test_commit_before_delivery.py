"""Reliable streams hand a message to live subscribers as soon as it is appended, while the
publisher's acknowledgement still waits for the commit group's fsync (as RabbitMQ confirms do).

What makes this safe: an offset a subscriber has seen never names another message. Subscribers
get a message early only when its offset is below the journal's durable reservation
(`deliverable_end`); a failed commit does not hand its offsets out again (they become empty
records), and after a crash the journal resumes at or beyond the reservation, so offsets that
were seen but never made durable are skipped, not reused. (Before, delivery waited for the
fsync, which cost QoS 1 latency its p99; before that, a failed commit reused offsets a live
subscriber had seen.)
"""

from __future__ import annotations

import errno
import json
import signal
import subprocess
import sys
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


def reliable_broker(journal: JournalStorage) -> tuple[Broker, Recorder]:
    broker = Broker(storage=journal, default_stream=StreamConfig("default", mode="reliable"))
    sub = broker.subscription("live")
    broker.add_filter(sub, "t/#")
    recorder = Recorder()
    broker.attach(sub, recorder)
    return broker, recorder


async def test_a_subscriber_gets_the_message_before_the_publisher_is_acknowledged(
    journal: JournalStorage,
) -> None:
    broker, recorder = reliable_broker(journal)
    # A fresh journal has reserved no offsets yet: the first message waits for its commit,
    # whose pass also makes a reservation durable.
    first = broker.publish(Message("t/1", b"one"))
    assert first is not None
    assert recorder.got == []
    await first
    assert recorder.got == [(0, b"one")]

    second = broker.publish(Message("t/1", b"two"))
    assert second is not None
    assert recorder.got == [(0, b"one"), (1, b"two")]  # delivered at once
    assert not second.done()  # the acknowledgement still waits for the fsync
    await second
    assert journal.open_shard("default", 0).committed_offset == 2


async def test_a_failed_commit_never_reuses_an_offset_a_subscriber_saw(
    journal: JournalStorage, monkeypatch: pytest.MonkeyPatch,
) -> None:
    broker, recorder = reliable_broker(journal)
    first = broker.publish(Message("t/1", b"first"))
    assert first is not None
    await first

    def disk_full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(segment_module.os, "write", disk_full)
        patch.setattr(segment_module.os, "pwritev", lambda fd, buffers, position, flags=0: (
            disk_full(fd, buffers[0])))
        lost = broker.publish(Message("t/1", b"lost"))
        assert lost is not None
        assert recorder.got[-1] == (1, b"lost")  # seen before the commit failed
        with pytest.raises((StorageFull, PublishRejected)):
            await lost  # the publisher is told: no acknowledgement

    kept = broker.publish(Message("t/1", b"kept"))
    assert kept is not None
    await kept
    assert recorder.got == [(0, b"first"), (1, b"lost"), (2, b"kept")]
    # Offset 1 names no message in the journal (an empty record), never "kept".
    stored = journal.open_shard("default", 0).read(0)
    assert [(r.offset, r.data != b"") for r in stored] == [(0, True), (1, False), (2, True)]


CRASHING_CHILD = r"""
import asyncio, json, os, signal, sys, threading
from shardgate.core.broker import Broker
from shardgate.core.message import Message
from shardgate.core.streams import StreamConfig
from shardgate.storage.journal import JournalStorage
from shardgate.storage.journal import log as log_module

class Recorder:
    consumer_id = "recorder"
    available = True
    def __init__(self):
        self.got = []
    def deliver(self, message, subscription, filters):
        self.got.append(message.offset)

async def main():
    journal = JournalStorage(sys.argv[1])
    broker = Broker(storage=journal, default_stream=StreamConfig("default", mode="reliable"))
    sub = broker.subscription("live")
    broker.add_filter(sub, "t/#")
    recorder = Recorder()
    broker.attach(sub, recorder)
    for i in range(3):
        await broker.publish(Message("t/1", b"durable %d" % i))
    # From now on the disk takes nothing: the next records are delivered, never written.
    never = threading.Event()
    log_module.write_all = lambda fd, data: never.wait()
    for i in range(5):
        broker.publish(Message("t/1", b"seen, then lost %d" % i))
    print(json.dumps(recorder.got), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


async def test_after_a_crash_the_offsets_subscribers_saw_are_not_handed_out_again(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "journal"
    child = subprocess.run(
        [sys.executable, "-c", CRASHING_CHILD, str(directory)],
        capture_output=True, timeout=60,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()
    seen = json.loads(child.stdout)
    assert seen == list(range(8))  # 3 durable, 5 delivered before a write that never came

    journal = JournalStorage(directory)
    try:
        broker, recorder = reliable_broker(journal)
        shard_log = journal.open_shard("default", 0)
        assert shard_log.committed_offset == 3  # the 5 lost records are gone...
        after = broker.publish(Message("t/1", b"after the crash"))
        assert after is not None
        await after
        # ...but their offsets are not reused: the new message gets a fresh one.
        (offset, payload), = recorder.got
        assert offset > max(seen) and payload == b"after the crash"
        stored = shard_log.read(0, 100_000)
        assert [r.offset for r in stored] == list(range(offset + 1))
        assert [r.offset for r in stored if r.data] == [0, 1, 2, offset]
    finally:
        journal.close()
