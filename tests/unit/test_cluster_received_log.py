"""The received log: what a node was pushed of a shard another node owns, replayed by its
durable subscriptions at the owner's offsets."""

from __future__ import annotations

from shardgate.cluster.received import ReceivedLog


def test_reads_sparse_records_from_an_offset_in_order():
    log = ReceivedLog()
    for offset in (3, 7, 8, 12):
        log.add(offset, 1000 + offset, f"r{offset}".encode())
    assert [r.offset for r in log.read(0)] == [3, 7, 8, 12]
    assert [r.offset for r in log.read(8)] == [8, 12]
    assert [r.offset for r in log.read(9, max_records=1)] == [12]
    assert log.read(13) == []
    assert (log.low_watermark, log.next_offset) == (3, 13)
    assert log.offset_for_timestamp(1008) == 8
    assert log.commit_waiter() is None


def test_ignores_a_record_at_or_below_what_it_holds():
    log = ReceivedLog()
    log.add(5, 0, b"a")
    log.add(5, 0, b"again")
    log.add(4, 0, b"older")
    assert [r.data for r in log.read(0)] == [b"a"]


def test_window_slides_by_count_and_by_bytes_moving_the_low_watermark():
    log = ReceivedLog(max_records=3, max_bytes=1 << 20)
    for offset in range(10):
        log.add(offset, 0, b"x")
    assert [r.offset for r in log.read(0)] == [7, 8, 9]
    assert log.low_watermark == 7
    small = ReceivedLog(max_records=100, max_bytes=10)
    for offset in range(4):
        small.add(offset, 0, b"12345")
    assert [r.offset for r in small.read(0)] == [2, 3] and small.low_watermark == 2
