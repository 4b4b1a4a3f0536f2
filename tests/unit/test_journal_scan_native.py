"""The journal's block scan in C (`storage/journal/scan_native.c`) against the Python scan it
replaces (`framing.scan_block`, compiled and interpreted): the same status, positions and
offsets on generated segments (every record size, every start, limit and end, torn, corrupt
and out-of-sequence records, random bytes), the same records' positions and timestamps, its
checksums equal to the `crc32c` package's and zlib's, and `Segment.read_block` giving the same
blocks, and the same errors, with and without it.

These tests fail when the extension is not built (CI builds it); with `SHARDGATE_PURE=1` they
skip, since the Python scan then serves alone.
"""

from __future__ import annotations

import importlib.util
import os
import random
import threading
import zlib
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shardgate.core.native import PURE_ENV, load_c_extension
from shardgate.storage.interfaces import CorruptRecord
from shardgate.storage.journal import (
    FORMAT_VERSION,
    VERSION_FILE,
    JournalStorage,
    RecordBlock,
    framing,
)
from shardgate.storage.journal import segment as segment_module
from shardgate.storage.journal.framing import SCAN_BAD_CRC, SCAN_BAD_OFFSET, SCAN_OK
from shardgate.storage.journal.record import HEADER_SIZE, checksum_function, encode

JOURNAL = os.path.dirname(framing.__file__)
crc32c = checksum_function("crc32c")
CHECKSUMS: dict[str, Callable[[Any], int]] = {"crc32c": crc32c, "crc32": zlib.crc32}
SIZES = [0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 100, 130, 255, 256, 257, 1000, 4096, 70_000]
I64_MAX = 2**63 - 1
T0 = 1_700_000_000_000


@pytest.fixture(scope="module")
def native() -> ModuleType:
    module = load_c_extension("shardgate.storage.journal.scan_native", JOURNAL)
    if module is None:
        if os.environ.get(PURE_ENV) == "1":
            pytest.skip(f"{PURE_ENV}=1: the C scan is not loaded")
        pytest.fail(
            "storage/journal/scan_native.c is not built, or built from another version of it: "
            "run `pip install -e .`"
        )
    return module


def _source_framing() -> ModuleType:
    """framing.py executed from its source (the scans interpreted, whatever is installed)."""
    spec = importlib.util.spec_from_file_location(
        "shardgate_framing_source", os.path.join(JOURNAL, "framing.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_source = _source_framing()
PY_SCANS = [
    framing.scan_block, framing._scan_indexed, framing._scan_unpacked,
    _source._scan_indexed, _source._scan_unpacked,
]


def python_scan(
    scan: Callable[..., tuple[int, int, int, int]], buf: bytes, from_offset: int, want: int,
    end_offset: int, name: str,
) -> tuple[tuple[int, int, int, int], tuple[list[int], list[int], list[int]] | None]:
    """A Python scan's result, and the positions and timestamps of the records it took (None
    when it stopped on an error or took none), computed here from the lengths it collected."""
    lengths: list[int] = []
    result = scan(buf, from_offset, want, end_offset, CHECKSUMS[name], lengths)
    if result[0] != SCAN_OK or not lengths:
        return result, None
    starts, ends, stamps = [], [], []
    position = result[1]
    for length in lengths:
        starts.append(position + HEADER_SIZE)
        ends.append(position + HEADER_SIZE + length)
        stamps.append(int.from_bytes(buf[position + 16 : position + 24], "little", signed=True))
        position += HEADER_SIZE + length
    return result, (starts, ends, stamps)


def agree(
    native: ModuleType, buf: bytes, from_offset: int, want: int, end_offset: int,
    name: str = "crc32c",
) -> tuple[int, int, int, int]:
    """Run the C scan and every Python scan on one input; they must agree. Returns the result."""
    status, p, a, b, starts, ends, stamps = native.scan_block(
        buf, from_offset, want, end_offset, name
    )
    got = (status, p, a, b)
    taken = None if starts is None else (list(starts), list(ends), list(stamps))
    for scan in PY_SCANS:
        expected, records = python_scan(scan, buf, from_offset, want, end_offset, name)
        assert got == expected, (scan, from_offset, want, end_offset)
        assert taken == records, (scan, from_offset, want, end_offset)
    if starts is not None:
        assert all(type(x) is array and x.typecode == "q" for x in (starts, ends, stamps))
    return got


def frame(
    items: list[tuple[int, int, bytes]], name: str = "crc32c"
) -> tuple[bytes, list[int]]:
    """(offset, timestamp, data) records framed back to back; returns the bytes and where each
    record starts."""
    out = bytearray()
    positions = []
    for offset, timestamp, data in items:
        positions.append(len(out))
        out += encode(offset, timestamp, data, CHECKSUMS[name])
    return bytes(out), positions


def segment(
    sizes: list[int], base: int = 1000, name: str = "crc32c", seed: int = 0
) -> tuple[bytes, list[int]]:
    rng = random.Random(seed)
    return frame(
        [(base + i, T0 + rng.randrange(-5, 5000), rng.randbytes(size))
         for i, size in enumerate(sizes)],
        name,
    )


# -- the checksums ------------------------------------------------------------------------------


def test_the_checksums_equal_the_crc32c_package_and_zlib(native: ModuleType) -> None:
    rng = random.Random(29)
    for length in range(301):
        for _ in range(4):
            data = rng.randbytes(length)
            assert native.checksum(data, "crc32c") == crc32c(data), length
            assert native.software_crc32c(data) == crc32c(data), length
            assert native.checksum(data, "crc32") == zlib.crc32(data), length
    for length in (4095, 65_536, 1_000_003, 5 * 1024 * 1024 + 7):
        data = rng.randbytes(length)
        assert native.checksum(data, "crc32c") == crc32c(data) == native.software_crc32c(data)
        assert native.checksum(data, "crc32") == zlib.crc32(data)
    # an unaligned view of a larger buffer
    data = rng.randbytes(1000)
    for start in range(9):
        view = memoryview(data)[start : start + 500]
        assert native.checksum(view, "crc32c") == crc32c(bytes(view))
        assert native.checksum(view, "crc32") == zlib.crc32(bytes(view))


def test_an_unknown_checksum_is_refused(native: ModuleType) -> None:
    buf, _ = segment([10, 20])
    with pytest.raises(LookupError, match="sha1"):
        native.scan_block(buf, 0, 10, 10**6, "sha1")
    with pytest.raises(LookupError):
        native.checksum(b"abc", "adler32")


# -- the scan on generated segments -------------------------------------------------------------


@pytest.mark.parametrize("name", ["crc32c", "crc32"])
def test_every_start_limit_and_end_on_records_of_every_size(
    native: ModuleType, name: str
) -> None:
    sizes = SIZES + list(reversed(SIZES)) + [130] * 20
    buf, _ = segment(sizes, base=1000, name=name)
    last = 1000 + len(sizes) - 1
    starts = [-(2**63), -1, 0, 999, 1000, 1001, 1017, 1018, 1019, 1035, last, last + 1, 10**9]
    wants = [-5, 0, 1, 2, 3, 17, 40, len(sizes), 10**9]
    ends = [-1, 1000, 1001, 1002, 1020, last, last + 1, last + 2, 10**9]
    results = set()
    for from_offset in starts:
        for want in wants:
            for end_offset in ends:
                results.add(agree(native, buf, from_offset, want, end_offset, name)[0])
    assert results == {SCAN_OK}


def test_a_buffer_ending_anywhere(native: ModuleType) -> None:
    """A chunk cut inside a header, inside a record's data, at a record boundary, and a
    single record larger than the chunk: the scan stops where `read_block` reads on from."""
    sizes = [5, 130, 0, 300, 70_000, 12, 130]
    buf, positions = segment(sizes)
    cuts = set(range(0, 400)) | {len(buf) - i for i in range(0, 40)}
    for position in positions:
        cuts |= {position + d for d in (-1, 0, 1, 8, 23, 24, 25)}
    for cut in sorted(c for c in cuts if 0 <= c <= len(buf)):
        chunk = buf[:cut]
        for from_offset in (0, 1000, 1001, 1003, 1004, 1005, 1006, 1007):
            for want in (1, 2, 100):
                agree(native, chunk, from_offset, want, 1007)
    # a chunk starting after the first records, as read_block reads on
    for position in positions:
        agree(native, buf[position:], 1000, 100, 1007)


def test_a_damaged_record_fails_its_checksum_only_when_wanted(native: ModuleType) -> None:
    sizes = [10, 130, 0, 64, 300]
    buf, positions = segment(sizes)
    seen = set()
    for index, position in enumerate(positions):
        end = positions[index + 1] if index + 1 < len(positions) else len(buf)
        # the crc, the timestamp, the data (the offset and length bytes break the framing)
        for byte in list(range(position + 4, position + 8)) + list(range(position + 16, end)):
            damaged = bytearray(buf)
            damaged[byte] ^= 0x40
            for from_offset in (1000, 1000 + index, 1001 + index, 1005):
                seen.add(agree(native, bytes(damaged), from_offset, 100, 1005)[0])
            status, p, offset, _ = agree(native, bytes(damaged), 1000, 100, 1005)
            assert (status, p, offset) == (SCAN_BAD_CRC, position, 1000 + index)
    assert seen == {SCAN_OK, SCAN_BAD_CRC}


def test_damaged_lengths_and_offsets(native: ModuleType) -> None:
    """Flipping any bit of a header's length or offset: whatever the framing then reads (a
    broken sequence, a record past the end, a checksum failure), the scans agree."""
    buf, positions = segment([10, 130, 0, 64, 300, 7])
    statuses = set()
    for position in positions:
        for byte in list(range(position, position + 4)) + list(range(position + 8, position + 16)):
            for bit in range(8):
                damaged = bytearray(buf)
                damaged[byte] ^= 1 << bit
                for from_offset in (0, 1000, 1003):
                    statuses.add(agree(native, bytes(damaged), from_offset, 100, 1006)[0])
    assert statuses == {SCAN_OK, SCAN_BAD_OFFSET, SCAN_BAD_CRC}


def test_an_offset_out_of_sequence(native: ModuleType) -> None:
    for offsets in ([5, 6, 8], [5, 5], [5, 4], [7, 100, 101], [-3, -2, 9], [-1, 7], [-5, 0, 1]):
        buf, positions = frame([(o, T0, b"x" * 20) for o in offsets])
        for from_offset in (-10, offsets[0], offsets[-1], 1000):
            agree(native, buf, from_offset, 100, 10**6)
    buf, positions = frame([(5, T0, b"a"), (6, T0, b"b"), (8, T0, b"c")])
    assert agree(native, buf, 0, 100, 100) == (SCAN_BAD_OFFSET, positions[2], 8, 7)


def test_offsets_and_arguments_at_the_ends_of_64_bits(native: ModuleType) -> None:
    """Python ints do not overflow: the record after offset 2**63 - 1 is expected at 2**63,
    and offsets and limits outside 64 bits compare as Python compares them."""
    buf, _ = frame([(I64_MAX, T0, b"last"), (0, T0, b"wraps")])
    for from_offset in (0, I64_MAX, 2**63, 2**70, -(2**70)):
        agree(native, buf, from_offset, 100, 2**64)
    assert agree(native, buf, 0, 100, 2**64)[:4] == (SCAN_BAD_OFFSET, 28, 0, 2**63)
    assert agree(native, buf[:28], 0, 100, 2**64) == (SCAN_OK, 0, 2**63, 4)
    buf, _ = frame([(-(2**63), -(2**63), b""), (-(2**63) + 1, I64_MAX, b"x")])
    for from_offset in (-(2**63), -(2**63) - 1, -(2**64), 0):
        for end_offset in (-(2**64), -(2**63) + 1, -(2**63) + 2, 2**64):
            for want in (-(2**64), 1, 2, 2**64):
                agree(native, buf, from_offset, want, end_offset)


def test_random_bytes(native: ModuleType) -> None:
    rng = random.Random(7)
    for _ in range(300):
        garbage = rng.randbytes(rng.randrange(0, 2000))
        for from_offset in (-(2**63), 0, 1000):
            agree(native, garbage, from_offset, rng.randrange(-1, 50), rng.choice([0, 10**6]))


def test_random_headers_over_valid_and_broken_records(native: ModuleType) -> None:
    """Records whose lengths, offsets and checksums are mostly right: garbage that frames."""
    rng = random.Random(11)
    for _ in range(400):
        out = bytearray()
        offset = rng.randrange(-3, 50)
        for _ in range(rng.randrange(0, 12)):
            out += encode(offset, rng.randrange(-(2**63), 2**63), rng.randbytes(rng.randrange(40)))
            roll = rng.random()
            if roll < 0.05:
                offset += rng.randrange(-2, 3)
            elif roll < 0.1:
                out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
            elif roll < 0.12:
                out += rng.randbytes(rng.randrange(30))
            offset += 1
        if rng.random() < 0.3 and out:
            out = out[: rng.randrange(len(out))]
        for from_offset in (-5, 0, 5, 20, 60):
            agree(native, bytes(out), from_offset, rng.randrange(0, 15), rng.randrange(0, 70))


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 600), max_size=30),
    base=st.integers(-100, 2**40),
    start=st.integers(-3, 33),
    want=st.integers(-1, 35),
    end=st.integers(-1, 35),
    cut=st.integers(0, 30_000),
    name=st.sampled_from(["crc32c", "crc32"]),
)
def test_generated_segments(
    native: ModuleType, sizes: list[int], base: int, start: int, want: int, end: int, cut: int,
    name: str,
) -> None:
    buf, _ = segment(sizes, base=base, name=name)
    agree(native, buf[: len(buf) - cut % (len(buf) + 1)], base + start, want, base + end, name)


def test_many_records_in_a_buffer_scanned_without_the_gil(native: ModuleType) -> None:
    """A 1 MiB chunk of 130-byte records (the scan releases the GIL for it), scanned from
    several threads at once, gives the same records in each."""
    buf, _ = segment([130] * 7000 + [5000] * 20)
    assert len(buf) > 1_000_000
    expected = agree(native, buf, 1000, 10**6, 10**6)
    assert expected == (SCAN_OK, 0, 1000 + 7020, 5000)  # b: the last length read
    results: list[Any] = []

    def scan() -> None:
        for _ in range(20):
            results.append(native.scan_block(buf, 1000, 10**6, 10**6, "crc32c"))

    threads = [threading.Thread(target=scan) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    first = results[0]
    assert len(results) == 60
    assert all(r[:4] == first[:4] and r[4:] == first[4:] for r in results)
    assert len(first[4]) == 7020


# -- Segment.read_block with and without the C scan ---------------------------------------------


def block_fields(block: RecordBlock) -> tuple[Any, ...]:
    return (
        block.buffer, block.first_offset, list(block.starts), list(block.ends),
        list(block.timestamps),
    )


def read_both(
    monkeypatch: pytest.MonkeyPatch, read: Callable[..., RecordBlock], *args: int, **kwargs: int
) -> tuple[Any, Any]:
    """`read(*args, **kwargs)` through the C scan, then through the Python scan: each one's
    block fields, or the CorruptRecord message it raised. The C scan reading into buffers of
    Arrow's pool (`allocate`, as the archiver reads) must give the C scan's own outcome, and
    its records' data as bytes."""
    outcomes = []
    for use_native, allocate in ((True, None), (False, None), (True, pa.allocate_buffer)):
        with monkeypatch.context() as patch:
            if not use_native:
                patch.setattr(segment_module, "_NATIVE_CHECKSUMS", {})
            try:
                block = read(*args, allocate=allocate, **kwargs)
                outcomes.append(block_fields(block))
                if allocate is not None and len(block):
                    assert type(block.data(len(block) - 1)) is bytes
                    assert block[0].data == outcomes[0][0][block.starts[0]:block.ends[0]]
            except CorruptRecord as exc:
                outcomes.append(("CorruptRecord", str(exc)))
    assert outcomes[2] == outcomes[0]
    return outcomes[0], outcomes[1]


@pytest.fixture(params=["crc32c", "crc32"])
def journal(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[JournalStorage]:
    (tmp_path / VERSION_FILE).write_text(f"{FORMAT_VERSION}\n{request.param}\n")
    store = JournalStorage(tmp_path, segment_bytes=300_000, index_interval_bytes=2048)
    yield store
    store.close()


def fill(store: JournalStorage, sizes: list[int]) -> None:
    shard = store.open_shard("s", 0)
    rng = random.Random(3)
    for first in range(0, len(sizes), 50):
        shard.append([(T0 + rng.randrange(10_000), rng.randbytes(size))
                      for size in sizes[first : first + 50]])
        store.flush_sync()


def test_read_block_gives_the_same_blocks_with_and_without_the_c_scan(
    native: ModuleType, journal: JournalStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(5)
    sizes = [rng.choice([0, 1, 17, 130, 130, 130, 900, 5000]) for _ in range(1200)] + [70_000]
    fill(journal, sizes)
    shard = journal.open_shard("s", 0)
    assert len(shard.segments) >= 3
    assert all(
        segment_module._NATIVE_CHECKSUMS.get(segment.crc) == journal.config.checksum
        for segment in shard.segments
    )
    for start in (0, 1, 49, 50, 333, 700, 1199, 1200, 1201, 5000):
        for max_records in (1, 7, 64, 1000, 10_000):
            position = start
            while True:
                with_c, without = read_both(monkeypatch, shard.read_block, position, max_records)
                assert with_c == without, (start, max_records, position)
                if not with_c[2]:
                    break
                position += len(with_c[2])
    for segment in shard.segments:  # small chunks: records larger than a chunk, read on
        base = segment.base_offset
        for chunk in (64, 1000, 4096):
            for offset in (base, base + 1, base + 17):
                with_c, without = read_both(
                    monkeypatch, segment.read_block, offset, 50, chunk=chunk
                )
                assert with_c == without


@pytest.mark.parametrize("damage", ["data", "crc", "offset", "length"])
def test_read_block_raises_the_same_errors_with_and_without_the_c_scan(
    native: ModuleType, journal: JournalStorage, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """A damaged record inside the published region: the same CorruptRecord either way."""
    fill(journal, [130] * 40)
    shard = journal.open_shard("s", 0)
    segment = shard.segments[-1]
    path = segment.path()
    data = bytearray(path.read_bytes())
    position = 20 * (HEADER_SIZE + 130)  # record 20
    byte = {"data": 30, "crc": 5, "offset": 9, "length": 1}[damage]
    data[position + byte] ^= 0x10
    path.write_bytes(bytes(data))
    errors = set()
    for start in (0, 10, 19, 20, 21, 39):
        for max_records in (1, 5, 40):
            with_c, without = read_both(monkeypatch, shard.read_block, start, max_records)
            assert with_c == without, (start, max_records)
            if with_c[0] == "CorruptRecord":
                errors.add(with_c[1])
    expected = {
        "data": "checksum mismatch at byte 3080",
        "crc": "checksum mismatch at byte 3080",
        "offset": "offset 4116 where 20 was expected at byte 3080",
        # a length past the published end: no record there (the read used to loop for ever)
        "length": "before the end of the segment (byte 6160)",
    }[damage]
    assert errors and all(expected in error for error in errors), errors
