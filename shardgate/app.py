"""Assembling a broker from a `Config`: storage engines, the core, protocol listeners.

This is the composition root: the only place that knows which engines and protocols exist.
What it starts with is in `topology.py` (streams, routes and schemas), `archiving.py` (the
archiver) and `tls.py` (the listeners' TLS context).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from .archiving import start_archiver
from .config import Config, ConfigError, check_cluster_archive
from .core.broker import Broker
from .core.edge import Edge, SecurityPort
from .core.errors import CoreError
from .core.index_keys import record_index_key
from .core.store_ports import PortSlot
from .core.streams import DispatchMode, StreamConfig
from .persistence import MetadataTopologySink, Persistence
from .protocols.mqtt.server import start_tcp_listener, start_websocket_listener
from .protocols.mqtt.service import MqttService
from .protocols.read_budget import ReadBudget
from .storage.interfaces import StorageError
from .storage.journal import JournalStorage
from .storage.metadata import SqliteMetadataStore
from .storage.metadata.ports import MetadataPorts
from .tls import server_ssl_context
from .topology import (
    SYS_STREAM,
    declare_configured_streams,
    register_configured_schemas,
    register_configured_schemas_ordered,
    restore_runtime_topology,
)

if TYPE_CHECKING:
    from .bridges.base import BridgeBase
    from .cluster.attach import ClusterParts
    from .cluster.control import ClusterNode
    from .cluster.data_plane import DataPlane
    from .cluster.views import ClusterViews
    from .protocols.amqp.service import AmqpService
    from .protocols.grpc.server import GrpcServer
    from .resources import ResourceAlarms
    from .security.auth import Security
    from .storage.archive import Archiver, ArchiveReader

__all__ = ["IN_FLIGHT_DRAIN_S", "SYS_STREAM", "Listener", "Shardgate"]

log = logging.getLogger(__name__)


IN_FLIGHT_DRAIN_S = 2.0
"""How long a graceful stop waits for clients to acknowledge the deliveries in flight."""


@dataclass
class Listener:
    name: str
    host: str
    port: int
    server: Any = field(repr=False, default=None)


class Shardgate:
    """One broker node: `await start()`, serve, `await stop()`."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.listeners: dict[str, Listener] = {}
        self.broker: Broker | None = None
        # The front door every protocol, admin surface and bridge goes through.
        self.edge: Edge | None = None
        self.mqtt: MqttService | None = None
        self.grpc: GrpcServer | None = None
        self.journal: JournalStorage | None = None
        self.metadata: SqliteMetadataStore | None = None
        self.ports: MetadataPorts | None = None
        self.persistence: Persistence | None = None
        self.archiver: Archiver | None = None
        self.security: Security | None = None
        self.bridges: list[BridgeBase[Any]] = []
        # the memory and disk alarms (`resources.py`), once the listeners are up
        self.alarms: ResourceAlarms | None = None
        self.archive_reader: ArchiveReader | None = None
        # The AMQP service (shared by the amqp and amqps listeners), once listening.
        self.amqp: AmqpService | None = None
        # cluster mode (`[cluster]` / `--cluster`): this node's membership; None on a single node
        self.cluster: ClusterNode | None = None
        # cluster mode: the cluster-wide listings of streams, subscriptions and clients that
        # the admin HTTP API and gRPC Admin give (`cluster.views`); None on a single node
        self.cluster_views: ClusterViews | None = None
        # cluster mode: done once the node has joined (MQTT sessions open from then on)
        self._joined: asyncio.Future[None] | None = None
        # cluster mode: forwarding, route table and pushes between nodes (`cluster.data_plane`),
        # started before any client listener so that no publish is stored by a non-owner
        self.data_plane: DataPlane | None = None
        # True from the end of `start` to the beginning of `stop`: what /readyz reports.
        self.ready = False

    def _ssl_context(self) -> ssl.SSLContext:
        return server_ssl_context(self.config.tls)

    def _build_broker(self) -> Broker:
        config = self.config
        journal_config = config.journal
        self.journal = JournalStorage(
            config.data_dir / "journal",
            fsync=journal_config.fsync,
            fsync_interval_ms=journal_config.fsync_interval_ms,
            segment_bytes=journal_config.segment_bytes,
            segment_ms=journal_config.segment_ms,
            retention_ms=journal_config.retention_ms,
            retention_bytes=journal_config.retention_bytes,
            max_open_files=journal_config.max_open_files,
            index_key=record_index_key,
        )
        self.metadata = SqliteMetadataStore(config.data_dir / "metadata.db")
        # The metadata store's ports: durable cursors and delayed messages (the broker keeps
        # them there), sessions and QoS 2 state (the MQTT service's).
        self.ports = MetadataPorts(self.metadata)
        default = StreamConfig(
            "default", mode=DispatchMode(config.default_stream_mode),
            partitions=config.default_stream_partitions,
        )
        # cluster mode: cursors restored from the store wait unplaced until the node has
        # joined and knows whose journal holds their shard (`CursorPlacer.replay_restored`).
        # What it keeps across restarts is filled in below (the topology sink) and by the
        # persistence and the archiver as they start (`core/store_ports.py`).
        broker = Broker(storage=self.journal, default_stream=default,
                        restored_cursors_wait=self.cluster is not None,
                        cursor_sink=self.ports, keeper=PortSlot(), topology=PortSlot(),
                        archive=PortSlot(), delayed_store=self.ports)
        declared_routes = declare_configured_streams(broker, config.streams)
        assert self.metadata is not None
        restore_runtime_topology(broker, self.metadata, declared_routes)
        # From here on, every stream and route change is written to the metadata store.
        broker.topology.install(MetadataTopologySink(self.metadata))
        return broker

    async def start(self) -> None:
        config = self.config
        config.data_dir.mkdir(parents=True, exist_ok=True)
        if config.cluster.enabled:
            from .cluster import attach
            from .cluster.control import ClusterStartError

            try:
                self.cluster = await attach.connect(self)
            except ClusterStartError as exc:
                raise ConfigError(f"cluster: {exc}") from exc
            try:  # one archive for the cluster, unless said otherwise (once etcd answered)
                check_cluster_archive(config)
            except ConfigError:
                await self.cluster.disconnect()
                raise
        try:
            self.broker = self._build_broker()
        except (StorageError, CoreError, ValueError) as exc:
            raise ConfigError(str(exc)) from exc
        parts: ClusterParts | None = None
        if self.cluster is not None:
            try:
                await attach.share_catalog(self, self.cluster)
            except ClusterStartError as exc:
                raise ConfigError(f"cluster: {exc}") from exc
            # stream and route changes made here go to etcd too, from now on
            topology = self.broker.topology
            topology.install(attach.ClusterTopologySink(topology.current, self.cluster))
            # the cluster's parts, handed to the Edge and the protocols as they are built
            parts = attach.assemble(self, self.cluster)
            self.data_plane = parts.plane
            from .admin.local_listings import local_action, local_view
            from .cluster.views import ClusterViews

            self.cluster_views = ClusterViews(self.cluster.view, self.cluster.credentials,
                                              local_view(self), local_action(self))
        assert self.metadata is not None
        from .protocols.grpc.consumer import GrpcSubscriptionState

        # Security: the port every protocol asks through the Edge; `install_security` below
        # (and again on a running broker) swaps the policy in it. gRPC's durable subscriptions
        # come back from the store with their consumer state.
        self.edge = edge = Edge(
            self.broker, remote_durables=parts.durables if parts is not None else None,
            listeners=self.listeners, security=SecurityPort(),
            owner_factories={GrpcSubscriptionState.OWNER_KIND: GrpcSubscriptionState.restored})
        stored = self.ports
        assert stored is not None
        self.persistence = Persistence(
            self.broker, self.metadata, stored, edge.owner_factories,
            remote_needs=parts.floors.remote_needs if parts is not None else None)
        self.persistence.restore_retained()
        assert self.broker is not None
        register_configured_schemas(self.broker, self.config.streams,
                                    in_cluster=self.cluster is not None)
        self.persistence.restore_subscriptions()
        held = self.broker.delayed.restore()
        if held:
            log.info("restored %d delayed messages", held)
        loop = asyncio.get_running_loop()
        # One read budget per loop turn for every client listener (protocols/read_budget.py).
        self.read_budget = ReadBudget(config.listeners.read_budget_s, call_soon=loop.call_soon)
        self.mqtt = MqttService(edge, config.mqtt, store=stored, scheduler=loop,
                                read_budget=self.read_budget,
                                use_identity_as_username=config.tls.use_identity_as_username)
        # cluster mode: sessions open once the node has joined (it knows then which it holds)
        joined: asyncio.Future[None] = loop.create_future()
        self._joined = joined
        if self.cluster is not None:
            self.mqtt.hold_sessions_until(joined)
        from .security.auth import install_security

        install_security(self)
        restored = self.mqtt.restore_sessions()
        if restored:
            log.info("restored %d persistent MQTT sessions", restored)
        await start_archiver(self)
        self.persistence.start(self.archiver)
        self.mqtt.start()
        host = config.listeners.host
        ports = config.listeners
        starting: tuple[str, str, int, str] = ("", host, 0, "")
        try:
            if parts is not None:
                # before any client listener: a publish for another node's shard is forwarded
                starting = ("the cluster", host, config.cluster.port, "cluster.port")
                await parts.plane.start()
            if ports.mqtt_port:
                starting = ("MQTT", host, ports.mqtt_port, "listeners.mqtt_port")
                server = await start_tcp_listener(self.mqtt, host, ports.mqtt_port)
                self._add_listener("mqtt", server)
            if ports.mqtts_port:
                starting = ("MQTT over TLS", host, ports.mqtts_port, "listeners.mqtts_port")
                server = await start_tcp_listener(self.mqtt, host, ports.mqtts_port, self._ssl_context())
                self._add_listener("mqtts", server)
            if ports.mqtt_ws_port:
                starting = ("MQTT over WebSocket", host, ports.mqtt_ws_port, "listeners.mqtt_ws_port")
                websocket = await start_websocket_listener(self.mqtt, host, ports.mqtt_ws_port)
                self._add_listener("mqtt-ws", websocket)
            if ports.mqtt_wss_port:
                starting = ("MQTT over secure WebSocket", host, ports.mqtt_wss_port,
                            "listeners.mqtt_wss_port")
                websocket = await start_websocket_listener(
                    self.mqtt, host, ports.mqtt_wss_port, self._ssl_context()
                )
                self._add_listener("mqtt-wss", websocket)
            if ports.amqp_port:
                starting = ("AMQP", host, ports.amqp_port, "listeners.amqp_port")
                from .protocols.amqp.server import start_amqp_listener

                amqp = await start_amqp_listener(
                    edge, host, ports.amqp_port, None, config.amqp, read_budget=self.read_budget,
                    queue_directory=parts.exchanges.queues if parts is not None else None,
                    exchange_directory=parts.exchanges if parts is not None else None)
                self.amqp = amqp.service
                self._add_listener("amqp", amqp)
            if ports.amqps_port:
                starting = ("AMQP over TLS", host, ports.amqps_port, "listeners.amqps_port")
                from .protocols.amqp.server import start_amqp_listener

                plain = self.listeners.get("amqp")
                amqps = await start_amqp_listener(
                    edge, host, ports.amqps_port, self._ssl_context(), config.amqp,
                    service=plain.server.service if plain is not None else None,
                    read_budget=self.read_budget,
                    queue_directory=parts.exchanges.queues if parts is not None else None,
                    exchange_directory=parts.exchanges if parts is not None else None,
                )
                self.amqp = amqps.service
                self._add_listener("amqps", amqps)
            if ports.grpc_port or ports.grpcs_port:
                from .protocols.grpc.server import GrpcServer, tls_credentials

                # one server for both ports: the same consumers, producers and subscriptions
                status: Callable[[], dict[str, Any]] | None = None
                if self.cluster is not None:
                    from .cluster.attach import cluster_status

                    status = partial(cluster_status, self.cluster)
                listing = None
                reset_anywhere = None
                if self.cluster_views is not None:
                    from .admin.local_listings import grpc_reset_anywhere
                    from .cluster.views import listing as cluster_listing

                    listing = partial(cluster_listing, self.cluster_views)
                    reset_anywhere = grpc_reset_anywhere(self.cluster_views)
                grpc_server = GrpcServer(edge, config.grpc, cluster_status=status,
                                         remote=parts.durable_consumers if parts is not None else None,
                                         listing=listing, reset_anywhere=reset_anywhere)
                if ports.grpc_port:
                    starting = ("gRPC", host, ports.grpc_port, "listeners.grpc_port")
                    bound = grpc_server.listen(host, ports.grpc_port, None)
                    self.listeners["grpc"] = Listener("grpc", host, bound, grpc_server)
                if ports.grpcs_port:
                    starting = ("gRPC over TLS", host, ports.grpcs_port, "listeners.grpcs_port")
                    self._ssl_context()  # the same checks, and errors, as the other TLS listeners
                    tls = config.tls
                    assert tls.cert_file and tls.key_file
                    credentials = tls_credentials(tls.cert_file, tls.key_file, tls.ca_file or "",
                                                  tls.require_client_cert)
                    bound = grpc_server.listen(host, ports.grpcs_port, credentials)
                    self.listeners["grpcs"] = Listener("grpcs", host, bound, grpc_server)
                await grpc_server.serve()
                self.grpc = grpc_server
            if ports.http_port:
                starting = ("admin HTTP", ports.http_host, ports.http_port, "listeners.http_port")
                from .admin.admin_http import start_http_server
                from .security.auth import is_loopback_host

                open_broker = self.security is None or self.security.open
                if open_broker and not is_loopback_host(ports.http_host):
                    raise ConfigError(
                        f"the admin API would serve {ports.http_host}:{ports.http_port} with no "
                        "authentication: add a user (shardgate users add NAME --role admin) or "
                        "keep listeners.http_host on a loopback address such as 127.0.0.1"
                    )

                http = await start_http_server(self, ports.http_host, ports.http_port)
                self._add_listener("http", http)
        except ConfigError:
            await self.stop()
            raise
        except OSError as exc:
            await self.stop()
            what, bound_host, port, setting = starting
            flag = "--" + setting.replace("listeners.", "").replace(".", "-").replace("_", "-")
            if exc.errno == errno.EADDRINUSE:
                reason = (f"the port is already in use (another broker running? change {setting} "
                          f"or {flag}, 0 turns the listener off)")
            else:  # an address this host does not have, a name that does not resolve
                host_setting = ("listeners.http_host" if setting == "listeners.http_port"
                                else "listeners.host or --host")
                reason = f"{exc.strerror or exc} (check {host_setting})"
            raise ConfigError(f"cannot listen for {what} on {bound_host}:{port}: {reason}") from exc
        for listener in self.listeners.values():
            log.info("listening for %s on %s:%d", listener.name, listener.host, listener.port)
        from .resources import ResourceAlarms

        assert self.journal is not None
        self.alarms = ResourceAlarms(config.data_dir, config.memory_high_watermark,
                                     config.disk_free_limit, self._memory_alarm,
                                     self.journal.refuse_appends)
        self.alarms.start()
        if self.cluster is not None:
            assert parts is not None
            try:
                await attach.join(self, self.cluster, parts)
                await register_configured_schemas_ordered(self.broker, self.config.streams)
            except ClusterStartError as exc:
                joined.cancel()
                await self.stop()
                raise ConfigError(f"cluster: {exc}") from exc
            except ConfigError:
                joined.cancel()
                await self.stop()
                raise
            except BaseException:
                joined.cancel()
                raise
            joined.set_result(None)
        if config.bridges:
            from .bridges.bridge import start_bridges

            try:
                start_bridges(self, config.bridges)
            except ValueError as exc:
                await self.stop()
                raise ConfigError(str(exc)) from exc
        if config.amqp_bridges:
            from .bridges.amqp_bridge import AmqpBridge

            try:
                for entry in config.amqp_bridges:
                    bridge = AmqpBridge(edge, entry)
                    bridge.start()
                    self.bridges.append(bridge)
            except ValueError as exc:
                await self.stop()
                raise ConfigError(str(exc)) from exc
        self.ready = True

    def _add_listener(self, name: str, server: Any) -> None:
        port = getattr(server, "port", None)
        if isinstance(port, int):
            self.listeners[name] = Listener(name, self.config.listeners.host, port, server)
            return
        sockets = list(getattr(server, "sockets", []) or [])
        address = sockets[0].getsockname() if sockets else (self.config.listeners.host, 0)
        self.listeners[name] = Listener(name, address[0], address[1], server)

    def port(self, name: str) -> int:
        return self.listeners[name].port

    def _memory_alarm(self, blocked: bool) -> None:
        """Hold every protocol's publishers while the memory alarm is raised."""
        if self.mqtt is not None:
            self.mqtt.block_publishers(blocked)
        if self.amqp is not None:
            self.amqp.resource_alarm("memory", blocked)
        if self.grpc is not None:
            self.grpc.block_publishers(blocked)

    async def stop(self) -> None:
        self.ready = False
        if self._joined is not None and not self._joined.done():
            self._joined.cancel()  # CONNECTs still waiting for the join are refused
        if self.alarms is not None:
            self.alarms.stop()
        if self.security is not None:
            self.security.stop_watching()
        if self.cluster is not None:
            # hand this node's shards over while it still serves, then go on stopping
            await self.cluster.leave()
            if self.broker is not None:
                await self.broker.delayed.finish()  # released ones deleted while forwarding works
        for bridge in self.bridges:
            await bridge.stop()
        self.bridges = []
        for listener in self.listeners.values():
            if listener.name.startswith("mqtt-ws"):
                # keep the open WebSocket connections for the drain below
                listener.server.close(close_connections=False)  # type: ignore[call-arg]
            else:
                listener.server.close()
        if self.mqtt is not None:
            left = await self.mqtt.finish_in_flight(
                min(IN_FLIGHT_DRAIN_S, self.config.shutdown_timeout_s * 0.1)
            )
            if left:
                log.info("stopping with %d MQTT deliveries unacknowledged; they are sent again "
                         "after the restart", left)
            self.mqtt.stop()
        for listener in self.listeners.values():
            try:
                await asyncio.wait_for(listener.server.wait_closed(), 5)
            except (TimeoutError, Exception):
                pass
        if self.cluster is not None:
            # the sessions and durable subscriptions the clients left above are in etcd before
            # the cluster port closes: a node their clients reconnect to reads them there
            await self.cluster.write_offline_state()
        if self.data_plane is not None:
            # after the clients, before the journal: forwarded publishes still land in it
            await self.data_plane.stop()
        if self.cluster is not None and self.cluster.replicas is not None:
            await self.cluster.replicas.close()  # before the journal: followers append to it
        if self.journal is not None:
            try:
                await asyncio.wait_for(self.journal.flush(), 10)
            except Exception:
                log.exception("journal flush on shutdown failed")
        if self.archiver is not None:
            try:
                await self.archiver.stop(flush=True)
            except Exception:
                log.exception("archiving on shutdown failed")
        if self.persistence is not None:
            await self.persistence.stop()
        if self.broker is not None:
            self.broker.delayed.close()
        if self.mqtt is not None:
            for session in list(self.mqtt.sessions.values()):
                self.mqtt.save_session(session)
        if self.journal is not None:
            self.journal.close()
        if self.metadata is not None:
            self.metadata.close()
        if self.cluster_views is not None:
            await self.cluster_views.close()
        if self.cluster is not None:
            await self.cluster.stop()
