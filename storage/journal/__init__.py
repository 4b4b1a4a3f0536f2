"""The local journal (WAL) engine for reliable streams, after Kafka's log.

`JournalStorage` implements `ShardStorage` and `JournalShardLog` implements `ShardLog` (see
`shardgate.storage.interfaces`): per shard, segment files of checksummed records with sparse
offset and time indexes, group commit under an fsync policy, recovery that cuts a torn tail,
and retention bounded by what consumers still need. For replicas: `truncate_to(offset)`
cuts a shard log back, and its `leader_epochs` (`LeaderEpochCache`) keeps the leader-epoch
checkpoint of Kafka's KIP-101.
"""

# ruff: noqa: E402 - the compiled build is chosen before any module imports `framing`
import os

from ...core.native import use_compiled_if_current

# The per-record loops (`framing.py`) run compiled when `pip install` built them from this source.
use_compiled_if_current("shardgate.storage.journal.framing_native", os.path.dirname(__file__))

from ..interfaces import LATENCY_BUCKETS, LatencyHistogram
from .block import RecordBlock
from .commit import CommitStats, GroupCommitter
from .config import (
    FsyncPolicy,
    JournalBusy,
    JournalClosed,
    JournalConfig,
    JournalLocked,
    JournalVersionError,
)
from .epochs import CorruptCheckpoint, EpochEndOffset, EpochEntry, LeaderEpochCache
from .log import JournalShardLog
from .record import DEFAULT_CHECKSUM
from .storage import FORMAT_VERSION, VERSION_FILE, JournalStorage

__all__ = [
    "DEFAULT_CHECKSUM",
    "FORMAT_VERSION",
    "LATENCY_BUCKETS",
    "VERSION_FILE",
    "CommitStats",
    "CorruptCheckpoint",
    "EpochEndOffset",
    "EpochEntry",
    "FsyncPolicy",
    "GroupCommitter",
    "JournalBusy",
    "JournalClosed",
    "JournalConfig",
    "JournalLocked",
    "JournalShardLog",
    "JournalStorage",
    "RecordBlock",
    "JournalVersionError",
    "LatencyHistogram",
    "LeaderEpochCache",
]
