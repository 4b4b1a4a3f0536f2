"""Fixtures of the unit tests: `journal`, a real journal engine in the test's directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from shardgate.storage.journal import JournalStorage


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[JournalStorage]:
    storage = JournalStorage(tmp_path / "journal")
    yield storage
    storage.close()
