"""One archive for a cluster (issue 29): a node refuses to start with an archive in its own data
directory (the default) unless `[archive] per_node = true` says so, and a shared URL is taken."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import free_port, wait_for
from tests.e2e.cluster_fixtures import CLUSTER_SECRET, ClusterNodeProcess, EtcdServer, settled


def serve(tmp_path: Path, etcd: EtcdServer, *extra: str) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "node.toml"
    config.write_text(f'[cluster]\nsecret = "{CLUSTER_SECRET}"\nconnect_timeout_s = 5\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    return subprocess.run(
        [sys.executable, "-m", "shardgate", "serve", "--data-dir", str(tmp_path / "n1"),
         "--config", str(config), "--cluster", etcd.url, "--node-id", "n1", "--cluster-port", "0",
         "--mqtt-port", "0", "--mqtt-ws-port", "0", "--amqp-port", "0", "--grpc-port", "0",
         "--http-port", str(free_port()), *extra],
        capture_output=True, text=True, timeout=120, env=env)


def test_a_node_refuses_an_archive_in_its_data_dir_and_takes_a_shared_url(
    etcd: EtcdServer, tmp_path: Path,
) -> None:
    refused = serve(tmp_path, etcd)
    assert refused.returncode == 2, refused.stderr
    assert "split across machines" in refused.stderr, refused.stderr
    assert "per_node = true" in refused.stderr and "Traceback" not in refused.stderr
    assert not etcd.keys("/nodes/"), "a refused node never registers"
    inside = serve(tmp_path, etcd, "--archive-url", f"file://{tmp_path / 'n1' / 'archive'}")
    assert inside.returncode == 2 and "split across machines" in inside.stderr, inside.stderr
    # `shardgate config check` says the same of a cluster configuration
    bad = tmp_path / "bad.toml"
    bad.write_text(f'data_dir = "{tmp_path / "n1"}"\n[cluster]\netcd = "{etcd.url}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    checked = subprocess.run([sys.executable, "-m", "shardgate", "config", "check", str(bad)],
                             capture_output=True, text=True, timeout=60, env=env)
    assert checked.returncode == 2, checked
    assert "split across machines" in checked.stderr
    # one shared directory (or object storage) is what a cluster wants
    shared = tmp_path / "shared-archive"
    node = ClusterNodeProcess(tmp_path / "n2", "n2", etcd.url, extra_config="[archive]\n",
                              extra_args=["--archive-url", f"file://{shared}"])
    node.start()
    try:
        wait_for(lambda: settled(node, {"n2"}), timeout=60)
        assert shared.is_dir() and not (tmp_path / "n2" / "archive").exists()
    finally:
        node.kill()
    # and `per_node = true` keeps the archive in the data directory, as said
    local = ClusterNodeProcess(tmp_path / "n3", "n3", etcd.url)
    local.start()
    try:
        wait_for(lambda: settled(local, {"n3"}), timeout=60)
        assert (tmp_path / "n3" / "archive").is_dir()
    finally:
        local.kill()
