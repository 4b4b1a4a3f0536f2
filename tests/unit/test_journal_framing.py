"""The journal's per-record loops (`storage/journal/framing.py`), compiled or not: framing gives
the bytes `record.encode` gives, and both versions of the bulk scan read them back alike,
stopping where `Segment.read_block` relies on them to stop."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shardgate.core.native import is_compiled
from shardgate.storage.interfaces import StoredRecord
from shardgate.storage.journal import RecordBlock, framing
from shardgate.storage.journal.framing import (
    SCAN_BAD_CRC,
    SCAN_BAD_OFFSET,
    SCAN_OK,
    frame_records,
)
from shardgate.storage.journal.record import HEADER_SIZE, checksum, encode

SCANS = [framing._scan_indexed, framing._scan_unpacked]
NO_TS = -(2**63)

record_lists = st.lists(
    st.tuples(st.integers(-(2**63), 2**63 - 1), st.binary(max_size=300)), min_size=1, max_size=40
)


def frame(records: list[tuple[int, bytes]], first: int = 0, interval: int = 64) -> tuple[
    bytes, list[list[int]], tuple[int, int, int, int]
]:
    buf = bytearray(b"prefix")
    lists: list[list[int]] = [[], [], [], []]
    state = frame_records(buf, records, first, 0, 0, 0, interval, NO_TS, NO_TS, *lists, checksum)
    assert bytes(buf[:6]) == b"prefix"
    return bytes(buf[6:]), lists, state


@settings(max_examples=150, deadline=None)
@given(record_lists, st.integers(0, 2**40))
def test_framing_gives_the_record_layout(records: list[tuple[int, bytes]], first: int) -> None:
    framed, _, (pos, _, max_ts, _) = frame(records, first)
    expected = b"".join(
        encode(first + i, ts, data) for i, (ts, data) in enumerate(records)
    )
    assert framed == expected
    assert pos == len(expected)
    assert max_ts == max(ts for ts, _ in records)


def test_framing_indexes_like_note_record() -> None:
    """An index entry at the first record at least `interval` bytes after the last one, and a
    time entry there when the largest timestamp grew."""
    records = [(100 + (i % 3), b"x" * 40) for i in range(12)]  # 64-byte records
    _, (offsets, positions, stamps, time_offsets), (_, last_index_pos, _, last_ts) = frame(
        records, interval=128
    )
    assert positions == [128, 256, 384, 512, 640]
    assert offsets == [2, 4, 6, 8, 10]
    assert (stamps, time_offsets) == ([102], [2])
    assert (last_index_pos, last_ts) == (640, 102)


def test_a_value_the_layout_cannot_hold_raises_struct_error() -> None:
    import struct

    with pytest.raises(struct.error):
        frame([(2**63, b"too late")])


@pytest.mark.parametrize("scan", SCANS)
@settings(max_examples=100, deadline=None)
@given(records=record_lists, start=st.integers(0, 45), want=st.integers(1, 50))
def test_both_scans_read_back_what_was_framed(
    scan: object, records: list[tuple[int, bytes]], start: int, want: int
) -> None:
    framed, _, _ = frame(records, first=7)
    lengths: list[int] = []
    end_offset = 7 + len(records)
    status, p, expected, _ = scan(  # type: ignore[operator]
        framed, 7 + start, want, end_offset, checksum, lengths
    )
    assert status == SCAN_OK
    taken = records[start : start + want]
    assert lengths == [len(d) for _, d in taken]
    if taken:
        assert expected == 7 + start + len(taken)
        # where the first record taken starts, from which the block's positions follow
        assert p == sum(HEADER_SIZE + len(d) for _, d in records[:start])
        block = RecordBlock.from_scan(framed, 7 + start, p, lengths)
        assert list(block) == [
            StoredRecord(7 + start + i, ts, d) for i, (ts, d) in enumerate(taken)
        ]


@pytest.mark.parametrize("scan", SCANS)
def test_both_scans_stop_inside_a_torn_record(scan: object) -> None:
    framed, _, _ = frame([(1, b"a" * 10), (2, b"b" * 50)])
    torn = framed[: 34 + 30]  # the second record lacks its last bytes
    lengths: list[int] = []
    status, p, expected, length = scan(  # type: ignore[operator]
        torn, 0, 10, 2, checksum, lengths
    )
    assert (status, p, expected, length) == (SCAN_OK, 0, 1, 50)  # p: the first taken
    assert lengths == [10]


@pytest.mark.parametrize("scan", SCANS)
def test_both_scans_report_a_bad_checksum_and_a_broken_sequence(scan: object) -> None:
    framed, _, _ = frame([(1, b"a" * 10), (2, b"b" * 10), (3, b"c" * 10)])
    damaged = bytearray(framed)
    damaged[34 + HEADER_SIZE] ^= 0xFF  # the data of offset 1
    result = scan(bytes(damaged), 0, 10, 3, checksum, [])  # type: ignore[operator]
    assert result[:3] == (SCAN_BAD_CRC, 34, 1)
    # before from_offset only the framing and the sequence are checked, not the checksum
    result = scan(bytes(damaged), 2, 10, 3, checksum, [])  # type: ignore[operator]
    assert result[0] == SCAN_OK
    gap = framed[:34] + encode(5, 2, b"b" * 10)
    result = scan(gap, 0, 10, 9, checksum, [])  # type: ignore[operator]
    assert result == (SCAN_BAD_OFFSET, 34, 5, 1)


def test_the_compiled_build_runs_the_compiled_scan() -> None:
    assert framing._COMPILED == is_compiled(framing)
