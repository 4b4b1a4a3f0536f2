"""The broker's back-pressure (core/backpressure.py): a congested queue holds the publisher in
hand, whatever it is, and every held publisher is released once no queue is congested."""

from __future__ import annotations

from shardgate.core.backpressure import BackPressure


class Publisher:
    def __init__(self) -> None:
        self.held = False
        self.releases = 0

    def hold(self) -> None:
        self.held = True

    def release(self) -> None:
        self.held = False
        self.releases += 1


def test_a_congested_queue_holds_the_current_publisher_until_every_queue_is_relieved() -> None:
    pressure = BackPressure()
    first, second = Publisher(), Publisher()
    with pressure.publishing(first):
        pressure.congested("queue-a")
    with pressure.publishing(second):
        pressure.congested("queue-b")
    assert first.held and second.held
    pressure.relieved("queue-a")
    assert first.held and second.held  # queue-b is still congested
    pressure.relieved("queue-b")
    assert (first.held, second.held) == (False, False)
    assert (first.releases, second.releases) == (1, 1)


def test_nobody_is_held_outside_a_publisher_and_a_queue_does_not_hold_its_own_client() -> None:
    pressure = BackPressure()
    own = Publisher()
    pressure.congested("queue")  # no current publisher: a timer's delivery, say
    with pressure.publishing(own):
        pressure.congested("queue", own=own)
    assert not own.held
    assert pressure.is_congested("queue")


def test_publishing_nests_and_restores_the_outer_publisher() -> None:
    pressure = BackPressure()
    outer, inner = Publisher(), Publisher()
    with pressure.publishing(outer):
        with pressure.publishing(inner):
            assert pressure.current is inner
        assert pressure.current is outer
        pressure.congested("queue")
    assert pressure.current is None
    assert outer.held and not inner.held


def test_a_publisher_released_while_it_holds_again_is_held_by_the_next_congestion() -> None:
    pressure = BackPressure()
    link = Publisher()

    class Relapsing(Publisher):
        """Released, it dispatches at once and fills the queue again (a peer's backlog)."""

        def release(self) -> None:
            super().release()
            with pressure.publishing(self):
                pressure.congested("queue")

    relapsing = Relapsing()
    with pressure.publishing(relapsing):
        pressure.congested("queue")
    with pressure.publishing(link):
        pressure.congested("other")
    pressure.relieved("other")
    assert relapsing.held and link.held  # "queue" is congested still
    pressure.relieved("queue")
    assert relapsing.held and not link.held  # held again by its own relapse
    assert relapsing.releases == 1
