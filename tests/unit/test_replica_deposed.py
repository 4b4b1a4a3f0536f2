"""`DeposedWaiters`: what a leader that lost its epoch still owes its publishers. A publish is
acknowledged only by the high watermark of a newer epoch's leader that passed it on a log
never cut below it; a cut below it, the deadline, or the end of following refuse it
(retryable); a new leadership over the same log takes what waits."""

from __future__ import annotations

from shardgate.cluster.replica_deposed import DeposedWaiters
from shardgate.cluster.replica_epochs import ReplicaError

NOT_LEADER = ReplicaError.NOT_LEADER


def deposed(*ends: int, epoch: int = 1, deadline: float = 10.0) -> DeposedWaiters[str]:
    waiters: DeposedWaiters[str] = DeposedWaiters()
    waiters.add(epoch, [(end, f"w{end}") for end in ends], deadline)
    return waiters


def test_the_new_leaders_high_watermark_acknowledges_what_it_passed() -> None:
    waiters = deposed(3, 5, 8)
    waiters.learned(2, 5)
    assert waiters.take_completed() == [("w3", None), ("w5", None)]
    assert len(waiters) == 1
    waiters.learned(2, 7)
    assert waiters.take_completed() == []
    waiters.learned(3, 8)  # a later leader's mark counts as well
    assert waiters.take_completed() == [("w8", None)]
    assert len(waiters) == 0


def test_only_a_newer_epochs_high_watermark_settles_anything() -> None:
    waiters = deposed(3, epoch=4)
    waiters.learned(4, 10)  # (never from this leader's own epoch)
    waiters.learned(3, 10)
    assert waiters.take_completed() == [] and len(waiters) == 1


def test_a_cut_below_a_publishs_end_refuses_it_and_keeps_the_rest() -> None:
    waiters = deposed(3, 5, 8)
    waiters.cut(5)  # the records from offset 5 on are gone
    assert waiters.take_completed() == [("w8", NOT_LEADER)]
    waiters.learned(2, 100)  # what the new leader holds at 5.. is not w8's record
    assert waiters.take_completed() == [("w3", None), ("w5", None)]


def test_what_is_not_settled_by_its_deadline_is_refused() -> None:
    waiters = deposed(3, deadline=10.0)
    waiters.add(2, [(9, "later")], 20.0)
    waiters.expire(9.9)
    assert waiters.take_completed() == []
    waiters.expire(10.0)
    assert waiters.take_completed() == [("w3", NOT_LEADER)]
    waiters.refuse_all()  # the node stops following the shard
    assert waiters.take_completed() == [("later", NOT_LEADER)]
    assert len(waiters) == 0


def test_a_new_leadership_takes_what_waits_in_order() -> None:
    waiters = deposed(3, 5)
    assert waiters.take_all() == [(3, "w3"), (5, "w5")]
    assert len(waiters) == 0 and waiters.take_completed() == []
