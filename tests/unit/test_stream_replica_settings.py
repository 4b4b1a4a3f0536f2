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
from shardgate.cluster.settings import ClusterSettings
from shardgate.config import ConfigError, load_config
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


def test_a_stream_without_the_settings_gets_the_cluster_defaults() -> None:
    unset = stream_definition(StreamConfig("plain", mode=DispatchMode.RELIABLE))
    # built in: three replicas, two in sync (issue 28), capped by the live nodes at placement
    assert stream_replication(unset) == Replication(3, 2)
    assert stream_replication(unset, ClusterSettings().replication_defaults) == Replication(3, 2)
    issue = ClusterSettings(default_replicas=3).replication_defaults
    assert issue == Replication(3, 2)
    assert stream_replication(unset, issue) == Replication(3, 2)
    # only one of the two set: the other is the default, the minimum capped by the replicas
    one = stream_definition(StreamConfig("one", mode=DispatchMode.RELIABLE, replicas=1))
    assert stream_replication(one, issue) == Replication(1, 1)
    three = stream_definition(StreamConfig("m3", mode=DispatchMode.RELIABLE,
                                           min_insync_replicas=3))
    assert stream_replication(three, issue) == Replication(3, 3)
    # a definition written by an earlier version has neither: the defaults
    assert stream_replication({"mode": "reliable"}, issue) == Replication(3, 2)
    assert stream_replication({"mode": "non-reliable"}, issue) == Replication(1, 1)


def test_the_cluster_defaults_come_from_the_cluster_section(tmp_path: Path) -> None:
    path = tmp_path / "shardgate.toml"
    path.write_text("[cluster]\ndefault_replicas = 1\ndefault_min_insync_replicas = 1\n")
    single = load_config(path, environ={}).cluster.replication_defaults
    assert single == Replication(1, 1)
    unset = stream_definition(StreamConfig("plain", mode=DispatchMode.RELIABLE))
    assert stream_replication(unset, single) == Replication(1, 1)
    # the stream's own settings win over the cluster's defaults
    five = stream_definition(StreamConfig("five", mode=DispatchMode.RELIABLE, replicas=5))
    assert stream_replication(five, single) == Replication(5, 1)
    # a minimum above the replicas is capped, never refused by the data path
    path.write_text("[cluster]\ndefault_replicas = 2\ndefault_min_insync_replicas = 3\n")
    assert load_config(path, environ={}).cluster.replication_defaults == Replication(2, 2)
    path.write_text("[cluster]\ndefault_replicas = 0\n")
    with pytest.raises(ConfigError, match="cluster.default_replicas = 0 is out of range"):
        load_config(path, environ={})


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
