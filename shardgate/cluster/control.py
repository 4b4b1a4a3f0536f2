"""The control plane of one cluster node: registration under a lease, the cached view of the
cluster kept fresh by one etcd watch, controller election and placement writes.

- Registration: `nodes/<id>` is put under this node's lease. A second node with the same id is
  refused (naming the first) unless it is the same node restarting (same data directory, whose
  identity is kept in `<data dir>/cluster-instance`).
- The view (`EtcdClusterView`, the `ClusterView` of `membership.py`) is read once, then kept
  by a watch on the whole cluster prefix; a broken or compacted watch re-reads and resumes.
- Election: the first node to create `controller` under its lease is the controller until its
  lease ends (then the others campaign again). Only the controller writes placement, with a
  compare-and-swap on the revision of `placement-guard` it last saw and on its own election
  revision, so a deposed controller's write fails.
- Replicated shards (`replica_placement.py`): the controller places their replicas, elects a
  new leader from the in-sync set when one dies (a new epoch), applies the in-sync set changes
  leaders propose (`isr/<stream>/<shard>`, deleted in the same transaction), and drains the
  nodes named under `drain/`.
- Fencing: `owns()` is true only while this node's lease is known to be alive (the last
  successful keep-alive plus the TTL); a node cut off from etcd stops acting for its shards
  when that runs out, and registers again (a new lease) when etcd is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import keys
from .etcd import (
    EtcdClient,
    EtcdError,
    EtcdUnavailable,
    KeyValue,
    WatchEvent,
    create_revision_is,
    delete_op,
    get_op,
    mod_revision_is,
    put_op,
    version_is,
)
from .etcd_lease import LeaseKeeper
from .link_auth import NodeCredentials, secret_check
from .link_tls import ClusterTlsError, load_cluster_tls
from .membership import NodeInfo, ShardAssignment
from .placement import ShardPlacement, ShardSpec, place
from .replica_leader import IsrProposal
from .replica_placement import Nodes, ReplicaPlacer, ReplicatedSpec
from .replica_status import Leading
from .replication import stream_replication
from .settings import ClusterSettings

if TYPE_CHECKING:
    from .durables import DurableHandover
    from .floors import CursorFloors
    from .replicated_shards import ReplicatedShards
    from .sessions import SessionHandover
    from .shared_files import SharedFiles
    from .state_rpc import StateRpc
    from .state_writer import StateWriter
    from .wills import WillKeeper

log = logging.getLogger(__name__)

# etcd allows 128 operations per transaction by default; the guard takes one
MAX_TXN_OPS = 100
# how often a node measures its message rate (and reports it when it moved)
LOAD_INTERVAL_S = 5.0
# how often the watch's health is checked against etcd (see `_watch_guard`)
WATCH_CHECK_S = 2.0
# a session claim that loses to other claims this many times in a row fails
CLAIM_ATTEMPTS = 5
# a background registry write (claim, release) is tried this many times while etcd fails
REGISTRY_WRITE_ATTEMPTS = 20


class ClaimRefused(Exception):
    """A session claim refused: the registry names another user as the session's owner."""


class SessionMovedOn(Exception):
    """A claim `held_by` a node refused: the registry names another node (or none) now."""


class ClusterStartError(Exception):
    """The node cannot join: etcd unreachable, node id taken, bad settings."""


def node_instance(data_dir: Path) -> str:
    """The identity of this node's data directory (made once, kept across restarts)."""
    path = data_dir / "cluster-instance"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        instance = uuid.uuid4().hex
        data_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(instance + "\n")
        return instance


class EtcdClusterView:
    """The locally cached cluster state; implements `membership.ClusterView`."""

    def __init__(self, node_id: str) -> None:
        self._node_id = node_id
        self.registrations: dict[str, keys.NodeRegistration] = {}
        self.placement: dict[str, list[ShardPlacement]] = {}
        self.streams: dict[str, dict[str, Any]] = {}
        self.routes: dict[str, dict[str, Any]] = {}
        # the MQTT session registry: client id -> the node its session lives on
        self.sessions: dict[str, str] = {}
        # ... and the whole entry (the node and the user who made the session), by client id
        self.session_entries: dict[str, keys.SessionEntry] = {}
        # registry entries changed by the last events applied: (client id, node or None)
        self.session_changes: list[tuple[str, str | None]] = []
        # the etcd revision of each registry entry known here (the claim a new claim compares
        # on), and of entries deleted lately: the watch may deliver events older than what this
        # node wrote itself, which must not undo it (applied by revision, see `note_session`)
        self.session_revisions: dict[str, int] = {}
        self._session_tombstones: dict[str, int] = {}
        # whole documents kept as bytes (auth/users, auth/acl, amqp/..., schemas/...), by key
        self.documents: dict[str, bytes] = {}
        self.controller_id: str | None = None
        self.controller_revision = 0
        self.guard_revision = 0
        self.revision = 0
        self.lease_valid_until = 0.0
        # shards this node stopped acting for before handing them over (graceful leave)
        self.released: set[tuple[str, int]] = set()
        # nodes `shardgate cluster drain` named (their replicas move off them)
        self.draining: set[str] = set()
        # in-sync set proposals of replicated shards' leaders, with their etcd key's revision
        self.proposals: dict[tuple[str, int], tuple[IsrProposal, int]] = {}
        self._callbacks: list[Callable[[], None]] = []
        self._node_infos: dict[str, NodeInfo] = {}

    # ---------------------------------------------------------------- ClusterView
    @property
    def node_id(self) -> str:
        return self._node_id

    def nodes(self) -> Mapping[str, NodeInfo]:
        return self._node_infos

    def leader(self, stream: str, shard: int) -> ShardAssignment | None:
        shards = self.placement.get(stream)
        if shards is None or not 0 <= shard < len(shards):
            return None
        return ShardAssignment.of(stream, shard, shards[shard])

    def leads(self, stream: str, shard: int) -> bool:
        shards = self.placement.get(stream)
        if shards is None or not 0 <= shard < len(shards):
            return False
        return (shards[shard].leader == self._node_id and self.lease_alive()
                and (not self.released or (stream, shard) not in self.released))

    def on_change(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    # ---------------------------------------------------------------- additions
    def lease_alive(self) -> bool:
        """True while this node's lease is known to be alive (fencing)."""
        return time.monotonic() < self.lease_valid_until

    def available(self, stream: str, shard: int) -> bool:
        """True when the shard's node is live (a dead node's reliable shards are not)."""
        assignment = self.leader(stream, shard)
        return assignment is not None and assignment.leader in self._node_infos

    def shard_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(self.registrations, 0)
        for shards in self.placement.values():
            for placed in shards:
                counts[placed.leader] = counts.get(placed.leader, 0) + 1
        return counts

    def shard_specs(self) -> list[ShardSpec]:
        specs = []
        for name, definition in sorted(self.streams.items()):
            reliable = definition.get("mode", "reliable") == "reliable"
            for index in range(int(definition.get("partitions", 1))):
                specs.append(ShardSpec(name, index, reliable))
        return specs

    # ---------------------------------------------------------------- applying etcd state
    def load(self, prefix: str, kvs: list[KeyValue], revision: int) -> None:
        """Replace the whole state with what etcd holds at `revision`; registry entries that
        differ from before are left in `session_changes`."""
        sessions_before = dict(self.sessions)
        entries_before = dict(self.session_entries)
        # what this node learnt after `revision` (its own claims) stays
        newer = {client_id: (entries_before.get(client_id), known)
                 for client_id, known in (*self.session_revisions.items(),
                                          *self._session_tombstones.items())
                 if known > revision}
        self.session_revisions.clear()
        self._session_tombstones.clear()
        self.registrations.clear()
        self.placement.clear()
        self.streams.clear()
        self.routes.clear()
        self.documents.clear()
        self.sessions.clear()
        self.session_entries.clear()
        self.draining.clear()
        self.proposals.clear()
        self.controller_id = None
        self.controller_revision = 0
        self.guard_revision = 0
        for kv in kvs:
            self._apply(prefix, WatchEvent(kv.key, kv.value, kv.mod_revision, kv.create_revision))
        for client_id, (entry, known) in newer.items():
            self.note_session(client_id, entry, known)
        self.revision = revision
        self._refresh_nodes()
        self.session_changes = [
            (client_id, self.sessions.get(client_id))
            for client_id in sessions_before.keys() | self.sessions.keys()
            if sessions_before.get(client_id) != self.sessions.get(client_id)
        ]

    def apply(self, prefix: str, events: list[WatchEvent]) -> bool:
        """Apply watch events; whether any could change placement (nodes, streams, placement,
        controller): session and auth keys do not, and need no placement run."""
        relevant = False
        for event in events:
            self._apply(prefix, event)
            self.revision = max(self.revision, event.revision)
            key = event.key[len(prefix):]
            relevant = relevant or not key.startswith((keys.SESSIONS, keys.DOCUMENTS, keys.AMQP,
                                                       keys.SCHEMAS))
        if self._session_tombstones:
            # every event up to the watch's revision has come: no older one can undo them
            for client_id, deleted in list(self._session_tombstones.items()):
                if deleted <= self.revision:
                    del self._session_tombstones[client_id]
        if relevant:
            self._refresh_nodes()
        return relevant

    def session_revision(self, client_id: str) -> int:
        """The revision of `client_id`'s registry entry as known here; 0 when there is none
        (etcd compares an absent key's modification revision as 0)."""
        return self.session_revisions.get(client_id, 0) if client_id in self.sessions else 0

    def note_session(self, client_id: str, entry: keys.SessionEntry | None, revision: int) -> bool:
        """Record that at `revision` the registry held `entry` for `client_id` (None: no
        entry), unless a later revision is known already. Whether it was recorded. (Not
        a change for the session listeners: this node's own claims, and what a failed claim
        read, which the watch brings again.)"""
        known = max(self.session_revisions.get(client_id, 0),
                    self._session_tombstones.get(client_id, 0))
        if revision <= known:
            return False
        if entry is None:
            self.sessions.pop(client_id, None)
            self.session_entries.pop(client_id, None)
            self.session_revisions.pop(client_id, None)
            self._session_tombstones[client_id] = revision
        else:
            self.sessions[client_id] = entry.node
            self.session_entries[client_id] = entry
            self.session_revisions[client_id] = revision
            self._session_tombstones.pop(client_id, None)
        return True

    def _apply(self, prefix: str, event: WatchEvent) -> None:
        key = event.key[len(prefix):]
        value = event.value
        try:
            if key.startswith(keys.NODES):
                node_id = key[len(keys.NODES):]
                if value is None:
                    self.registrations.pop(node_id, None)
                else:
                    self.registrations[node_id] = keys.NodeRegistration.from_json(value)
            elif key.startswith(keys.PLACEMENT):
                stream = key[len(keys.PLACEMENT):]
                if value is None:
                    self.placement.pop(stream, None)
                else:
                    self.placement[stream] = [ShardPlacement.from_json(shard)
                                              for shard in keys.decode(value)["shards"]]
            elif key == keys.PLACEMENT_GUARD:
                self.guard_revision = 0 if value is None else event.revision
            elif key == keys.CONTROLLER:
                if value is None:
                    self.controller_id, self.controller_revision = None, 0
                else:
                    self.controller_id = keys.decode(value)["node_id"]
                    self.controller_revision = event.create_revision
            elif key.startswith(keys.STREAMS):
                self._set(self.streams, key[len(keys.STREAMS):], value)
            elif key.startswith(keys.ROUTES):
                self._set(self.routes, key[len(keys.ROUTES):], value)
            elif key.startswith(keys.SESSIONS):
                client_id = key[len(keys.SESSIONS):]
                entry = None if value is None else keys.SessionEntry.from_json(value)
                holder = None if entry is None else entry.node
                before = self.sessions.get(client_id)
                if self.note_session(client_id, entry, event.revision) and before != holder:
                    self.session_changes.append((client_id, holder))
            elif key.startswith(keys.DRAIN):
                if value is None:
                    self.draining.discard(key[len(keys.DRAIN):])
                else:
                    self.draining.add(key[len(keys.DRAIN):])
            elif key.startswith(keys.ISR_PROPOSALS):
                stream, _, index = key[len(keys.ISR_PROPOSALS):].rpartition("/")
                if value is None:
                    self.proposals.pop((stream, int(index)), None)
                else:
                    data = keys.decode(value)
                    proposal = IsrProposal(str(data["leader"]), int(data["leader_epoch"]),
                                           int(data["isr_version"]), frozenset(map(str, data["isr"])))
                    self.proposals[(stream, int(index))] = (proposal, event.revision)
            elif key.startswith((keys.DOCUMENTS, keys.AMQP, keys.SCHEMAS)):
                if value is None:
                    self.documents.pop(key, None)
                else:
                    self.documents[key] = value
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("cluster: ignoring malformed etcd key %s: %s", event.key, exc)

    @staticmethod
    def _set(table: dict[str, dict[str, Any]], name: str, value: bytes | None) -> None:
        if value is None:
            table.pop(name, None)
        else:
            table[name] = keys.decode(value)

    def _refresh_nodes(self) -> None:
        self._node_infos = {
            node_id: NodeInfo(node_id, registration.cluster_address, registration.instance)
            for node_id, registration in self.registrations.items()
        }

    def changed(self) -> None:
        for callback in list(self._callbacks):
            try:
                callback()
            except Exception:
                log.exception("cluster change callback failed")


class ClusterNode:
    """This node's membership: `connect()`, `join()`, serve, `leave()`, `stop()`."""

    def __init__(self, settings: ClusterSettings, node_id: str, data_dir: Path) -> None:
        if not node_id or "/" in node_id:
            raise ClusterStartError(f"cluster node id {node_id!r}: must be non-empty, without '/'")
        if settings.lease_ttl_s < 2:
            raise ClusterStartError("cluster.lease_ttl_s must be at least 2 seconds")
        self.settings = settings
        self.node_id = node_id
        self.prefix = settings.prefix
        # the data directory's first start in a cluster (its sessions never had etcd snapshots)
        self.first_cluster_start = not (data_dir / "cluster-instance").exists()
        self.instance = node_instance(data_dir)
        try:
            secret = settings.load_secret()
        except ValueError as exc:
            raise ClusterStartError(str(exc)) from None
        try:
            tls = load_cluster_tls(settings.tls_cert_file, settings.tls_key_file,
                                   settings.tls_ca_file, settings.tls_server_name)
        except ClusterTlsError as exc:
            raise ClusterStartError(str(exc)) from None
        # what this node proves to its peers on the cluster port (`link_auth.py`), and how it
        # encrypts what it says there (`link_tls.py`)
        self.credentials = NodeCredentials(node_id, self.instance, secret, tls)
        self.view = EtcdClusterView(node_id)
        self.client = EtcdClient(
            settings.endpoints, username=settings.username, password=settings.password,
            ca_file=settings.ca_file, cert_file=settings.cert_file, key_file=settings.key_file,
            timeout=max(1.0, min(5.0, settings.lease_ttl_s / 2)),
        )
        self.registration: keys.NodeRegistration | None = None
        self.lease_id = 0
        self._lease_keeper: LeaseKeeper | None = None
        self._lease_lost = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()
        self._running = False
        # told (on the event loop) about catalog changes seen in etcd: (kind, name, definition)
        self.catalog_listeners: list[Callable[[str, str, dict[str, Any] | None], None]] = []
        # catalog writes made on this node, sent to etcd in order by one task (see `submit`)
        self._writes: asyncio.Queue[
            tuple[str, bytes | None, bool] | Callable[[], Awaitable[None]]] = asyncio.Queue()
        self._pending_writes = 0
        # which of the given reliable shards hold no message here (graceful leave hands them over)
        self.empty_shards: Callable[[list[tuple[str, int]]], list[tuple[str, int]]] | None = None
        # messages this node has handled so far (in + out); its rate is the load it reports
        self.load_probe: Callable[[], int] | None = None
        # the users and ACL files kept equal on every node (shared_files.SharedFiles)
        self.shared_files: SharedFiles | None = None
        # told when a client's session moved to another node: (client id, node id)
        self.session_listeners: list[Callable[[str, str], object]] = []
        # told about changes of whole documents (auth/...) seen in etcd: (key, value)
        self.document_listeners: list[Callable[[str, bytes | None], None]] = []
        # MQTT sessions moving between nodes (sessions.SessionHandover) and the calls between
        # nodes it and remote cursors make (state_rpc.StateRpc); set by `attach.join`
        self.handover: SessionHandover | None = None
        self.state_rpc: StateRpc | None = None
        # wills kept in etcd and published for departed nodes (wills.WillKeeper)
        self.wills: WillKeeper | None = None
        # durable subscriptions shared through etcd (durables.DurableHandover) and the writer
        # of the snapshots both keep there (state_writer.StateWriter)
        self.durables: DurableHandover | None = None
        self.state_writer: StateWriter | None = None
        # this node's durable cursors' floors for other owners' retention (floors.CursorFloors)
        self.floors: CursorFloors | None = None
        # the replicated shards this node leads or follows (replicated_shards.ReplicatedShards)
        self.replicas: ReplicatedShards | None = None
        # this node runs the replication data path (set before `join`; its registration says
        # so, and only such nodes receive replicas: `replication.py`)
        self.replication = False
        # this node's leaderships of replicated shards (`ReplicaManager.leading(...).leader`,
        # set by the data path): their high watermark and followers' lag in `cluster status`
        # and the metrics (`replica_status.py`)
        self.replica_leading: Leading | None = None
        # the controller's replica placement state, and the lease of each node's registration
        # it last saw (a new lease: the node registered again, `replica_placement.Nodes.rejoined`)
        self.replica_placer = ReplicaPlacer(settings.re_replicate_after_s,
                                            settings.unclean_leader_election)
        self._leases_seen: dict[str, int] = {}

    def key(self, suffix: str) -> str:
        return self.prefix + suffix

    # ---------------------------------------------------------------- start
    async def connect(self) -> None:
        """Reach etcd within `connect_timeout_s`, or raise ClusterStartError saying why."""
        deadline = time.monotonic() + self.settings.connect_timeout_s
        last: Exception | None = None
        while True:
            try:
                await self.client.connect()
                return
            except EtcdUnavailable as exc:
                last = exc
            except EtcdError as exc:
                raise ClusterStartError(f"etcd refused the connection: {exc}") from None
            if time.monotonic() >= deadline:
                raise ClusterStartError(
                    f"cannot reach etcd at {', '.join(self.settings.endpoints)} after "
                    f"{self.settings.connect_timeout_s:g} s: {last}")
            await asyncio.sleep(0.25)

    async def read_catalog(self) -> EtcdClusterView:
        """Read the whole cluster state once (before the watch starts)."""
        kvs, revision = await self.client.get_prefix(self.prefix)
        self.view.load(self.prefix, kvs, revision)
        return self.view

    async def publish_streams(self, definitions: Mapping[str, dict[str, Any]]) -> None:
        """Declare streams this node was configured with, unless the cluster already has them."""
        for name, definition in definitions.items():
            key = self.key(keys.STREAMS + name)
            await self.client.txn([version_is(key, 0)], [put_op(key, keys.encode(definition))])

    async def join(self, cluster_address: str, listeners: Mapping[str, str]) -> None:
        """Register under a new lease; start the keep-alive, the watch and the controller."""
        self.registration = keys.NodeRegistration(
            node_id=self.node_id, cluster_address=cluster_address, instance=self.instance,
            started_ms=int(time.time() * 1000), listeners=dict(listeners),
            secret_check=secret_check(self.credentials.secret), replication=self.replication,
        )
        try:
            await self._register()
        except EtcdError as exc:
            raise ClusterStartError(f"cannot register with etcd: {exc}") from None
        self._running = True
        self._start_lease_keeper()
        self._tasks = [asyncio.create_task(self._write_catalog(), name="cluster-catalog-writer")]
        # this node's own writes queued before it joined go first, or the read below would make
        # them look undone (as when the watch reads everything again)
        deadline = time.monotonic() + self.settings.connect_timeout_s
        while self._pending_writes and self._running and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        written = not self._pending_writes
        kvs, revision = await self.client.get_prefix(self.prefix)
        before = self._catalog_snapshot()
        self.view.load(self.prefix, kvs, revision)
        self.view.session_changes = []  # joining is not a change of anyone's session
        if written:
            # what changed since the catalog was read (users, ACL, streams, AMQP topology)
            # reaches the listeners, as the watch's changes will; and nodes that registered
            # meanwhile reach the data plane's links
            self._after_change(before)
        else:
            log.warning("cluster: this node's writes are not all in etcd yet; changes made "
                        "elsewhere since it started apply at the next change")
            self.view.changed()
        self._tasks += [
            asyncio.create_task(self._keep_alive(), name="cluster-lease"),
            asyncio.create_task(self._watch_guard(revision), name="cluster-watch"),
            asyncio.create_task(self._control(), name="cluster-controller"),
            asyncio.create_task(self._report_load(), name="cluster-load"),
        ]
        log.info("cluster %s: node %s joined (internal address %s)", self.settings.name,
                 self.node_id, cluster_address)

    async def _register(self) -> None:
        assert self.registration is not None
        key = self.key(keys.NODES + self.node_id)
        ttl = self.settings.lease_ttl_s
        sent = time.monotonic()
        lease = await self.client.grant(ttl)
        self.registration.lease = lease
        result = await self.client.txn(
            [version_is(key, 0)], [put_op(key, self.registration.to_json(), lease)], [get_op(key)])
        if not result.succeeded:
            existing = result.reads[0][0] if result.reads and result.reads[0] else None
            other = keys.NodeRegistration.from_json(existing.value) if existing else None
            if existing is not None and other is not None and other.instance == self.instance:
                # the same node restarting before its previous lease ran out: take the key over
                taken = await self.client.txn(
                    [mod_revision_is(key, existing.mod_revision)],
                    [put_op(key, self.registration.to_json(), lease)])
                if taken.succeeded:
                    await self.client.revoke(existing.lease)
                else:
                    await self.client.revoke(lease)
                    raise ClusterStartError(f"node id {self.node_id!r} changed hands during start")
            else:
                await self.client.revoke(lease)
                address = other.cluster_address if other else "?"
                raise ClusterStartError(
                    f"node id {self.node_id!r} is already in use by a running node "
                    f"(internal address {address}); give this node another --node-id")
        self.lease_id = lease
        self.view.lease_valid_until = sent + ttl

    # ---------------------------------------------------------------- background loops
    def _start_lease_keeper(self) -> None:
        """Keep the lease alive from a thread of its own (etcd_lease.LeaseKeeper), so a busy event
        loop cannot let it expire; its answers reach the fencing view through the loop."""
        loop = asyncio.get_running_loop()
        self._lease_lost = asyncio.Event()

        def refreshed(lease_id: int, sent: float, granted: int) -> None:  # on the event loop
            if lease_id != self.lease_id or not self._running:
                return  # an answer about a lease this node no longer holds
            if granted <= 0:
                self._lease_lost.set()
            else:
                self.view.lease_valid_until = max(self.view.lease_valid_until, sent + granted)

        def from_thread(lease_id: int, sent: float, granted: int) -> None:
            loop.call_soon_threadsafe(refreshed, lease_id, sent, granted)

        self._lease_keeper = self.client.lease_keeper(
            self.lease_id, max(0.5, self.settings.lease_ttl_s / 3), from_thread)
        self._lease_keeper.start()

    async def _keep_alive(self) -> None:
        """Register again (a new lease) whenever etcd says the lease is gone."""
        assert self._lease_keeper is not None
        while self._running:
            await self._lease_lost.wait()
            self._lease_lost.clear()
            log.warning("cluster: the lease of node %s expired; registering again", self.node_id)
            await self._register_again()
            self._lease_keeper.lease_id = self.lease_id
            self._lease_keeper.refresh_now()

    async def _register_again(self) -> None:
        while self._running:
            try:
                await self._register()
                self._wake.set()
                log.info("cluster: node %s registered again", self.node_id)
                return
            except (EtcdError, ClusterStartError) as exc:
                log.warning("cluster: registering again failed: %s", exc)
                await asyncio.sleep(0.5)

    async def _watch_guard(self, revision: int) -> None:
        """Run the watch; every WATCH_CHECK_S ask etcd whether keys changed after the view's
        revision, and restart the watch (re-reading everything) when they still have at the
        next check: a watch stream that silently stopped delivering (seen after an etcd restart)
        must not leave this node's view stale."""
        watch = asyncio.create_task(self._watch(revision), name="cluster-watch-stream")
        stale_since: int | None = None
        try:
            while self._running:
                await asyncio.sleep(WATCH_CHECK_S)
                seen = self.view.revision
                try:
                    behind = await self.client.latest_modification(self.prefix) > seen
                except Exception:
                    continue  # etcd away: the watch loop itself deals with that
                if not behind:
                    stale_since = None
                elif stale_since != seen:
                    stale_since = seen  # give the watch until the next check
                else:
                    log.warning("cluster: the etcd watch is behind (at revision %d); "
                                "reading the state again", seen)
                    watch.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await watch
                    watch = asyncio.create_task(self._watch(0), name="cluster-watch-stream")
                    stale_since = None
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watch

    async def _watch(self, revision: int) -> None:
        while self._running:
            try:
                if revision == 0:
                    # read everything again; what changed meanwhile (a stream created or
                    # deleted while this node could not watch) is applied as any change is.
                    # This node's own writes still queued go first, or they would look undone.
                    while self._pending_writes and self._running:
                        await asyncio.sleep(0.05)
                    kvs, revision = await self.client.get_prefix(self.prefix)
                    before = self._catalog_snapshot()
                    self.view.load(self.prefix, kvs, revision)
                    self._after_change(before)
                    log.info("cluster: watching etcd again from revision %d", revision)
                async with contextlib.aclosing(
                        self.client.watch_prefix(self.prefix, revision + 1)) as changes:
                    async for events in changes:
                        before = self._catalog_snapshot()
                        relevant = self.view.apply(self.prefix, events)
                        revision = self.view.revision
                        self._after_change(before, wake=relevant)
            except Exception as exc:  # a broken stream must never end the watch loop
                (log.warning if revision else log.debug)(
                    "cluster: watch interrupted (%s); reading the state again", exc)
                revision = 0
                await asyncio.sleep(0.5)
            except asyncio.CancelledError:
                if _cancelling():
                    raise
                revision = 0  # the channel under the stream was closed (fail-over): resume
                await asyncio.sleep(0.5)

    def _catalog_snapshot(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        return dict(self.view.streams), dict(self.view.routes), dict(self.view.documents)

    def _after_change(self, before: tuple[dict[str, Any], ...] | None = None, *,
                      wake: bool = True) -> None:
        if wake:
            self._wake.set()
        changes, self.view.session_changes = self.view.session_changes, []
        if before is not None:
            for client_id, node_id in changes:
                if node_id is not None and node_id != self.node_id:
                    for session_listener in self.session_listeners:
                        try:
                            session_listener(client_id, node_id)
                        except Exception:
                            log.exception("cluster session listener failed")
        if before is not None:
            old_documents, new_documents = before[2], self.view.documents
            for key in old_documents.keys() | new_documents.keys():
                if old_documents.get(key) != new_documents.get(key):
                    for document_listener in self.document_listeners:
                        try:
                            document_listener(key, new_documents.get(key))
                        except Exception:
                            log.exception("cluster document listener failed")
        if before is not None and self.catalog_listeners:
            for kind, old, new in zip(("stream", "route"), before[:2],
                                      self._catalog_snapshot()[:2], strict=True):
                for name in old.keys() | new.keys():
                    if old.get(name) != new.get(name):
                        for listener in self.catalog_listeners:
                            try:
                                listener(kind, name, new.get(name))
                            except Exception:
                                log.exception("cluster catalog listener failed")
        if wake:
            self.view.changed()

    async def _control(self) -> None:
        """Campaign for controller while there is none; as controller, keep placement right."""
        while self._running:
            self._wake.clear()
            try:
                if self.view.lease_alive():
                    if self.view.controller_id is None:
                        await self._campaign()
                    if self.is_controller:
                        await self._write_placement()
            except Exception as exc:
                log.warning("cluster controller step failed: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)

    @property
    def is_controller(self) -> bool:
        return self.view.controller_id == self.node_id and self.view.lease_alive()

    async def _campaign(self) -> None:
        key = self.key(keys.CONTROLLER)
        result = await self.client.txn(
            [version_is(key, 0)],
            [put_op(key, keys.encode({"node_id": self.node_id}), self.lease_id)])
        if result.succeeded:
            self.view.controller_id = self.node_id
            self.view.controller_revision = result.revision
            log.info("cluster: node %s is the controller", self.node_id)

    def desired_placement(self) -> dict[str, list[ShardPlacement]]:
        return self._desired()[0]

    def _desired(self) -> tuple[dict[str, list[ShardPlacement]], dict[str, int]]:
        """The placement every stream should have, and the leases of the nodes it was made for
        (`_write_placement` remembers them once it is written)."""
        view = self.view
        current = {
            (stream, index): placed
            for stream, shards in view.placement.items()
            for index, placed in enumerate(shards)
        }
        registrations = view.registrations
        draining = {node for node in view.draining if node in registrations}
        draining |= {node for node, reg in registrations.items() if reg.leaving}
        live = [node for node in registrations if node not in draining]
        load = {node: reg.load for node, reg in registrations.items()}
        released = set()
        for node, registration in registrations.items():
            if registration.leaving:
                for name in registration.released:
                    stream, _, index = name.rpartition("/")
                    if index.isdigit() and current.get((stream, int(index)), None) is not None \
                            and current[(stream, int(index))].leader == node:
                        released.add((stream, int(index)))
        # shards of replicated streams, and reliable shards with a replica on a draining node
        # (moved by copying), are the replica placer's; the others `place()`'s
        defaults = self.settings.replication_defaults
        settings = {name: stream_replication(definition, defaults)
                    for name, definition in view.streams.items()}
        replicated: list[ReplicatedSpec] = []
        specs = view.shard_specs()
        for spec in specs:
            key = (spec.stream, spec.shard)
            placed = current.get(key)
            wanted = settings[spec.stream].replicas
            if spec.reliable and key not in released and (
                    (wanted > 1 and (placed is not None or self._replica_nodes(draining)))
                    or (placed is not None and (len(placed.replicas) > 1
                                                or any(r in draining for r in placed.replicas)))):
                replicated.append(ReplicatedSpec(spec.stream, spec.shard, wanted))
        # `place()` sees every shard (its balance counts them all); the replica placer's
        # decisions then replace its own for the replicated ones
        placed_now = place(specs, current, live, load, released)
        # the lease each node is registered under; -1 for a leader seen dead, so that its
        # return counts as registering again even for a controller that never saw its lease
        leases = {placed.leader: -1 for placed in current.values()
                  if placed.leader not in registrations}
        leases.update((node, reg.lease) for node, reg in registrations.items())
        nodes = Nodes(
            alive=frozenset(registrations), placeable=frozenset(self._replica_nodes(draining)),
            rejoined=frozenset(node for node, lease in leases.items()
                               if node in self._leases_seen and self._leases_seen[node] != lease),
            draining=frozenset(draining))
        proposals = {key: proposal for key, (proposal, _) in view.proposals.items()}
        placed_now.update(self.replica_placer.place(
            replicated, current, nodes, time.monotonic(), proposals))
        desired: dict[str, list[ShardPlacement]] = {}
        for name, definition in view.streams.items():
            shards = [placed_now.get((name, index)) for index in range(int(definition.get("partitions", 1)))]
            if all(shard is not None for shard in shards):
                desired[name] = shards  # type: ignore[assignment]
        return desired, leases

    def _replica_nodes(self, draining: set[str]) -> list[str]:
        """The live nodes that may receive replicas: they run the replication data path and
        are neither leaving nor draining."""
        return [node for node, reg in self.view.registrations.items()
                if reg.replication and node not in draining]

    async def _write_placement(self) -> None:
        view = self.view
        desired, leases = self._desired()
        ops = []
        for name, shards in sorted(desired.items()):
            if view.placement.get(name) != shards:
                value = keys.encode({"shards": [placed.to_json() for placed in shards]})
                ops.append(put_op(self.key(keys.PLACEMENT + name), value))
        for name in view.placement.keys() - view.streams.keys():
            ops.append(delete_op(self.key(keys.PLACEMENT + name)))
        # the proposals read are answered (applied above, or refused) by deleting them in the
        # same transaction; one made again since is compared out and read at the next pass
        answered = [(self.key(f"{keys.ISR_PROPOSALS}{stream}/{index}"), revision)
                    for (stream, index), (_, revision) in sorted(view.proposals.items())]
        guard = self.key(keys.PLACEMENT_GUARD)
        chunks = [ops[start:start + MAX_TXN_OPS] for start in range(0, len(ops), MAX_TXN_OPS)]
        if answered and not chunks:
            chunks = [[]]
        for number, chunk in enumerate(chunks):
            compares = [create_revision_is(self.key(keys.CONTROLLER), view.controller_revision),
                        mod_revision_is(guard, view.guard_revision)]
            if number == 0:
                compares += [mod_revision_is(key, revision) for key, revision in answered[:20]]
                chunk = chunk + [delete_op(key) for key, _ in answered[:20]]
            result = await self.client.txn(
                compares, [put_op(guard, keys.encode({"controller": self.node_id}))] + chunk)
            if not result.succeeded:
                return  # the view was stale or another controller won: the watch catches up
            view.guard_revision = result.revision
            if number == 0:
                for (stream, index), (_, revision) in list(view.proposals.items()):
                    if (self.key(f"{keys.ISR_PROPOSALS}{stream}/{index}"), revision) in answered[:20]:
                        del view.proposals[(stream, index)]
        self._leases_seen.update(leases)
        if ops:
            for name, shards in desired.items():
                view.placement[name] = shards
            for name in list(view.placement.keys() - view.streams.keys()):
                del view.placement[name]
            log.info("cluster: placement written (%d streams changed)", len(ops))

    # ---------------------------------------------------------------- replication control
    def propose_isr(self, stream: str, shard: int, proposal: IsrProposal) -> None:
        """`ReplicaManager`'s `propose`: this node leads the shard and asks the controller to
        write another in-sync set (put under this node's lease, in order with its other
        writes; the controller answers by writing the placement, or not, and deleting it)."""
        value = keys.encode({"leader": proposal.leader, "leader_epoch": proposal.leader_epoch,
                             "isr_version": proposal.isr_version, "isr": sorted(proposal.isr)})
        self.submit(f"{keys.ISR_PROPOSALS}{stream}/{shard}", value, under_lease=True)

    async def drain(self, node_id: str, *, cancel: bool = False) -> None:
        """`shardgate cluster drain NODE`: ask the controller to move every replica and
        leadership off `node_id` (or, with `cancel`, to stop). Raises EtcdError."""
        key = self.key(keys.DRAIN + node_id)
        if cancel:
            await self.client.delete(key)
        else:
            await self.client.put(key, keys.encode({"since_ms": int(time.time() * 1000)}))

    async def _report_load(self) -> None:
        """Every LOAD_INTERVAL_S, put this node's message rate in its registration when it moved
        by more than a fifth (placement breaks ties between nodes with as many shards by it)."""
        if self.load_probe is None:
            return
        last_count, last_time = self.load_probe(), time.monotonic()
        while self._running:
            await asyncio.sleep(LOAD_INTERVAL_S)
            count, now = self.load_probe(), time.monotonic()
            rate = (count - last_count) / max(now - last_time, 1e-3)
            last_count, last_time = count, now
            registration = self.registration
            if registration is None or registration.leaving:
                continue
            if abs(rate - registration.load) <= max(1.0, 0.2 * registration.load):
                continue
            registration.load = round(rate, 1)
            with contextlib.suppress(Exception):
                await self.client.put(self.key(keys.NODES + self.node_id), registration.to_json(),
                                      self.lease_id)

    # ---------------------------------------------------------------- session registry
    async def claim_session(self, client_id: str, also_read: Sequence[str] = (), *,
                            owner: str | None = None, owned: bool = False,
                            refuse_other_user: bool = False,
                            vacant_refuses: tuple[str, Callable[[KeyValue | None], bool]] | None = None,
                            held_by: str | None = None,
                            ) -> tuple[str | None, list[list[KeyValue]]]:
        """Make the registry name this node for `client_id`, for any kind of session: one etcd
        transaction that puts the entry only if it is still the claim this node knows (compared
        on its revision); when another claim came first, what it wrote is read in the same
        transaction and the claim is made again on top of it. So claims are ordered by etcd:
        the last one wins everywhere, and each node applies them by revision (`note_session`).
        Returns the holder before this claim and the values of the etcd keys `also_read`
        (full keys), read in the transaction that won. The entry names `owner` as the user who
        made the session when `owned`. With `refuse_other_user`, a session the registry names
        another user for (at the revision the claim compares on) is not claimed:
        ClaimRefused is raised, and nothing changes anywhere. When the registry names no node
        (the holder is gone, its entry with its lease), `vacant_refuses` judges instead: the
        full key of the session's last snapshot and whether that snapshot is another user's.
        The snapshot is read before the transaction, which compares its revision as well, so
        a snapshot written between that judgement and the claim (the dying holder's last one)
        makes the claim look again rather than hand one user's session to another. With
        `held_by`, the claim is made only while the registry names that node (a leaving node's
        handover, which must not take a session its client resumed elsewhere meanwhile): else
        SessionMovedOn. Raises EtcdError when etcd fails or others keep claiming."""
        key = self.key(keys.SESSIONS + client_id)
        view = self.view
        entry = keys.SessionEntry(self.node_id, owner, owned)
        value = entry.to_json()
        for _attempt in range(CLAIM_ATTEMPTS):
            known = view.session_revision(client_id)
            previous = view.sessions.get(client_id) if known else None
            held = view.session_entries.get(client_id) if known else None
            if refuse_other_user and held is not None and held.refuses(owner):
                raise ClaimRefused(f"client identifier {client_id!r} has a session of "
                                           f"another user (on {held.node})")
            if held_by is not None and previous != held_by:
                raise SessionMovedOn(f"the session of {client_id!r} is on {previous} now")
            guards = [mod_revision_is(key, known)]
            if refuse_other_user and vacant_refuses is not None and previous is None:
                snapshot_key, refuses = vacant_refuses
                snapshot = await self.client.get(snapshot_key)
                if refuses(snapshot):
                    raise ClaimRefused(f"client identifier {client_id!r} has a session of "
                                       "another user (its holder is gone)")
                guards.append(mod_revision_is(
                    snapshot_key, 0 if snapshot is None else snapshot.mod_revision))
            result = await self.client.txn(
                guards,
                [*(get_op(read) for read in also_read), put_op(key, value, self.lease_id)],
                [get_op(key)])
            if result.succeeded:
                view.note_session(client_id, entry, result.revision)
                return previous, result.reads
            current = result.reads[0]
            if current:
                view.note_session(client_id, keys.SessionEntry.from_json(current[0].value),
                                  current[0].mod_revision)
            else:
                view.note_session(client_id, None, result.revision)
        raise EtcdError(f"the session of {client_id!r} was claimed by other nodes "
                        f"{CLAIM_ATTEMPTS} times in a row")

    def claim_session_soon(self, client_id: str, owner: str | None = None, owned: bool = False) -> None:
        """A session opened here without a claim (the client's session was here already, or
        was made by another user here): claim it in the background unless the registry names
        this node and this owner already."""
        entry = keys.SessionEntry(self.node_id, owner, owned)
        if self.view.session_entries.get(client_id) == entry:
            return
        self._registry_write(functools.partial(self._claim_in_background, entry, client_id))

    async def _claim_in_background(self, entry: keys.SessionEntry, client_id: str) -> None:
        if self.view.session_entries.get(client_id) != entry:
            await self.claim_session(client_id, owner=entry.owner, owned=entry.owned)

    def release_session(self, client_id: str) -> None:
        """The client's session ended here: drop its registry entry, in the background, only
        if it is still this node's claim (a claim made since on another node stays)."""
        if self.view.sessions.get(client_id) == self.node_id:
            self._registry_write(functools.partial(
                self._release, client_id, self.view.session_revision(client_id)))

    async def _release(self, client_id: str, claimed: int) -> None:
        key = self.key(keys.SESSIONS + client_id)
        result = await self.client.txn([mod_revision_is(key, claimed)], [delete_op(key)])
        if result.succeeded:
            self.view.note_session(client_id, None, result.revision)

    def _registry_write(self, write: Callable[[], Awaitable[None]]) -> None:
        """Run a registry write in the background, after the catalog writes queued before it
        (one writer keeps this node's writes in order); etcd errors are retried there."""
        self._pending_writes += 1
        self._writes.put_nowait(write)

    # ---------------------------------------------------------------- catalog writes
    def submit(self, suffix: str, value: bytes | None, *, under_lease: bool = False) -> None:
        """Put (value) or delete (None) the key `suffix` in etcd, after every earlier submit;
        `under_lease`: the key goes when this node's lease does. Called from synchronous code
        (the broker's topology sink, the MQTT service); retried while etcd is away."""
        self._pending_writes += 1
        self._writes.put_nowait((suffix, value, under_lease))

    async def _write_catalog(self) -> None:
        while self._running:
            item = await self._writes.get()
            if not isinstance(item, tuple):
                await self._run_registry_write(item)
                continue
            suffix, value, under_lease = item
            while self._running:
                try:
                    if value is None:
                        await self.client.delete(self.key(suffix))
                    else:
                        await self.client.put(self.key(suffix), value,
                                              self.lease_id if under_lease else 0)
                    self._pending_writes -= 1
                    break
                except Exception as exc:
                    log.warning("cluster: cannot write %s to etcd yet (%s); retrying", suffix, exc)
                    await asyncio.sleep(0.5)

    async def _run_registry_write(self, write: Callable[[], Awaitable[None]]) -> None:
        """One registry write (a claim or a release); tried again (bounded) while etcd fails."""
        try:
            for attempt in range(REGISTRY_WRITE_ATTEMPTS):
                try:
                    await write()
                    return
                except Exception as exc:
                    if attempt == REGISTRY_WRITE_ATTEMPTS - 1 or not self._running:
                        log.warning("cluster: session registry write failed: %s", exc)
                        return
                await asyncio.sleep(0.5)
        finally:
            self._pending_writes -= 1

    # ---------------------------------------------------------------- leave
    async def leave(self) -> None:
        """SIGTERM: ask the controller to move this node's shards, wait (bounded) until it has."""
        if not self._running or self.registration is None:
            return
        others = [n for n, reg in self.view.registrations.items() if n != self.node_id and not reg.leaving]
        if others and self.empty_shards is not None:
            # reliable shards whose log is empty can move with nothing lost: stop acting for
            # them first (publishes get a retryable error), then check they are still empty
            mine = [(spec.stream, spec.shard) for spec in self.view.shard_specs()
                    if spec.reliable and self.view.leads(spec.stream, spec.shard)]
            self.view.released.update(mine)
            empty = set(self.empty_shards(mine))
            self.view.released.intersection_update(empty)
            self.registration.released = sorted(f"{stream}/{shard}" for stream, shard in empty)
        self.registration.leaving = True
        key = self.key(keys.NODES + self.node_id)
        try:
            announced = await self.client.put(key, self.registration.to_json(), self.lease_id)
        except EtcdError as exc:
            log.warning("cluster: cannot announce leaving: %s", exc)
            return
        if not others:
            return
        if self.is_controller:
            self._wake.set()
        deadline = time.monotonic() + self.settings.leave_timeout_s
        while time.monotonic() < deadline:
            # once the watch has passed the announcement, the view holds every placement made
            # before it; then wait for the controller to move what this node still owns
            if self.view.revision >= announced and not self._movable_owned():
                log.info("cluster: node %s handed its shards over", self.node_id)
                return
            await asyncio.sleep(0.05)
        log.warning("cluster: shards not handed over within %.1f s (still leading: %s); they "
                    "stay this node's until it is back", self.settings.leave_timeout_s,
                    ", ".join(f"{stream}/{shard}" for stream, shard in self._movable_owned()))

    def _movable_owned(self) -> list[tuple[str, int]]:
        """The shards this node leads that the controller moves off it while it leaves:
        non-reliable ones, the empty reliable ones it released, replicated ones (leadership
        goes to an in-sync replica) and, where another live node runs the replication data
        path, the reliable ones holding messages too: the controller copies each to that node
        (`replica_placement._drain`) and moves it only once the copy is in sync, so a graceful
        leave moves its data rather than leaving the shard unavailable until it is back."""
        copied = self.replication and any(
            registration.replication and not registration.leaving and node not in self.view.draining
            for node, registration in self.view.registrations.items() if node != self.node_id)
        owned = []
        for spec in self.view.shard_specs():
            assignment = self.view.leader(spec.stream, spec.shard)
            if assignment is None or assignment.leader != self.node_id:
                continue
            if (not spec.reliable or copied or (spec.stream, spec.shard) in self.view.released
                    or len(assignment.isr) > 1):
                owned.append((spec.stream, spec.shard))
        return owned

    async def write_offline_state(self) -> None:
        """A graceful stop, once its clients are gone and before its cluster port closes: the
        durable subscriptions' checkpoints and the snapshots of the sessions the stop took
        offline are written to etcd (bounded), so a node their clients reconnect to meanwhile,
        refused by this one, reads them there (`SessionHandover._take_now`, `Durables._find`)."""
        if self.durables is not None:
            self.durables.stop()
        if self.state_writer is not None:
            await self.state_writer.drain()
        if self.handover is not None:
            # then each persistent session goes to a live node, with what it holds
            await self.handover.hand_over_offline()

    async def stop(self) -> None:
        """Stop the loops and end the lease (the node's keys go with it)."""
        if self.durables is not None:
            self.durables.stop()
        if self.handover is not None:
            self.handover.stop()
        if self.wills is not None:
            self.wills.stop()
        if self.floors is not None:
            await self.floors.stop()
        if self.state_writer is not None:
            await self.state_writer.stop()  # the last offline sessions' snapshots first
        self._running = False
        if self.shared_files is not None:
            await self.shared_files.stop()
        if self.state_rpc is not None:
            await self.state_rpc.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        if self._lease_keeper is not None:
            await asyncio.to_thread(self._lease_keeper.stop, self.client.timeout + 1)
            self._lease_keeper = None
        if self.lease_id:
            with contextlib.suppress(EtcdError):
                await self.client.revoke(self.lease_id)
            self.lease_id = 0
        self.view.lease_valid_until = 0.0
        await self.client.close()


def _cancelling() -> bool:
    """True when the running task itself is being cancelled (not merely a gRPC call under it,
    which grpc.aio reports as CancelledError when its channel is closed)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
