"""The `[cluster]` configuration section (`serve --cluster URL --node-id ID --cluster-port N`).

Cluster mode is on when `etcd` names at least one endpoint; otherwise none of
`shardgate.cluster` runs and the node is today's embedded single node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


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
    # how long `serve` waits for etcd at start before giving up with an error
    connect_timeout_s: float = 10.0
    # how long a SIGTERM'd node waits for its shards to be handed over before it exits
    leave_timeout_s: float = 10.0
    # how often the controller removes expired MQTT sessions' snapshots from etcd
    session_sweep_s: float = 30.0
    # how long the cursor floors of a node that left the view still keep owners' journals
    departed_floors_retention_s: float = 86400.0
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
        "connect_timeout_s": (0.001, None),
        "leave_timeout_s": (0, None),
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
    def prefix(self) -> str:
        return f"/shardgate/{self.name}/"
