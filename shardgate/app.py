"""Assembling a broker from a `Config`: storage engines, the core, protocol listeners.

This is the composition root: the only place that knows which engines and protocols exist.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import Config, ConfigError, check_cluster_archive
from .core.broker import Broker
from .core.edge import Edge
from .core.errors import CoreError
from .core.index_keys import record_index_key
from .core.restoring import set_aside
from .core.streams import DispatchMode, RoutingRule, Schema, StreamConfig
from .persistence import MetadataTopologySink, Persistence, stream_config
from .protocols.mqtt.server import start_tcp_listener, start_websocket_listener
from .protocols.mqtt.service import MqttService
from .protocols.read_budget import ReadBudget
from .storage.interfaces import StorageError
from .storage.journal import JournalStorage
from .storage.metadata import SqliteMetadataStore
from .storage.metadata.ports import MetadataPorts

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

log = logging.getLogger(__name__)

SYS_STREAM = "sys"


def _definition(config: StreamConfig) -> str:
    parts = [config.mode.value, f"{config.partitions} partitions", f"schema {config.schema.value}"]
    if config.retention_ms is not None:
        parts.append(f"retention_ms {config.retention_ms}")
    if config.retention_bytes is not None:
        parts.append(f"retention_bytes {config.retention_bytes}")
    if config.replicas is not None:
        parts.append(f"replicas {config.replicas}")
    if config.min_insync_replicas is not None:
        parts.append(f"min_insync_replicas {config.min_insync_replicas}")
    return "(" + ", ".join(parts) + ")"


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
        tls = self.config.tls
        if not tls.cert_file or not tls.key_file:
            raise ConfigError("a TLS listener needs tls.cert_file and tls.key_file")
        if tls.require_client_cert and not tls.ca_file:
            # Without a CA there is nothing to verify a client certificate against: the
            # listener would accept clients with none, the opposite of what was asked.
            raise ConfigError("tls.require_client_cert = true needs tls.ca_file (the CA that "
                              "signs client certificates)")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(tls.cert_file, tls.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"tls.cert_file {tls.cert_file!r} / tls.key_file {tls.key_file!r}: "
                              f"cannot load a certificate and its key ({exc})") from None
        if tls.ca_file:
            try:
                context.load_verify_locations(tls.ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"tls.ca_file {tls.ca_file!r}: cannot load ({exc})") from None
            context.verify_mode = ssl.CERT_REQUIRED if tls.require_client_cert else ssl.CERT_OPTIONAL
        return context

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
        default = StreamConfig(
            "default", mode=DispatchMode(config.default_stream_mode),
            partitions=config.default_stream_partitions,
        )
        # cluster mode: cursors restored from the store wait unplaced until the node has
        # joined and knows whose journal holds their shard (`CursorPlacer.replay_restored`)
        broker = Broker(storage=self.journal, default_stream=default,
                        restored_cursors_wait=self.cluster is not None)
        broker.create_stream(StreamConfig(SYS_STREAM, mode=DispatchMode.NON_RELIABLE))
        broker.add_route(RoutingRule("$SYS/#", SYS_STREAM))
        declared_routes: dict[str, str] = {}
        for entry in config.streams:
            declared = StreamConfig(
                entry.name, mode=DispatchMode(entry.mode), partitions=entry.partitions,
                schema=Schema(entry.schema),
                retention_ms=entry.retention_ms, retention_bytes=entry.retention_bytes,
                replicas=entry.replicas, min_insync_replicas=entry.min_insync_replicas,
            )
            routes = entry.routes or [entry.name, f"{entry.name}/#"]
            broker.create_stream(declared, routes=routes)
            declared_routes.update(dict.fromkeys(routes, entry.name))
        self._restore_runtime_topology(broker, declared_routes)
        # From here on, every stream and route change is written to the metadata store.
        broker.topology_sink = MetadataTopologySink(self.metadata)
        return broker

    def _register_configured_schemas(self) -> None:
        """Register the `schema_file` of each configured stream (no new version when it is
        the latest already); a file that cannot be read, an invalid schema or one that breaks
        the stream's compatibility mode stops the start with the stream named. In a cluster
        the files are only read and checked here: they are registered once the node has
        joined (`_register_configured_schemas_ordered`)."""
        assert self.broker is not None
        for entry in self.config.streams:
            if not entry.schema_file:
                continue
            try:
                text = Path(entry.schema_file).read_text(encoding="utf-8")
                if self.cluster is not None:
                    self.broker.schemas.prepare(entry.name, entry.schema_type, text,
                                                entry.compatibility or None)
                    continue
                self.broker.schemas.register(entry.name, entry.schema_type, text,
                                             entry.compatibility or None)
            except (OSError, UnicodeDecodeError, CoreError) as exc:
                raise ConfigError(f"stream {entry.name!r}: schema_file {entry.schema_file!r}: "
                                  f"{exc}") from exc

    async def _register_configured_schemas_ordered(self) -> None:
        """In a cluster, once joined: register each configured `schema_file` through the
        cluster's compare-and-set in etcd (`register_ordered`), as the gRPC Admin service
        does, checked against the latest version etcd holds; a schema that breaks the
        stream's compatibility with it, or an etcd out of reach, stops the start."""
        assert self.broker is not None
        for entry in self.config.streams:
            if not entry.schema_file:
                continue
            try:
                text = Path(entry.schema_file).read_text(encoding="utf-8")
                await self.broker.schemas.register_ordered(entry.name, entry.schema_type, text,
                                                           entry.compatibility or None)
            except (OSError, UnicodeDecodeError, CoreError) as exc:
                raise ConfigError(f"stream {entry.name!r}: schema_file {entry.schema_file!r}: "
                                  f"{exc}") from exc

    def _restore_runtime_topology(self, broker: Broker, declared_routes: dict[str, str]) -> None:
        """Bring back the streams and routes created at run time (CLI, gRPC Admin), kept in
        the metadata store. The rule when both define the same name: the configuration file
        wins for the streams and route patterns it declares; the stored definition is set
        aside (and kept in the store) with a warning."""
        assert self.metadata is not None
        builtin = {broker.router.default_stream, SYS_STREAM}
        for record in self.metadata.list_streams():
            if record.name in builtin:
                continue
            try:
                stored = stream_config(record)
                existing = broker.streams.get(record.name)
                if existing is None:
                    broker.create_stream(stored)
            except (CoreError, ValueError) as exc:
                set_aside(log, f"stream {record.name!r}", record, exc)
                continue
            if existing is None:
                log.info("restored stream %r (%s, %d partitions) created at run time",
                         stored.name, stored.mode.value, stored.partitions)
            elif _definition(existing.config) != _definition(stored):
                log.warning(
                    "stream %r is declared in the configuration file and was also created or "
                    "changed at run time; the configuration file wins: using %s, not the stored %s",
                    record.name, _definition(existing.config), _definition(stored),
                )
        for route in self.metadata.list_routes():
            owner = declared_routes.get(route.pattern)
            if owner is not None:
                if owner != route.stream:
                    log.warning(
                        "route %r goes to stream %r in the configuration file and to %r at run "
                        "time; the configuration file wins", route.pattern, owner, route.stream,
                    )
                continue
            if route.stream not in broker.streams:
                log.warning("route %r in the metadata store names stream %r, which does not "
                            "exist; skipped", route.pattern, route.stream)
                continue
            try:
                broker.add_route(RoutingRule(route.pattern, route.stream))
            except (CoreError, ValueError) as exc:
                set_aside(log, f"route {route.pattern!r}", route, exc)

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
                await self.cluster.client.close()
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
            self.broker.topology_sink = attach.ClusterTopologySink(self.broker.topology_sink,
                                                                   self.cluster)
            # the cluster's parts, handed to the Edge and the protocols as they are built
            parts = attach.assemble(self, self.cluster)
            self.data_plane = parts.plane
            from .admin.local_listings import local_action, local_view
            from .cluster.views import ClusterViews

            self.cluster_views = ClusterViews(self.cluster.view, self.cluster.credentials,
                                              local_view(self), local_action(self))
        assert self.metadata is not None
        self.edge = edge = Edge(self.broker,
                                remote_durables=parts.durables if parts is not None else None)
        edge.listeners = self.listeners
        from .protocols.grpc.consumer import GrpcSubscriptionState

        edge.owner_factories[GrpcSubscriptionState.OWNER_KIND] = GrpcSubscriptionState.restored
        self.ports = stored = MetadataPorts(self.metadata)
        self.persistence = Persistence(
            self.broker, self.metadata, stored, edge.owner_factories,
            remote_needs=parts.floors.remote_needs if parts is not None else None)
        self.persistence.restore_retained()
        self._register_configured_schemas()
        self.persistence.restore_subscriptions()
        self.broker.delayed.store = stored
        held = self.broker.delayed.restore()
        if held:
            log.info("restored %d delayed messages", held)
        loop = asyncio.get_running_loop()
        # One read budget per loop turn for every client listener (protocols/read_budget.py).
        self.read_budget = ReadBudget(config.listeners.read_budget_s, call_soon=loop.call_soon)
        self.mqtt = MqttService(edge, config.mqtt, store=stored, scheduler=loop,
                                read_budget=self.read_budget)
        self.mqtt.use_identity_as_username = config.tls.use_identity_as_username
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
        await self._start_archiver()
        self.persistence.start()
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
                if self.security is not None:
                    self.security.attach_amqp(amqp.service)
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
                if self.security is not None and plain is None:
                    self.security.attach_amqp(amqps.service)
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
                                         remote=parts.durables if parts is not None else None,
                                         listing=listing, reset_anywhere=reset_anywhere)
                if ports.grpc_port:
                    starting = ("gRPC", host, ports.grpc_port, "listeners.grpc_port")
                    grpc_server.port = grpc_server.listen(host, ports.grpc_port, None)
                    self.listeners["grpc"] = Listener("grpc", host, grpc_server.port, grpc_server)
                if ports.grpcs_port:
                    starting = ("gRPC over TLS", host, ports.grpcs_port, "listeners.grpcs_port")
                    self._ssl_context()  # the same checks, and errors, as the other TLS listeners
                    tls = config.tls
                    assert tls.cert_file and tls.key_file
                    credentials = tls_credentials(tls.cert_file, tls.key_file, tls.ca_file or "",
                                                  tls.require_client_cert)
                    grpc_server.secure_port = grpc_server.listen(host, ports.grpcs_port, credentials)
                    self.listeners["grpcs"] = Listener("grpcs", host, grpc_server.secure_port,
                                                       grpc_server)
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
                await self._register_configured_schemas_ordered()
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

    async def _start_archiver(self) -> None:
        archive = self.config.archive
        if not archive.enabled:
            return
        from .storage.archive import ArchiveConfigError, Archiver, ArchiveReader, ArchiveSettings

        url = archive.url or f"file://{(self.config.data_dir / 'archive').resolve()}"
        settings = ArchiveSettings(
            target_rows=archive.target_rows, target_bytes=archive.target_bytes,
            max_delay_s=archive.max_delay_s, compaction=archive.compaction,
            file_target_bytes=archive.file_target_bytes, compact_after_s=archive.compact_after_s,
            keep_typed_payload=archive.keep_typed_payload,
            endpoint_url=archive.endpoint_url, region=archive.region,
            access_key_id=archive.access_key_id, secret_access_key=archive.secret_access_key,
            # leave part of the shutdown budget to the journal and the metadata store
            stop_timeout_s=max(1.0, self.config.shutdown_timeout_s * 0.6),
        )
        broker = self.broker
        assert broker is not None

        def reliable_streams() -> list[tuple[str, int, str]]:
            return [
                (stream.name, len(stream.shards), stream.config.schema.value)
                for stream in broker.streams.values() if stream.reliable
            ]

        def registered_schema(name: str) -> tuple[str, Any, int] | None:
            latest = broker.schemas.latest(name)
            return None if latest is None else (latest.type.value, latest.parsed, latest.version)

        def continue_log(name: str, index: int, offset: int) -> bool:
            """A shard log that holds no record continues at `offset`, its broker shard too."""
            stream = broker.streams.get(name)
            if stream is None or not 0 <= index < len(stream.shards):
                return False
            shard = stream.shards[index]
            start_at = getattr(shard.log, "start_at", None)
            if start_at is None or shard.log is None or shard.next_offset != shard.log.next_offset:
                return False
            try:
                shard.next_offset = start_at(offset)
            except StorageError as exc:
                log.error("%s/%d: the archive holds offsets up to %d, the journal fewer, and it "
                          "cannot continue after them: %s", name, index, offset - 1, exc)
                return False
            return True

        leads = None
        if self.cluster is not None:  # only a shard's leader archives it
            view, node_id = self.cluster.view, self.cluster.node_id

            def leads(name: str, index: int) -> bool:
                assignment = view.leader(name, index)
                return assignment is not None and assignment.leader == node_id

        assert self.journal is not None  # the archive reads the journal's reliable streams
        try:
            journal = self.journal

            def archived_log(stream: str, shard: int) -> Any:
                # a replicated shard: its leader archives what is below the high watermark
                cluster = self.cluster
                if cluster is not None and cluster.replicas is not None:
                    return cluster.replicas.archived_log(stream, shard)
                return journal.open_shard(stream, shard)

            self.archiver = Archiver(self.journal, url, reliable_streams, settings,
                                     registered_schema=registered_schema, leads=leads,
                                     continue_log=continue_log,
                                     shard_log=archived_log if self.cluster is not None else None)
            await self.archiver.start()
            if self.cluster is not None:  # a shard this node starts to lead: at once
                self.cluster.view.on_change(self.archiver.wake)
        except ArchiveConfigError as exc:
            raise ConfigError(f"archive: {exc}") from exc
        self.archive_reader = ArchiveReader(url, settings)
        broker.archive = self.archive_reader
        assert self.persistence is not None
        self.persistence.archiver = self.archiver
        log.info("archiving reliable streams to %s", url)

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
            self.mqtt.publishers_blocked = blocked
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
