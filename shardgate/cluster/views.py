"""Cluster-wide listings: the streams, subscriptions and clients a user reads as "the broker",
the same whichever node is asked.

Each node answers for what it holds (the shards it leads, its subscriptions, its connected
clients) on the cluster port (`LocalView`, a signed call as every call between nodes,
`link_auth.py`); the node that was asked asks every registered node at once, then merges:

- streams: each shard's figures come from the node that leads it (the placement in etcd), with
  that node as the shard's `owner`; a shard whose owner did not answer is `unavailable` (its
  offsets unknown); durable cursors on a shard come from every node that holds one, their lag
  measured against the owner's end of the shard;
- subscriptions: one row per cluster subscription. A name held on several nodes with the same
  protocol and type is one subscription spread over them (an MQTT share group has members on
  every node): its row lists them in `node` (comma-separated) and, in the admin HTTP shape,
  `nodes`, each consumer with its `node`; its counts are the sum of the nodes';
- clients: every node's rows, each with its `node`;
- nodes: every node's resource row, and a row naming each node that did not answer.

A node that does not answer within `ANSWER_TIMEOUT_S` (or is registered but not live) is
named in the listing's `unanswered` with the reason, never silently left out.

The same service carries an administrator's actions on a subscription (`LocalAction`: purge,
move the cursors): a subscription lives on one node at a time (its holder: the MQTT session's
node, an AMQP queue's home, a gRPC durable subscription's holder), so the asked node acts if it
holds it and otherwise asks every live node, and the node that held it acts and is named in
the answer (`act`). Two shapes are
merged alike: the admin HTTP API's JSON (`shardgate.admin.admin_http`) and the gRPC Admin
messages (as dicts, `google.protobuf.json_format`). This is an operator's call, not a hot
path: one unary call per node per listing.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from .link_auth import NodeCredentials, cluster_channel
from .membership import ClusterView

log = logging.getLogger(__name__)

SERVICE = "shardgate.cluster.v1.ClusterViews"
LOCAL_VIEW = "LocalView"
ANSWER_TIMEOUT_S = 5.0
# the listings a node answers: `streams`, `stream` (one, with cursors: `name`),
# `subscriptions`, `clients`; each in the `json` (admin HTTP) or `proto` (gRPC Admin) shape;
# and `nodes` (each node's resources: memory, descriptors, disk, alarms, connections), json only
KINDS = frozenset({"streams", "stream", "subscriptions", "clients", "nodes"})
SHAPES = frozenset({"json", "proto"})
# node-local streams ($SYS): every node has its own, never placed; the asked node's is shown
LOCAL_STREAMS = frozenset({"sys"})

LocalView = Callable[[str, str, dict[str, Any]], Any]
"""(kind, shape, arguments) -> this node's listing, JSON-able; raises LookupError for a
stream or subscription it does not have."""

LOCAL_ACTION = "LocalAction"
# the actions a node takes on a subscription it holds: `purge` (admin HTTP), `cursor` (admin
# HTTP, a `cursor_position` body), `reset` (gRPC Admin ResetCursor, its position as a dict)
ACTIONS = frozenset({"purge", "cursor", "reset"})

LocalAction = Callable[[str, dict[str, Any]], Any]
"""(action, arguments) -> what this node did, JSON-able; raises LookupError when it does not
hold the subscription and `Refused` when it holds it but cannot act on it."""


class Refused(Exception):
    """The node holding the subscription refuses the action (a live-only subscription has no
    cursor to move); the message says why."""


class Unreached(Exception):
    """No node that answered holds the subscription, and some nodes did not answer."""


@dataclass(slots=True)
class Acted:
    """What the node that held the subscription did."""

    node: str
    value: Any


@dataclass(slots=True)
class Answers:
    """Each node's listing (node id -> its JSON value), and the nodes that gave none."""

    by_node: dict[str, Any] = field(default_factory=dict)
    unanswered: dict[str, str] = field(default_factory=dict)

    def unanswered_list(self) -> list[dict[str, str]]:
        return [{"node": node, "reason": reason} for node, reason in sorted(self.unanswered.items())]


class ClusterViews:
    """Both ends of `LocalView`: `handler()` serves this node's listings to its peers;
    `gather()` asks every node (this one directly) and the merge functions combine them."""

    def __init__(self, view: ClusterView, credentials: NodeCredentials, local: LocalView,
                 act: LocalAction | None = None) -> None:
        self.view = view
        self.credentials = credentials
        self.local = local
        self.local_action = act
        self._channels: dict[str, grpc.aio.Channel] = {}

    @property
    def node_id(self) -> str:
        return self.view.node_id

    # ------------------------------------------------------------ serving
    def handler(self) -> grpc.GenericRpcHandler:
        async def local_view(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            try:
                asked = json.loads(request)
                kind, shape = str(asked["kind"]), str(asked["shape"])
                arguments = dict(asked.get("arguments") or {})
            except (ValueError, KeyError, TypeError):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a LocalView request is "
                                    "JSON with kind, shape and arguments")
                raise AssertionError("unreachable") from None
            if kind not in KINDS or shape not in SHAPES:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"no listing {kind!r} in shape {shape!r}")
            try:
                value = self.local(kind, shape, arguments)
            except LookupError as exc:
                await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            return json.dumps(value, separators=(",", ":"), default=str).encode()

        async def local_action(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            try:
                asked = json.loads(request)
                action = str(asked["action"])
                arguments = dict(asked.get("arguments") or {})
            except (ValueError, KeyError, TypeError):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a LocalAction request is "
                                    "JSON with action and arguments")
                raise AssertionError("unreachable") from None
            if action not in ACTIONS or self.local_action is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"no action {action!r}")
            assert self.local_action is not None
            try:
                value = self.local_action(action, arguments)
            except LookupError as exc:
                await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            except Refused as exc:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            return json.dumps(value, separators=(",", ":"), default=str).encode()

        return grpc.method_handlers_generic_handler(SERVICE, {
            LOCAL_VIEW: grpc.unary_unary_rpc_method_handler(local_view),
            LOCAL_ACTION: grpc.unary_unary_rpc_method_handler(local_action),
        })

    # ------------------------------------------------------------ asking
    async def gather(self, kind: str, shape: str, arguments: Mapping[str, Any] | None = None,
                     timeout: float = ANSWER_TIMEOUT_S) -> Answers:
        """Every registered node's listing; this node's own is computed here. A node that
        does not have the named stream answers nothing for it (not an error)."""
        args = dict(arguments or {})
        answers = Answers()
        try:
            answers.by_node[self.node_id] = self.local(kind, shape, args)
        except LookupError:
            pass  # not here (a stream another node created a moment ago): the others say
        live = self.view.nodes()
        # also those whose lease lapsed: still registered, or still leading shards
        known = set(getattr(self.view, "registrations", {})) | set(live)
        known |= {placed.leader for shards in getattr(self.view, "placement", {}).values()
                  for placed in shards}
        peers = sorted(node for node in known if node != self.node_id)
        request = json.dumps({"kind": kind, "shape": shape, "arguments": args}).encode()

        async def ask(node: str) -> None:
            info = live.get(node)
            if info is None:
                answers.unanswered[node] = "not live (its lease expired)"
                return
            call = self._channel(info.cluster_address).unary_unary(f"/{SERVICE}/{LOCAL_VIEW}")
            try:
                answers.by_node[node] = json.loads(await call(request, timeout=timeout))
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.NOT_FOUND:
                    return  # it has no such thing: nothing to add
                answers.unanswered[node] = f"{exc.code().name}: {exc.details()}"
            except ValueError as exc:
                answers.unanswered[node] = f"an answer that is not JSON: {exc}"

        await asyncio.gather(*(ask(node) for node in peers))
        if answers.unanswered:
            log.warning("cluster-wide %s listing without node(s) %s", kind,
                        ", ".join(f"{node} ({reason})" for node, reason in answers.unanswered.items()))
        return answers

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = cluster_channel(address, self.credentials, [])
            self._channels[address] = channel
        return channel

    async def act(self, action: str, arguments: Mapping[str, Any],
                  timeout: float = ANSWER_TIMEOUT_S) -> list[Acted]:
        """Take `action` on the node(s) holding the subscription `arguments["name"]`: here if
        it is held here, else on every live node that holds it (one, but for a moment of
        handover). Raises LookupError when no node holds it, `Refused` when its holder
        refuses, and `Unreached` when none that answered holds it and some did not answer."""
        if self.local_action is None:
            raise Refused("this node takes no action on subscriptions")
        args = dict(arguments)
        try:
            return [Acted(self.node_id, self.local_action(action, args))]
        except LookupError:
            pass
        live = self.view.nodes()
        request = json.dumps({"action": action, "arguments": args}).encode()
        acted: list[Acted] = []
        refused: list[str] = []
        unanswered: dict[str, str] = {}

        async def ask(node: str, address: str) -> None:
            call = self._channel(address).unary_unary(f"/{SERVICE}/{LOCAL_ACTION}")
            try:
                acted.append(Acted(node, json.loads(await call(request, timeout=timeout))))
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.NOT_FOUND:
                    return
                if exc.code() is grpc.StatusCode.FAILED_PRECONDITION:
                    refused.append(str(exc.details()))
                    return
                unanswered[node] = f"{exc.code().name}: {exc.details()}"
            except ValueError as exc:
                unanswered[node] = f"an answer that is not JSON: {exc}"

        await asyncio.gather(*(ask(node, info.cluster_address) for node, info in sorted(live.items())
                               if node != self.node_id))
        acted.sort(key=lambda done: done.node)
        if acted:
            return acted
        name = args.get("name", "")
        if refused:
            raise Refused(refused[0])
        if unanswered:
            raise Unreached(f"no node that answered holds subscription {name!r}; not answered: "
                            + ", ".join(f"{node} ({reason})" for node, reason in sorted(unanswered.items())))
        raise LookupError(f"subscription {name!r} does not exist on any node")

    def owner(self, stream: str, shard: int) -> str:
        """The node leading the shard, as placed in etcd ("" while it is unassigned)."""
        assignment = self.view.leader(stream, shard)
        return "" if assignment is None else assignment.leader

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close(grace=None)


# ---------------------------------------------------------------- merging
def _int(value: Any) -> int:
    """A count as either shape carries it (the proto JSON writes 64-bit integers as text)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


Owner = Callable[[str, int], str]


def merge_stream(name: str, answers: Answers, owner_of: Owner, here: str) -> dict[str, Any] | None:
    """One stream, cluster-wide: its definition as this node has it (the catalog is the same on
    every node), each shard from its owner, cursors from every node. None if no node has it."""
    mine = answers.by_node.get(here)
    base = mine if mine is not None else next(iter(answers.by_node.values()), None)
    if base is None:
        return None
    merged = dict(base)
    if name in LOCAL_STREAMS:
        merged["shards"] = [dict(shard, owner=here) for shard in base.get("shards", [])]
        return merged
    shards = []
    for shard in base.get("shards", []):
        index = _int(shard.get("index"))
        owner = owner_of(name, index)
        source = answers.by_node.get(owner)
        theirs = None
        if source is not None:
            theirs = next((s for s in source.get("shards", []) if _int(s.get("index")) == index), None)
        if theirs is None:
            shards.append({"index": index, "next_offset": None if "messages" in base else 0,
                           "owner": owner, "unavailable": True})
            continue
        shard_view = dict(theirs, owner=owner, unavailable=False)
        if "cursors" in base:  # detail: every node's cursors on this shard, lag from its end
            end = _int(theirs.get("next_offset"))
            cursors = []
            for node, answer in sorted(answers.by_node.items()):
                for other in answer.get("shards", []):
                    if _int(other.get("index")) != index:
                        continue
                    for cursor in other.get("cursors", []):
                        cursors.append(dict(cursor, node=node,
                                            lag=max(0, end - _int(cursor.get("floor")))))
            shard_view["cursors"] = cursors
        shards.append(shard_view)
    merged["shards"] = shards
    if "messages" in base:  # the admin HTTP shape: the sum of what the shards hold
        merged["messages"] = sum(_int(s.get("next_offset")) for s in shards)
        merged["complete"] = not any(s.get("unavailable") for s in shards)
    return merged


def merge_streams(answers: Answers, owner_of: Owner, here: str) -> list[dict[str, Any]]:
    """Every stream any node listed, cluster-wide (see `merge_stream`), by name."""
    names = sorted({stream["name"] for listing in answers.by_node.values() for stream in listing})
    merged = []
    for name in names:
        per_node = Answers({node: next(s for s in listing if s["name"] == name)
                            for node, listing in answers.by_node.items()
                            if any(s["name"] == name for s in listing)}, answers.unanswered)
        stream = merge_stream(name, per_node, owner_of, here)
        if stream is not None:
            merged.append(stream)
    return merged


def merge_rows(answers: Answers, sort_key: Callable[[dict[str, Any]], Any]) -> list[dict[str, Any]]:
    """Every node's rows (subscriptions, clients), each with its `node`."""
    rows = [dict(row, node=node) for node, listing in answers.by_node.items() for row in listing]
    rows.sort(key=lambda row: (sort_key(row), row["node"]))
    return rows


def merge_subscriptions(answers: Answers, shape: str) -> list[dict[str, Any]]:
    """One row per subscription, cluster-wide (module docstring): the rows of one name, protocol
    and type on several nodes merged, their consumers together, their counts summed."""
    merged: dict[tuple[str, str, str], dict[str, Any]] = {}
    out: list[dict[str, Any]] = []
    json_shape = shape == "json"
    for row in merge_rows(answers, lambda row: str(row.get("name", ""))):
        node = str(row["node"])
        key = (str(row.get("name", "")), str(row.get("protocol", "")), str(row.get("type", "")))
        consumers = [dict(c, node=node) if json_shape else dict(c) for c in row.get("consumers", [])]
        first = merged.get(key)
        if first is None:
            first = dict(row, consumers=consumers)
            if json_shape:
                first["nodes"] = [node]
            merged[key] = first
            out.append(first)
            continue
        first["node"] = f"{first['node']},{node}"
        if json_shape:
            first["nodes"].append(node)
        first["consumers"] = first["consumers"] + consumers
        first["durable"] = bool(first.get("durable")) or bool(row.get("durable"))
        for count in ("lag", "inflight", "queued"):
            if count in first or count in row:
                first[count] = _int(first.get(count)) + _int(row.get(count))
        for filters in ("filters", "topic_filters"):
            if filters in row:
                have = list(first.get(filters, []))
                first[filters] = have + [f for f in row[filters] if f not in have]
    return out


def merge_nodes(answers: Answers) -> list[dict[str, Any]]:
    """The node-resource table: each node's row, and one naming each node that did not answer
    (`unanswered`: why), by node id."""
    rows = merge_rows(answers, lambda row: "")
    rows += [{"node": node, "unanswered": reason} for node, reason in answers.unanswered.items()]
    rows.sort(key=lambda row: str(row["node"]))
    return rows


async def listing(views: ClusterViews, kind: str, shape: str,
                  arguments: Mapping[str, Any] | None = None) -> tuple[Any, list[dict[str, str]]]:
    """The cluster-wide listing of `kind` and the nodes that did not answer. `stream` raises
    LookupError when no node has the stream."""
    answers = await views.gather(kind, shape, arguments)
    here = views.node_id
    if kind == "streams":
        return merge_streams(answers, views.owner, here), answers.unanswered_list()
    if kind == "stream":
        name = str((arguments or {})["name"])
        stream = merge_stream(name, answers, views.owner, here)
        if stream is None:
            raise LookupError(f"stream {name!r} does not exist")
        return stream, answers.unanswered_list()
    if kind == "subscriptions":
        return merge_subscriptions(answers, shape), answers.unanswered_list()
    if kind == "nodes":
        return merge_nodes(answers), answers.unanswered_list()
    return merge_rows(answers, lambda row: (str(row.get("protocol", "")),
                                            str(row.get("client_id", "")))), answers.unanswered_list()


Listing = Callable[[str, str, Mapping[str, Any] | None], Awaitable[tuple[Any, list[dict[str, str]]]]]
"""What the admin surfaces are handed in cluster mode: `listing` bound to the node's views."""


__all__ = ["ANSWER_TIMEOUT_S", "Acted", "Answers", "ClusterViews", "Listing", "LocalAction", "Owner",
           "Refused", "Unreached", "listing", "merge_nodes", "merge_rows", "merge_stream",
           "merge_streams", "merge_subscriptions"]
