"""An idle broker hands back what a burst of load left: its per-topic caches are dropped
(rebuilt on demand) once per idle period, never while traffic flows, and once more after an
archive file written while idle."""

from __future__ import annotations

from pathlib import Path

import pytest
from shardgate.core.broker import Broker
from shardgate.core.message import Message, now_ms
from shardgate.core.records import MessageRecord, encode_message
from shardgate.storage.archive import Archiver, ArchiveSettings
from shardgate.storage.journal import JournalStorage
from shardgate.storage.metadata import SqliteMetadataStore

from shardgate import persistence as persistence_module
from shardgate.persistence import Persistence


class Recorder:
    consumer_id = "recorder"
    available = True

    def __init__(self) -> None:
        self.got: list[str] = []

    def deliver(self, message: Message, subscription: object, filters: tuple[str, ...]) -> None:
        self.got.append(message.topic)


def test_caches_are_released_once_per_idle_period(tmp_path: Path) -> None:
    store = SqliteMetadataStore(tmp_path / "meta.db")
    try:
        broker = Broker()
        persistence = Persistence(broker, store)
        live = broker.subscription("live")
        broker.add_filter(live, "t/#")
        recorder = Recorder()
        broker.attach(live, recorder)
        durable = broker.durable_subscription("kept")
        broker.add_filter(durable, "t/#")
        for i in range(100):
            broker.publish(Message(f"t/{i}", b"x"))
        durable._filters_for("t/1")
        assert len(broker._match_cache) == 100

        assert not persistence.check_idle()  # first look: traffic since the start
        assert persistence.check_idle()  # nothing since: released
        assert broker._match_cache == {} and broker._topic_stream_cache == {}
        assert durable._filter_set is None
        assert not persistence.check_idle()  # once per idle period

        broker.publish(Message("t/again", b"x"))
        assert not persistence.check_idle()  # busy again
        assert broker._match_cache  # caches refill as they are used
        assert persistence.check_idle()
        # Delivery works as before with the caches rebuilt on demand.
        broker.publish(Message("t/1", b"x"))
        assert recorder.got[-1] == "t/1" and len(recorder.got) == 102
    finally:
        store.close()


async def test_an_archive_file_written_after_the_idle_release_is_released_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tail of a load is archived up to a minute after it, once the broker is idle and has
    already released: that write's leftovers are handed back by one more release, while the
    broker stays idle (a write is activity; nothing came in or went out)."""
    journal = JournalStorage(tmp_path / "journal", fsync="os")
    store = SqliteMetadataStore(tmp_path / "meta.db")
    archiver = Archiver(journal, f"file://{tmp_path / 'archive'}",
                        lambda: [("default", 1, "bytes")],
                        ArchiveSettings(poll_interval_s=0.02, max_delay_s=3600))
    try:
        persistence = Persistence(Broker(), store)
        persistence.archiver = archiver
        releases: list[int] = []
        monkeypatch.setattr(persistence_module, "release_idle_memory",
                            lambda broker: releases.append(1))
        assert not persistence.check_idle()  # first look
        assert persistence.check_idle() and len(releases) == 1  # idle: released
        assert not persistence.check_idle()  # once per idle period

        shard_log = journal.open_shard("default", 0)
        shard_log.append([(now_ms(), encode_message(MessageRecord(
            topic="t/x", payload=b"x", qos=1, retain=False, publish_time_ms=now_ms(),
            producer_protocol="mqtt", producer_id="p"))) for _ in range(50)])
        await shard_log.flush()
        await archiver.flush()  # the tail of the load, archived after the release
        assert archiver.files_written == 1
        assert not persistence.check_idle()  # the write counts as activity
        assert persistence.check_idle() and len(releases) == 2  # released again
        assert not persistence.check_idle() and len(releases) == 2
    finally:
        await archiver.stop(flush=False)
        store.close()
        journal.close()


def test_topics_matched_by_the_same_filters_share_one_cached_result() -> None:
    """An id in every topic must not make the broker's topic -> subscriptions cache keep a list,
    pairs and filter tuples per topic."""
    broker = Broker()
    sub = broker.subscription("devices")
    broker.add_filter(sub, "devices/+/temperature")
    recorder = Recorder()
    broker.attach(sub, recorder)
    for i in range(500):
        broker.publish(Message(f"devices/{i}/temperature", b"x"))
    results = {id(matches) for matches in broker._match_cache.values()}
    assert len(broker._match_cache) == 500 and len(results) == 1
    broker.remove_filter(sub, "devices/+/temperature")
    assert broker._match_cache == {} and broker._match_results == {}  # no removed subscription kept
    assert len(recorder.got) == 500


def test_the_idle_release_drops_the_patterns_compiled_under_load() -> None:
    """`re` caches up to 512 compiled patterns for good; the subscriptions' filters compiled
    under load were most of the objects left in the load's arenas once idle."""
    import re

    pattern = re.compile(rb"devices/[^/]*/temperature-idle-release")
    assert re.compile(rb"devices/[^/]*/temperature-idle-release") is pattern  # cached
    persistence_module.release_idle_memory(Broker())
    assert re.compile(rb"devices/[^/]*/temperature-idle-release") is not pattern
