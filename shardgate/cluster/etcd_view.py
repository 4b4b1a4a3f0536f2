"""The node's cached view of the cluster (`EtcdClusterView`, the `ClusterView` of
`membership.py`): what etcd holds under the cluster prefix, read once (`load`) and then kept
by the watch's events (`apply`, `view_watch.py`), with what this node learnt of its own
writes (session registry claims, applied by revision: `note_session`).

It reads and decides nothing in etcd itself: the watch feeds it, the control plane's parts
read it (the controller's placement, the data plane's leaders, the session registry).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from . import keys
from .control_store import decode_placement, decode_proposal
from .etcd import KeyValue, WatchEvent
from .membership import NodeInfo, ShardAssignment
from .placement import ShardPlacement, ShardSpec
from .replica_leader import IsrProposal

log = logging.getLogger(__name__)


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
        # a drain's handshake (`leader_handoff.py`): the controller's requests that a shard's
        # leader quiesce it, as (leader, leader epoch, the request's etcd revision), and the
        # leaders' answers, as (leader, leader epoch, the revision of the request answered)
        self.quiesce_requests: dict[tuple[str, int], tuple[str, int, int]] = {}
        self.quiesced: dict[tuple[str, int], tuple[str, int, int]] = {}
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
        self.quiesce_requests.clear()
        self.quiesced.clear()
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
                    self.placement[stream] = decode_placement(value)
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
                    self.proposals[(stream, int(index))] = (decode_proposal(value), event.revision)
            elif key.startswith(keys.QUIESCE):
                self._set_handoff(self.quiesce_requests, key[len(keys.QUIESCE):], value,
                                  event.revision)
            elif key.startswith(keys.QUIESCED):
                self._set_handoff(self.quiesced, key[len(keys.QUIESCED):], value)
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

    @staticmethod
    def _set_handoff(table: dict[tuple[str, int], tuple[str, int, int]], name: str,
                     value: bytes | None, revision: int | None = None) -> None:
        """A request (at its `revision`) or an answer (naming the request's) of a drain."""
        stream, _, index = name.rpartition("/")
        if value is None:
            table.pop((stream, int(index)), None)
        else:
            data = keys.decode(value)
            asked = revision if revision is not None else int(data.get("asked", 0))
            table[(stream, int(index))] = (str(data["leader"]), int(data["epoch"]), asked)

    def _refresh_nodes(self) -> None:
        self._node_infos = {
            node_id: NodeInfo(node_id, registration.cluster_address, registration.instance,
                              registration.lease)
            for node_id, registration in self.registrations.items()
        }

    def changed(self) -> None:
        for callback in list(self._callbacks):
            try:
                callback()
            except Exception:
                log.exception("cluster change callback failed")
