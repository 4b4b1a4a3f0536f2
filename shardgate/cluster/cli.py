"""`shardgate cluster status`: the cluster as one node sees it; `shardgate cluster drain NODE`.

`status` prints the nodes (id, internal address, client listeners, shards led), which node is
the controller, the shards whose node is not live (unavailable until it returns), per
replicated shard its leader, epoch, replicas, in-sync set and (for the shards the answering
node leads) high watermark and followers' lag, the under-replicated shards, the nodes being
drained, and from which offset the answering node keeps its shards' journals for durable
cursors on other nodes.

`drain NODE` asks the controller to move every replica and leadership off NODE (each replica
is copied to another node and caught up first), so that the node can be removed once
`status` shows it holds nothing; `drain NODE --cancel` stops that. It asks a node's admin HTTP
API (`POST /api/cluster/drain/NODE`): `--http-url URL` or `SHARDGATE_HTTP_URL`.

Like every client command it finds the node with `--url HOST:PORT`, else `SHARDGATE_URL`,
else 127.0.0.1:6650, and asks its gRPC Admin service (`GetClusterStatus`) with `--username`
and `--password`. `--http-url URL` (or `SHARDGATE_HTTP_URL` when neither `--url` nor
`SHARDGATE_URL` is given) asks a node's admin HTTP API (`/api/cluster`) instead, with the same
credentials as HTTP basic authentication.

Exit codes: 0 when every shard is available, `EXIT_UNAVAILABLE` (3) while some shard's node is
not live (the status is printed all the same: scripts and probes can wait on it), 1 when the
status could not be read.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from datetime import UTC, datetime
from typing import Any

CONNECT_TIMEOUT_S = 5.0
EXIT_UNAVAILABLE = 3


class StatusError(Exception):
    """The status could not be read: the message says why (printed, exit code 1)."""


def add_cluster_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cluster = sub.add_parser("cluster", help="cluster status, drain a node (any node of the cluster)")
    cluster.add_argument("action", choices=["status", "drain"])
    cluster.add_argument("node", nargs="?", default=None, help="drain: the node to empty")
    cluster.add_argument("--cancel", action="store_true", help="drain: stop draining the node")
    cluster.add_argument("--url", default=None,
                         help="a node's gRPC address HOST:PORT (default $SHARDGATE_URL or "
                              "127.0.0.1:6650)")
    cluster.add_argument("--http-url", default=None,
                         help="ask a node's admin HTTP API instead (default $SHARDGATE_HTTP_URL "
                              "when neither --url nor $SHARDGATE_URL is given)")
    cluster.add_argument("--username", default=None,
                         help="authenticate as this user (an admin; default $SHARDGATE_USERNAME)")
    cluster.add_argument("--password", default=None,
                         help="the user's password (default $SHARDGATE_PASSWORD)")
    cluster.add_argument("--json", action="store_true", help="print JSON")
    cluster.set_defaults(cluster_handler=run_cluster_command)


def run_cluster_command(args: argparse.Namespace) -> int:
    username = args.username or os.environ.get("SHARDGATE_USERNAME")
    password = args.password or os.environ.get("SHARDGATE_PASSWORD") or ""
    http_url = args.http_url
    if http_url is None and args.url is None and not os.environ.get("SHARDGATE_URL"):
        http_url = os.environ.get("SHARDGATE_HTTP_URL")
    try:
        if args.action == "drain":
            http_url = args.http_url or os.environ.get("SHARDGATE_HTTP_URL")
            if not args.node:
                raise StatusError("cluster drain needs the node to drain: shardgate cluster drain NODE")
            if http_url is None:
                raise StatusError("cluster drain asks a node's admin API: give --http-url URL "
                                  "(or SHARDGATE_HTTP_URL)")
            status = _drain_over_http(http_url.rstrip("/"), args.node, args.cancel, username,
                                      password)
        elif http_url is not None:
            status = _status_over_http(http_url.rstrip("/"), username, password)
        else:
            status = asyncio.run(_status_over_grpc(args.url, username, password))
    except StatusError as exc:
        print(f"shardgate: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print(render_status(status))
    return EXIT_UNAVAILABLE if status.get("unavailable_shards") else 0


async def _status_over_grpc(url: str | None, username: str | None, password: str) -> dict[str, Any]:
    from ..client import Client, PermissionDenied, ShardgateError, Unauthenticated, Unavailable

    client = Client(url, username=username, password=password if username else None)
    try:
        await client.connect(CONNECT_TIMEOUT_S)
        return await client.admin.cluster_status()
    except Unavailable as exc:
        raise StatusError(f"cannot reach the broker at {client.target}: {exc.details}. Is it "
                          "running? Use --url HOST:PORT or SHARDGATE_URL.") from None
    except (PermissionDenied, Unauthenticated) as exc:
        raise StatusError(f"{exc}; give --username and --password of an admin user") from None
    except ShardgateError as exc:
        raise StatusError(str(exc)) from None
    finally:
        await client.close()


def _drain_over_http(base: str, node: str, cancel: bool, username: str | None,
                     password: str) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{base}/api/cluster/drain/{urllib.parse.quote(node, safe='')}", data=b"{}",
        method="DELETE" if cancel else "POST", headers={"Content-Type": "application/json"})
    return _ask_over_http(request, base, username, password)


def _status_over_http(base: str, username: str | None, password: str) -> dict[str, Any]:
    return _ask_over_http(urllib.request.Request(f"{base}/api/cluster"), base, username, password)


def _ask_over_http(request: urllib.request.Request, base: str, username: str | None,
                   password: str) -> dict[str, Any]:
    if username:
        token = base64.b64encode(f"{username}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            status: dict[str, Any] = json.loads(response.read())
            return status
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read() or b"{}").get("error", exc.reason)
        except ValueError:
            detail = exc.reason
        if exc.code == 401:
            detail = f"{detail}; give --username and --password of an admin user"
        raise StatusError(str(detail)) from None
    except OSError as exc:
        raise StatusError(f"cannot reach the admin API at {base}: {exc}") from None


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
    lines.extend(_render_replicated(status))
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


def _render_replicated(status: dict[str, Any]) -> list[str]:
    """The replicated shards' table, the under-replicated ones and the draining nodes."""
    lines: list[str] = []
    shards = status.get("replicated_shards", {})
    if shards:
        header = ("shard", "leader", "epoch", "replicas", "in sync", "high watermark", "lag")
        rows = []
        for name, shard in sorted(shards.items()):
            leader = shard["leader"] if shard.get("leader_live", True) else f"{shard['leader']} (down)"
            lag = shard.get("lag")
            rows.append((
                name, leader, str(shard["leader_epoch"]), ",".join(shard["replicas"]),
                ",".join(shard["isr"]),
                str(shard["high_watermark"]) if "high_watermark" in shard else "-",
                ",".join(f"{replica}:{records}" for replica, records in lag.items())
                if lag else "-",
            ))
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        lines.append("replicated shards (high watermark and lag: on the node that leads them):")
        for row in (header, *rows):
            lines.append("  " + "  ".join(cell.ljust(width)
                                          for cell, width in zip(row, widths, strict=True)).rstrip())
    under = status.get("under_replicated_shards", [])
    if under:
        lines.append(f"under-replicated: {', '.join(under)}")
    for node, holding in status.get("draining", {}).items():
        state = f"still holds {', '.join(holding)}" if holding else "holds no replica: it may be removed"
        lines.append(f"draining {node}: {state}")
    return lines
