"""A stream's replica settings: the defaults, the caps, the refusals, and their way through
the metadata store and the cluster's stream definition."""

from __future__ import annotations

from pathlib import Path

import pytest
from shardgate.core.errors import InvalidStreamConfig
from shardgate.core.streams import DispatchMode, StreamConfig
from shardgate.storage.metadata.sqlite import SqliteMetadataStore

from shardgate.cluster.attach import stream_config as from_definition
from shardgate.cluster.attach import stream_definition
from shardgate.cluster.replication import Replication, stream_replication
from shardgate.persistence import stream_config, stream_record


def test_the_cluster_reads_the_settings_and_caps_the_in_sync_minimum() -> None:
    definition = stream_definition(
        StreamConfig("five", mode=DispatchMode.RELIABLE, replicas=5, min_insync_replicas=3))
    assert stream_replication(definition) == Replication(5, 3)
    two = stream_definition(StreamConfig("two", mode=DispatchMode.RELIABLE, replicas=2))
    assert stream_replication(two).min_insync == 2
    one = stream_definition(StreamConfig("one", mode=DispatchMode.RELIABLE, replicas=1))
    assert stream_replication(one) == Replication(1, 1)
    metrics = stream_definition(StreamConfig("m", mode=DispatchMode.NON_RELIABLE, replicas=3))
    assert stream_replication(metrics) == Replication(1, 1)


@pytest.mark.parametrize(("replicas", "min_insync", "message"), [
    (0, None, "replicas must be between 1 and 16"),
    (17, None, "replicas must be between 1 and 16"),
    (None, 0, "min_insync_replicas must be between 1 and 16"),
    (2, 3, r"min_insync_replicas \(3\) cannot exceed replicas \(2\)"),
])
def test_impossible_replica_settings_are_refused(
    replicas: int | None, min_insync: int | None, message: str,
) -> None:
    with pytest.raises(InvalidStreamConfig, match=message):
        StreamConfig("orders", replicas=replicas, min_insync_replicas=min_insync)


def test_replica_settings_survive_the_metadata_store_and_the_cluster_definition(
    tmp_path: Path,
) -> None:
    config = StreamConfig("orders", mode=DispatchMode.RELIABLE, replicas=3, min_insync_replicas=2)
    unset = StreamConfig("plain", mode=DispatchMode.RELIABLE)
    store = SqliteMetadataStore(tmp_path / "metadata.db")
    try:
        store.put_stream(stream_record(config))
        store.put_stream(stream_record(unset))
        kept = {record.name: stream_config(record) for record in store.list_streams()}
    finally:
        store.close()
    assert (kept["orders"].replicas, kept["orders"].min_insync_replicas) == (3, 2)
    assert (kept["plain"].replicas, kept["plain"].min_insync_replicas) == (None, None)
    again = from_definition("orders", stream_definition(config))
    assert (again.replicas, again.min_insync_replicas) == (3, 2)
    # a definition written by an earlier version has neither: the defaults
    assert from_definition("old", {"mode": "reliable"}).replicas is None
