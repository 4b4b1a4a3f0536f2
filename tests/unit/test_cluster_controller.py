"""The controller's decisions (`cluster/controller.py`) read from a cached view alone: what
placement it wants, what it writes to get there, what it keeps of a write, and what a leaving
node waits for. The transactions themselves are `test_control_store.py`'s, on a real etcd."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from shardgate.cluster import keys
from shardgate.cluster.control_store import (
    AnsweredProposal,
    PlacementChange,
    PlacementWritten,
    decode_proposal,
    encode_placement,
    encode_proposal,
)
from shardgate.cluster.controller import (
    Controller,
    desired_placement,
    movable_led,
    placement_change,
)
from shardgate.cluster.etcd import KeyValue, WatchEvent
from shardgate.cluster.etcd_view import EtcdClusterView
from shardgate.cluster.placement import ShardPlacement
from shardgate.cluster.replica_leader import IsrProposal
from shardgate.cluster.replica_placement import ReplicaPlacer
from shardgate.cluster.settings import ClusterSettings

PREFIX = "/shardgate/t/"


def registration(node: str, *, lease: int = 1, leaving: bool = False, replication: bool = False,
                 released: list[str] | None = None) -> bytes:
    return keys.NodeRegistration(node_id=node, cluster_address="127.0.0.1:1", instance=node,
                                 started_ms=1, leaving=leaving, lease=lease,
                                 replication=replication, released=released or []).to_json()


def view_of(entries: Mapping[str, bytes], node_id: str = "a") -> EtcdClusterView:
    """A view loaded as from etcd, each key at its own revision; its lease alive."""
    view = EtcdClusterView(node_id)
    kvs = [KeyValue(PREFIX + key, value, revision, revision, 0)
           for revision, (key, value) in enumerate(entries.items(), start=1)]
    view.load(PREFIX, kvs, len(kvs))
    view.lease_valid_until = time.monotonic() + 60
    return view


def stream(partitions: int, *, mode: str = "reliable", replicas: int = 1) -> bytes:
    definition: dict[str, Any] = {"mode": mode, "partitions": partitions, "replicas": replicas}
    return keys.encode(definition)


def single(leader: str, epoch: int = 0) -> ShardPlacement:
    return ShardPlacement.single(leader, epoch)


def test_a_new_stream_is_placed_on_the_live_nodes_and_only_what_changed_is_written() -> None:
    view = view_of({"nodes/a": registration("a"), "nodes/b": registration("b"),
                    "streams/s": stream(2, mode="non-reliable"),
                    "streams/kept": stream(1), "placement/kept": encode_placement([single("a")]),
                    "placement/gone": encode_placement([single("b")])})
    desired, leases = desired_placement(view, ReplicaPlacer(), {}, time.monotonic())
    assert sorted(placed.leader for placed in desired["s"]) == ["a", "b"]
    assert desired["kept"] == [single("a")] and "gone" not in desired
    assert leases == {"a": 1, "b": 1}
    change = placement_change(view, "a", desired)
    assert set(change.put) == {"s"} and list(change.removed) == ["gone"]
    assert (change.controller, change.guard_revision) == ("a", view.guard_revision)


def test_a_leaving_nodes_non_reliable_and_released_shards_move_its_loaded_reliable_ones_stay() -> None:
    view = view_of({
        "nodes/a": registration("a", leaving=True, released=["empty/0"]),
        "nodes/b": registration("b"),
        "streams/live": stream(1, mode="non-reliable"), "placement/live": encode_placement([single("a")]),
        "streams/empty": stream(1), "placement/empty": encode_placement([single("a")]),
        "streams/loaded": stream(1), "placement/loaded": encode_placement([single("a")]),
    })
    desired, _ = desired_placement(view, ReplicaPlacer(), {}, time.monotonic())
    assert desired["live"][0].leader == "b" and desired["live"][0].leader_epoch == 1
    assert desired["empty"][0].leader == "b"
    assert desired["loaded"] == [single("a")]  # its log is on a's disk: no replica elsewhere
    view.released.add(("empty", 0))
    # what the leaving node waits for: no node to copy to, so not the loaded reliable shard
    assert sorted(movable_led(view, "a", replication=False)) == [("empty", 0), ("live", 0)]


def test_a_leaving_node_waits_for_its_reliable_shards_when_another_node_can_take_a_copy() -> None:
    entries = {"nodes/a": registration("a", leaving=True, replication=True),
               "nodes/b": registration("b", replication=True),
               "streams/loaded": stream(1), "placement/loaded": encode_placement([single("a")])}
    assert movable_led(view_of(entries), "a", replication=True) == [("loaded", 0)]
    assert movable_led(view_of(entries), "a", replication=False) == []
    # a draining node takes no copy
    entries["drain/b"] = keys.encode({"since_ms": 1})
    assert movable_led(view_of(entries), "a", replication=True) == []


def test_a_leader_registered_again_under_a_new_lease_leads_in_a_new_epoch() -> None:
    three = ShardPlacement("a", ("a", "b", "c"), ("a", "b", "c"), 4)
    entries = {**{f"nodes/{n}": registration(n, lease=1, replication=True) for n in "abc"},
               "streams/r": stream(1, replicas=3), "placement/r": encode_placement([three])}
    placer = ReplicaPlacer()
    desired, leases = desired_placement(view_of(entries), placer, {}, time.monotonic())
    assert desired["r"] == [three]
    entries["nodes/a"] = registration("a", lease=2, replication=True)
    again, _ = desired_placement(view_of(entries), placer, leases, time.monotonic())
    assert again["r"][0].leader == "a" and again["r"][0].leader_epoch == 5


def test_a_leader_restarted_before_a_new_controller_took_over_leads_in_a_new_epoch() -> None:
    """The placement keeps the lease its leader was named under: a controller that never saw
    that lease (the old one died with the leader) still sees the leader registered again."""
    three = ShardPlacement("a", ("a", "b", "c"), ("a", "b", "c"), 4, leader_lease=1)
    entries = {**{f"nodes/{n}": registration(n, lease=1, replication=True) for n in "abc"},
               "streams/r": stream(1, replicas=3), "placement/r": encode_placement([three])}
    entries["nodes/a"] = registration("a", lease=2, replication=True)
    desired, leases = desired_placement(view_of(entries), ReplicaPlacer(), {}, time.monotonic())
    assert (desired["r"][0].leader, desired["r"][0].leader_epoch) == ("a", 5)
    assert desired["r"][0].leader_lease == 2
    # written so, it stays so: the next pass names nobody again
    entries["placement/r"] = encode_placement(desired["r"])
    again, _ = desired_placement(view_of(entries), ReplicaPlacer(), leases, time.monotonic())
    assert again["r"] == desired["r"]


def test_a_leader_named_in_a_new_epoch_is_stamped_with_its_lease() -> None:
    three = ShardPlacement("a", ("a", "b", "c"), ("a", "b", "c"), 4)
    entries = {**{f"nodes/{n}": registration(n, lease=7, replication=True) for n in "bc"},
               "streams/r": stream(1, replicas=3), "placement/r": encode_placement([three])}
    desired, _ = desired_placement(view_of(entries), ReplicaPlacer(), {}, time.monotonic())
    elected = desired["r"][0]
    assert elected.leader in ("b", "c") and elected.leader_epoch == 5
    assert elected.leader_lease == 7
    assert ShardPlacement.from_json(elected.to_json()) == elected


def test_every_proposal_read_is_answered_in_order_compared_on_its_revision() -> None:
    proposal = IsrProposal("a", 0, 0, frozenset({"a"}))
    view = view_of({"nodes/a": registration("a"), "isr/s/1": encode_proposal(proposal),
                    "isr/s/0": encode_proposal(proposal)})
    change = placement_change(view, "a", {})
    assert list(change.answered) == [AnsweredProposal("s", 0, 3), AnsweredProposal("s", 1, 2)]


def test_a_proposal_that_gives_the_shard_up_says_so_in_etcd() -> None:
    for proposal in (IsrProposal("a", 3, 2, frozenset({"b"}), gives_up=True),
                     IsrProposal("a", 3, 2, frozenset({"a", "b"}))):
        assert decode_proposal(encode_proposal(proposal)) == proposal


class RecordingStore:
    """The store's `write_placement`, answering what a test says etcd did."""

    def __init__(self, answer: PlacementWritten | None = None) -> None:
        self.answer = answer
        self.changes: list[PlacementChange] = []

    async def write_placement(self, change: PlacementChange) -> PlacementWritten:
        self.changes.append(change)
        if self.answer is not None:
            return self.answer
        return PlacementWritten(change.guard_revision + 1, True, tuple(change.answered))


def controller_over(view: EtcdClusterView, store: RecordingStore) -> Controller:
    return Controller(store, view, "a", ClusterSettings())  # type: ignore[arg-type]


async def test_a_complete_write_becomes_the_views_placement_and_a_refused_one_does_not() -> None:
    proposal = IsrProposal("a", 0, 0, frozenset({"a"}))
    entries = {"nodes/a": registration("a"), "streams/s": stream(1, mode="non-reliable"),
               "isr/x/0": encode_proposal(proposal)}
    refused_view = view_of(entries)
    refusing = RecordingStore(PlacementWritten(refused_view.guard_revision, False, ()))
    await controller_over(refused_view, refusing).write_placement()
    assert refusing.changes and "s" not in refused_view.placement
    assert ("x", 0) in refused_view.proposals  # not answered: read again at the next pass
    view = view_of(entries)
    controller = controller_over(view, RecordingStore())
    await controller.write_placement()
    assert [placed.leader for placed in view.placement["s"]] == ["a"]
    assert view.guard_revision == 1 and not view.proposals
    assert controller.leases_seen == {"a": 1}


class RefusedWhileTheWatchCatchesUp(RecordingStore):
    """Refuses the write (the guard it compared on is an older one), while the view's watch
    brings the guard's newer revision, `newer`, before the answer."""

    def __init__(self, view: EtcdClusterView, newer: int) -> None:
        super().__init__()
        self.view = view
        self.newer = newer

    async def write_placement(self, change: PlacementChange) -> PlacementWritten:
        self.changes.append(change)
        self.view.apply(PREFIX, [WatchEvent(PREFIX + keys.PLACEMENT_GUARD, b"{}", self.newer, 1)])
        return PlacementWritten(change.guard_revision, False, ())


async def test_a_refused_write_leaves_the_view_at_the_guard_its_watch_brought_meanwhile() -> None:
    """A pass made from an older guard (the watch brought an earlier write of this controller's
    late) is refused, and the watch brings the newer guard while it is on its way: the view
    keeps that one. Going back to the one the pass read, it was refused at every pass after:
    no later event corrects it (only the controller writes the guard), and the placement froze
    (`test_cluster_controller_watch_lag.py`, on etcd)."""
    proposal = IsrProposal("a", 0, 0, frozenset({"a"}))
    view = view_of({"nodes/a": registration("a"), "streams/s": stream(1, mode="non-reliable"),
                    keys.PLACEMENT_GUARD: b"{}", "isr/x/0": encode_proposal(proposal)})
    read = view.guard_revision
    store = RefusedWhileTheWatchCatchesUp(view, read + 10)
    await controller_over(view, store).write_placement()
    assert store.changes[0].guard_revision == read and "s" not in view.placement
    assert view.guard_revision == read + 10
    # and the next pass compares on it
    await controller_over(view, RecordingStore()).write_placement()
    assert view.guard_revision == read + 11 and [p.leader for p in view.placement["s"]] == ["a"]


def test_a_drained_live_leader_is_moved_once_it_answered_the_request_as_it_stands() -> None:
    three = ShardPlacement("a", ("a", "b", "c"), ("a", "b", "c"), 4)
    entries = {**{f"nodes/{n}": registration(n, replication=True) for n in "abc"},
               "streams/r": stream(1, replicas=3), "placement/r": encode_placement([three]),
               "drain/a": keys.encode({"since_ms": 1})}
    placer = ReplicaPlacer()
    desired, _ = desired_placement(view_of(entries), placer, {}, time.monotonic())
    assert desired["r"] == [three] and placer.quiesce_wanted == {("r", 0): ("a", 4)}
    # the request (here at revision 7, the seventh key) and an answer naming it: off it goes
    entries["quiesce/r/0"] = keys.encode({"leader": "a", "epoch": 4})
    answer = {"leader": "a", "epoch": 4, "asked": 7, "high_watermark": 9, "known": True}
    entries["quiesced/r/0"] = keys.encode(answer)
    view = view_of(entries)
    assert view.quiesce_requests[("r", 0)] == ("a", 4, 7)
    moved, _ = desired_placement(view, placer, {}, time.monotonic())
    assert (moved["r"][0].leader, moved["r"][0].leader_epoch) == ("b", 5)
    assert placer.quiesce_wanted == {}
    # an answer to an earlier request (withdrawn and made again since) is none to this one
    entries["quiesced/r/0"] = keys.encode({**answer, "asked": 3})
    held, _ = desired_placement(view_of(entries), ReplicaPlacer(), {}, time.monotonic())
    assert held["r"] == [three]
