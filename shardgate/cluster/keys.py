"""What Shardgate keeps in etcd, and how it is spelled: one module so every reader and writer
agrees. Every key lives under `/shardgate/<cluster name>/`; values are JSON.

    nodes/<node id>        a live node's registration, under that node's lease
    controller             the elected controller's node id, under its lease
    placement/<stream>     the stream's shards: [{leader, replicas, isr, leader_epoch}, ...]
                           (`placement.ShardPlacement`; written by the controller only)
    placement-guard        bumped with every placement write: the compare-and-swap token
    streams/<name>         a stream's definition (mode, partitions, retention, schema)
    routes/<pattern>       a routing rule: topics matching the pattern go to a stream
    auth/users, auth/acl   the users file and the ACL file, whole (see shared_files.py)
    sessions/<client id>   the node an MQTT client's session lives on (under that node's lease)
                           and the user who made it (`SessionEntry`)
    amqp/<vhost>/exchanges/<name>   a durable AMQP exchange (type, flags, arguments)
    amqp/<vhost>/queues/<name>      the node a shared AMQP queue lives on (amqp_queues.py)
    drain/<node id>        `shardgate cluster drain`: the controller moves every replica and
                           leadership off that node (deleted by `--cancel`)
    isr/<stream>/<shard>   a replicated shard's leader's in-sync set proposal (under the
                           leader's lease); the controller applies or refuses it, then deletes it
    quiesce/<stream>/<shard>   the controller asks the shard's live leader to quiesce it before
                           it moves the leadership away (a drain): {leader, epoch}, under the
                           controller's lease; deleted once moved, or no longer wanted
    quiesced/<stream>/<shard>  the leader's answer (under its lease): {leader, epoch, asked
                           (the request's revision), high_watermark, known}; the leader
                           deletes it once the request is gone

Outside that prefix, under `/shardgate/<cluster name>.state/` (read on demand, never watched):
    sessions/<client id>   an MQTT persistent session's last snapshot (sessions.py)
    durables/<name>        a durable subscription's definition, holder and cursors (durables.py)
    floors/<node id>       the lowest offset that node's durable cursors still need, per shard
                           another node owns (floors.py: the owners' retention keeps it)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

NODES = "nodes/"
CONTROLLER = "controller"
PLACEMENT = "placement/"
PLACEMENT_GUARD = "placement-guard"
STREAMS = "streams/"
ROUTES = "routes/"
DOCUMENTS = "auth/"
# Kept whole like documents (view.documents), watched, told to document listeners.
AMQP = "amqp/"
# Each stream's registered schema versions (`schemas.py`), kept and told like documents.
SCHEMAS = "schemas/"
SESSIONS = "sessions/"
DRAIN = "drain/"
ISR_PROPOSALS = "isr/"
# a drain's handshake before a live leader is moved (`leader_handoff.py`)
QUIESCE = "quiesce/"
QUIESCED = "quiesced/"


def encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def decode(raw: bytes) -> Any:
    return json.loads(raw)


@dataclass(slots=True)
class NodeRegistration:
    """What a node says of itself in `nodes/<id>`."""

    node_id: str
    cluster_address: str
    # the data directory's identity: a restart of the same node may replace its own stale key
    instance: str
    started_ms: int
    listeners: dict[str, str] = field(default_factory=dict)
    # set on SIGTERM: the controller moves this node's shards away before it exits
    leaving: bool = False
    # messages per second the node handles, for placement ties
    load: float = 0.0
    # leaving: reliable shards ("stream/shard") with an empty log it no longer writes to
    released: list[str] = field(default_factory=list)
    # proves the node's cluster secret without showing it (`link_auth.secret_check`): a node
    # started with another secret sees the mismatch and refuses to start
    secret_check: str = ""
    # the lease this registration is under: a new one means the node registered again (a new
    # process, or the same one after its lease ran out), so a shard it leads gets a new epoch
    lease: int = 0
    # the node runs the replication data path (follows leaders, answers fetches): only such
    # nodes receive replicas of replicated shards (`replication.py`)
    replication: bool = False

    def to_json(self) -> bytes:
        return encode({
            "node_id": self.node_id, "cluster_address": self.cluster_address,
            "instance": self.instance, "started_ms": self.started_ms,
            "listeners": self.listeners, "leaving": self.leaving, "load": self.load,
            "released": self.released, "secret_check": self.secret_check,
            "lease": self.lease, "replication": self.replication,
        })

    @classmethod
    def from_json(cls, raw: bytes) -> NodeRegistration:
        data = decode(raw)
        return cls(
            node_id=data["node_id"], cluster_address=data.get("cluster_address", ""),
            instance=data.get("instance", ""), started_ms=int(data.get("started_ms", 0)),
            listeners=dict(data.get("listeners", {})), leaving=bool(data.get("leaving", False)),
            load=float(data.get("load", 0.0)), released=list(data.get("released", [])),
            secret_check=str(data.get("secret_check", "")),
            lease=int(data.get("lease", 0)), replication=bool(data.get("replication", False)),
        )


@dataclass(frozen=True, slots=True)
class SessionEntry:
    """What the registry says of an MQTT client's session in `sessions/<client id>`: the node
    it lives on and, once known (`owned`), the user who made it (None: an anonymous client).
    Another user's CONNECT with that client id is refused on every node as on the holder
    (`mqtt.session_takeover_by_other_user`); an entry without an owner (written before owners
    were kept) is anyone's."""

    node: str
    owner: str | None = None
    owned: bool = False

    def to_json(self) -> bytes:
        return encode({"node": self.node, **({"owner": self.owner} if self.owned else {})})

    @classmethod
    def from_json(cls, raw: bytes) -> SessionEntry:
        data = decode(raw)
        owner = data.get("owner")
        return cls(str(data["node"]), None if owner is None else str(owner), "owner" in data)

    def refuses(self, username: str | None) -> bool:
        """Whether the session is another user's than `username`'s."""
        return self.owned and self.owner != username
