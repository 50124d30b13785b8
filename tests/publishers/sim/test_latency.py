"""The latency model against the measured H200 calibration table."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from publishers.sim.latency import PROFILES, LatencyProfile, fit_profile, load_profile

CALIBRATION = Path(__file__).resolve().parents[2] / "data" / "calibration"
# profile -> (model key in the json, layer scale)
MODELS = {"llama-8b": ("llama-8b", 1.0), "llama-70b": ("llama-70b-40of80-layers", 2.0)}


def _rows(model: str) -> list[dict[str, Any]]:
    data = json.loads((CALIBRATION / "h200-prefill.json").read_text())
    rows: list[dict[str, Any]] = data["models"][model]["rows"]
    return rows


def _cases() -> list[tuple[str, str, int]]:
    kinds = ("cold_prefill", "warm_prefill_suffix_32", "warm_prefill_suffix_128")
    return [
        (profile, kind, row["tokens"])
        for profile, (model, _) in MODELS.items()
        for row in _rows(model)
        for kind in kinds
    ]


def _predict(profile: LatencyProfile, kind: str, tokens: int) -> float:
    if kind == "cold_prefill":
        return profile.step_ms([(tokens, 0)], [])
    suffix = int(kind.rsplit("_", 1)[1])
    return profile.step_ms([(suffix, tokens - suffix)], [])


@pytest.mark.parametrize(("profile", "kind", "tokens"), _cases())
def test_reproduces_calibration_row_within_10_percent(profile: str, kind: str, tokens: int) -> None:
    model, scale = MODELS[profile]
    row = next(r for r in _rows(model) if r["tokens"] == tokens)
    measured = row[kind]["median_ms"] * scale
    predicted = _predict(PROFILES[profile], kind, tokens)
    assert predicted == pytest.approx(measured, rel=0.10)


@pytest.mark.parametrize("profile", sorted(MODELS))
def test_decode_and_batch_rows_are_close(profile: str) -> None:
    model, scale = MODELS[profile]
    for row in _rows(model):
        t = row["tokens"]
        decode = PROFILES[profile].step_ms([], [t])
        assert decode == pytest.approx(row["decode_step"]["median_ms"] * scale, rel=0.10)
        if "cold_prefill_batch4" in row:
            batch = PROFILES[profile].step_ms([(t, 0)] * 4, [])
            assert batch == pytest.approx(row["cold_prefill_batch4"]["median_ms"] * scale, rel=0.1)


@pytest.mark.parametrize("profile", sorted(MODELS))
def test_constants_table_is_the_fit_of_the_json(profile: str) -> None:
    model, scale = MODELS[profile]
    fitted = fit_profile(profile, _rows(model), layer_scale=scale)
    table = PROFILES[profile]
    for name in ("floor_ms", "kv_ms_per_token", "step_compute_ms", "token_ms", "attention_ms"):
        assert getattr(table, name) == pytest.approx(getattr(fitted, name), rel=1e-5, abs=1e-12)
    assert len(table.prefill_floor) == len(fitted.prefill_floor)
    for (c1, r1), (c2, r2) in zip(table.prefill_floor, fitted.prefill_floor, strict=True):
        assert c1 == c2
        assert r1 == pytest.approx(r2, rel=1e-5)


def test_70b_8k_prompt_cold_vs_cached() -> None:
    profile = load_profile("llama-70b")
    cold = profile.step_ms([(8192, 0)], []) / 1000
    cached = profile.step_ms([(16, 8192 - 16)], []) / 1000
    assert 1.8 < cold < 2.4
    assert 0.07 < cached < 0.13


def test_floor_override_and_shape() -> None:
    fast = load_profile("llama-8b", floor_ms=6.0)
    assert fast.floor_ms == 6.0
    assert fast.step_ms([], [128]) == pytest.approx(6.0)
    assert fast.step_ms([], []) == 0.0
    # compute-bound prefill does not depend on the floor
    base = load_profile("llama-8b")
    assert fast.step_ms([(8192, 0)], []) == base.step_ms([(8192, 0)], [])
    with pytest.raises(ValueError, match="unknown latency profile"):
        load_profile("gpt-5")


def test_monotone_in_work() -> None:
    profile = load_profile("llama-70b")
    assert profile.step_ms([(512, 0)], [100] * 8) > profile.step_ms([(512, 0)], [])
    assert profile.step_ms([(2048, 0)], []) > profile.step_ms([(1024, 0)], [])
    # chunked prefill: a later chunk attends to the earlier ones and costs more
    assert profile.step_ms([(4096, 4096)], []) > profile.step_ms([(4096, 0)], [])
    # extrapolating the prefill floor past the table keeps growing, never negative
    assert profile.prefill_floor_at(64_000) >= profile.prefill_floor_at(16_304)
    assert all(math.isfinite(profile.step_ms([(16, c)], [])) for c in (0, 1, 100_000))


def test_a_lone_prefill_is_its_chunks_one_step_each() -> None:
    profile = PROFILES["llama-8b"]
    chunks = [(8192, 0), (8192, 8192), (3616, 16384)]
    assert profile.lone_prefill_ms(20_000, 8192) == pytest.approx(
        sum(profile.step_ms([chunk], []) for chunk in chunks)
    )
    # a cached prefix is context, not work; a fully cached prompt costs nothing more
    assert profile.lone_prefill_ms(20_000, 8192, cached=16_384) == pytest.approx(
        profile.step_ms([(3616, 16384)], [])
    )
    assert profile.lone_prefill_ms(1_000, 8192, cached=1_000) == 0.0
