"""The leader-epoch history of a shard's log (KIP-101's cache): assignment keeps it monotonic,
"where does epoch E end" answers as Kafka's OffsetsForLeaderEpoch (with KIP-279's epoch),
truncation from either end, and the epochs sent beside fetched records."""

from __future__ import annotations

import pytest

from shardgate.cluster.replica_epochs import UNDEFINED, EpochHistory, EpochStart, epochs_in


def history(*pairs: tuple[int, int]) -> EpochHistory:
    return EpochHistory(EpochStart(epoch, start) for epoch, start in pairs)


def test_the_latest_epoch_again_is_not_a_new_entry() -> None:
    epochs = history((1, 0))
    assert epochs.assign(1, 10) is False
    assert epochs.entries == (EpochStart(1, 0),)
    assert epochs.assign(2, 10) is True
    assert epochs.latest_epoch == 2


def test_an_epoch_that_holds_no_record_is_replaced_by_the_next() -> None:
    epochs = history((1, 0), (2, 5))
    epochs.assign(3, 5)  # epoch 2 wrote nothing
    assert epochs.entries == (EpochStart(1, 0), EpochStart(3, 5))


def test_a_lower_epoch_drops_the_entries_it_conflicts_with() -> None:
    epochs = history((1, 0), (3, 5))
    epochs.assign(2, 7)
    assert epochs.entries == (EpochStart(1, 0), EpochStart(2, 7))


def test_negative_epochs_and_offsets_are_refused() -> None:
    with pytest.raises(ValueError):
        EpochHistory().assign(-1, 0)
    with pytest.raises(ValueError):
        EpochHistory().assign(1, -5)


def test_end_offset_of_the_latest_epoch_is_the_log_end() -> None:
    assert history((1, 0), (4, 10)).end_offset_for(4, 17) == (4, 17)


def test_end_offset_of_an_earlier_epoch_is_where_the_next_starts() -> None:
    epochs = history((1, 0), (4, 10), (6, 20))
    assert epochs.end_offset_for(1, 30) == (1, 10)
    assert epochs.end_offset_for(4, 30) == (4, 20)


def test_an_epoch_the_log_never_had_answers_with_the_largest_epoch_below_it() -> None:
    # KIP-279: the follower learns which epoch the answer is about
    epochs = history((1, 0), (4, 10), (6, 20))
    assert epochs.end_offset_for(3, 30) == (1, 10)
    assert epochs.end_offset_for(5, 30) == (4, 20)


def test_an_epoch_below_every_known_one_ends_where_the_first_starts() -> None:
    assert history((3, 7), (5, 9)).end_offset_for(1, 12) == (1, 7)


def test_an_epoch_above_every_known_one_or_an_empty_history_is_undefined() -> None:
    assert history((1, 0), (2, 5)).end_offset_for(9, 12) == (UNDEFINED, UNDEFINED)
    assert EpochHistory().end_offset_for(1, 0) == (UNDEFINED, UNDEFINED)
    assert history((1, 0)).end_offset_for(UNDEFINED, 3) == (UNDEFINED, UNDEFINED)


def test_epoch_at_names_the_epoch_a_record_was_written_in() -> None:
    epochs = history((1, 0), (4, 10))
    assert [epochs.epoch_at(o) for o in (0, 9, 10, 50)] == [1, 1, 4, 4]
    assert history((2, 5)).epoch_at(3) == UNDEFINED


def test_truncate_from_forgets_epochs_starting_at_or_after_the_cut() -> None:
    epochs = history((1, 0), (4, 10), (6, 20))
    epochs.truncate_from(20)
    assert epochs.entries == (EpochStart(1, 0), EpochStart(4, 10))
    epochs.truncate_from(5)
    assert epochs.entries == (EpochStart(1, 0),)
    epochs.truncate_from(0)
    assert epochs.latest_epoch == UNDEFINED


def test_truncate_until_moves_the_epoch_holding_the_new_start() -> None:
    epochs = history((1, 0), (4, 10), (6, 20))
    epochs.truncate_until(15)
    assert epochs.entries == (EpochStart(4, 15), EpochStart(6, 20))
    epochs.truncate_until(3)  # before every epoch still kept: nothing to do
    assert epochs.entries == (EpochStart(4, 15), EpochStart(6, 20))


def test_entries_in_a_range_start_at_the_range() -> None:
    epochs = history((1, 0), (4, 10), (6, 20))
    assert epochs_in(epochs, 5, 25) == (EpochStart(1, 5), EpochStart(4, 10), EpochStart(6, 20))
    assert epochs_in(epochs, 12, 18) == (EpochStart(4, 12),)
    assert epochs_in(epochs, 12, 12) == ()
