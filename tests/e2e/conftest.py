"""End-to-end fixtures shared by several test modules: the cluster ones (a real etcd and
`shardgate serve --cluster` processes) live in cluster_fixtures.py."""

from tests.e2e.cluster_fixtures import cluster, etcd  # noqa: F401
