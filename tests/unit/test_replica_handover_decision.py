"""Where a node that has just begun to lead a replicated shard starts handing on what it
inherited (`replicated_shards.inherited_from`): the records of an earlier epoch that nobody may
have dispatched to live subscribers. From its known high watermark when the old leader's
process still runs (it dispatched what it committed; at a graceful leave this node knows its
last high watermark, the old leader waited for that), from further back when that process is
gone or was started again (it may have died before its pushes arrived: from the dispatched
mark it told this node, else the mark kept on this node's disk, else further back), from
before the log's end when nothing is known of it (this process started since, and no mark was
kept), and nothing for a shard this process held alone (it dispatched it)."""

from __future__ import annotations

from shardgate.cluster.keys import NodeRegistration
from shardgate.cluster.replicated_shards import REDISPATCH_RECORDS, inherited_from

HW, END = 50_000, 50_010


def registered(**leases: int) -> dict[str, NodeRegistration]:
    return {node: NodeRegistration(node, "127.0.0.1:1", "instance", 0, lease=lease)
            for node, lease in leases.items()}


def start(previous: tuple[str, int | None] | None, registrations: dict[str, NodeRegistration],
          *, held_alone: bool = False, high_watermark: int = HW,
          dispatched: int | None = None, kept: int | None = None) -> int | None:
    return inherited_from(previous, node_id="n2", registrations=registrations,
                          held_alone=held_alone, high_watermark=high_watermark, log_end=END,
                          dispatched=dispatched, kept=kept)


def test_a_leader_that_still_runs_under_its_lease_is_handed_on_from_the_known_high_watermark() -> None:
    assert start(("n1", 7), registered(n1=7, n2=9)) == HW
    # a graceful leave: the old leader took no more publishes and waited until this node knew
    # the high watermark it ended at, here all it held; nothing is handed on
    assert start(("n1", 7), registered(n1=7, n2=9), high_watermark=END) == END


def test_a_leader_gone_or_started_again_is_handed_on_from_further_back() -> None:
    assert start(("n1", 7), registered(n2=9)) == HW - REDISPATCH_RECORDS
    assert start(("n1", 7), registered(n1=8, n2=9)) == HW - REDISPATCH_RECORDS  # a new process
    assert start(("n1", None), registered(n1=8, n2=9)) == HW - REDISPATCH_RECORDS  # lease not known


def test_a_leader_gone_is_handed_on_from_the_dispatched_mark_it_told() -> None:
    # every record below the mark was dispatched and each push of it answered: nothing below
    # it can be missing anywhere, what lies above it may be
    assert start(("n1", 7), registered(n2=9), dispatched=HW - 3) == HW - 3
    assert start(("n1", 7), registered(n1=8, n2=9), dispatched=HW - 3) == HW - 3  # a new process
    assert start(("n1", None), registered(n2=9), dispatched=0) == 0
    # never above the high watermark this node knew (the mark came with it, bounded by it)
    assert start(("n1", 7), registered(n2=9), dispatched=HW + 5) == HW
    # the old leader still runs: it dispatched what it committed, the mark changes nothing
    assert start(("n1", 7), registered(n1=7, n2=9), dispatched=HW - 3) == HW
    # placed as leader in an epoch this node's earlier run led: nothing was told of that run
    assert start(("n2", None), registered(n2=9), dispatched=HW - 3) == END - REDISPATCH_RECORDS


def test_where_no_high_watermark_is_known_the_margin_is_taken_below_the_logs_end() -> None:
    assert start(("n1", 7), registered(n2=9), high_watermark=0) == END - REDISPATCH_RECORDS
    # placed as leader in an epoch this node's earlier run led: that run is gone
    assert start(("n2", None), registered(n2=9)) == END - REDISPATCH_RECORDS


def test_with_no_leader_followed_only_a_shard_held_alone_here_is_not_handed_on() -> None:
    assert start(None, registered(n2=9), held_alone=True) is None
    assert start(None, registered(n2=9)) == END - REDISPATCH_RECORDS


def test_a_node_started_again_hands_on_from_the_mark_kept_on_its_disk() -> None:
    # nothing in memory (no leader followed since this process started): the kept mark
    assert start(None, registered(n2=9), kept=HW - 40) == HW - 40
    # its own earlier run led (nothing was told of that run): the mark that run kept
    assert start(("n2", None), registered(n2=9), kept=HW - 40) == HW - 40
    assert start(("n2", None), registered(n2=9), dispatched=HW - 3, kept=HW - 40) == HW - 40
    # a leader gone that told no mark since this process started (its high watermark is 0)
    assert start(("n1", 7), registered(n2=9), high_watermark=0, kept=HW - 40) == HW - 40
    # both a told mark and a kept one are lower bounds: the further one
    assert start(("n1", 7), registered(n2=9), dispatched=HW - 3, kept=HW - 40) == HW - 3
    assert start(("n1", 7), registered(n2=9), dispatched=HW - 90, kept=HW - 40) == HW - 40
    # the old leader still runs: from the high watermark, as before
    assert start(("n1", 7), registered(n1=7, n2=9), kept=HW - 40) == HW
    # a shard held alone here is still not handed on
    assert start(None, registered(n2=9), held_alone=True, kept=HW - 40) is None
