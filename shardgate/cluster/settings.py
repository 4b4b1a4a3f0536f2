"""The `[cluster]` configuration section (`serve --cluster URL --node-id ID --cluster-port N`).

Cluster mode is on when `etcd` names at least one endpoint; otherwise none of
`shardgate.cluster` runs and the node is today's embedded single node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from .replication import DEFAULT_MIN_INSYNC_REPLICAS, DEFAULT_REPLICAS, Replication


@dataclass(slots=True)
class ClusterSettings:
    # etcd endpoints: http://host:port or https://host:port, a list or one comma-separated string
    etcd: list[str] | str = field(default_factory=list)
    # the cluster's name: every key lives under /shardgate/<name>/ in etcd
    name: str = "shardgate"
    # this node's id, unique in the cluster (default: the host name)
    node_id: str = ""
    # the internal (node-to-node gRPC) listener; 0 picks a free port
    port: int = 7001
    # host:port other nodes dial to reach the internal listener (default: listeners.host:port)
    advertise_address: str = ""
    # a node whose lease is not refreshed for this long is dead; its non-reliable shards move
    lease_ttl_s: int = 5
    # a peer that sends nothing on its link for this long (frozen) is given up on: publishes
    # waiting for it fail retryably, and its link is redialed until it answers again
    link_timeout_s: float = 3.0
    # a publish (QoS >= 1) forwarded for a client of this node while its shard fails over is
    # held this long for the shard's next leader before it is refused retryably
    # (`forwarding.HeldForwards`)
    forward_hold_s: float = 10.0
    # how long `serve` waits for etcd at start before giving up with an error
    connect_timeout_s: float = 10.0
    # how long a SIGTERM'd node waits for its shards to be handed over before it exits
    leave_timeout_s: float = 10.0
    # a replicated shard that lacks a live replica (its node dead) this long gets a new
    # replica on another node, copied from its leader
    re_replicate_after_s: float = 30.0
    # let a replica that was not in sync lead when no in-sync one is live (Kafka's
    # unclean.leader.election.enable): the shard is available again, but records acknowledged
    # by the lost replicas may be gone. Off: the shard waits for an in-sync replica
    unclean_leader_election: bool = False
    # What a reliable stream without its own `replicas` / `min_insync_replicas` gets: this many
    # replicas per shard (capped by the live nodes that may hold them), and this many of them in
    # sync to acknowledge a publish (capped by the replicas the shard has). Give every node the
    # same values. The defaults are `replication.DEFAULT_REPLICAS` (3) and
    # `DEFAULT_MIN_INSYNC_REPLICAS` (2); 1 replica keeps one copy per shard, lost with its
    # node's disk
    default_replicas: int = DEFAULT_REPLICAS
    default_min_insync_replicas: int = DEFAULT_MIN_INSYNC_REPLICAS
    # how often the controller removes expired MQTT sessions' snapshots from etcd
    session_sweep_s: float = 30.0
    # how long the cursor floors of a node that left the view still keep owners' journals
    departed_floors_retention_s: float = 86400.0
    # The cluster's shared secret: every node proves it to every other on the cluster port
    # (`link_auth.py`). Prefer `secret_file` (a file only the broker's user reads); at least
    # 16 bytes, e.g. `openssl rand -hex 32`. Every node of a cluster has the same one.
    secret: str | None = None
    secret_file: str | None = None
    # Run the cluster port without node authentication (a node without a secret refuses to
    # start otherwise): only on a network no one else reaches.
    insecure: bool = False
    # TLS on the cluster port (`link_tls.py`): this node's certificate and key, and the
    # cluster's CA that signed every node's certificate. All three, or none (then the port is
    # authenticated by the secret but not encrypted: keep it on a private network). A dialing
    # node checks that a peer's certificate names the host of its advertised address, or
    # `tls_server_name` when set (one name every node's certificate carries).
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_ca_file: str | None = None
    tls_server_name: str | None = None
    # etcd's own credentials and TLS (`https://` endpoints)
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    # The allowed range of each numeric setting, inclusive (None: no bound), checked by the
    # configuration loader with the file, the name and the value.
    RANGES: ClassVar[dict[str, tuple[float | None, float | None]]] = {
        "lease_ttl_s": (1, None),
        "link_timeout_s": (0.001, None),
        "forward_hold_s": (0, None),
        "connect_timeout_s": (0.001, None),
        "leave_timeout_s": (0, None),
        "re_replicate_after_s": (0, None),
        "default_replicas": (1, 16),
        "default_min_insync_replicas": (1, 16),
        "session_sweep_s": (0.001, None),
        "departed_floors_retention_s": (0, None),
    }

    @property
    def endpoints(self) -> list[str]:
        if isinstance(self.etcd, str):
            return [part.strip() for part in self.etcd.split(",") if part.strip()]
        return [str(part) for part in self.etcd]

    @property
    def enabled(self) -> bool:
        return bool(self.endpoints)

    @property
    def replication_defaults(self) -> Replication:
        """What a reliable stream without the replica settings gets (`replication.py`)."""
        return Replication(self.default_replicas,
                           min(self.default_min_insync_replicas, self.default_replicas))

    @property
    def prefix(self) -> str:
        return f"/shardgate/{self.name}/"

    def load_secret(self) -> bytes:
        """The cluster secret (`secret`, or the contents of `secret_file` less surrounding
        white space); b"" with `insecure`. ValueError when neither, or when it is too short."""
        from .link_auth import MIN_SECRET_BYTES

        if self.secret and self.secret_file:
            raise ValueError("set one of cluster.secret and cluster.secret_file, not both")
        if self.secret_file:
            try:
                secret = Path(self.secret_file).read_bytes().strip()
            except OSError as exc:
                raise ValueError(f"cannot read cluster.secret_file: {exc}") from None
            source = f"cluster.secret_file {self.secret_file}"
        else:
            secret = (self.secret or "").encode()
            source = "cluster.secret"
        if not secret:
            if self.insecure:
                return b""
            raise ValueError(
                "no cluster secret: any process that reaches the cluster port could join as a "
                "node. Give every node the same secret (cluster.secret_file, --cluster-secret-file "
                "or SHARDGATE_CLUSTER__SECRET; e.g. `openssl rand -hex 32 > cluster.secret`), or "
                "run with --insecure-cluster (cluster.insecure = true) on a closed network")
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"{source} is {len(secret)} bytes: at least {MIN_SECRET_BYTES}")
        return secret
