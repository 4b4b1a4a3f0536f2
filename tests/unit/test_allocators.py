"""glibc tuning of `shardgate serve`: once tuned, a large buffer freed does not make glibc carve
the next ones from its heap (where they pin pages after an idle broker frees them).

Each check runs in a fresh interpreter: glibc serves a large request from free heap chunks
before it maps new memory, so the heap a long test session leaves behind would decide the
outcome instead of the tuning."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from shardgate.storage.allocators import _GLIBC

pytestmark = pytest.mark.skipif(_GLIBC is None, reason="not glibc")

MAPPED_AFTER_A_LARGE_FREE = textwrap.dedent("""
    import ctypes
    from shardgate.storage.allocators import return_freed_memory, tune_malloc

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost",
        )]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2

    def mapped_bytes():
        return int(libc.mallinfo2().hblkhd)

    if TUNE:
        tune_malloc()
    first = bytearray(8 << 20)  # untuned, freeing it raises the mmap threshold to 8 MiB
    del first
    before = mapped_bytes()
    second = bytearray(4 << 20)
    grew = mapped_bytes() - before
    del second
    released = mapped_bytes() <= before
    return_freed_memory()  # callable anywhere, idempotent
    print(grew, released)
""")


def mapped_growth(tune: bool) -> tuple[int, bool]:
    """Run the allocation sequence in a fresh interpreter; (bytes newly mapped for the 4 MiB
    buffer, whether freeing it unmapped them)."""
    tuned_elsewhere = {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX"}
    env = {key: value for key, value in os.environ.items() if key not in tuned_elsewhere}
    result = subprocess.run(
        [sys.executable, "-c", f"TUNE = {tune}\n" + MAPPED_AFTER_A_LARGE_FREE],
        capture_output=True, text=True, timeout=60, env=env, check=True,
    )
    grew, released = result.stdout.split()
    return int(grew), released == "True"


def test_large_buffers_keep_their_own_mapping_after_a_large_one_is_freed() -> None:
    grew, released = mapped_growth(tune=True)
    assert grew >= 4 << 20
    assert released


def test_untuned_glibc_carves_a_large_buffer_from_its_heap_after_a_larger_one_is_freed() -> None:
    """The behaviour the tuning exists for; if glibc stops doing this the tuning is moot."""
    grew, _ = mapped_growth(tune=False)
    assert grew < 4 << 20


REUSED_WORKSPACE = textwrap.dedent("""
    import resource
    from shardgate.storage.allocators import tune_malloc

    tune_malloc()
    block = bytearray(2 << 20)  # a zstd workspace's size: its pages are mapped once
    del block
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        block = bytearray(2 << 20)  # zeroed: every page is touched
        del block
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def test_a_buffer_of_a_few_mib_freed_and_taken_again_reuses_its_pages() -> None:
    """What Arrow's Parquet writer does for every data page it compresses (a zstd workspace
    of 1 to 2 MiB, freed after): the tuned heap keeps those pages, instead of mapping (or
    growing back) and faulting 512 fresh pages each time."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    result = subprocess.run([sys.executable, "-c", REUSED_WORKSPACE], capture_output=True,
                            text=True, timeout=60, env=env, check=True)
    faults = int(result.stdout)
    assert faults < (2 << 20) // 4096, f"{faults} page faults for ten reuses of 2 MiB"
