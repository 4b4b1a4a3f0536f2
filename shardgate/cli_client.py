"""The client-side commands of the `shardgate` CLI, over the native gRPC API (the SDK).

`add_client_commands(subparsers)` adds `streams`, `pub`, `sub`, `subs`, `clients` and `info` to
the CLI's subparsers; each parsed namespace carries `client_handler(args) -> exit code`. It can
also run alone: `python -m shardgate.cli_client streams list`.

The broker is found with `--url HOST:PORT`, else `SHARDGATE_URL`, else 127.0.0.1:6650. Output
is a readable table by default and JSON with `--json`; errors go to stderr with exit code 1
(an unreachable broker included). This module must not import the broker itself.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from typing import Any, TextIO

from .client import Client, Position, ReceivedMessage, ShardgateError, Unavailable, schemas

CONNECT_TIMEOUT_S = 3.0
Handler = Callable[[Client, argparse.Namespace], Awaitable[int]]


# ------------------------------------------------------------------------------ output
def _table(rows: Sequence[Sequence[object]], headers: Sequence[str], out: TextIO) -> None:
    text = [[str(cell) for cell in row] for row in rows]
    widths = [max([len(h)] + [len(row[i]) for row in text]) for i, h in enumerate(headers)]
    print("  ".join(h.upper().ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip(),
          file=out)
    for row in text:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip(), file=out)


def _json(value: Any, out: TextIO) -> None:
    print(json.dumps(value, default=_plain, sort_keys=False), file=out)


def _plain(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _stream_row(s: Any) -> list[Any]:
    messages = str(sum(shard.next_offset for shard in s.shards))
    if any(shard.unavailable for shard in s.shards):
        messages += "+?"  # a cluster node that owns some of its shards did not answer
    return [s.name, s.mode.value, s.partitions, s.schema.value, messages,
            ",".join(s.routes) or "-"]


def _warn_unanswered(unanswered: dict[str, str], what: str) -> None:
    """A cluster listing's nodes that did not answer: said on stderr, never left out silently."""
    for node, reason in sorted(unanswered.items()):
        print(f"shardgate: node {node} did not answer ({reason}): its {what} are missing",
              file=sys.stderr)


def _payload_text(payload: bytes) -> str:
    return payload.decode("utf-8", "replace")


def message_json(message: ReceivedMessage) -> dict[str, Any]:
    """A received message as a JSON object: the payload as text when it is UTF-8, else base64."""
    out: dict[str, Any] = {
        "topic": message.topic, "stream": message.stream, "shard": message.shard,
        "offset": message.offset, "publish_time_ms": message.publish_time_ms,
        "headers": [[k, v] for k, v in message.headers],
    }
    try:
        out["payload"] = message.payload.decode("utf-8")
    except UnicodeDecodeError:
        out["payload_base64"] = base64.b64encode(message.payload).decode()
    if message.key is not None:
        out["key"] = message.key.decode("utf-8", "replace")
    for name in ("content_type", "reply_to"):
        if getattr(message, name):
            out[name] = getattr(message, name)
    if message.correlation_data:
        out["correlation_data"] = message.correlation_data.decode("utf-8", "replace")
    if message.producer_protocol:
        out["producer"] = f"{message.producer_protocol}:{message.producer_id}"
    if message.redelivery_count:
        out["redelivery_count"] = message.redelivery_count
    return out


# ------------------------------------------------------------------------------ handlers
async def _streams_create(client: Client, args: argparse.Namespace) -> int:
    info = await client.admin.create_stream(
        args.name, partitions=args.partitions, mode=args.mode, schema=args.schema,
        retention_ms=args.retention_ms, retention_bytes=args.retention_bytes,
        routes=args.route or None, replicas=args.replicas, min_insync_replicas=args.min_insync,
    )
    if args.json:
        _json(info, sys.stdout)
    else:
        print(f"created stream {info.name} ({info.mode.value}, {info.partitions} "
              f"partition{'' if info.partitions == 1 else 's'}, "
              f"schema {info.schema.value}, routes {', '.join(info.routes)})")
    return 0


async def _streams_list(client: Client, args: argparse.Namespace) -> int:
    streams = await client.admin.list_streams()
    if args.json:
        _json(streams, sys.stdout)
    else:
        _table([_stream_row(s) for s in streams],
               ["name", "mode", "partitions", "schema", "messages", "routes"], sys.stdout)
    _warn_unanswered(streams.unanswered, "shards' figures")
    return 0


async def _streams_describe(client: Client, args: argparse.Namespace) -> int:
    info = await client.admin.describe_stream(args.name)
    if args.json:
        _json(info, sys.stdout)
        return 0
    _table([_stream_row(info)], ["name", "mode", "partitions", "schema", "messages", "routes"],
           sys.stdout)
    print(file=sys.stdout)
    if any(shard.owner for shard in info.shards):  # a cluster: the node leading each shard
        _table([[shard.index, shard.owner,
                 "?" if shard.unavailable else shard.next_offset,
                 "no answer" if shard.unavailable else "available"] for shard in info.shards],
               ["shard", "owner", "next offset", "status"], sys.stdout)
    else:
        _table([[shard.index, shard.next_offset] for shard in info.shards],
               ["shard", "next offset"], sys.stdout)
    if info.subscriptions:
        print(file=sys.stdout)
        _table(sorted(info.subscriptions.items()), ["subscription", "lag"], sys.stdout)
    _warn_unanswered(info.unanswered, "shards' figures")
    return 0


async def _streams_delete(client: Client, args: argparse.Namespace) -> int:
    await client.admin.delete_stream(args.name)
    if args.json:
        _json({"deleted": args.name}, sys.stdout)
    else:
        print(f"deleted stream {args.name}")
    return 0


def _headers(values: Sequence[str]) -> list[tuple[str, str]]:
    headers = []
    for value in values:
        key, sep, text = value.partition("=")
        if not sep or not key:
            raise SystemExit(f"shardgate: --header expects KEY=VALUE, got {value!r}")
        headers.append((key, text))
    return headers


def _encode(text: str, args: argparse.Namespace) -> bytes:
    if args.int64:
        try:
            return schemas.encode_int64(int(text.strip()))
        except ValueError:
            raise SystemExit(f"shardgate: --int64 expects an integer, got {text!r}") from None
    return text.encode("utf-8")


async def _pub(client: Client, args: argparse.Namespace) -> int:
    producer = client.producer(args.producer_name or "shardgate-cli")
    fields: dict[str, Any] = {"headers": _headers(args.header or [])}
    if args.key is not None:
        fields["key"] = args.key
    if args.content_type:
        fields["content_type"] = args.content_type
    if args.stream:
        fields["stream"] = args.stream
    if args.ttl_ms:
        fields["ttl_ms"] = args.ttl_ms
    if args.message is not None:
        receipt = await producer.send(args.topic, _encode(args.message, args), **fields)
        if args.json:
            _json(receipt, sys.stdout)
        else:
            print(f"published to {receipt.stream} shard {receipt.shard} offset {receipt.offset}")
        await producer.close()
        return 0
    futures = []
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        futures.append(producer.send_nowait(args.topic, _encode(line.rstrip("\r\n"), args), **fields))
    results = await asyncio.gather(*futures, return_exceptions=True)
    await producer.close()
    failed = [r for r in results if isinstance(r, BaseException)]
    for error in failed[:10]:
        print(f"shardgate: {error}", file=sys.stderr)
    if args.json:
        for result in results:
            _json(result if not isinstance(result, BaseException) else {"error": str(result)},
                  sys.stdout)
    else:
        print(f"published {len(results) - len(failed)} messages"
              + (f", {len(failed)} refused" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


async def _sub(client: Client, args: argparse.Namespace) -> int:
    position = Position.earliest() if args.position == "earliest" else Position.latest()
    name = args.subscription or f"cli-{os.getpid()}"
    credit = max(1, min(args.count or 1000, 1000))
    if args.stream:
        consumer = client.consumer(name, stream=args.target, type=args.type, position=position,
                                   credit=credit, durable=args.durable,
                                   max_deliveries=args.max_deliveries)
    else:
        consumer = client.consumer(name, [args.target], type=args.type, position=position,
                                   credit=credit, durable=args.durable,
                                   max_deliveries=args.max_deliveries)
    await consumer.subscribe()
    received = 0
    try:
        while args.count is None or received < args.count:
            try:
                message = await consumer.receive(args.timeout)
            except TimeoutError:
                break
            if args.json:
                _json(message_json(message), sys.stdout)
            elif args.int64 and len(message.payload) == 8:
                print(message.int64(), file=sys.stdout)
            else:
                print(_payload_text(message.payload), file=sys.stdout)
            sys.stdout.flush()
            message.ack()
            received += 1
    finally:
        await consumer.close()
    return 0


async def _subs_list(client: Client, args: argparse.Namespace) -> int:
    subs = await client.admin.list_subscriptions()
    if args.json:
        _json(subs, sys.stdout)
    else:
        nodes = any(s.node for s in subs)  # a cluster: the node holding each
        _table([[s.name, s.type.value, s.protocol, "yes" if s.durable else "no",
                 ",".join(s.topic_filters), len(s.consumers), s.lag] + ([s.node] if nodes else [])
                for s in subs],
               ["name", "type", "protocol", "durable", "filters", "consumers", "lag"]
               + (["node"] if nodes else []), sys.stdout)
    _warn_unanswered(subs.unanswered, "subscriptions")
    return 0


async def _subs_describe(client: Client, args: argparse.Namespace) -> int:
    info = await client.admin.describe_subscription(args.name)
    if args.json:
        _json(info, sys.stdout)
        return 0
    _table([[info.name, info.type.value, info.protocol, "yes" if info.durable else "no",
             ",".join(info.topic_filters), info.lag, info.max_deliveries or "-"]],
           ["name", "type", "protocol", "durable", "filters", "lag", "max deliveries"], sys.stdout)
    print(file=sys.stdout)
    _table([[c.consumer_id, c.protocol, "yes" if c.active else "no", c.delivered, c.unacked,
             c.credit] for c in info.consumers],
           ["consumer", "protocol", "active", "delivered", "unacked", "credit"], sys.stdout)
    return 0


async def _subs_reset(client: Client, args: argparse.Namespace) -> int:
    if args.offset is not None:
        position = Position.at_offset(args.offset)
    elif args.time_ms is not None:
        position = Position.at_time(args.time_ms)
    else:
        position = Position.earliest() if args.position == "earliest" else Position.latest()
    info = await client.admin.reset_cursor(args.name, position)
    if args.json:
        _json(info, sys.stdout)
    else:
        print(f"reset subscription {info.name}" + (f" on node {info.node}" if info.node else ""))
    return 0


async def _subs_delete(client: Client, args: argparse.Namespace) -> int:
    await client.admin.delete_subscription(args.name)
    if args.json:
        _json({"deleted": args.name}, sys.stdout)
    else:
        print(f"deleted subscription {args.name}")
    return 0


async def _clients_list(client: Client, args: argparse.Namespace) -> int:
    clients = await client.admin.list_clients()
    if args.json:
        _json(clients, sys.stdout)
    else:
        nodes = any(c.node for c in clients)  # a cluster: the node each is connected to
        _table([[c.protocol, c.client_id, c.username or "-", c.remote, c.detail, c.messages_in,
                 c.messages_out] + ([c.node] if nodes else []) for c in clients],
               ["protocol", "client", "user", "remote", "detail", "in", "out"]
               + (["node"] if nodes else []), sys.stdout)
    _warn_unanswered(clients.unanswered, "clients")
    return 0


async def _info(client: Client, args: argparse.Namespace) -> int:
    info = await client.admin.broker_info()
    if args.json:
        _json(info, sys.stdout)
    else:
        rows: list[list[object]] = [["version", info.version], ["uptime (s)", f"{info.uptime_s:.0f}"],
                ["listeners", ", ".join(f"{n} {h}:{p}" for n, (h, p) in info.listeners.items())],
                ["messages in / out", f"{info.messages_in} / {info.messages_out}"],
                ["dropped", info.messages_dropped], ["streams", info.streams],
                ["subscriptions", info.subscriptions], ["clients", info.clients]]
        _table(rows, ["field", "value"], sys.stdout)
    return 0


# ------------------------------------------------------------------------------ running
async def _run(handler: Handler, args: argparse.Namespace) -> int:
    client = Client(args.url, username=args.username, password=args.password)
    try:
        await client.connect(CONNECT_TIMEOUT_S)
        return await handler(client, args)
    finally:
        await client.close()


def run_handler(handler: Handler, args: argparse.Namespace) -> int:
    """Run one client command; prints errors to stderr and returns the exit code."""
    try:
        return asyncio.run(_run(handler, args))
    except Unavailable as exc:
        url = Client(args.url).target
        print(f"shardgate: cannot reach the broker at {url}: {exc.details}. "
              "Is it running? Use --url HOST:PORT or SHARDGATE_URL.", file=sys.stderr)
        return 1
    except ShardgateError as exc:
        print(f"shardgate: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _bind(parser: argparse.ArgumentParser, handler: Handler) -> None:
    parser.set_defaults(client_handler=lambda args: run_handler(handler, args))


def _positive(text: str) -> int:
    """An argparse type: a whole number of at least 1 (a clear usage error, not a traceback)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help="broker address HOST:PORT (default $SHARDGATE_URL or "
                                      "127.0.0.1:6650)")
    common.add_argument("--json", action="store_true", help="JSON output for scripts")
    common.add_argument("--username", help="authenticate as this user")
    common.add_argument("--password", help="the user's password")
    return common


def add_client_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add the client commands to the `shardgate` CLI. Each parsed namespace has
    `client_handler`, a function of the namespace returning the exit code."""
    common = _common()

    streams = subparsers.add_parser("streams", help="create, list, describe, delete streams")
    streams_sub = streams.add_subparsers(dest="streams_command", required=True)
    create = streams_sub.add_parser("create", parents=[common], help="create a stream")
    create.add_argument("name")
    create.add_argument("--partitions", type=_positive, default=1, metavar="N",
                        help="shards of the stream (default 1)")
    create.add_argument("--mode", choices=["reliable", "non-reliable"], default=None,
                        help="default: the broker's default_stream_mode (reliable unless configured)")
    create.add_argument("--schema", choices=["bytes", "string", "int64", "json"], default="bytes",
                        help="payloads that do not fit are refused (default bytes: anything)")
    create.add_argument("--retention-ms", type=int,
                        help="journal retention by age (default: the broker's journal.retention_ms)")
    create.add_argument("--retention-bytes", type=int,
                        help="journal retention by size per shard (default: journal.retention_bytes)")
    create.add_argument("--replicas", type=_positive, default=None, metavar="N",
                        help="in a cluster, copies of each shard of a reliable stream "
                             "(default: [cluster] default_replicas, 3, capped by the live "
                             "nodes; a single node keeps one)")
    create.add_argument("--min-insync", type=_positive, default=None, metavar="N",
                        help="replicas that must hold a message before it is acknowledged "
                             "(default: [cluster] default_min_insync_replicas, 2, at most "
                             "the replicas)")
    create.add_argument("--route", action="append", metavar="FILTER",
                        help="topic filter routed to the stream (repeatable; default NAME and NAME/#)")
    _bind(create, _streams_create)
    _bind(streams_sub.add_parser("list", parents=[common], help="list streams"), _streams_list)
    describe = streams_sub.add_parser("describe", parents=[common], help="shards and offsets")
    describe.add_argument("name")
    _bind(describe, _streams_describe)
    delete = streams_sub.add_parser("delete", parents=[common], help="delete a stream")
    delete.add_argument("name")
    _bind(delete, _streams_delete)

    pub = subparsers.add_parser("pub", parents=[common],
                                help="publish MESSAGE, or one message per line of stdin")
    pub.add_argument("topic")
    pub.add_argument("message", nargs="?", help="the payload (default: one message per stdin line)")
    pub.add_argument("--key", help="partition key: messages of one key go to one shard, in order")
    pub.add_argument("--header", action="append", metavar="K=V", help="a header (repeatable)")
    pub.add_argument("--content-type")
    pub.add_argument("--stream", help="the stream the topic must resolve to")
    pub.add_argument("--ttl-ms", type=int, help="expire the message this long after publishing")
    pub.add_argument("--int64", action="store_true",
                     help="send each message as an 8-byte big-endian integer (int64 streams)")
    pub.add_argument("--producer-name", help="producer id the message carries "
                                             "(default shardgate-cli)")
    _bind(pub, _pub)

    sub = subparsers.add_parser("sub", parents=[common], help="consume and print messages")
    sub.add_argument("target", metavar="TOPIC_OR_FILTER",
                     help="a topic filter (a stream name with --stream)")
    sub.add_argument("--stream", action="store_true", help="TOPIC_OR_FILTER names a stream")
    sub.add_argument("--subscription", "-s", default=None,
                     help="subscription name (default: a new one for this command)")
    sub.add_argument("--type", choices=["exclusive", "shared", "failover"], default="exclusive",
                     help="subscription type (default exclusive)")
    sub.add_argument("--position", choices=["earliest", "latest"], default="latest",
                     help="where to start: earliest replays what the streams hold (archive, "
                          "journal) before the live tail")
    sub.add_argument("--durable", action="store_true",
                     help="keep the subscription and its position after this command exits; "
                          "the next `sub` with the same --subscription resumes from there")
    sub.add_argument("--max-deliveries", type=int, default=0, metavar="N",
                     help="with --durable: dead-letter a message to $dlq/<subscription> after N "
                     "deliveries (default: the broker's grpc.max_deliveries)")
    sub.add_argument("--count", "-n", type=int, help="exit after N messages")
    sub.add_argument("--timeout", type=float, help="exit after this many idle seconds")
    sub.add_argument("--int64", action="store_true", help="print 8-byte payloads as integers")
    _bind(sub, _sub)

    subs = subparsers.add_parser("subs", help="list, describe, reset, delete subscriptions")
    subs_sub = subs.add_subparsers(dest="subs_command", required=True)
    _bind(subs_sub.add_parser("list", parents=[common], help="list subscriptions"), _subs_list)
    sdescribe = subs_sub.add_parser("describe", parents=[common], help="filters and consumers")
    sdescribe.add_argument("name")
    _bind(sdescribe, _subs_describe)
    reset = subs_sub.add_parser("reset", parents=[common], help="move a durable cursor")
    reset.add_argument("name")
    reset.add_argument("--position", choices=["earliest", "latest"], default="earliest",
                       help="default earliest (unless --offset or --time-ms)")
    reset.add_argument("--offset", type=int, help="move every shard's cursor to this offset")
    reset.add_argument("--time-ms", type=int,
                       help="move to the first message published at or after this epoch ms")
    _bind(reset, _subs_reset)
    sdelete = subs_sub.add_parser("delete", parents=[common], help="delete a subscription")
    sdelete.add_argument("name")
    _bind(sdelete, _subs_delete)

    clients = subparsers.add_parser("clients", parents=[common],
                                    help="connected clients of every protocol (list)")
    clients_sub = clients.add_subparsers(dest="clients_command")
    _bind(clients, _clients_list)  # `shardgate clients` alone lists
    _bind(clients_sub.add_parser("list", parents=[common], help="list clients"), _clients_list)

    _bind(subparsers.add_parser("info", parents=[common], help="broker version, listeners, stats"),
          _info)


def dispatch(args: argparse.Namespace) -> int:
    """Run the client command of a parsed namespace (what `shardgate.cli` calls)."""
    return int(args.client_handler(args))


def main_client(argv: list[str] | None = None) -> None:
    """`python -m shardgate.cli_client ...`: the client commands alone."""
    parser = argparse.ArgumentParser(prog="shardgate", description="Shardgate client commands")
    add_client_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    sys.exit(dispatch(args))


if __name__ == "__main__":
    main_client()
