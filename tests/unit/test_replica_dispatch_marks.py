"""A replicated shard leader's dispatched mark (`dispatch_marks.DispatchMarks`): the offset
below which every record of the shard was dispatched here and each push of it answered by the
node it went to. It moves to a checkpoint's offset only once every link settled the pushes it
had queued at that checkpoint; a checkpoint taken while a stored message waits for some node's
routes never counts; a link closed since is not waited for; a leadership starts at the mark
its hand-on starts from."""

from __future__ import annotations

from dataclasses import dataclass

from shardgate.cluster.dispatch_marks import DispatchMarks

KEY = ("s", 0)


@dataclass
class Link:
    pushes_queued: int = 0
    pushes_settled: int = 0

    def push(self, count: int = 1) -> None:
        self.pushes_queued += count

    def answer(self) -> None:
        self.pushes_settled = self.pushes_queued


class Plane:
    def __init__(self, *nodes: str) -> None:
        self.dispatched: dict[tuple[str, int], int] = {}
        self.links = {node: Link() for node in nodes}
        self.held = 0
        self.marks = DispatchMarks(self.dispatched, self.links, lambda: self.held > 0)

    def dispatch(self, end: int, *to: str) -> None:
        """The shard dispatched to `end`, each record pushed to the nodes `to`."""
        self.dispatched[KEY] = end
        for node in to:
            self.links[node].push()


def test_the_mark_moves_once_every_link_answered_the_pushes_of_a_checkpoint() -> None:
    plane = Plane("n2", "n3")
    plane.marks.begin(KEY, 10)
    assert plane.marks.mark(KEY) == 10  # the hand-on's start, before anything is dispatched
    plane.dispatch(15, "n2", "n3")
    assert plane.marks.mark(KEY) == 10  # checkpoint (15), pushes not answered
    plane.links["n2"].answer()
    assert plane.marks.mark(KEY) == 10  # n3 has not answered
    plane.dispatch(18, "n3")
    assert plane.marks.mark(KEY) == 10  # checkpoint (18)
    plane.links["n3"].pushes_settled = 1  # n3 answered the first push to it, not the second
    assert plane.marks.mark(KEY) == 15
    plane.links["n3"].answer()
    assert plane.marks.mark(KEY) == 18
    plane.dispatch(20)  # a record nobody else wants: nothing on its way, it counts at once
    assert plane.marks.mark(KEY) == 20


def test_a_push_still_unanswered_holds_the_mark_below_it() -> None:
    plane = Plane("n2")
    plane.marks.begin(KEY, 0)
    plane.dispatch(5, "n2")
    assert plane.marks.mark(KEY) == 0
    plane.dispatch(6, "n2")
    assert plane.marks.mark(KEY) == 0
    plane.links["n2"].pushes_settled = 1  # the second push is on its way
    assert plane.marks.mark(KEY) == 5
    assert plane.marks.mark(KEY) == 5
    plane.links["n2"].answer()
    assert plane.marks.mark(KEY) == 6


def test_a_checkpoint_taken_while_a_message_waits_for_routes_never_counts() -> None:
    plane = Plane("n2")
    plane.marks.begin(KEY, 0)
    plane.dispatch(5)
    plane.held = 1  # held for a node whose routes are not known yet
    assert plane.marks.mark(KEY) == 0
    assert plane.marks.mark(KEY) == 0
    plane.held = 0
    plane.dispatch(7, "n2")  # the held one was pushed
    assert plane.marks.mark(KEY) == 0
    plane.links["n2"].answer()
    assert plane.marks.mark(KEY) == 7


def test_a_link_closed_since_the_checkpoint_is_not_waited_for() -> None:
    plane = Plane("n2", "n3")
    plane.marks.begin(KEY, 0)
    plane.dispatch(4, "n2", "n3")
    assert plane.marks.mark(KEY) == 0
    plane.links["n2"].answer()
    del plane.links["n3"]  # n3 left the view: what its link held was given up
    assert plane.marks.mark(KEY) == 4


def test_a_leadership_counts_its_own_dispatching_from_where_its_hand_on_starts() -> None:
    plane = Plane("n2")
    plane.dispatched[KEY] = 900  # dispatched in an earlier leadership of this process
    plane.marks.begin(KEY, 400)
    assert KEY not in plane.dispatched
    assert plane.marks.mark(KEY) == 400
    # held alone until now (no hand-on): what this process dispatched counts
    plane.dispatched[KEY] = 900
    plane.marks.begin(KEY, None)
    assert plane.marks.mark(KEY) == 900
    plane.marks.end(KEY)
    assert plane.marks.mark(KEY) is None
    # nothing dispatched and nothing handed on: not known
    del plane.dispatched[KEY]
    plane.marks.begin(KEY, None)
    assert plane.marks.mark(KEY) is None


def test_it_says_when_a_waiting_checkpoint_would_count_so_parked_fetches_learn_it_at_once() -> None:
    plane = Plane("n2")
    plane.marks.begin(KEY, 0)
    assert not plane.marks.waiting(KEY) and not plane.marks.ready(KEY)
    plane.dispatch(3, "n2")
    assert plane.marks.mark(KEY) == 0
    assert plane.marks.waiting(KEY) and not plane.marks.ready(KEY)
    plane.links["n2"].answer()
    assert plane.marks.ready(KEY)
    assert plane.marks.mark(KEY) == 3
    assert not plane.marks.waiting(KEY)
