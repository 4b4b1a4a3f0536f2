"""pymalloc's free pools inside arenas that a few live objects keep: `release_free_pools` hands
their pages back, and the heap goes on working (pools reused for any size class, live objects
untouched).

Runs in a fresh interpreter: the heap a long test session leaves behind would decide how much
there is to release."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from shardgate.storage.allocators import _pymalloc_layout_known

pytestmark = pytest.mark.skipif(not _pymalloc_layout_known(),
                                reason="needs CPython 3.11's pymalloc on 64-bit Linux")

FRAGMENTED_HEAP = textwrap.dedent("""
    import gc
    from shardgate.storage.allocators import release_free_pools

    def rss_anon_kib():
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])

    # About 50 MiB of small objects; one in 700 stays, so (almost) every arena stays too.
    made = [(i, str(i) * 3, [i], {"i": i}) for i in range(200_000)]
    kept = made[::700]
    del made
    gc.collect()
    before = rss_anon_kib()
    released = release_free_pools()
    after = rss_anon_kib()
    again = release_free_pools()  # released pools are marked: only those the first call's own
    # temporaries left free are found again
    intact = all(k[1] == str(k[0]) * 3 and k[2] == [k[0]] and k[3] == {"i": k[0]} for k in kept)
    # The released pools serve every size class again, initialised afresh.
    remade = [(i, str(i) * 5, bytes(i % 500), [i] * (i % 60)) for i in range(200_000)]
    reused = all(len(r[2]) == r[0] % 500 and r[1] == str(r[0]) * 5 and len(r[3]) == r[0] % 60
                 for r in remade)
    print(released, before - after, again, intact, reused)
""")


def test_free_pools_of_kept_arenas_are_handed_back_and_reused() -> None:
    result = subprocess.run([sys.executable, "-c", FRAGMENTED_HEAP], capture_output=True,
                            text=True, timeout=120, check=True)
    released, freed_kib, again, intact, reused = result.stdout.split()
    assert int(released) > 1000  # of about 3,000 pools, most free
    assert int(freed_kib) > 12 * 1024  # 12 KiB of each released pool
    assert int(again) < int(released) // 10
    assert intact == "True"
    assert reused == "True"
