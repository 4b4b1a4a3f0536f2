"""A drain's handshake on the leader's side (`leader_handoff.LeaderHandoff`): a request of the
controller naming this node takes the shard's quiesce up and answers it under this node's
lease; a request withdrawn reopens the shard (its present leadership too where this node still
leads it in that epoch) and deletes the answer; a request for an epoch this node does not lead
yet waits for it, one for an older epoch is not answered. The view is the real one, fed as
etcd's watch feeds it; the replicated shards are a stand-in that records what it was told."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from shardgate.cluster import keys
from shardgate.cluster.etcd import WatchEvent
from shardgate.cluster.etcd_view import EtcdClusterView
from shardgate.cluster.leader_handoff import LeaderHandoff
from shardgate.cluster.placement import ShardPlacement

PREFIX = "/p/"
KEY = ("s", 0)


@dataclass
class Leading:
    epoch: int


@dataclass
class ShardLog:
    leader: Leading | None
    high_watermark: int = 42


@dataclass
class Manager:
    logs: dict[tuple[str, int], ShardLog] = field(default_factory=dict)

    def leading(self, stream: str, index: int) -> ShardLog | None:
        shard_log = self.logs.get((stream, index))
        return shard_log if shard_log is not None and shard_log.leader is not None else None


@dataclass
class Replicas:
    manager: Manager = field(default_factory=Manager)
    quiesced: list[tuple[tuple[str, int], ...]] = field(default_factory=list)
    reopened: list[tuple[str, int, bool]] = field(default_factory=list)

    async def quiesce(self, timeout_s: float, shards: Any = None, *, why: str = "leaving") -> bool:
        assert why == "drain" and 0 < timeout_s <= 3.0
        self.quiesced.append(tuple(shards))
        return True

    def reopen(self, stream: str, index: int, *, leading: bool) -> None:
        self.reopened.append((stream, index, leading))


class Node:
    def __init__(self) -> None:
        self.node_id = "a"
        self.view = EtcdClusterView("a")
        self.written: list[tuple[str, Any, bool]] = []

    def submit(self, suffix: str, value: bytes | None, *, under_lease: bool = False) -> None:
        self.written.append((suffix, None if value is None else keys.decode(value), under_lease))

    def etcd(self, suffix: str, value: Any, revision: int) -> None:
        """A change the watch brings."""
        raw = None if value is None else keys.encode(value)
        self.view.apply(PREFIX, [WatchEvent(PREFIX + suffix, raw, revision, revision)])
        self.view.changed()


def placed(leader: str, epoch: int) -> dict[str, Any]:
    return {"shards": [ShardPlacement(leader, ("a", "b", "c"), ("a", "b", "c"), epoch).to_json()]}


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0.02)


async def test_a_request_is_quiesced_and_answered_and_its_withdrawal_after_the_move_reopens() -> None:
    node, replicas = Node(), Replicas()
    replicas.manager.logs[KEY] = ShardLog(Leading(3))
    node.etcd("placement/s", placed("a", 3), 1)
    handoff = LeaderHandoff(node, replicas)  # type: ignore[arg-type]
    handoff.start()
    node.etcd("quiesce/s/0", {"leader": "b", "epoch": 3}, 2)  # another node's: not this one's
    node.etcd("quiesce/s/0", {"leader": "a", "epoch": 3}, 3)
    await settle()
    assert replicas.quiesced == [(KEY,)]
    assert node.written == [("quiesced/s/0", {"leader": "a", "epoch": 3, "asked": 3,
                                              "high_watermark": 42, "known": True}, True)]
    # the controller moved the shard, then deleted its request
    node.etcd("placement/s", placed("b", 4), 4)
    node.etcd("quiesce/s/0", None, 5)
    assert replicas.reopened == [("s", 0, False)]  # a later leadership takes publishes
    assert node.written[-1] == ("quiesced/s/0", None, False)
    await handoff.close()


async def test_a_request_withdrawn_while_this_node_still_leads_reopens_the_present_leadership() -> None:
    node, replicas = Node(), Replicas()
    replicas.manager.logs[KEY] = ShardLog(Leading(3))
    node.etcd("placement/s", placed("a", 3), 1)
    handoff = LeaderHandoff(node, replicas)  # type: ignore[arg-type]
    handoff.start()
    node.etcd("quiesce/s/0", {"leader": "a", "epoch": 3}, 2)
    await settle()
    node.etcd("quiesce/s/0", None, 3)  # the drain was cancelled
    assert replicas.reopened == [("s", 0, True)]
    assert node.written[-1] == ("quiesced/s/0", None, False)
    # drained again: a new request (its answer names it), taken up anew
    node.etcd("quiesce/s/0", {"leader": "a", "epoch": 3}, 4)
    await settle()
    assert replicas.quiesced == [(KEY,), (KEY,)] and node.written[-1][1]["asked"] == 4
    # withdrawn and made again between two looks at the view: reopened, then quiesced again
    node.view.apply(PREFIX, [WatchEvent(PREFIX + "quiesce/s/0", None, 5, 0),
                             WatchEvent(PREFIX + "quiesce/s/0", keys.encode(
                                 {"leader": "a", "epoch": 3}), 6, 6)])
    node.view.changed()
    await settle()
    assert replicas.reopened == [("s", 0, True), ("s", 0, True)]
    assert replicas.quiesced == [(KEY,)] * 3 and node.written[-1][1]["asked"] == 6
    await handoff.close()


async def test_a_request_for_an_epoch_not_led_yet_waits_for_it_and_an_older_one_is_not_answered() -> None:
    node, replicas = Node(), Replicas()
    shard_log = replicas.manager.logs[KEY] = ShardLog(Leading(2))
    node.etcd("placement/s", placed("a", 3), 1)
    handoff = LeaderHandoff(node, replicas)  # type: ignore[arg-type]
    handoff.start()
    node.etcd("quiesce/s/0", {"leader": "a", "epoch": 3}, 2)
    await settle()
    assert replicas.quiesced == [] and node.written == []
    shard_log.leader = Leading(3)  # the replica manager leads the new epoch now
    await settle()
    assert replicas.quiesced == [(KEY,)] and node.written[-1][1]["epoch"] == 3
    # a request for an epoch older than the one led here: the controller asks again
    other = ("s", 1)
    replicas.manager.logs[other] = ShardLog(Leading(5))
    node.etcd("quiesce/s/1", {"leader": "a", "epoch": 4}, 3)
    await settle()
    assert replicas.quiesced == [(KEY,)] and all(key != "quiesced/s/1" for key, *_ in node.written)
    await handoff.close()
