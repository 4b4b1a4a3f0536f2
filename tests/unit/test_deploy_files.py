"""The files shipped for operators (`deploy/`): the Prometheus alert rules pass `promtool check
rules`, every metric they and the Grafana dashboard name is one the broker exports, the
systemd unit passes `systemd-analyze verify`, the compose file describes three nodes and etcd.
(A live scrape passing `promtool check metrics` is in tests/e2e/test_metrics.py.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "shardgate-alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "shardgate-dashboard.json"

# Every metric the alerts and the dashboard may name: the broker's, the cluster's and
# bridges' (exported only when configured), Prometheus' own `up` and the process collector's.
EXPORTED = re.compile(
    r"^(up|process_(resident_memory_bytes|open_fds|max_fds|cpu_seconds_total)"
    r"|shardgate_(cluster_(unavailable_shards|lease_alive|nodes)"
    r"|bridge_(connected|dropped_total)"
    r"|[a-z_]+))$")


def _metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (identifiers followed by `{`, `[` or an operator)."""
    expr = re.sub(r'"[^"]*"', '""', expr)
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)
    return {name for name in re.findall(r"\b([a-z_][a-z0-9_]*)\b(?!\s*\()", expr)
            if name.startswith(("shardgate_", "process_")) or name == "up"}


def collector_names() -> set[str]:
    """The `shardgate_*` names the collectors yield, read from their source."""
    names = set()
    for path in (ROOT / "shardgate" / "admin" / "metrics.py", ROOT / "shardgate" / "cluster" / "metrics.py"):
        text = path.read_text()
        prefix = "shardgate_cluster" if "cluster" in path.parts else "shardgate"
        names |= {f"{prefix}_{name}" for name in re.findall(r'f"\{PREFIX\}_([a-z_]+)"', text)}
        names |= {f"{prefix}_{name}" for name in re.findall(r'"([a-z_]+_seconds)",', text)}
        # families named in a loop: ("messages_received", ...) by protocol and by stream too
        for name in re.findall(r'\("([a-z_]+)", ', text):
            names |= {f"{prefix}_{name}", f"{prefix}_protocol_{name}", f"{prefix}_stream_{name}",
                      f"{prefix}_journal_{name}"}
    # the archiver's status fields, named at scrape time (`_archive`)
    names |= {f"shardgate_archive_{name}" for name in (
        "lag_records", "lag_seconds", "files", "bytes", "buffered", "failures", "skipped")}
    return names


def test_alert_rules_pass_promtool() -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    done = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_alerts_cover_what_pages_an_operator() -> None:
    alerts = {rule["alert"]: rule["expr"] for group in yaml.safe_load(RULES.read_text())["groups"]
              for rule in group["rules"]}
    for wanted in ("NodeDown", "ShardUnavailable", "DiskFilling", "MemoryHigh", "ArchiveLagging",
                   "ConsumerLag", "MessagesDropped"):
        assert f"Shardgate{wanted}" in alerts


def test_every_metric_named_by_the_alerts_and_the_dashboard_is_exported() -> None:
    exprs = [rule["expr"] for group in yaml.safe_load(RULES.read_text())["groups"]
             for rule in group["rules"]]
    dashboard = json.loads(DASHBOARD.read_text())
    exprs += [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    known = collector_names()
    for expr in exprs:
        for name in _metric_names(expr):
            base = re.sub(r"_(bucket|sum|count|total)$", "", name)
            assert name in ("up",) or name.startswith("process_") or base in known or name in known \
                or f"{base}_total" in known or base.removesuffix("_total") in known, (name, expr)
            assert EXPORTED.match(name), name


def test_systemd_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    shardgate = Path(sys.executable).with_name("shardgate")
    if not shardgate.exists():
        pytest.skip("the shardgate command is not installed beside this interpreter")
    unit = tmp_path / "shardgate.service"
    unit.write_text((DEPLOY / "systemd" / "shardgate.service").read_text()
                    .replace("/usr/local/bin/shardgate", str(shardgate)))
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                          text=True, timeout=120)
    complaints = [line for line in (done.stdout + done.stderr).splitlines() if str(unit) in line]
    assert done.returncode == 0 and not complaints, done.stdout + done.stderr


def test_compose_file_runs_three_nodes_on_one_etcd_with_a_cluster_secret() -> None:
    compose = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    assert sorted(services) == ["etcd", "n1", "n2", "n3"]
    for node in ("n1", "n2", "n3"):
        command = services[node]["command"]
        assert command[0] == "serve" and "http://etcd:2379" in command
        assert command[command.index("--node-id") + 1] == node
        assert "--cluster-secret-file" in command
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["shardgate"]' in dockerfile and "HEALTHCHECK" in dockerfile
