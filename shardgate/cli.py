"""The `shardgate` command line."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from .config import Config, ConfigError, check_cluster_archive, check_config, load_config
from .storage.allocators import tune_malloc


def _configure_logging(config: Config) -> None:
    level = getattr(logging, config.log_level.upper(), logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    if config.log_json:
        from .logs import JsonFormatter

        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    from .logs import quiet_third_party_loggers

    quiet_third_party_loggers(level)


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="start the broker")
    serve.add_argument("--config", type=Path, default=os.environ.get("SHARDGATE_CONFIG") or None,
                       help="TOML configuration file (default $SHARDGATE_CONFIG)")
    serve.add_argument("--data-dir", type=Path, help="data directory (default ./shardgate-data)")
    serve.add_argument("--host", help="address the client listeners bind (default 127.0.0.1; "
                       "the admin API binds listeners.http_host)")
    for name, default in (("mqtt", 1883), ("mqtt-ws", 8083), ("mqtts", 0), ("mqtt-wss", 0),
                          ("amqp", 5672), ("amqps", 0), ("grpc", 6650), ("grpcs", 0),
                          ("http", 8080)):
        serve.add_argument(f"--{name}-port", type=int, metavar="N",
                           help=f"{name} listener port, 0 turns it off (default {default})")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--cluster", metavar="URL",
                       help="join a cluster coordinated by etcd at URL (comma-separated endpoints)")
    serve.add_argument("--node-id", help="this node's id in the cluster (default: the host name)")
    serve.add_argument("--cluster-port", type=int, metavar="N",
                       help="internal node-to-node listener port (default 7001, 0 picks one)")
    serve.add_argument("--cluster-secret-file", metavar="PATH",
                       help="file holding the cluster's shared secret, the same on every node "
                       "(cluster.secret_file)")
    serve.add_argument("--insecure-cluster", action="store_true", default=None,
                       help="run the cluster port without node authentication (cluster.insecure)")
    serve.add_argument("--archive-url", metavar="URL",
                       help="where reliable streams are archived as Parquet (archive.url; in a "
                       "cluster, the same URL on every node)")
    serve.add_argument("--port-file", type=Path,
                       help="write the bound listener ports as JSON to this file once started")


def _raise_descriptor_limit() -> None:
    """Every client connection takes a descriptor: take the hard limit as the soft one (as Go's
    runtime does), so the distribution's default of 1,024 does not cap the clients."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError):
        pass  # not POSIX, or not allowed: keep the limit given


async def _serve(config: Config, port_file: Path | None) -> int:
    from .app import Shardgate

    try:
        import uvloop  # noqa: F401
    except ImportError:
        pass
    app = Shardgate(config)
    try:
        await app.start()
    except ConfigError as exc:
        print(f"shardgate: {exc}", file=sys.stderr)
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    if port_file is not None:
        ports = {name: listener.port for name, listener in app.listeners.items()}
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(ports))
        tmp.replace(port_file)
    # Long-lived broker state need not be rescanned by every collection, and the message path
    # allocates many short-lived objects: freeze what start-up built, collect less often.
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    logging.getLogger("shardgate").info("shardgate started (data dir %s)", config.data_dir)
    await stop.wait()
    logger = logging.getLogger("shardgate")
    logger.info("shutting down")
    try:
        await asyncio.wait_for(app.stop(), config.shutdown_timeout_s)
    except TimeoutError:
        logger.error("graceful stop took longer than shutdown_timeout_s = %s; exiting now "
                     "(acknowledged messages are in the journal)", config.shutdown_timeout_s)
        return 1
    return 0


def _config_parser(sub: argparse._SubParsersAction) -> None:
    config = sub.add_parser("config", help="check a configuration file without starting")
    config.add_argument("action", choices=["check"])
    config.add_argument("file", nargs="?", type=Path, default=os.environ.get("SHARDGATE_CONFIG") or None,
                        help="TOML configuration file (default $SHARDGATE_CONFIG; none: the "
                        "defaults and SHARDGATE_* variables)")


def _config_command(args: argparse.Namespace) -> int:
    """Every setting of the file and the environment, checked as `serve` checks them."""
    try:
        config = load_config(args.file)
        check_config(config)
        check_cluster_archive(config)
    except ConfigError as exc:
        print(f"shardgate: {exc}", file=sys.stderr)
        return 2
    where = args.file or "defaults and environment"
    print(f"{where}: configuration is valid ({len(config.streams)} streams, "
          f"{len(config.bridges) + len(config.amqp_bridges)} bridges, data dir {config.data_dir})")
    return 0


def _archive_parser(sub: argparse._SubParsersAction) -> None:
    archive = sub.add_parser("archive", help="Parquet archive status and flush (admin HTTP API)")
    archive.add_argument("action", choices=["status", "flush"])
    archive.add_argument("--http-url", default=None,
                         help="admin API (default $SHARDGATE_HTTP_URL or http://127.0.0.1:8080)")
    archive.add_argument("--json", action="store_true", help="print JSON")
    archive.add_argument("--username", default=None,
                         help="admin user, when the broker has users (default $SHARDGATE_USERNAME)")
    archive.add_argument("--password", default=None,
                         help="its password (default $SHARDGATE_PASSWORD)")


def _archive_command(args: argparse.Namespace) -> int:
    import base64
    import os
    import urllib.error
    import urllib.request

    base = (args.http_url or os.environ.get("SHARDGATE_HTTP_URL") or "http://127.0.0.1:8080").rstrip("/")
    if args.action == "flush":
        # (a change: the admin API wants a request a cross-site page could not send)
        request = urllib.request.Request(f"{base}/api/archive/flush", method="POST", data=b"{}",
                                         headers={"Content-Type": "application/json"})
    else:
        request = urllib.request.Request(f"{base}/api/archive")
    username = args.username or os.environ.get("SHARDGATE_USERNAME")
    password = args.password or os.environ.get("SHARDGATE_PASSWORD") or ""
    if username:
        token = base64.b64encode(f"{username}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=150) as response:
            status = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read() or b"{}").get("error", exc.reason)
        except ValueError:
            detail = exc.reason
        if exc.code == 401:
            detail = f"{detail}; give --username and --password of an admin user"
        print(f"shardgate: {detail}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"shardgate: cannot reach the admin API at {base}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    if not status.get("enabled", True):
        print("archiving is not enabled")
        return 0
    header = ("stream", "shard", "journal", "archived up to", "lag", "files", "bytes")
    rows = [
        (s["stream"], str(s["shard"]), f"{s['journal_low']}..{s['journal_next']}",
         str(s["archived_up_to"]), str(s["lag_records"]), str(s["files"]), str(s["bytes"]))
        for s in status.get("shards", [])
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    for row in (header, *rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    return 0


def _add_client_commands(sub: Any) -> None:
    """Every command but `serve`."""
    from .cli_client import add_client_commands
    from .cluster.cli import add_cluster_commands
    from .health_cli import add_health_command
    from .schemas_cli import add_schemas_commands
    from .security.users_cli import add_users_commands

    add_client_commands(sub)
    add_schemas_commands(sub)
    _archive_parser(sub)
    _config_parser(sub)
    add_health_command(sub)
    add_users_commands(sub)
    add_cluster_commands(sub)


def main(argv: list[str] | None = None) -> None:
    from . import __version__

    parser = argparse.ArgumentParser(prog="shardgate", description="Shardgate message gateway")
    parser.add_argument("--version", action="version", version=f"shardgate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    if (sys.argv[1:] if argv is None else argv)[:1] != ["serve"]:
        # The other commands, for any command but `serve`: the broker uses none of them, and
        # their modules (the SDK, urllib) would add about 0.08 CPU-s to each start.
        _add_client_commands(sub)
    args = parser.parse_args(argv)
    if getattr(args, "cluster_handler", None) is not None:
        sys.exit(args.cluster_handler(args))
    if getattr(args, "health_handler", None) is not None:
        sys.exit(args.health_handler(args))
    if getattr(args, "users_handler", None) is not None:
        sys.exit(args.users_handler(args))
    if args.command == "archive":
        sys.exit(_archive_command(args))
    if args.command == "config":
        sys.exit(_config_command(args))
    if getattr(args, "client_handler", None) is not None:
        from .cli_client import dispatch

        sys.exit(dispatch(args))
    if args.command == "serve":
        overrides: dict[tuple[str, ...], Any] = {
            ("data_dir",): args.data_dir,
            ("listeners", "host"): args.host,
            ("listeners", "mqtt_port"): args.mqtt_port,
            ("listeners", "mqtt_ws_port"): args.mqtt_ws_port,
            ("listeners", "mqtts_port"): args.mqtts_port,
            ("listeners", "mqtt_wss_port"): args.mqtt_wss_port,
            ("listeners", "amqp_port"): args.amqp_port,
            ("listeners", "amqps_port"): args.amqps_port,
            ("listeners", "grpc_port"): args.grpc_port,
            ("listeners", "grpcs_port"): args.grpcs_port,
            ("listeners", "http_port"): args.http_port,
            ("log_level",): args.log_level,
            ("cluster", "etcd"): args.cluster,
            ("cluster", "node_id"): args.node_id,
            ("cluster", "port"): args.cluster_port,
            ("cluster", "secret_file"): args.cluster_secret_file,
            ("cluster", "insecure"): args.insecure_cluster,
            ("archive", "url"): args.archive_url,
        }
        try:
            config = load_config(args.config, overrides=overrides)
            check_config(config)
        except ConfigError as exc:
            print(f"shardgate: {exc}", file=sys.stderr)
            sys.exit(2)
        _configure_logging(config)
        tune_malloc()
        _raise_descriptor_limit()
        try:
            import uvloop

            code = uvloop.run(_serve(config, args.port_file))
        except ImportError:
            code = asyncio.run(_serve(config, args.port_file))
        sys.exit(code)
