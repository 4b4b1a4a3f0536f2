"""The dispatched marks kept on disk for a node started again (`dispatch_checkpoints.py`, over
`storage/journal/offset_checkpoint.py`): the file never goes back while its mark counts, a
file not written as this code writes it counts as no mark (never as another number), a kept
mark counts only for the log it was kept for (the record before it still there in the same
leader epoch), never above what the journal made durable, and a lost data directory has none."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from shardgate.storage.journal.offset_checkpoint import OffsetCheckpoint

from shardgate.cluster.dispatch_checkpoints import CHECKPOINT_FILE, KeptMarks
from shardgate.cluster.replica_epochs import EpochHistory, EpochStart

KEY = ("safe", 0)


@dataclass
class Log:
    """The figures of a shard's journal log that a kept mark reads (`MarkedLog`)."""

    directory: Path
    next_offset: int = 1_000
    committed_offset: int = 1_000
    low_watermark: int = 0
    leader_epochs: EpochHistory = field(default_factory=lambda: EpochHistory(
        [EpochStart(1, 0), EpochStart(3, 600)]))


def test_an_offset_checkpoint_is_replaced_whole_and_reads_back(tmp_path: Path) -> None:
    file = OffsetCheckpoint(tmp_path, "mark")
    assert file.read() is None
    file.write(1200, 3)
    assert file.read() == (1200, 3)
    file.write(0, -1, sync=True)
    assert file.read() == (0, -1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mark"]  # no temporary file left


def test_a_file_not_written_as_an_offset_checkpoint_is_no_offset(tmp_path: Path) -> None:
    file = OffsetCheckpoint(tmp_path, "mark")
    # a machine crash before an unsynced write reached the disk: empty, or zeros; or a foreign
    # or later format
    for content in (b"", b"\x00" * 8, b"0\n", b"0\n12 3", b"1\n1200 3\n", b"0\n-5 3\n",
                    b"0\n12\n", b"0\n12 3 4\n", b"0\n1200 3\n7\n", b"0\n12 -2\n"):
        file.path.write_bytes(content)
        assert file.read() is None, content


def test_a_kept_mark_never_goes_back_and_survives_a_new_process(tmp_path: Path) -> None:
    log = Log(tmp_path)
    kept = KeptMarks()
    assert kept.kept(KEY, log) is None
    assert kept.keep(KEY, log, 500)
    assert not kept.keep(KEY, log, 400)  # a lower mark (told by a leader that knew less)
    assert not kept.keep(KEY, log, 500)
    assert kept.keep(KEY, log, 700, sync=True)
    assert (tmp_path / CHECKPOINT_FILE).read_text() == "0\n700 3\n"  # offset 699: epoch 3
    again = KeptMarks()  # the node started again
    assert again.kept(KEY, log) == 700
    assert not again.keep(KEY, log, 650)
    assert (tmp_path / CHECKPOINT_FILE).read_text() == "0\n700 3\n"


def test_a_mark_is_kept_at_most_up_to_the_durable_end(tmp_path: Path) -> None:
    log = Log(tmp_path, next_offset=1_000, committed_offset=800)
    KeptMarks().keep(KEY, log, 950)  # (a follower's high watermark may pass its durable end)
    assert KeptMarks().kept(KEY, log) == 800


def test_a_kept_mark_counts_only_for_the_log_it_was_kept_for(tmp_path: Path) -> None:
    log = Log(tmp_path)
    KeptMarks().keep(KEY, log, 700)
    # the log cut below the mark (a machine crash took the journal's unsynced tail): the
    # record before it is gone
    assert KeptMarks().kept(KEY, Log(tmp_path, next_offset=650, committed_offset=650)) is None
    # cut below it and written again in a later epoch (an unclean election)
    rewritten = Log(tmp_path, leader_epochs=EpochHistory([EpochStart(1, 0), EpochStart(5, 650)]))
    kept = KeptMarks()
    assert kept.kept(KEY, rewritten) is None
    assert kept.keep(KEY, rewritten, 300)  # a lower mark replaces the one that no longer counts
    assert kept.kept(KEY, rewritten) == 300
    # a mark at or below the log's first offset always counts: the hand-on starts there anyway
    (tmp_path / "low").mkdir()
    assert KeptMarks().keep(KEY, Log(tmp_path / "low"), 0)
    assert KeptMarks().kept(KEY, Log(tmp_path / "low", low_watermark=200)) == 0


def test_a_lost_data_directory_keeps_no_mark(tmp_path: Path) -> None:
    directory = tmp_path / "safe" / "0"
    directory.mkdir(parents=True)
    kept = KeptMarks()
    kept.keep(KEY, Log(directory), 700)
    shutil.rmtree(tmp_path / "safe")
    assert not kept.keep(KEY, Log(directory), 800)  # the directory is gone: nothing written
    assert not directory.exists()
    directory.mkdir(parents=True)  # an emptied data directory, the shard fetched again
    assert KeptMarks().kept(KEY, Log(directory)) is None
