"""The etcd client's pure parts: endpoint parsing and prefix ranges; the cluster settings."""

from __future__ import annotations

import pytest

from shardgate.cluster.etcd import Endpoint, parse_endpoints, prefix_end
from shardgate.cluster.settings import ClusterSettings


def test_endpoints_accept_urls_and_bare_host_ports() -> None:
    assert parse_endpoints(["http://127.0.0.1:2379", "https://etcd.example:2380", "10.0.0.1:23"]) == [
        Endpoint("127.0.0.1:2379", False), Endpoint("etcd.example:2380", True),
        Endpoint("10.0.0.1:23", False)]
    assert parse_endpoints(["http://etcd"]) == [Endpoint("etcd:2379", False)]


@pytest.mark.parametrize("bad", [[], [""], ["ftp://x:1"]])
def test_bad_endpoints_are_refused(bad: list[str]) -> None:
    with pytest.raises(ValueError):
        parse_endpoints(bad)


def test_prefix_end_covers_exactly_the_prefix() -> None:
    assert prefix_end(b"/shardgate/a/") == b"/shardgate/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff") == b"\0"


def test_cluster_mode_is_on_only_with_an_etcd_endpoint() -> None:
    assert not ClusterSettings().enabled
    settings = ClusterSettings(etcd="http://a:1, http://b:2", name="prod")
    assert settings.enabled and settings.endpoints == ["http://a:1", "http://b:2"]
    assert settings.prefix == "/shardgate/prod/"
