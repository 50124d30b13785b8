"""OccupancyBook: each replica's requests in flight over the last seconds, time-weighted."""

from __future__ import annotations

import pytest

from router.decide.occupancy import OccupancyBook
from tests.clock import ManualClock


def test_a_count_weighs_by_how_long_it_held_and_halves_every_half_life() -> None:
    clock = ManualClock(50.0)
    book = OccupancyBook(1.0, clock=clock)
    assert book.observe("a", 4) == 4.0  # the first count is all it knows
    clock.now += 1.0
    assert book.observe("a", 0) == pytest.approx(4.0)  # 4 held for the whole second
    clock.now += 1.0
    assert book.observe("a", 0) == pytest.approx(2.0)  # then 0 for one half-life
    clock.now += 2.0
    assert book.observe("a", 6) == pytest.approx(0.5)
    assert book.observe("a", 6) == pytest.approx(0.5)  # no time passed: nothing changes
    clock.now += 1.0
    assert book.observe("a", 6) == pytest.approx(0.5 * 0.5 + 6 * 0.5)


def test_replicas_are_apart_and_a_replica_that_left_starts_over() -> None:
    clock = ManualClock()
    book = OccupancyBook(2.0, clock=clock)
    book.observe("a", 8)
    book.observe("b", 1)
    clock.now += 2.0
    assert (book.observe("a", 0), book.observe("b", 1)) == (pytest.approx(8.0), 1.0)
    book.forget("a")
    book.forget("unknown")
    assert book.observe("a", 0) == 0.0


def test_the_half_life_must_be_positive() -> None:
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="half_life_s"):
            OccupancyBook(bad)
