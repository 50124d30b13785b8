"""Online prefill-speed estimates: seed without data, convergence, robustness, bounds."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.decide.estimator import SpeedBook, SpeedModel
from router.decide.policy_types import DEFAULT_SPEED, SpeedEstimate


def _feed(
    model: SpeedModel,
    floor: float,
    slope: float,
    n: int,
    rng: random.Random,
    *,
    noise: float = 5.0,
    outliers: float = 0.0,
    x_max: float = 8000.0,
) -> None:
    for _ in range(n):
        x = rng.uniform(0, x_max)
        y = floor + slope * x + rng.gauss(0, noise)
        if rng.random() < outliers:
            y += rng.uniform(1_000, 20_000)  # a stall, a retry, a GC pause
        model.observe(max(y, 0.0), x)


def test_without_data_the_estimate_is_the_seed() -> None:
    seed = SpeedEstimate(floor_ms=30.0, prefill_ms_per_token=0.05)
    model = SpeedModel(seed)
    assert model.estimate() == seed
    assert model.samples == 0 and model.spread_tokens == 0
    book = SpeedBook(seed)
    assert book.get("never-seen") == seed
    assert book.estimates() == {}


@pytest.mark.parametrize(
    ("floor", "slope"),
    [(40.0, 0.05), (8.0, 0.01), (25.0, 0.032), (60.0, 0.25)],  # last: Llama-70B vs 8B seed
)
def test_converges_to_the_true_floor_and_slope(floor: float, slope: float) -> None:
    model = SpeedModel(DEFAULT_SPEED)
    _feed(model, floor, slope, 1000, random.Random(42))
    estimate = model.estimate()
    assert estimate.prefill_ms_per_token == pytest.approx(slope, rel=0.03)
    assert estimate.floor_ms == pytest.approx(floor, abs=4.0)


def test_learns_fast_when_the_seed_is_right_order_of_magnitude() -> None:
    model = SpeedModel(DEFAULT_SPEED)
    _feed(model, 40.0, 0.05, 100, random.Random(1))
    assert model.estimate().prefill_ms_per_token == pytest.approx(0.05, rel=0.05)
    assert model.estimate().floor_ms == pytest.approx(40.0, abs=5.0)


def test_robust_to_outliers() -> None:
    clean, dirty = SpeedModel(DEFAULT_SPEED), SpeedModel(DEFAULT_SPEED)
    _feed(clean, 40.0, 0.05, 1000, random.Random(5))
    _feed(dirty, 40.0, 0.05, 1000, random.Random(5), outliers=0.05)
    assert dirty.estimate().prefill_ms_per_token == pytest.approx(0.05, rel=0.05)
    assert dirty.estimate().floor_ms == pytest.approx(40.0, abs=10.0)
    # for scale: the plain least-squares fit of the same data would be off by ~500 ms
    assert abs(dirty.estimate().floor_ms - clean.estimate().floor_ms) < 10.0


def test_no_spread_in_tokens_keeps_the_seed_slope_and_learns_the_level() -> None:
    model = SpeedModel(DEFAULT_SPEED)
    rng = random.Random(2)
    for _ in range(500):
        model.observe(90.0 + rng.gauss(0, 2), 1000)
    estimate = model.estimate()
    assert estimate.prefill_ms_per_token == pytest.approx(DEFAULT_SPEED.prefill_ms_per_token)
    assert estimate.prefill_ms(1000) == pytest.approx(90.0, abs=1.0)


def test_follows_a_change_of_speed() -> None:
    model = SpeedModel(DEFAULT_SPEED, half_life=50)
    rng = random.Random(3)
    _feed(model, 30.0, 0.03, 500, rng)
    _feed(model, 30.0, 0.06, 500, rng)  # e.g. a neighbour started sharing the GPU
    assert model.estimate().prefill_ms_per_token == pytest.approx(0.06, rel=0.05)


def test_garbage_is_ignored_and_bounds_hold() -> None:
    model = SpeedModel(DEFAULT_SPEED, max_ms_per_token=1.0, max_floor_ms=1000.0)
    for ttft, tokens in [(math.nan, 10), (math.inf, 10), (-5.0, 10), (10.0, -1), (10.0, math.nan)]:
        model.observe(ttft, tokens)
    assert model.rejected == 5 and model.observations == 0
    assert model.estimate() == DEFAULT_SPEED
    for i in range(2000):
        model.observe(1e9, 10 + i % 2)  # absurd: a billion ms for ten tokens
    estimate = model.estimate()
    assert estimate.floor_ms <= 1000.0 and estimate.prefill_ms_per_token <= 1.0
    for _ in range(2000):
        model.observe(0.0, 50_000)  # absurd the other way: instant
    estimate = model.estimate()
    assert estimate.floor_ms >= 0.0 and estimate.prefill_ms_per_token >= model.min_ms_per_token


@given(
    st.lists(
        st.tuples(st.floats(0, 1e7, allow_nan=False), st.floats(0, 1e6, allow_nan=False)),
        max_size=60,
    )
)
def test_any_observations_give_a_finite_bounded_estimate(
    observations: list[tuple[float, float]],
) -> None:
    model = SpeedModel(DEFAULT_SPEED, half_life=5)
    for ttft, tokens in observations:
        model.observe(ttft, tokens)
        estimate = model.estimate()
        assert math.isfinite(estimate.floor_ms) and math.isfinite(estimate.prefill_ms_per_token)
        assert model.min_floor_ms <= estimate.floor_ms <= model.max_floor_ms
        assert model.min_ms_per_token <= estimate.prefill_ms_per_token <= model.max_ms_per_token


def test_book_keeps_one_model_per_replica() -> None:
    book = SpeedBook(DEFAULT_SPEED, half_life=20, max_ms_per_token=2.0)
    rng = random.Random(9)
    for _ in range(400):
        x = rng.uniform(0, 4000)
        book.observe("fast", 10 + 0.01 * x, x)
        book.observe("slow", 50 + 0.2 * x, x)
    assert book.get("fast").prefill_ms_per_token == pytest.approx(0.01, rel=0.02)
    assert book.get("slow").prefill_ms_per_token == pytest.approx(0.2, rel=0.02)
    assert set(book.estimates()) == {"fast", "slow"}
    book.forget("slow")
    assert book.get("slow") == DEFAULT_SPEED
    with pytest.raises(ValueError):
        SpeedBook(DEFAULT_SPEED, half_life=0)
    with pytest.raises(TypeError):
        SpeedBook(DEFAULT_SPEED, no_such_option=1.0)


def test_evidence_fades_with_idle_time_so_a_shunned_replica_comes_back() -> None:
    model = SpeedModel(DEFAULT_SPEED, idle_half_life_s=10.0)
    for i in range(5):  # a cold start: five slow first answers
        model.observe(150.0, 1000.0, now=i * 0.1)
    assert model.estimate(now=0.5).floor_ms > 80
    # the router sends it nothing more (it looks slow): the estimate drifts back to the seed,
    # so the replica gets requests again and is measured anew
    assert model.estimate(now=60.0).floor_ms < 35
    assert model.estimate(now=120.0).floor_ms == pytest.approx(DEFAULT_SPEED.floor_ms, abs=1.0)
    assert model.samples < 0.01
    # without the clock nothing fades
    frozen = SpeedModel(DEFAULT_SPEED)
    for _ in range(5):
        frozen.observe(150.0, 1000.0)
    assert frozen.estimate().floor_ms > 80


def test_fading_hardly_touches_a_replica_in_use() -> None:
    model = SpeedModel(DEFAULT_SPEED)
    rng = random.Random(3)
    for i in range(1000):  # ten answers a second
        x = rng.uniform(0, 8000)
        model.observe(40.0 + 0.05 * x + rng.gauss(0, 5.0), x, now=i / 10)
    estimate = model.estimate(now=100.0)
    assert estimate.prefill_ms_per_token == pytest.approx(0.05, rel=0.03)
    assert estimate.floor_ms == pytest.approx(40.0, abs=4.0)


def test_a_book_fades_its_models_by_its_clock() -> None:
    now = [0.0]
    book = SpeedBook(DEFAULT_SPEED, clock=lambda: now[0])
    for _ in range(5):
        book.observe("r1", 150.0, 1000.0)
    assert book.get("r1").floor_ms > 80
    now[0] = 120.0
    assert book.get("r1").floor_ms == pytest.approx(DEFAULT_SPEED.floor_ms, abs=1.0)
    assert book.estimates()["r1"] == book.get("r1")
    with pytest.raises(ValueError):
        SpeedBook(DEFAULT_SPEED, idle_half_life_s=0.0)
