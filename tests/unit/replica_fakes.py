"""In-process fakes for the replica state machines: a node with an in-memory log, and a shard
of several such nodes whose leader, followers and controller talk by direct calls, on a
manual clock. No socket, no thread: every step is the test's."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardgate.cluster.replica_control import ReplicaSet, apply_proposal, elect, rejoined
from shardgate.cluster.replica_epochs import (
    EpochEndRequest,
    EpochHistory,
    FetchPlan,
    FetchRequest,
    FetchResponse,
    Refused,
    ReplicaError,
)
from shardgate.cluster.replica_follower import FollowerReplica, FollowerState, ResetLog, Truncate
from shardgate.cluster.replica_leader import LeaderReplica

LAG_MAX_S = 10.0


@dataclass
class Node:
    """A node's copy of the shard: records as (epoch, payload), and how much is durable."""

    name: str
    records: list[tuple[int, str]] = field(default_factory=list)
    durable_end: int = 0
    history: EpochHistory = field(default_factory=EpochHistory)
    high_watermark: int = 0
    leader: LeaderReplica[str] | None = None
    follower: FollowerReplica | None = None

    def apply(self, action: Truncate | ResetLog | None) -> None:
        if isinstance(action, Truncate):
            del self.records[action.end_offset:]
            self.durable_end = min(self.durable_end, action.end_offset)
        elif isinstance(action, ResetLog):
            raise AssertionError("the fake log has no retention")


class Shard:
    """One replicated shard over `names`, led first by the first name, on a manual clock."""

    def __init__(self, names: list[str], *, min_insync: int = 2, auto_sync: bool = True) -> None:
        self.now = 0.0
        self.nodes = {name: Node(name) for name in names}
        self.live = set(names)
        self.min_insync = min_insync
        self.auto_sync = auto_sync
        self.record = ReplicaSet(names[0], tuple(names), frozenset(names), 1)
        self.outcomes: dict[str, ReplicaError | None] = {}
        self._assume_roles()

    # -- the controller ---------------------------------------------------------------------

    def _assume_roles(self) -> None:
        for name in sorted(self.live):
            self._assume_roles_of(name)

    def _assume_roles_of(self, name: str) -> None:
        node = self.nodes[name]
        record = self.record
        if node.leader is not None:
            node.leader.supersede()
            self._collect(node)
        node.leader = node.follower = None
        if record.leader == name:
            node.leader = LeaderReplica(
                name, record.epoch, record.replicas, record.isr,
                min_insync=self.min_insync, lag_time_max_s=LAG_MAX_S, history=node.history,
                log_end=len(node.records), durable_end=node.durable_end,
                high_watermark=node.high_watermark, now=self.now, isr_version=record.isr_version)
            self._collect(node)
        elif record.leader is not None:
            node.follower = FollowerReplica(
                name, record.leader, record.epoch, history=node.history,
                log_end=len(node.records), durable_end=node.durable_end,
                high_watermark=node.high_watermark)

    def elect(self) -> None:
        """The controller saw the live nodes: a new leader and epoch if the leader died."""
        new = elect(self.record, self.live)
        if new is self.record:
            return
        changed_leader = new.leader != self.record.leader or new.epoch != self.record.epoch
        self.record = new
        if changed_leader:
            self._assume_roles()
        else:
            leader = self.leader_node()
            assert leader is not None and leader.leader is not None
            leader.leader.isr_changed(new.isr, new.isr_version, self.now)
            self._collect(leader)

    def controller_round(self) -> None:
        leader = self.leader_node()
        if leader is None or leader.leader is None:
            return
        proposal = leader.leader.take_proposal()
        if proposal is None:
            return
        new = apply_proposal(self.record, proposal, self.live)
        if new is None:
            leader.leader.proposal_failed()
            return
        self.record = new
        leader.leader.isr_changed(new.isr, new.isr_version, self.now)
        self._collect(leader)

    # -- nodes --------------------------------------------------------------------------------

    def leader_node(self) -> Node | None:
        name = self.record.leader
        return self.nodes[name] if name is not None and name in self.live else None

    def kill(self, name: str) -> None:
        """The process dies: what it had not made durable is gone, and so are its roles."""
        node = self.nodes[name]
        self.live.discard(name)
        del node.records[node.durable_end:]
        node.history.truncate_from(node.durable_end)
        if node.leader is not None:
            node.leader.supersede()
            node.leader.take_completed()  # its clients went with it
        node.leader = node.follower = None

    def restart(self, name: str) -> None:
        """The node's process starts again and registers: a leader gets a new epoch."""
        self.live.add(name)
        new = rejoined(self.record, name)
        if new is not self.record:
            self.record = new
            self._assume_roles()
        else:
            self._assume_roles_of(name)

    def publish(self, payload: str) -> ReplicaError | None:
        """Publish on the leader; None when taken (its outcome comes later)."""
        node = self.leader_node()
        if node is None or node.leader is None:
            return ReplicaError.NOT_LEADER
        refusal = node.leader.check_append(self.now)
        if refusal is not None:
            return refusal
        node.records.append((node.leader.epoch, payload))
        node.leader.appended(len(node.records))
        node.leader.await_commit(len(node.records), payload, self.now)
        if self.auto_sync:
            self.sync(node.name)
        self._collect(node)
        return None

    def sync(self, name: str) -> None:
        """The node's commit pass: what it appended is now durable."""
        node = self.nodes[name]
        node.durable_end = len(node.records)
        if node.leader is not None:
            node.leader.durable(node.durable_end, self.now)
            self._collect(node)
        if node.follower is not None:
            node.follower.durable(node.durable_end)

    def _collect(self, node: Node) -> None:
        if node.leader is None:
            return
        node.high_watermark = node.leader.high_watermark
        for payload, error in node.leader.take_completed():
            self.outcomes[payload] = error

    def acknowledged(self) -> list[str]:
        return [payload for payload, error in self.outcomes.items() if error is None]

    # -- the peer link ----------------------------------------------------------------------

    def step(self, name: str) -> bool:
        """One request of follower `name` and its answer; True when something moved."""
        node = self.nodes[name]
        follower = node.follower
        if follower is None or name not in self.live:
            return False
        if follower.state is FollowerState.WAITING:
            follower.retry()  # the fake's pause after a refusal is one round
        request = follower.next_request()
        if request is None:
            return False
        if isinstance(request, Truncate):
            node.apply(request)
            return True
        target = self.nodes[follower.leader]
        leader = target.leader if follower.leader in self.live else None
        if isinstance(request, EpochEndRequest):
            answer = leader.on_epoch_end(request) if leader else Refused(ReplicaError.NOT_LEADER)
            node.apply(follower.on_epoch_end(answer))
            return not isinstance(answer, Refused)
        assert isinstance(request, FetchRequest)
        plan = leader.on_fetch(request, self.now) if leader else Refused(ReplicaError.NOT_LEADER)
        self._collect(target)
        if isinstance(plan, Refused):
            node.apply(follower.on_fetch(plan))
            return False
        assert isinstance(plan, FetchPlan)
        response = FetchResponse(follower.epoch, plan.start, plan.end, plan.high_watermark,
                                 plan.epochs)
        if follower.accepts(response):
            node.records.extend(target.records[plan.start:plan.end])
        node.apply(follower.on_fetch(response))
        node.high_watermark = follower.high_watermark
        if self.auto_sync:
            self.sync(name)
        return plan.end > plan.start

    def pump(self, rounds: int = 20, only: set[str] | None = None) -> None:
        """Let the followers (all, or `only`) fetch until nothing moves, and once more so
        that each reports what it made durable; the controller answers proposals between
        rounds."""
        quiet = 0
        for _ in range(rounds):
            moved = False
            for name in sorted(self.nodes):
                if only is None or name in only:
                    moved |= self.step(name)
            self.controller_round()
            quiet = 0 if moved else quiet + 1
            if quiet == 2:
                return

    def advance(self, seconds: float) -> None:
        self.now += seconds
        for node in self.nodes.values():
            if node.leader is not None and node.name in self.live:
                node.leader.tick(self.now)
                self._collect(node)
        self.controller_round()

    def committed(self) -> list[tuple[int, str]]:
        node = self.leader_node()
        assert node is not None and node.leader is not None
        return node.records[:node.leader.high_watermark]
