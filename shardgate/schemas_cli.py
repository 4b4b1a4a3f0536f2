"""`shardgate schemas register|list|show`: the schema registry of streams over the gRPC Admin
service (as the other client commands: `--url`, `--json`, `--username`, `--password`).

    shardgate schemas register STREAM FILE --type json|avro [--compatibility MODE]
    shardgate schemas list
    shardgate schemas show STREAM
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .cli_client import _bind, _common, _json, _table
from .client import Client


async def _register(client: Client, args: argparse.Namespace) -> int:
    try:
        text = Path(args.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"shardgate: cannot read the schema file {args.file}: {exc}", file=sys.stderr)
        return 2
    try:
        json.loads(text)
    except ValueError as exc:
        print(f"shardgate: {args.file} is not JSON: {exc}", file=sys.stderr)
        return 2
    info = await client.admin.register_schema(args.stream, text, type=args.type,
                                              compatibility=args.compatibility)
    if args.json:
        _json(info, sys.stdout)
    else:
        print(f"stream {info.stream}: schema version {info.version} ({info.type}, "
              f"compatibility {info.compatibility})")
    return 0


async def _list(client: Client, args: argparse.Namespace) -> int:
    schemas = await client.admin.list_schemas()
    if args.json:
        _json(schemas, sys.stdout)
    else:
        _table([[s.stream, s.version, s.type, s.compatibility, s.rejected] for s in schemas],
               ["stream", "version", "type", "compatibility", "rejected"], sys.stdout)
    return 0


async def _show(client: Client, args: argparse.Namespace) -> int:
    versions = await client.admin.schemas(args.stream)
    if args.json:
        _json(versions, sys.stdout)
        return 0
    if not versions:
        print(f"stream {args.stream} has no registered schema")
        return 0
    for version in versions:
        print(f"version {version.version} ({version.type}, compatibility "
              f"{version.compatibility})")
        print(json.dumps(json.loads(version.definition), indent=2))
    return 0


def add_schemas_commands(subparsers: argparse._SubParsersAction) -> None:
    common = _common()
    schemas = subparsers.add_parser("schemas", help="register, list and show stream schemas")
    sub = schemas.add_subparsers(dest="schemas_command", required=True)
    register = sub.add_parser("register", parents=[common],
                              help="register a new schema version of a stream")
    register.add_argument("stream")
    register.add_argument("file", help="the schema: a JSON Schema or an Avro schema (.avsc)")
    register.add_argument("--type", choices=["json", "avro"], default="json",
                          help="the schema language (default json: JSON Schema)")
    register.add_argument("--compatibility", choices=["backward", "forward", "full", "none"],
                          default=None,
                          help="checked against the latest version (default: the stream's "
                               "mode so far, backward at first)")
    _bind(register, _register)
    _bind(sub.add_parser("list", parents=[common], help="the latest schema of each stream"),
          _list)
    show = sub.add_parser("show", parents=[common], help="every schema version of a stream")
    show.add_argument("stream")
    _bind(show, _show)
