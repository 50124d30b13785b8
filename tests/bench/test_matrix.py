"""The scenario matrix's cells, verdicts against the best peer, and its Markdown report."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from bench.commands import BenchSettings, plan
from bench.matrix.cells import AXES, MOONCAKE_LIKE, Cell, cells, mooncake_trace
from bench.matrix.commands import MatrixSettings, load_verdicts, result_path
from bench.matrix.report import (
    SECTION_BEGIN,
    SECTION_END,
    axis_table,
    full_tables,
    replace_section,
    report,
)
from bench.matrix.verdicts import verdict
from bench.report import document
from bench.summary import Summary
from tracker.framework.errors import ConfigError


def summary(
    policy: str, p50: float, p95: float, hit: float, *, mean: float = 0.0, rate: float = 1.0
) -> Summary:
    return Summary(
        policy=policy,
        requests=10,
        errors=0,
        ttft_ms={"p50": p50, "p95": p95, "p99": p95, "mean": mean or p50},
        e2e_ms={"p50": 1.0, "p95": 1.0, "p99": 1.0, "mean": 1.0},
        output_tokens_per_s=rate,
        hit_rate=hit,
        prompt_tokens=100,
        cached_tokens=int(100 * hit),
        output_tokens=10,
        per_replica={"a": 10},
        decision_ms={"p50": 1.0, "p95": 1.0, "p99": 1.0, "mean": 1.0},
        makespan_s=1.0,
        wall_s=1.0,
    )


def doc(*summaries: Summary) -> dict[str, object]:
    meta = {"bound": {"ideal_hit_rate": 0.8, "ttft_floor_ms": {"p50": 20.0, "p95": 90.0}}}
    return json.loads(json.dumps(document(meta, {s.policy: s for s in summaries}, [])))


def test_every_axis_has_cells_that_bench_accepts() -> None:
    matrix = cells()
    assert {c.axis for c in matrix} == set(AXES)
    assert len({c.key for c in matrix}) == len(matrix)
    for cell in matrix:
        settings = BenchSettings(**cell.settings)
        assert settings.policy_list  # the settings are valid bench settings
    # the cells of one axis differ in what that axis varies
    routers = [c for c in matrix if c.axis == "routers"]
    assert [c.settings.get("routers", 1) for c in routers] == [1, 2, 4]
    assert [c.events for c in matrix if c.axis == "cache"] == [False, False, True, True]
    # the 1-router cell is the 700-block cache cell: one run serves both
    cache_700 = next(c for c in matrix if c.axis == "cache" and c.label == "700")
    assert cache_700.digest == routers[0].digest
    # the light cells, where every router keeps its groups home, pool three seeds
    pooled = {(c.axis, c.label) for c in matrix if c.seeds == 3}
    assert [c.settings["speedup"] for c in matrix if c.axis == "trace"] == [1.0, 2.0, 4.0]
    assert pooled == {
        ("cache", "4096 roomy"),
        ("cache", "1024"),
        ("load", "25%"),
        ("agents", "8192 roomy"),
    }
    assert all(c.seeds == 1 for c in matrix if (c.axis, c.label) not in pooled)
    once = Cell("cache", "1024", next(c for c in matrix if c.label == "1024").settings)
    assert once.digest != next(c for c in matrix if c.label == "1024").digest


def test_a_cell_plans_with_its_bounds() -> None:
    cell = next(c for c in cells(("cache",)) if c.label == "400")
    chosen = plan(BenchSettings(**cell.settings))
    assert chosen.fleet.num_blocks == 400 and chosen.workload.requests == 320
    assert chosen.rate_rps == 8.0


def test_the_agents_axis_varies_one_thing_a_cell_with_the_same_session_starts() -> None:
    matrix = cells(("agents",))
    by_label = {c.label: c for c in matrix}
    base = by_label["5120, fan-out 8, 1 router (base)"]
    for cell in matrix:
        changed = {k for k in cell.settings if cell.settings[k] != base.settings.get(k)}
        assert changed <= {"num_blocks", "routers", "agents_fanout"}
    assert [c.events for c in matrix] == [True, True, True, True, False, True]
    assert by_label["4 routers"].settings["routers"] == 4
    plans = [plan(BenchSettings(**by_label[k].settings)) for k in ("fan-out 1", "fan-out 32")]
    assert [p.workload.params["fanout"] for p in plans] == [1, 32]
    # one pace for every cell: sessions of more requests start further apart
    one, many = ([c.start_s for c in p.workload.conversations] for p in plans)
    assert len(one) == len(many) == 8 and many[-1] > 2 * one[-1]
    assert all(p.shape.longest_request < 3072 * 16 for p in plans)  # fits the pressure cell


def test_the_trace_axis_replays_mooncake_at_three_speeds_or_its_likeness(
    tmp_path: Path,
) -> None:
    matrix = cells(("trace",))
    assert [c.settings["speedup"] for c in matrix] == [1.0, 2.0, 4.0]
    assert {c.settings["trace"] for c in matrix} == {mooncake_trace()[0]}
    # a fresh clone has no downloaded trace: the generated one, labelled so
    assert mooncake_trace(tmp_path) == (MOONCAKE_LIKE, False)
    (tmp_path / "bench/traces/data").mkdir(parents=True)
    (tmp_path / "bench/traces/data/conversation_trace.jsonl").write_text("{}\n")
    assert mooncake_trace(tmp_path)[1]
    generated = BenchSettings(**{**matrix[0].settings, "trace": MOONCAKE_LIKE})
    chosen = plan(generated)
    assert chosen.workload.requests == 600 and chosen.fleet.replicas == 8
    starts = sorted({c.start_s for c in chosen.workload.conversations})
    assert starts[:3] == [0.0, 3.0, 6.0]  # bursts every 3 s, as the real trace's
    # another slice of it has its own clock
    later = plan(dataclasses.replace(generated, trace_from=600))
    assert later.workload.conversations[0].start_s == 0.0
    assert later.workload.params["from"] == 600


def test_verdict_against_the_best_peer_per_metric() -> None:
    cell = Cell("routers", "4", {}, events=True)
    found = verdict(
        cell,
        doc(
            summary("kvrouter", 50, 100, 0.70),
            summary("vllm-kv", 49, 150, 0.55),
            summary("smg", 60, 140, 0.62),
            summary("round-robin", 10, 10, 0.10),  # not a peer: never the benchmark
        ),
    )
    assert found.best == {
        "p50": ("vllm-kv", 49),
        "p95": ("smg", 140),
        "hit_rate": ("smg", 0.62),
    }
    assert found.ratio("p95") == pytest.approx(1.4)
    assert found.ratio("hit_rate") == pytest.approx(8.0)
    assert found.ties and found.wins and found.met  # p50 within 3 %
    slower = verdict(
        cell, doc(summary("kvrouter", 52, 100, 0.70), summary("vllm-kv", 49, 150, 0.7))
    )
    assert not slower.ties and not slower.met
    even = verdict(cell, doc(summary("kvrouter", 49, 140, 0.63), summary("smg", 49, 140, 0.62)))
    assert even.ties and not even.wins and not even.met  # events cells must win outright
    plain = Cell("load", "25%", {})
    assert verdict(plain, even.doc).met
    alone = verdict(plain, doc(summary("kvrouter", 1, 1, 0.5)))
    assert math.isnan(alone.ratio("p50")) and not alone.met
    assert all(math.isnan(x) for x in alone.beside())


def test_beside_the_goal_the_mean_and_the_throughput_of_the_best_peers() -> None:
    # an overload cell: a peer that sacrifices one engine has the median, not the mean
    found = verdict(
        Cell("load", "100%", {}),
        doc(
            summary("kvrouter", 470, 3100, 0.93, mean=920, rate=1300),
            summary("smg", 170, 14500, 0.76, mean=3540, rate=700),
            summary("vllm-cache", 190, 14200, 0.78, mean=3400, rate=706),
            summary("round-robin", 100, 900, 0.2, mean=300, rate=2000),  # not a peer
        ),
    )
    assert not found.met  # the goal reads only p50, p95 and hits
    mean, rate = found.beside()
    assert mean == pytest.approx(3400 / 920) and rate == pytest.approx(1300 / 706)
    assert "| **missed** | 3.70x / 1.84x |" in axis_table([found])


def test_report_tables_and_the_readme_section(tmp_path: Path) -> None:
    cell = Cell("bypass", "25%", {"x": 1}, events=True)
    found = verdict(cell, doc(summary("kvrouter", 40, 90, 0.7), summary("smg", 41, 200, 0.6)))
    table = axis_table([found])
    assert "| 25% | 80.0% / 20 / 90 | 70.0% / 40 / 90 |" in table
    assert "+10.0 pts" in table and "2.22x" in table and "met (events)" in table
    assert table.rstrip().endswith("| met (events) | 1.02x / 1.00x |")
    assert report([found]).startswith("**outside traffic")
    text = f"intro\n{SECTION_BEGIN}\nold\n{SECTION_END}\nrest\n"
    assert replace_section(text, "new\n") == f"intro\n{SECTION_BEGIN}\nnew\n{SECTION_END}\nrest\n"
    with pytest.raises(ConfigError):
        replace_section("no markers", "x")
    # results are found by cell, or by another cell of the same settings
    settings = MatrixSettings(axes="routers", out=str(tmp_path))
    one = next(c for c in cells(("routers",)) if c.label == "1")
    shared = tmp_path / f"cache-700-{one.digest}.json"
    shared.write_text(json.dumps(found.doc))
    assert result_path(one, tmp_path) == shared
    assert [v.cell.label for v in load_verdicts(settings)] == ["1"]


def test_a_pooled_cell_shows_its_seeds_and_each_pass_ratio() -> None:
    cell = Cell("load", "25%", {}, seeds=2)
    pooled = doc(summary("kvrouter", 42, 60, 0.93), summary("smg", 41, 55, 0.94))
    meta = {
        "workload": {"name": "gsp"}, "requests": 320, "date": "today", "time_scale": 3,
        "rate_rps": 7.6, "load": 0.25, "seeds": [1, 2],
        "fleet": {"replicas": 4, "num_blocks": 1024, "block_size": 16, "routers": 1,
                  "profile": "llama-8b"},
        "shape": {"requests": 320, "prompt_tokens": 4979.0, "output_tokens": 64.0,
                  "unique_tokens": 313.5, "shared_blocks": 3010, "private_blocks": 15.0,
                  "longest_request": 5043},
        "passes": [
            {"seed": 1, "policies": {
                "kvrouter": {"p50": 40.0, "p95": 50.0, "hit_rate": 0.93},
                "smg": {"p50": 41.0, "p95": 55.0, "hit_rate": 0.94},
                "vllm-kv": {"p50": 44.0, "p95": 45.0, "hit_rate": 0.90},
                "round-robin": {"p50": 1.0, "p95": 1.0, "hit_rate": 1.0},
            }},
            {"seed": 2, "policies": {
                "kvrouter": {"p50": 44.0, "p95": 70.0, "hit_rate": 0.93},
                "smg": {"p50": 41.0, "p95": 56.0, "hit_rate": 0.93},
            }},
        ],
    }  # fmt: skip
    found = verdict(cell, {**pooled, **meta})
    assert "| 25% (2 seeds) |" in axis_table([found])
    tables = full_tables([found])
    assert "gsp, 320 requests x 2 seeds (1, 2; pooled), 4 engines" in tables
    # per pass, the best peer per metric (not round-robin), over kvrouter's
    seed_1 = "seed 1: p50 1.02x, p95 0.90x, -1.0 pts"
    assert f"{seed_1}; seed 2: p50 0.93x, p95 0.80x, +0.0 pts." in tables


def test_bad_matrix_settings() -> None:
    with pytest.raises(ConfigError):
        MatrixSettings(axes="cache,weather")
    with pytest.raises(ConfigError):
        MatrixSettings(policies="kvrouter,magic")
