"""Fixtures of the unit tests: `journal`, a real journal engine in the test's directory, keyed
by topic as `shardgate serve` builds it (its segments keep a key index: `core/index_keys.py`);
`plain_journal`, the same without key indexes (readers scan blocks)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from shardgate.core.index_keys import record_index_key
from shardgate.storage.journal import JournalStorage


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[JournalStorage]:
    storage = JournalStorage(tmp_path / "journal", index_key=record_index_key)
    yield storage
    storage.close()


@pytest.fixture
def plain_journal(tmp_path: Path) -> Iterator[JournalStorage]:
    storage = JournalStorage(tmp_path / "journal")
    yield storage
    storage.close()
