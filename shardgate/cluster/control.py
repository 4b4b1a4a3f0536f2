"""The control plane of one cluster node (`ClusterNode`): registration under a lease, the
lease kept alive, the background loops, and the node's leave; the other parts are modules of
their own, which `ClusterNode` builds and runs:

| part | module |
|---|---|
| every etcd read, write and transaction of the control plane | `control_store.py` (`ControlStore`) |
| the cached view of the cluster (`EtcdClusterView`) | `etcd_view.py` |
| the etcd watch that keeps it, and the listeners of its changes | `view_watch.py` |
| election and placement decisions and writes | `controller.py` |
| the MQTT session registry's claims and releases | `session_registry.py` |
| this node's background writes, in order | `node_writes.py` |

- Registration: `nodes/<id>` is put under this node's lease. A second node with the same id is
  refused (naming the first) unless it is the same node restarting (same data directory, whose
  identity is kept in `<data dir>/cluster-instance`).
- Fencing: `EtcdClusterView.leads()` is true only while this node's lease is known to be alive
  (the last successful keep-alive plus the TTL); a node cut off from etcd stops acting for its
  shards when that runs out, and registers again (a new lease) when etcd is back.
- Leave (SIGTERM): the node says it is leaving and waits (bounded) until the controller has
  moved what it leads (`controller.movable_led`).
- Drain (`drain`): the controller moves what a node holds off it; the leader quiesces each
  replicated shard first when the controller asks (`leader_handoff.py`).

The names other modules import from here (`EtcdClusterView`, `ClaimRefused`, `SessionMovedOn`)
stay importable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import keys
from .control_store import ControlStore, encode_proposal
from .controller import Controller, movable_led
from .etcd import EtcdClient, EtcdError, EtcdUnavailable, KeyValue
from .etcd_lease import LeaseKeeper
from .etcd_view import EtcdClusterView
from .link_auth import NodeCredentials, secret_check
from .link_tls import ClusterTlsError, load_cluster_tls
from .membership import NodeInfo
from .node_writes import NodeWrites
from .placement import ShardPlacement
from .replica_leader import IsrProposal
from .replica_placement import ReplicaPlacer
from .replica_status import Leading
from .session_registry import ClaimRefused, SessionMovedOn, SessionRegistry
from .settings import ClusterSettings
from .view_watch import ViewWatch
from .waits import wait_within

if TYPE_CHECKING:
    from .durables import DurableHandover
    from .floors import CursorFloors
    from .leader_handoff import LeaderHandoff
    from .replicated_shards import ReplicatedShards
    from .sessions import SessionHandover
    from .shared_files import SharedFiles
    from .state_rpc import StateRpc
    from .state_store import StateStore
    from .state_writer import StateWriter
    from .wills import WillKeeper

__all__ = ["ClaimRefused", "ClusterNode", "ClusterStartError", "EtcdClusterView", "SessionMovedOn",
           "node_instance"]

log = logging.getLogger(__name__)

# how often a node measures its message rate (and reports it when it moved)
LOAD_INTERVAL_S = 5.0
# how long `drain` waits for the watch to bring its own write back into the view
DRAIN_SEEN_S = 5.0
# at most how long a leaving node waits for the followers of the shards it leads to know
# where it ends (`ReplicatedShards.quiesce`; at most a third of `leave_timeout_s`)
QUIESCE_S = 3.0


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
        # every etcd write and transaction of the control plane (`control_store.py`)
        self.store = ControlStore(self.client, self.prefix)
        # the plain reads and writes of the other cluster state modules (`state_store.py`)
        self.state_store: StateStore = self.client
        self.registration: keys.NodeRegistration | None = None
        self.lease_id = 0
        self._lease_keeper: LeaseKeeper | None = None
        self._lease_lost = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        # the leases of dead peers this node ended (`peer_gone`), each once
        self._leases_ended: set[int] = set()
        self._wake = asyncio.Event()
        self._running = False
        # this node's writes, sent to etcd in order by one task (see `submit`)
        self.writes = NodeWrites(self.store, lambda: self.lease_id, lambda: self._running)
        self.session_registry = SessionRegistry(self.store, self.view, node_id,
                                                lambda: self.lease_id, self.writes)
        self.view_watch = ViewWatch(
            self.store, self.view, node_id, running=lambda: self._running,
            pending_writes=lambda: self.writes.pending, wake=self._wake.set)
        # told (on the event loop) about catalog changes seen in etcd: (kind, name, definition)
        self.catalog_listeners = self.view_watch.catalog_listeners
        # which of the given reliable shards hold no message here (graceful leave hands them over)
        self.empty_shards: Callable[[list[tuple[str, int]]], list[tuple[str, int]]] | None = None
        # messages this node has handled so far (in + out); its rate is the load it reports
        self.load_probe: Callable[[], int] | None = None
        # the users and ACL files kept equal on every node (shared_files.SharedFiles)
        self.shared_files: SharedFiles | None = None
        # told when a client's session moved to another node: (client id, node id)
        self.session_listeners = self.view_watch.session_listeners
        # told about changes of whole documents (auth/...) seen in etcd: (key, value)
        self.document_listeners = self.view_watch.document_listeners
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
        # this node's answers to the controller's requests to quiesce a shard before a drain
        # moves it (leader_handoff.LeaderHandoff; set by `attach.join` with `replicas`)
        self.handoff: LeaderHandoff | None = None
        # this node runs the replication data path (set before `join`; its registration says
        # so, and only such nodes receive replicas: `replication.py`)
        self.replication = False
        # this node's leaderships of replicated shards (`ReplicaManager.leading(...).leader`,
        # set by the data path): their high watermark and followers' lag in `cluster status`
        # and the metrics (`replica_status.py`)
        self.replica_leading: Leading | None = None
        # election and placement (`controller.py`)
        self.controller = Controller(self.store, self.view, node_id, settings)

    def key(self, suffix: str) -> str:
        return self.prefix + suffix

    # ---------------------------------------------------------------- start
    async def disconnect(self) -> None:
        """Close the etcd connection of a node that will not join (it holds no lease)."""
        await self.client.close()

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
        kvs, revision = await self.store.read_all()
        self.view.load(self.prefix, kvs, revision)
        return self.view

    async def publish_streams(self, definitions: Mapping[str, dict[str, Any]]) -> None:
        """Declare streams this node was configured with, unless the cluster already has them."""
        for name, definition in definitions.items():
            await self.store.declare_stream(name, definition)

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
        self._tasks = [asyncio.create_task(self.writes.run(), name="cluster-catalog-writer")]
        # this node's own writes queued before it joined go first, or the read below would make
        # them look undone (as when the watch reads everything again)
        deadline = time.monotonic() + self.settings.connect_timeout_s
        while self.writes.pending and self._running and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        written = not self.writes.pending
        kvs, revision = await self.store.read_all()
        before = self.view_watch.catalog_snapshot()
        self.view.load(self.prefix, kvs, revision)
        self.view.session_changes = []  # joining is not a change of anyone's session
        if written:
            # what changed since the catalog was read (users, ACL, streams, AMQP topology)
            # reaches the listeners, as the watch's changes will; and nodes that registered
            # meanwhile reach the data plane's links
            self.view_watch.after_change(before)
        else:
            log.warning("cluster: this node's writes are not all in etcd yet; changes made "
                        "elsewhere since it started apply at the next change")
            self.view.changed()
        self._tasks += [
            asyncio.create_task(self._keep_alive(), name="cluster-lease"),
            asyncio.create_task(self.view_watch.run(revision), name="cluster-watch"),
            asyncio.create_task(self._control(), name="cluster-controller"),
            asyncio.create_task(self._report_load(), name="cluster-load"),
        ]
        for task in self._tasks:
            task.add_done_callback(self._task_ended)
        log.info("cluster %s: node %s joined (internal address %s)", self.settings.name,
                 self.node_id, cluster_address)

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        """Say so when one of the control plane's loops ends while the node runs: each is
        meant to run until `stop`, and one that ended quietly (the watch, say) leaves the
        node's view of the cluster stale for good."""
        if not self._running:
            return
        if task.cancelled():
            log.error("cluster: %s was cancelled while the node runs", task.get_name())
        elif task.exception() is not None:
            log.error("cluster: %s failed while the node runs", task.get_name(),
                      exc_info=task.exception())
        else:
            log.error("cluster: %s ended while the node runs", task.get_name())

    async def _register(self) -> None:
        assert self.registration is not None
        store = self.store
        ttl = self.settings.lease_ttl_s
        sent = time.monotonic()
        lease = await store.grant_lease(ttl)
        self.registration.lease = lease
        created, held = await store.register(self.registration, lease)
        if not created:
            if held is not None and held.registration.instance == self.instance:
                # the same node restarting before its previous lease ran out: take the key over
                if await store.take_over_registration(self.registration, lease, held):
                    await store.revoke_lease(held.lease)
                else:
                    await store.revoke_lease(lease)
                    raise ClusterStartError(f"node id {self.node_id!r} changed hands during start")
            else:
                await store.revoke_lease(lease)
                address = held.registration.cluster_address if held else "?"
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

    async def _control(self) -> None:
        """Campaign for controller while there is none; as controller, keep placement right."""
        while self._running:
            self._wake.clear()
            try:
                await self.controller.step(self.lease_id)
            except Exception as exc:
                log.warning("cluster controller step failed: %s", exc)
            with contextlib.suppress(TimeoutError):
                await wait_within(self._wake.wait(), 1.0)

    @property
    def is_controller(self) -> bool:
        return self.controller.elected

    @property
    def replica_placer(self) -> ReplicaPlacer:
        return self.controller.replica_placer

    def desired_placement(self) -> dict[str, list[ShardPlacement]]:
        return self.controller.desired()[0]

    # ---------------------------------------------------------------- a dead peer
    def peer_gone(self, info: NodeInfo) -> None:
        """The data plane's `PeerWatch`: its links found `info`'s cluster port refusing every
        dial for a while: its process is gone (a frozen or cut-off node's does not refuse; a
        node stopping in order says `leaving` first). Its lease is revoked, so that the
        controller fails its shards over now instead of when the lease runs out. Only the
        registration the refusals were seen against: `info` is the node as the view showed
        it when they began, and a registration under another lease is a later process (no
        clock is compared: those of two machines may disagree)."""
        registration = self.view.registrations.get(info.node_id)
        if (registration is None or info.node_id == self.node_id or registration.leaving
                or not registration.lease or registration.lease in self._leases_ended
                or registration.cluster_address != info.cluster_address
                or registration.lease != info.lease):
            return
        self._leases_ended.add(registration.lease)
        log.warning("cluster: node %s refuses connections at %s: its process is gone; its "
                    "lease is ended so that its shards fail over now", info.node_id,
                    info.cluster_address)

        async def revoke() -> None:
            with contextlib.suppress(EtcdError):
                await self.store.revoke_lease(registration.lease)

        self._tasks.append(asyncio.get_running_loop().create_task(revoke(), name="cluster-peer-gone"))

    # ---------------------------------------------------------------- replication control
    def propose_isr(self, stream: str, shard: int, proposal: IsrProposal) -> None:
        """`ReplicaManager`'s `propose`: this node leads the shard and asks the controller to
        write another in-sync set (put under this node's lease, in order with its other
        writes; the controller answers by writing the placement, or not, and deleting it)."""
        self.submit(f"{keys.ISR_PROPOSALS}{stream}/{shard}", encode_proposal(proposal),
                    under_lease=True)

    async def drain(self, node_id: str, *, cancel: bool = False) -> None:
        """`shardgate cluster drain NODE`: ask the controller to move every replica and
        leadership off `node_id` (or, with `cancel`, to stop). Raises EtcdError. Returns once
        this node's view shows it (at most DRAIN_SEEN_S later), so that the status the caller
        answers with says it: the view learns of the write from the watch, not from the write."""
        if cancel:
            await self.store.clear_drain(node_id)
        else:
            await self.store.set_drain(node_id, int(time.time() * 1000))
        deadline = time.monotonic() + DRAIN_SEEN_S
        while (node_id in self.view.draining) == cancel and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

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
                await self.store.put_registration(registration, self.lease_id)

    # ---------------------------------------------------------------- session registry
    async def claim_session(self, client_id: str, also_read: Sequence[str] = (), *,
                            owner: str | None = None, owned: bool = False,
                            refuse_other_user: bool = False,
                            vacant_refuses: tuple[str, Callable[[KeyValue | None], bool]] | None = None,
                            held_by: str | None = None,
                            ) -> tuple[str | None, list[list[KeyValue]]]:
        """`SessionRegistry.claim`: make the registry name this node for `client_id`."""
        return await self.session_registry.claim(
            client_id, also_read, owner=owner, owned=owned, refuse_other_user=refuse_other_user,
            vacant_refuses=vacant_refuses, held_by=held_by)

    def claim_session_soon(self, client_id: str, owner: str | None = None, owned: bool = False) -> None:
        """`SessionRegistry.claim_soon`: claim a session opened here, in the background."""
        self.session_registry.claim_soon(client_id, owner, owned)

    def release_session(self, client_id: str) -> None:
        """`SessionRegistry.release`: drop this node's registry entry, in the background."""
        self.session_registry.release(client_id)

    # ---------------------------------------------------------------- catalog writes
    def submit(self, suffix: str, value: bytes | None, *, under_lease: bool = False) -> None:
        """Put (value) or delete (None) the key `suffix` in etcd, after every earlier submit;
        `under_lease`: the key goes when this node's lease does. Called from synchronous code
        (the broker's topology sink, the MQTT service); retried while etcd is away."""
        self.writes.submit(suffix, value, under_lease=under_lease)

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
        if others and self.replicas is not None:
            # the replicated shards it leads take no more publishes, and their followers learn
            # where its dispatching ends before the controller moves them (no message twice)
            await self.replicas.quiesce(min(QUIESCE_S, self.settings.leave_timeout_s / 3))
        self.registration.leaving = True
        try:
            announced = await self.store.put_registration(self.registration, self.lease_id)
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
        return movable_led(self.view, self.node_id, self.replication)

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
        if self.handoff is not None:
            await self.handoff.close()
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
                await self.store.revoke_lease(self.lease_id)
            self.lease_id = 0
        self.view.lease_valid_until = 0.0
        await self.client.close()

