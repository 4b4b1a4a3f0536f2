"""The journal's sparse indexes keep no Python object per entry. A segment keeps its indexes
while it exists, and they grow one entry per few KiB written, all through a load: an int
object per entry (three or four per entry, tens of thousands under a soak) sat among the
load's short-lived objects and kept their pages of Python's small-object heap, and their
1 MiB arenas, once the load had gone. Run in a fresh interpreter, so that nothing else
allocates meanwhile."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

APPEND_AND_COUNT = textwrap.dedent("""
    import gc, json, sys, tempfile, time
    from pathlib import Path
    from shardgate.core.records import MessageRecord, encode_message
    from shardgate.storage.journal import JournalStorage

    journal = JournalStorage(Path(tempfile.mkdtemp()) / "journal")
    shard = journal.open_shard("default", 0)
    now = int(time.time() * 1000)
    payload = b"x" * 5000  # every record past the 4 KiB index interval: one entry each
    rows = [encode_message(MessageRecord(f"t/{i}", payload, 1, False, now)) for i in range(10)]
    shard.append([(now, row) for row in rows])  # the first pass allocates what every pass reuses
    journal.flush_sync()
    gc.collect()
    before = sys.getallocatedblocks()
    for batch in range(1, 200):
        shard.append([(now + batch, row) for row in rows])  # a new timestamp: a time entry too
        journal.flush_sync()
    gc.collect()
    entries = sum(len(segment.index_offsets) + len(segment.time_stamps) for segment in shard._segments)
    print(json.dumps({"entries": entries, "blocks": sys.getallocatedblocks() - before}))
""")


def test_the_journal_indexes_hold_no_object_per_entry() -> None:
    done = subprocess.run([sys.executable, "-c", APPEND_AND_COUNT], capture_output=True, text=True,
                          timeout=120, check=True)
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["entries"] >= 2000
    assert counts["blocks"] < counts["entries"] // 10
