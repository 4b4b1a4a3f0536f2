"""The journal's key index (`storage/journal/keyindex.py`) keyed by topic prefix
(`core/index_keys.py`): reads of a few topics' records through it, built by the reads from the
records on disk (after a restart and a torn tail too), the fallbacks to scanning, and the key
matching of filters, wildcards included, which must never hide a record a filter matches."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shardgate.core.index_keys import (
    INDEX_LEVELS,
    UNREADABLE_KEY,
    any_may_match,
    key_may_match,
    record_index_key,
)
from shardgate.core.message import Message
from shardgate.core.records import encode_message, record_topic
from shardgate.core.topics import filter_matches
from shardgate.storage.interfaces import CorruptRecord, IdleReleasable, KeyedReadable
from shardgate.storage.journal import JournalStorage
from shardgate.storage.journal import keyindex as keyindex_module
from shardgate.storage.journal import segment as segment_module
from shardgate.storage.journal.log import KEYED_SEALED_SEGMENTS
from shardgate.storage.journal.record import HEADER_SIZE

T0 = 1_700_000_000_000


def topic_of(i: int) -> str:
    return f"site/{i % 20}/dev/{i}"


def publish(shard, first: int, count: int, topic=topic_of) -> None:  # noqa: ANN001
    shard.append([
        (T0 + i, encode_message(Message(topic(i), b"payload-%d" % i))) for i in range(first, first + count)
    ])


def wanting(*filters: str):  # noqa: ANN201
    return lambda key: any_may_match(filters, key)


def read_all_keyed(shard, wants, from_offset: int = 0, batch: int = 50) -> list[tuple[int, str]]:  # noqa: ANN001
    """Every record `wants` accepts from `from_offset`, through `read_keyed` alone."""
    got: list[tuple[int, str]] = []
    position = from_offset
    while position < shard.committed_offset:
        block = shard.read_keyed(position, batch, wants)
        assert block is not None, f"no key index at {position}"
        assert block.end_offset > position
        got += [(r.offset, record_topic(r.data)) for r in block]
        position = block.end_offset
    return got


def expected(first: int, last: int, topic_filter: str) -> list[tuple[int, str]]:
    return [(i, topic_of(i)) for i in range(first, last) if filter_matches(topic_filter, topic_of(i))]


def open_journal(directory: Path, **options: int) -> JournalStorage:
    return JournalStorage(directory, index_key=record_index_key, **options)


def test_the_records_of_the_wanted_topics_are_read_across_segment_rolls(tmp_path: Path) -> None:
    store = open_journal(tmp_path / "j", segment_bytes=20_000)
    shard = store.open_shard("s", 0)
    assert isinstance(shard, KeyedReadable)
    for first in range(0, 2000, 100):
        publish(shard, first, 100)
        store.flush_sync()
    segments = shard.segments
    assert len(segments) > KEYED_SEALED_SEGMENTS + 2
    # Appends build no index: readers do.
    assert all(s.key_index is None for s in segments)
    # Older sealed segments than the newest few are read by scanning.
    assert shard.read_keyed(0, 50, wanting("site/7/#")) is None
    first = segments[-1 - KEYED_SEALED_SEGMENTS].base_offset
    assert read_all_keyed(shard, wanting("site/7/#"), first) == expected(first, 2000, "site/7/#")
    assert [s.key_index is not None for s in segments] == (
        [False] * (len(segments) - KEYED_SEALED_SEGMENTS - 1) + [True] * (KEYED_SEALED_SEGMENTS + 1))
    # A key stands for every topic under its first levels: the reader gets a superset (the
    # replay checks each record's topic); a filter matching every key's topics is dense.
    assert read_all_keyed(shard, wanting("site/14/dev/1934"), first) == expected(first, 2000, "site/14/#")
    assert shard.read_keyed(first, 50, wanting("site/+/dev/1934")) is None
    # From the middle of a segment: nothing below the position comes back.
    assert read_all_keyed(shard, wanting("site/3/#"), 1501) == expected(1501, 2000, "site/3/#")
    # Not published yet (appended, not committed): not read.
    publish(shard, 2000, 20)
    assert read_all_keyed(shard, wanting("site/7/#"), 1990) == expected(1990, 2000, "site/7/#")
    store.close()


def test_forgotten_indexes_are_built_again_by_the_next_read(tmp_path: Path) -> None:
    """An idle broker drops the key indexes (`forget_caches`): nothing of them stays, and the
    next keyed read gets the same records through an index built again from the file."""
    store = open_journal(tmp_path / "j", segment_bytes=20_000)
    shard = store.open_shard("s", 0)
    assert isinstance(shard, IdleReleasable)
    for first in range(0, 1000, 100):
        publish(shard, first, 100)
        store.flush_sync()
    first = shard.segments[-1 - KEYED_SEALED_SEGMENTS].base_offset
    before = read_all_keyed(shard, wanting("site/7/#"), first)
    assert before == expected(first, 1000, "site/7/#")
    assert any(s.key_index is not None for s in shard.segments)
    shard.forget_caches()
    assert all(s.key_index is None for s in shard.segments)
    assert read_all_keyed(shard, wanting("site/7/#"), first) == before
    store.close()


def test_a_topic_nobody_publishes_passes_the_whole_segment_in_one_read(tmp_path: Path) -> None:
    store = open_journal(tmp_path / "j")
    shard = store.open_shard("s", 0)
    publish(shard, 0, 500)
    store.flush_sync()
    block = shard.read_keyed(0, 10, wanting("elsewhere/#"))
    assert block is not None and not len(block) and block.end_offset == 500
    store.close()


def test_after_a_restart_the_index_is_built_from_the_segments_on_disk(tmp_path: Path) -> None:
    directory = tmp_path / "j"
    store = open_journal(directory, segment_bytes=20_000)
    shard = store.open_shard("s", 0)
    for first in range(0, 1000, 100):
        publish(shard, first, 100)
        store.flush_sync()
    store.close()

    store = open_journal(directory, segment_bytes=20_000)
    shard = store.open_shard("s", 0)
    first = shard.segments[-1 - KEYED_SEALED_SEGMENTS].base_offset
    assert read_all_keyed(shard, wanting("site/7/#"), first) == expected(first, 1000, "site/7/#")
    # Records appended after the restart are added by the next read.
    publish(shard, 1000, 100)
    store.flush_sync()
    assert read_all_keyed(shard, wanting("site/7/#"), first) == expected(first, 1100, "site/7/#")
    store.close()


def test_each_read_indexes_a_bounded_number_of_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(segment_module, "INDEX_RECORDS", 30)
    store = open_journal(tmp_path / "j")
    shard = store.open_shard("s", 0)
    publish(shard, 0, 1000)
    store.flush_sync()
    block = shard.read_keyed(0, 50, wanting("site/7/#"))
    assert block is not None and block.end_offset == 30
    assert [r.offset for r in block] == [7, 27]
    assert read_all_keyed(shard, wanting("site/7/#")) == expected(0, 1000, "site/7/#")
    # A reader behind where the index starts, or beyond where one read can extend it, scans.
    other = open_journal(tmp_path / "k", index_interval_bytes=100)
    late = other.open_shard("s", 0)
    publish(late, 0, 1000)
    other.flush_sync()
    assert late.read_keyed(500, 50, wanting("site/7/#")) is not None
    assert late.read_keyed(0, 50, wanting("site/7/#")) is None
    assert late.read_keyed(900, 50, wanting("site/7/#")) is None
    other.close()
    store.close()


@pytest.mark.parametrize("cut", ["header", "data"])
def test_a_torn_tail_is_not_in_the_index(tmp_path: Path, cut: str) -> None:
    directory = tmp_path / "j"
    store = open_journal(directory)
    shard = store.open_shard("s", 0)
    publish(shard, 0, 39)
    store.flush_sync()
    last_start = shard.segments[-1].size
    publish(shard, 39, 1, topic=lambda i: "torn/last")
    store.flush_sync()
    store.close()
    log_file = directory / "s" / "0" / "00000000000000000000.log"
    os.truncate(log_file, last_start + (3 if cut == "header" else HEADER_SIZE + 2))

    store = open_journal(directory)
    shard = store.open_shard("s", 0)
    assert shard.committed_offset == 39
    assert read_all_keyed(shard, wanting("torn/#", "site/1/#")) == expected(0, 39, "site/1/#")
    # The offset of the lost record stays handed out; the next ones are indexed where they land.
    publish(shard, 40, 3, topic=lambda i: "torn/last")
    store.flush_sync()
    assert [o for o, _ in read_all_keyed(shard, wanting("torn/#"))] == [40, 41, 42]
    store.close()


def test_wanting_most_records_falls_back_to_a_block_scan(tmp_path: Path) -> None:
    store = open_journal(tmp_path / "j")
    shard = store.open_shard("s", 0)
    publish(shard, 0, 400)
    store.flush_sync()
    for dense in ("#", "site/#", "+/+/dev/+"):
        assert shard.read_keyed(0, 50, wanting(dense)) is None, dense
    # A wildcard filter wanting few records is served by the index.
    block = shard.read_keyed(0, 50, wanting("+/4/#"))
    assert block is not None and [r.offset for r in block] == list(range(4, 400, 20))
    store.close()


def test_too_many_keys_drop_the_segment_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keyindex_module, "MAX_KEYS", 10)
    store = open_journal(tmp_path / "j")
    shard = store.open_shard("s", 0)
    publish(shard, 0, 11, topic=lambda i: f"k{i}")
    store.flush_sync()
    assert shard.read_keyed(0, 10, wanting("k3")) is None
    assert [r.offset for r in shard.read(0, 100)] == list(range(11))
    store.close()


def test_a_record_damaged_on_disk_is_reported_not_returned(tmp_path: Path) -> None:
    directory = tmp_path / "j"
    store = open_journal(directory)
    shard = store.open_shard("s", 0)
    publish(shard, 0, 100)
    store.flush_sync()
    assert shard.read_keyed(0, 100, wanting("site/7/#")) is not None
    position = shard.segments[-1].key_index.postings[b"site/7/dev/"][1]  # type: ignore[union-attr]
    with open(directory / "s" / "0" / "00000000000000000000.log", "r+b") as file:
        file.seek(position + HEADER_SIZE + 5)
        byte = file.read(1)
        file.seek(position + HEADER_SIZE + 5)
        file.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CorruptRecord, match="checksum"):
        shard.read_keyed(0, 100, wanting("site/7/#"))
    store.close()


def test_large_records_are_read_whole(tmp_path: Path) -> None:
    store = open_journal(tmp_path / "j")
    shard = store.open_shard("s", 0)
    sizes = [10, 70_000, 3, 9000, 5000, 200_000, 1]
    shard.append([
        (T0, encode_message(Message(f"big/{i % 2}", bytes([i]) * size))) for i, size in enumerate(sizes)
    ] + [(T0, encode_message(Message(f"other/{i}", b"x"))) for i in range(40)])
    store.flush_sync()
    block = shard.read_keyed(0, 100, wanting("big/0"))
    assert block is not None
    assert [r.offset for r in block] == [0, 2, 4, 6]
    assert [len(r.data) for r in block] == [len(encode_message(Message("big/0", bytes([i]) * sizes[i])))
                                             for i in (0, 2, 4, 6)]
    store.close()


def test_record_keys() -> None:
    def key(topic: str) -> bytes:
        return record_index_key(encode_message(Message(topic, b"p")))

    assert INDEX_LEVELS == 3
    assert key("a") == b"a"
    assert key("a/b/c") == b"a/b/c"
    assert key("a/b/c/d/e") == b"a/b/c/"
    assert key("a/b/c/") == b"a/b/c/"
    assert key("/x//y") == b"/x//"
    assert key("é/ü/ñ/1") == "é/ü/ñ/".encode()
    assert record_index_key(b"") == UNREADABLE_KEY
    assert record_index_key(b"\x09" + bytes(40)) == UNREADABLE_KEY
    assert key_may_match("$SYS/#", UNREADABLE_KEY)
    assert key_may_match("a/b/c/d", b"a/b/c/") and not key_may_match("a/b/c", b"a/b/c/")
    assert key_may_match("a/b/#", b"a/b") and not key_may_match("a/b/+", b"a/b")
    assert not key_may_match("#", b"$SYS/x/y/") and key_may_match("$SYS/#", b"$SYS/x/y/")


LEVEL = st.sampled_from(["a", "b", "", "$s", "é"])


@settings(max_examples=400, deadline=None)
@given(
    topic=st.lists(LEVEL, min_size=1, max_size=6),
    rule=st.lists(st.sampled_from(["a", "b", "", "+", "é", "$s"]), min_size=1, max_size=6),
    multi=st.booleans(),
)
def test_a_key_never_hides_a_topic_its_filter_matches(topic: list[str], rule: list[str], multi: bool) -> None:
    name = "/".join(topic)
    topic_filter = "/".join([*rule, "#"] if multi else rule)
    key = record_index_key(encode_message(Message(name, b"")))
    if filter_matches(topic_filter, name):
        assert key_may_match(topic_filter, key), (topic_filter, name, key)
    if len(topic) <= INDEX_LEVELS:  # an exact key: no false match either
        assert key_may_match(topic_filter, key) == filter_matches(topic_filter, name)
