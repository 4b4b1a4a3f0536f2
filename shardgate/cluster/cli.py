"""`shardgate cluster status`: the cluster as one node's admin API sees it (`/api/cluster`).

Prints the nodes (id, internal address, client listeners, shards led), which node is the
controller, the shards whose node is not live (unavailable until it returns), and from which
offset the answering node keeps its shards' journals for durable cursors on other nodes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from datetime import UTC, datetime
from typing import Any


def add_cluster_commands(sub: argparse._SubParsersAction) -> None:
    cluster = sub.add_parser("cluster", help="cluster status (admin HTTP API of any node)")
    cluster.add_argument("action", choices=["status"])
    cluster.add_argument("--http-url", default=None,
                         help="a node's admin API (default $SHARDGATE_HTTP_URL or http://127.0.0.1:8080)")
    cluster.add_argument("--json", action="store_true", help="print JSON")
    cluster.set_defaults(cluster_handler=run_cluster_command)


def run_cluster_command(args: argparse.Namespace) -> int:
    base = (args.http_url or os.environ.get("SHARDGATE_HTTP_URL") or "http://127.0.0.1:8080").rstrip("/")
    try:
        with urllib.request.urlopen(f"{base}/api/cluster", timeout=10) as response:
            status = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        detail = json.loads(exc.read() or b"{}").get("error", exc.reason)
        print(f"shardgate: {detail}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"shardgate: cannot reach the admin API at {base}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(render_status(status))
    return 0


def _utc(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def render_status(status: dict[str, Any]) -> str:
    nodes = status["nodes"]
    lines = [
        f"cluster {status['cluster']}: {len(nodes)} nodes, controller {status['controller'] or '(none)'}, "
        f"{status['shards']} shards in {status['streams']} streams"
    ]
    header = ("node", "internal address", "mqtt", "amqp", "grpc", "http", "shards", "state")
    rows = []
    for node in nodes:
        listeners = node.get("listeners", {})
        state = "leaving" if node["leaving"] else "controller" if node["controller"] else "live"
        rows.append((
            node["node_id"], node["cluster_address"], listeners.get("mqtt", "-"),
            listeners.get("amqp", "-"), listeners.get("grpc", "-"), listeners.get("http", "-"),
            str(node["shards"]), state,
        ))
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    for row in (header, *rows):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    unavailable = status.get("unavailable_shards", [])
    if unavailable:
        lines.append(f"unavailable (their node is not live): {', '.join(unavailable)}")
    floors = status.get("cursor_floors", {})
    if floors:
        kept = ", ".join(f"{shard} from {offset}" for shard, offset in floors.items())
        lines.append(f"journal kept here for cursors on other nodes: {kept}")
    for node_id, departed in status.get("departed_floors", {}).items():
        shards = ", ".join(f"{shard} from {offset}" for shard, offset in departed["floors"].items()) or "none"
        if departed["ignored"]:
            state = "ignored (departed_floors_retention_s has passed)"
        elif departed.get("ignored_from_ms") is not None:
            state = f"kept until {_utc(departed['ignored_from_ms'])}"
        else:
            state = "kept"
        lines.append(f"cursor floors of departed node {node_id} ({shards}): {state}")
    return "\n".join(lines)
