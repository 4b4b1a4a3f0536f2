"""In a cluster only a shard's leader archives it, and a new owner of a shard continues the
archive's sequence of files: two archivers on two journals share one URL while the shard's
leadership moves between them (`Archiver(leads=..., continue_log=...)`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem
from shardgate.storage.archive import Archiver, ArchiveSettings, list_stream_files
from shardgate.storage.journal import JournalBusy, JournalStorage

from tests.unit.test_archive import T0, append, read_rows, streams

FAST = ArchiveSettings(target_rows=100, poll_interval_s=0.02, max_delay_s=3600,
                       retry_initial_s=0.02, retry_max_s=0.1, stop_timeout_s=2)


def continue_in(journal: JournalStorage) -> Callable[[str, int, int], bool]:
    def continue_log(stream: str, shard: int, offset: int) -> bool:
        try:
            journal.open_shard(stream, shard).start_at(offset)
        except JournalBusy:
            return False  # it holds records
        return True

    return continue_log


async def test_only_the_leader_archives_and_a_new_owner_continues_the_sequence(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'archive'}"
    leader = {"s": "a"}
    journals = {name: JournalStorage(tmp_path / name, fsync="os") for name in ("a", "b")}
    archivers = {
        name: Archiver(journal, url, streams(("s", 1, "bytes")), FAST,
                       leads=lambda _stream, _shard, name=name: leader["s"] == name,
                       continue_log=continue_in(journal))
        for name, journal in journals.items()
    }
    try:
        await append(journals["a"], "s", 0, 40)
        # b holds a copy it does not lead (a replica): it archives nothing of it
        await append(journals["b"], "s", 0, 40)
        for archiver in archivers.values():
            await archiver.flush()
        assert read_rows(tmp_path / "archive", "s").column("offset").to_pylist() == list(range(40))
        assert archivers["b"].status()[0]["files"] == 0
        # the shard moves to c, a node with an empty journal: its log continues at offset 40
        journals["c"] = JournalStorage(tmp_path / "c", fsync="os")
        archivers["c"] = Archiver(journals["c"], url, streams(("s", 1, "bytes")), FAST,
                                  leads=lambda _stream, _shard: leader["s"] == "c",
                                  continue_log=continue_in(journals["c"]))
        leader["s"] = "c"
        await archivers["c"].flush()
        assert journals["c"].open_shard("s", 0).next_offset == 40
        await append(journals["c"], "s", 0, 25, ts=T0 + 1000)
        await append(journals["a"], "s", 0, 5)  # a late write on the old owner is not archived
        for archiver in archivers.values():
            await archiver.flush()
        offsets = read_rows(tmp_path / "archive", "s").column("offset").to_pylist()
        assert sorted(offsets) == list(range(65))
        files = list_stream_files(LocalFileSystem(), str(tmp_path / "archive"), "s")
        assert [(f.first_offset, f.last_offset) for f in files] == [(0, 39), (40, 64)]
        # and back to a: its journal holds records, the archive is ahead: it reports, never
        # writes an overlapping file
        leader["s"] = "a"
        await archivers["a"].flush()
        files = list_stream_files(LocalFileSystem(), str(tmp_path / "archive"), "s")
        assert [(f.first_offset, f.last_offset) for f in files] == [(0, 39), (40, 64)]
        assert "another journal wrote to this archive" in archivers["a"].status()[0]["last_error"]
    finally:
        for archiver in archivers.values():
            await archiver.stop(flush=False)
        for journal in journals.values():
            journal.close()
