"""ChurnBook: stored-block counts seen at lookups become per-replica rates and relative churn."""

from __future__ import annotations

import pytest

from router.decide.churn import ChurnBook
from tests.clock import ManualClock
from tracker.core.index import Residency


def test_rates_from_successive_counts() -> None:
    clock = ManualClock(100.0)
    book = ChurnBook(half_life_s=10.0, min_interval_s=1.0, settle_s=2.0, clock=clock)
    book.observe({"a": Residency(10, 1000), "b": Residency(10, 50)})
    assert book.rate("a") is None  # one count is no rate
    clock.now += 0.5
    book.observe({"a": Residency(10, 5000)})  # too close to the last count: ignored
    assert book.rate("a") is None
    clock.now += 1.5
    book.observe({"a": Residency(10, 1400), "b": Residency(10, 150)})
    assert book.rate("a") == pytest.approx(200.0)  # 400 blocks in 2 s
    assert book.rate("b") == pytest.approx(50.0)
    assert book.relative(["a", "b", "c"]) == {
        "a": pytest.approx(1.6),
        "b": pytest.approx(0.4),
        "c": None,
    }


def test_rates_are_smoothed_over_the_half_life() -> None:
    clock = ManualClock(100.0)
    book = ChurnBook(half_life_s=10.0, clock=clock)
    book.observe({"a": Residency(0, 0)})
    clock.now += 10
    book.observe({"a": Residency(0, 1000)})  # 100/s
    clock.now += 10
    book.observe({"a": Residency(0, 1000)})  # 0/s for one half-life
    assert book.rate("a") == pytest.approx(50.0)


def test_a_rebuilt_index_starts_over_and_idle_fleets_are_alike() -> None:
    clock = ManualClock(100.0)
    book = ChurnBook(settle_s=1.0, clock=clock)
    book.observe({"a": Residency(5, 500), "b": Residency(5, 500)})
    clock.now += 2
    book.observe({"a": Residency(5, 10), "b": Residency(5, 500)})  # a's count went back
    assert book.rate("a") is None
    assert book.relative(["a", "b"]) == {"a": None, "b": 1.0}  # b: 0/s, the mean is 0
    book.forget("b")
    assert book.rate("b") is None


def test_a_rate_is_known_once_its_counts_span_a_half_life() -> None:
    """One or two samples of a bursty count are no rate: a replica that stored a prefix a
    second ago would look to churn fastest of all."""
    clock = ManualClock(100.0)
    book = ChurnBook(half_life_s=10.0, clock=clock)
    book.observe({"a": Residency(0, 0), "b": Residency(0, 0)})
    for second in range(1, 10):
        clock.now += 1
        book.observe({"a": Residency(0, 300 * second), "b": Residency(0, 0)})
        assert book.relative(["a", "b"]) == {"a": None, "b": None}, second
    clock.now += 1
    book.observe({"a": Residency(0, 3000), "b": Residency(0, 0)})
    assert book.rate("a") == pytest.approx(300.0)
    assert book.relative(["a", "b"]) == {"a": pytest.approx(2.0), "b": 0.0}
    book.observe({"a": Residency(0, 0)})  # the index was rebuilt: a half-life again
    clock.now += 2
    book.observe({"a": Residency(0, 600)})
    assert book.rate("a") is None


def test_bad_settings() -> None:
    with pytest.raises(ValueError):
        ChurnBook(half_life_s=0)
