"""A cluster archives into one table: an archive in each node's own data directory (the default)
is refused unless `[archive] per_node = true` says it is meant (`config.check_cluster_archive`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardgate.config import ConfigError, check_cluster_archive, load_config


def cluster_config(tmp_path: Path, **archive: object) -> object:
    config = load_config(environ={})
    config.data_dir = tmp_path / "n1"
    config.cluster.etcd = "http://127.0.0.1:2379"
    for key, value in archive.items():
        setattr(config.archive, key, value)
    return config


@pytest.mark.parametrize("url", ["", "file://{data}/archive", "{data}/elsewhere/archive",
                                 "file://{data}"])
def test_an_archive_in_the_node_data_dir_is_refused_in_a_cluster(tmp_path: Path, url: str) -> None:
    config = cluster_config(tmp_path, url=url.format(data=tmp_path / "n1"))
    with pytest.raises(ConfigError) as refused:
        check_cluster_archive(config)  # type: ignore[arg-type]
    message = str(refused.value)
    assert "split across machines" in message
    assert "per_node = true" in message and "s3://" in message


@pytest.mark.parametrize("url", ["s3://bucket/shardgate", "file://{shared}", "{shared}",
                                 "simplecache::s3://bucket/x"])
def test_a_shared_url_is_accepted(tmp_path: Path, url: str) -> None:
    config = cluster_config(tmp_path, url=url.format(shared=tmp_path / "shared"))
    check_cluster_archive(config)  # type: ignore[arg-type]


def test_per_node_or_no_archive_or_no_cluster_is_accepted(tmp_path: Path) -> None:
    check_cluster_archive(cluster_config(tmp_path, per_node=True))  # type: ignore[arg-type]
    check_cluster_archive(cluster_config(tmp_path, enabled=False))  # type: ignore[arg-type]
    single = load_config(environ={})
    single.data_dir = tmp_path / "single"
    check_cluster_archive(single)
