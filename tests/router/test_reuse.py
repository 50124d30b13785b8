"""ReuseBook: the blocks of each replica's cache that routed requests reused lately."""

from __future__ import annotations

import pytest

from router.reuse import ReuseBook
from tests.clock import ManualClock


def test_unknown_until_the_book_has_watched_a_whole_window() -> None:
    clock = ManualClock(100.0)
    book = ReuseBook(30.0, clock=clock)
    book.record("a", root=1, blocks=300)
    assert book.valued("a") is None  # a restarted router cannot tell cold from unseen
    clock.now += 30.0
    assert book.valued("b") == 0  # watched, and nothing routed there was a hit


def test_prefixes_sum_by_their_deepest_reuse_and_lapse_after_the_window() -> None:
    clock = ManualClock(100.0)
    book = ReuseBook(30.0, clock=clock)
    clock.now += 30.0
    book.record("a", root=1, blocks=300)
    book.record("a", root=2, blocks=300)
    book.record("a", root=1, blocks=120)  # a shorter hit of a prefix seen deeper
    book.record("a", root=3, blocks=0)  # a miss reuses nothing
    book.record("b", root=1, blocks=40)
    assert (book.valued("a"), book.valued("b")) == (600, 40)
    clock.now += 20.0
    book.record("a", root=2, blocks=310)  # a conversation grew: its turn's depth
    clock.now += 15.0  # root 1 was last reused 35 s ago
    assert book.valued("a") == 310
    clock.now += 20.0
    assert book.valued("a") == 0
    book.forget("b")
    assert book.valued("b") == 0


def test_the_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window_s"):
        ReuseBook(0.0)


def test_a_replica_keeps_a_bounded_number_of_prefixes_oldest_first_out() -> None:
    clock = ManualClock(100.0)
    book = ReuseBook(30.0, clock=clock)
    clock.now += 30.0
    for root in range(10_000):
        book.record("a", root=root, blocks=1)
    assert book.valued("a") == 8_192  # the 1,808 oldest were dropped, and their blocks
