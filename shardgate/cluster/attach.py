"""Joining a `Shardgate` app to its cluster: the only place that knows both the app and etcd.

`connect()` runs first in `Shardgate.start()` (fail fast: etcd unreachable, node id taken),
`share_catalog()` once the broker exists (streams and routes of etcd into the broker, this
node's configured streams into etcd), `assemble()` next: the cluster's parts, which the
composition root hands to the Edge and the protocols as it builds them (their typed ports;
nothing here sets an attribute of a core or protocol object), and `join()` once the listeners
are bound (registration, keep-alive, watch, controller; the parts take part from then on).
Catalog changes seen later in etcd are applied to the broker as they come.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import keys
from .control import ClusterNode, ClusterStartError
from .etcd import EtcdError
from .link_auth import secret_matches
from .replica_status import shard_status

if TYPE_CHECKING:
    from ..app import Shardgate
    from ..core.streams import StreamConfig
    from .amqp_topology import SharedExchanges
    from .data_plane import DataPlane
    from .durable_consumers import DurableConsumers
    from .durables import DurableHandover
    from .floors import CursorFloors
    from .peer_link import PeerLink
    from .replicated_shards import ReplicatedShards
    from .session_cursors import CursorPlacer
    from .state_rpc import StateRpc
    from .state_writer import StateWriter

log = logging.getLogger(__name__)

# Streams each node has for itself and which are never placed (node-local $SYS topics).
LOCAL_STREAMS = frozenset({"sys"})


def stream_definition(config: StreamConfig) -> dict[str, Any]:
    return {
        "mode": str(config.mode), "partitions": config.partitions, "schema": str(config.schema),
        "retention_ms": config.retention_ms, "retention_bytes": config.retention_bytes,
        "replicas": config.replicas, "min_insync_replicas": config.min_insync_replicas,
    }


def stream_config(name: str, definition: dict[str, Any]) -> StreamConfig:
    from ..core.streams import StreamConfig

    return StreamConfig(
        name, mode=definition.get("mode", "reliable"), partitions=int(definition.get("partitions", 1)),
        schema=definition.get("schema", "bytes"), retention_ms=definition.get("retention_ms"),
        retention_bytes=definition.get("retention_bytes"),
        replicas=definition.get("replicas"), min_insync_replicas=definition.get("min_insync_replicas"),
    )


async def connect(app: Shardgate) -> ClusterNode:
    settings = app.config.cluster
    node_id = settings.node_id or socket.gethostname()
    node = ClusterNode(settings, node_id, app.config.data_dir)
    await node.connect()
    try:
        view = await node.read_catalog()
    except EtcdError as exc:
        raise ClusterStartError(f"cannot read the cluster state from etcd: {exc}") from None
    existing = view.registrations.get(node_id)
    if existing is not None and existing.instance != node.instance:
        await node.disconnect()
        raise ClusterStartError(
            f"node id {node_id!r} is already in use by a running node (internal address "
            f"{existing.cluster_address}); give this node another --node-id")
    for other in sorted(view.registrations.values(), key=lambda registration: registration.node_id):
        if other.node_id != node_id and not secret_matches(node.credentials.secret, other.secret_check):
            await node.disconnect()
            raise ClusterStartError(
                f"running node {other.node_id!r} runs a version without node authentication: "
                "stop it first" if not other.secret_check else
                f"running node {other.node_id!r} has another cluster secret than this node: "
                "they could not link; give every node the same cluster.secret_file")
    if not node.credentials.authenticated:
        log.warning("cluster: NODE AUTHENTICATION IS OFF (cluster.insecure): any process that "
                    "reaches the cluster port can join as a node, read and inject messages; "
                    "set cluster.secret_file on every node")
    return node


async def share_catalog(app: Shardgate, node: ClusterNode) -> None:
    """Everything etcd holds (streams, routes) into the broker; later changes follow through
    the watch. This node's own configured streams go to etcd once it has joined (`join`), so
    the controller places them with this node counted."""
    try:
        view = await node.read_catalog()
    except EtcdError as exc:
        raise ClusterStartError(f"cannot read the stream catalog from etcd: {exc}") from None
    for name, definition in view.streams.items():
        apply_catalog_change(app, "stream", name, definition)
    for pattern, definition in view.routes.items():
        apply_catalog_change(app, "route", pattern, definition)
    node.catalog_listeners.append(lambda kind, name, value: apply_catalog_change(app, kind, name, value))
    # users and ACL: the same files on every node (before the broker's security reads them)
    from ..security.auth import security_paths
    from .shared_files import SharedFiles

    users_file, acl_file = security_paths(Path(app.config.data_dir), app.config.auth)
    node.shared_files = SharedFiles(node, {"users": users_file, "acl": acl_file})
    await node.shared_files.start()


@dataclass(slots=True)
class ClusterParts:
    """The cluster's collaborators the composition root hands to the core and the protocols
    when it builds them (their typed ports), made before them by `assemble`; each takes part
    once the node has joined (`join`), and answers as a single node would until then."""

    plane: DataPlane
    rpc: StateRpc
    # replicated reliable shards: followers fetch from leaders on the plane's links
    replicas: ReplicatedShards
    writer: StateWriter
    placer: CursorPlacer
    # the Edge's `core.placement.RemoteDurables`
    durables: DurableHandover
    # the gRPC server's `RemoteSubscriptions` (consumers relayed to a subscription's holder)
    durable_consumers: DurableConsumers
    # the AMQP virtual hosts' `ExchangeDirectory` (and its `queues`, their `QueueDirectory`)
    exchanges: SharedExchanges
    # what other nodes' cursors need of this node's shards (`Persistence`'s retention)
    floors: CursorFloors


def assemble(app: Shardgate, node: ClusterNode) -> ClusterParts:
    """Build the cluster's parts for `app`'s broker (which exists), before the Edge and the
    protocols, which are built with them."""
    from .amqp_queue_replicas import QueueReplicas
    from .amqp_topology import SharedExchanges
    from .data_plane import DataPlane
    from .dispatch_marks import DispatchMarks
    from .durable_consumers import DurableConsumers
    from .durables import DurableHandover
    from .floors import CursorFloors
    from .replicated_shards import ReplicatedShards
    from .session_cursors import CursorPlacer
    from .shard_reader import OwnerLogs
    from .state_rpc import StateRpc
    from .state_writer import StateWriter

    settings = app.config.cluster
    broker = app.broker
    assert broker is not None and app.journal is not None
    rpc = StateRpc(node.view, node.credentials)
    # the plane's links, which the replicas' requests travel on too
    links: dict[str, PeerLink] = {}
    replicas = ReplicatedShards(node, broker, app.journal, propose=node.propose_isr, links=links)
    plane = DataPlane(broker, node.view, app.config.listeners.host, settings.port,
                      link_timeout_s=settings.link_timeout_s, credentials=node.credentials,
                      forward_hold_s=settings.forward_hold_s,
                      # a subscription opened here at an earlier position reads other nodes'
                      # shards from them; the replica requests of peers' followers; a dead
                      # peer's lease ends at once, so its shards fail over
                      owner_reads=OwnerLogs(rpc), replicas=replicas.service, peers=node,
                      links=links)
    # how far the shards this node leads were dispatched to every node (pushes answered)
    unrouted = plane.unrouted
    replicas.track_dispatch(DispatchMarks(plane.fanout.dispatched, links,
                                          lambda: unrouted.held() > 0))
    writer = StateWriter(node)
    placer = CursorPlacer(node, broker, plane, rpc)
    durables = DurableHandover(node, broker, placer, rpc, writer)
    return ClusterParts(plane, rpc, replicas, writer, placer, durables, DurableConsumers(durables),
                        SharedExchanges(node, broker, plane, QueueReplicas(node, broker, placer)),
                        CursorFloors(node, broker))


class ClusterTopologySink:
    """The broker's topology sink in cluster mode: every stream and route change made on this
    node goes to the local metadata store (as on a single node) and to etcd, where every other
    node's watch applies it. Changes that came from etcd are not written back."""

    def __init__(self, local: Any, node: ClusterNode) -> None:
        self.local = local
        self.node = node

    def stream_saved(self, config: StreamConfig) -> None:
        if self.local is not None:
            self.local.stream_saved(config)
        if config.name in LOCAL_STREAMS:
            return
        definition = stream_definition(config)
        if self.node.view.streams.get(config.name) != definition:
            self.node.view.streams[config.name] = definition
            self.node.submit(keys.STREAMS + config.name, keys.encode(definition))

    def stream_deleted(self, name: str) -> None:
        if self.local is not None:
            self.local.stream_deleted(name)
        if self.node.view.streams.pop(name, None) is not None:
            self.node.submit(keys.STREAMS + name, None)
        for pattern, route in list(self.node.view.routes.items()):
            if route.get("stream") == name:
                del self.node.view.routes[pattern]
                self.node.submit(keys.ROUTES + pattern, None)

    def route_saved(self, rule: Any) -> None:
        if self.local is not None:
            self.local.route_saved(rule)
        definition = {"stream": rule.stream}
        if self.node.view.routes.get(rule.topic_filter) != definition:
            self.node.view.routes[rule.topic_filter] = definition
            self.node.submit(keys.ROUTES + rule.topic_filter, keys.encode(definition))

    def route_removed(self, topic_filter: str) -> None:
        if self.local is not None:
            self.local.route_removed(topic_filter)
        if self.node.view.routes.pop(topic_filter, None) is not None:
            self.node.submit(keys.ROUTES + topic_filter, None)


def apply_catalog_change(app: Shardgate, kind: str, name: str, definition: dict[str, Any] | None) -> None:
    """Make the broker agree with etcd about one stream or route."""
    from ..core.errors import CoreError
    from ..core.streams import RoutingRule

    broker = app.broker
    if broker is None or name in LOCAL_STREAMS:
        return
    try:
        if kind == "stream":
            existing = broker.streams.get(name)
            if definition is None:
                if existing is not None and name != broker.router.default_stream:
                    broker.delete_stream(name)
                    log.info("cluster: stream %s deleted on another node", name)
            elif existing is None:
                broker.create_stream(stream_config(name, definition))
                log.info("cluster: stream %s created on another node", name)
        elif kind == "route":
            current = {rule.topic_filter: rule.stream for rule in broker.router.rules}
            if definition is None:
                if name in current:
                    broker.remove_route(name)
            elif current.get(name) != definition.get("stream") and definition.get("stream") in broker.streams:
                broker.add_route(RoutingRule(name, definition["stream"]))
    except (CoreError, ValueError) as exc:
        log.warning("cluster: cannot apply %s %s from etcd: %s", kind, name, exc)


async def join(app: Shardgate, node: ClusterNode, parts: ClusterParts) -> None:
    """Register under a lease with the data plane's address (the app starts the plane before
    its client listeners), put the parts to work, then declare this node's configured
    streams."""
    settings = app.config.cluster
    host = app.config.listeners.host
    broker = app.broker
    assert broker is not None
    from .schemas import SharedSchemas

    # the registered schemas of etcd into the broker, this node's missing ones into etcd
    await SharedSchemas(node, broker.schemas).install()
    plane = parts.plane
    address = settings.advertise_address or f"{host}:{plane.port}"
    listeners = {name: f"{listener.host}:{listener.port}" for name, listener in app.listeners.items()}
    listeners["cluster"] = f"{host}:{plane.port}"
    # shared-state calls between nodes on the same port: session handover, remote shard reads
    from .shard_reader import serve_read

    rpc = parts.rpc
    rpc.on_read = lambda request: serve_read(broker, plane, request)
    plane.add_service(rpc.handler())
    node.state_rpc = rpc
    if app.cluster_views is not None:  # this node's part of the cluster-wide listings
        plane.add_service(app.cluster_views.handler())
    # replicated reliable shards: followers fetch from leaders over the same port
    replicas = node.replicas = parts.replicas
    plane.add_service(replicas.service.handler())  # (for nodes that still call by gRPC)
    replicas.start()
    from .leader_handoff import LeaderHandoff

    # a drain asks the leader to quiesce each replicated shard before it is moved
    node.handoff = LeaderHandoff(node, replicas)
    node.handoff.start()
    node.replication = True  # its registration says so: the controller may place replicas here
    node.replica_leading = replicas.leading_figures
    from .sessions import SessionHandover

    writer = parts.writer
    writer.start()
    node.state_writer = writer
    placer = parts.placer
    edge = app.edge
    assert edge is not None
    node.durables = parts.durables
    node.durables.install(edge)
    if app.grpc is not None:  # consumers of this node's durable subscriptions on other nodes
        plane.add_service(parts.durable_consumers.serve(app.grpc))
    mqtt = app.mqtt
    if mqtt is not None:
        handover = SessionHandover(node, mqtt, broker, placer, rpc, writer)
        handover.install()
        node.handover = handover
        await handover.drop_moved()
        # the MQTT session registry: a client connecting here takes its session over from
        # the node it was on, which ends that connection with DISCONNECT 0x8E
        mqtt.session_events.opened.append(handover.opened)
        mqtt.session_events.ended.append(node.release_session)
        node.session_listeners.append(mqtt.session_taken_elsewhere)
        for client_id, session in mqtt.sessions.items():
            if session.connection is not None:
                node.claim_session_soon(client_id, session.owner, session.owned)
        handover.start()  # sweeping expired snapshots, checkpointing moving sessions
        from .wills import WillKeeper

        wills = node.wills = WillKeeper(node, mqtt, writer, broker)
        wills.install()
        wills.start()
    await node.durables.drop_moved()
    from .delayed import SharedDelayed

    shared_delayed = SharedDelayed(node, broker.publish, broker)
    broker.delayed.share(shared_delayed)  # delayed messages held from now on live in etcd
    floors = node.floors = parts.floors
    if app.amqp is not None:
        parts.exchanges.install(app.amqp)

    def empty_shards(shards: list[tuple[str, int]]) -> list[tuple[str, int]]:
        empty = []
        for name, index in shards:
            stream = broker.streams.get(name)
            if stream is None or index >= len(stream.shards):
                continue
            shard = stream.shards[index]
            # no record ever published here (a log may start past 0: after the archive's files)
            held = getattr(shard.log, "holds_records", shard.next_offset > 0)
            if not held and shard.log is not None and shard.next_offset == shard.log.next_offset:
                empty.append((name, index))
        return empty

    node.empty_shards = empty_shards
    stats = broker.stats
    node.load_probe = lambda: stats.messages_in + stats.messages_out
    await node.join(address, listeners)
    placer.replay_restored()  # the cursors restored at start, which waited for the shard map
    floors.start()
    shared_delayed.start()
    ours = {
        name: stream_definition(stream.config)
        for name, stream in broker.streams.items() if name not in LOCAL_STREAMS
    }
    try:
        await node.publish_streams(ours)
    except EtcdError as exc:
        raise ClusterStartError(f"cannot share the stream catalog through etcd: {exc}") from None


def cluster_status(node: ClusterNode) -> dict[str, Any]:
    """What `/api/cluster` and `shardgate cluster status` show."""
    view = node.view
    counts = view.shard_counts()
    sessions: dict[str, int] = {}
    for owner in view.sessions.values():
        sessions[owner] = sessions.get(owner, 0) + 1
    nodes = []
    for node_id, registration in sorted(view.registrations.items()):
        nodes.append({
            "node_id": node_id, "cluster_address": registration.cluster_address,
            "listeners": registration.listeners, "leaving": registration.leaving,
            "controller": node_id == view.controller_id, "shards": counts.get(node_id, 0),
            "load": registration.load,
            "sessions": sessions.get(node_id, 0),
            "started_ms": registration.started_ms,
        })
    replicated = shard_status(view.placement, view.streams, view.registrations,
                              node.replica_leading, node.settings.replication_defaults)
    unavailable = sorted(
        f"{stream}/{index}"
        for stream, shards in view.placement.items()
        for index, placed in enumerate(shards)
        if placed.leader not in view.registrations
    )
    return {
        "cluster": node.settings.name, "node_id": node.node_id, "controller": view.controller_id,
        # False once this node cannot prove its lease is alive: it no longer acts for its shards
        "lease_alive": view.lease_alive(),
        "nodes": nodes, "streams": len(view.streams),
        "shards": sum(len(shards) for shards in view.placement.values()),
        "unavailable_shards": unavailable,
        # per shard: [leader, leader epoch] (what scripts and tests read) ...
        "placement": {
            stream: [[placed.leader, placed.leader_epoch] for placed in shards]
            for stream, shards in sorted(view.placement.items())
        },
        # ... and the whole placement: leader, replicas, in-sync replicas, leader epoch
        "replicas": {
            stream: [placed.to_json() for placed in shards]
            for stream, shards in sorted(view.placement.items())
        },
        # per replicated shard: leader, replicas, in-sync set, epoch, under-replicated, and for
        # the shards this node leads, the high watermark, log end and each follower's lag
        "replicated_shards": replicated,
        "under_replicated_shards": sorted(
            name for name, shard in replicated.items() if shard["under_replicated"]),
        # nodes `shardgate cluster drain` named, and whether each still holds a replica
        "draining": {
            drained: sorted(f"{stream}/{index}" for stream, shards in view.placement.items()
                            for index, placed in enumerate(shards) if drained in placed.replicas)
            for drained in sorted(view.draining)
        },
        # what other nodes' durable cursors still need of this node's shards (retention keeps it)
        "cursor_floors": node.floors.status() if node.floors is not None else {},
        # cursor floors reported by nodes out of the view (ignored after a bound)
        "departed_floors": node.floors.departed_status() if node.floors is not None else {},
    }


__all__ = ["ClusterStartError", "apply_catalog_change", "cluster_status", "connect", "join",
           "share_catalog", "keys"]
