"""glibc tuning of `shardgate serve`: once tuned, a large buffer freed does not make glibc carve
the next ones from its heap (where they pin pages after an idle broker frees them)."""

from __future__ import annotations

import ctypes

import pytest
from shardgate.storage.allocators import return_freed_memory, tune_malloc


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost",
    )]


def mapped_bytes() -> int:
    """Bytes glibc holds in blocks of their own mapping (`hblkhd` of mallinfo2)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    return int(libc.mallinfo2().hblkhd)


def test_large_buffers_keep_their_own_mapping_after_a_large_one_is_freed() -> None:
    if not tune_malloc():
        pytest.skip("not glibc")
    first = bytearray(8 << 20)  # untuned, freeing it would raise the mmap threshold to 8 MiB
    del first
    before = mapped_bytes()
    second = bytearray(4 << 20)
    assert mapped_bytes() >= before + (4 << 20)
    del second
    assert mapped_bytes() <= before
    return_freed_memory()  # callable anywhere, idempotent
