"""Benchmark report arithmetic: percentiles, ratios, goals, oracle net of its probes."""

from __future__ import annotations

import math

import pytest

from bench.harness import PolicyRun
from bench.loadgen import Result
from bench.report import add_ratios, goals, markdown
from bench.summary import concatenate, percentile, summarize


def results(ttfts_s: list[float], cached: int = 0, decision_ms: float = 0.0) -> list[Result]:
    return [
        Result(
            i, 0, 0, sent_s=float(i), ttft_s=t, e2e_s=t + 1.0, prompt_tokens=100,
            cached_tokens=cached, output_tokens=10, replica=f"r{i % 2}", decision_ms=decision_ms,
        )
        for i, t in enumerate(ttfts_s)
    ]  # fmt: skip


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10.0], 99) == 10.0
    assert percentile(list(range(101)), 95) == 95
    assert math.isnan(percentile([], 50))


def test_summary_scales_to_simulated_time_and_counts_engine_hits() -> None:
    run = PolicyRun("kvrouter", results([0.2, 0.4], cached=50), wall_s=3.0)
    summary = summarize(run, time_scale=10.0)
    assert summary.ttft_ms["p50"] == pytest.approx(30.0)  # 0.3 s real / 10
    assert summary.hit_rate == 0.5
    assert summary.per_replica == {"r0": 1, "r1": 1}
    assert summary.output_tokens_per_s == pytest.approx(20 / 0.24)  # 2.4 s real / 10


def test_oracle_latencies_are_net_of_its_probe_time() -> None:
    run = PolicyRun("oracle", results([0.2], decision_ms=100.0), wall_s=1.0)
    assert summarize(run, time_scale=1.0).ttft_ms["p50"] == pytest.approx(100.0)


def test_passes_of_several_seeds_pool_as_one_run() -> None:
    first = results([0.2, 0.4], cached=50)  # group 0 on r0 and r1; the last answer at 2.4 s
    second = results([0.6, 0.8, 1.0], cached=100)  # group 0 again: another seed's prefix
    for r in second:
        r.replica = "r1"
    runs = [
        PolicyRun(
            "kvrouter", first, 2.0, router_stats={"retries": 1.0, "stage_total_ms": 2.0},
            engine_stats={"preemptions": 0.0, "prefix_cache_hits": 5.0},
            engine_requests={"r0": 1, "r1": 1},
        ),
        PolicyRun(
            "kvrouter", second, 3.0, router_stats={"retries": 2.0, "stage_total_ms": 4.0},
            engine_stats={"preemptions": 0.0, "prefix_cache_hits": 7.0},
            engine_requests={"r1": 3},
        ),
    ]  # fmt: skip
    pooled = concatenate(runs)
    assert [r.sent_s for r in pooled.results] == [0.0, 1.0, 2.4, 3.4, 4.4]
    assert [r.group for r in pooled.results] == [0, 0, 1, 1, 1]
    assert [r.conversation for r in pooled.results] == [0, 1, 2, 3, 4]
    assert pooled.router_stats == {"retries": 3.0, "stage_total_ms": 3.0}
    assert pooled.engine_stats == {"preemptions": 0.0, "prefix_cache_hits": 12.0}
    assert pooled.engine_requests == {"r0": 1, "r1": 4}
    assert pooled.wall_s == 5.0
    summary = summarize(pooled, time_scale=1.0)
    assert summary.ttft_ms["p50"] == pytest.approx(600.0)  # the middle of all five
    assert summary.hit_rate == pytest.approx(400 / 500)
    assert summary.engines_per_group == pytest.approx(1.5)  # 2 engines, then 1
    assert summary.makespan_s == pytest.approx(6.4)  # 2.4 s, then 4.0 s from the second
    # the runs themselves are left as they were, and one pass is itself
    assert [r.group for r in second] == [0, 0, 0] and second[0].sent_s == 0.0
    assert concatenate(runs[:1]) is runs[0]
    with pytest.raises(ValueError, match="no runs"):
        concatenate([])
    with pytest.raises(ValueError, match="different policies"):
        concatenate([runs[0], PolicyRun("smg", first, 1.0)])


def test_ratios_and_goals() -> None:
    runs = {
        "round-robin": PolicyRun("round-robin", results([2.0] * 10), 1.0),
        "seed": PolicyRun("seed", results([0.3] * 10, cached=80), 1.0),
        "kvrouter": PolicyRun("kvrouter", results([0.1] * 10, cached=90), 1.0),
        "oracle": PolicyRun("oracle", results([0.1] * 10, cached=95), 1.0),
    }
    summaries = {name: summarize(run, 1.0) for name, run in runs.items()}
    add_ratios(summaries)
    kv = summaries["kvrouter"]
    assert kv.vs_round_robin["ttft_p50"] == pytest.approx(20.0)
    assert kv.vs_oracle["ttft_p99"] == pytest.approx(1.0)
    assert kv.vs_oracle["hit_rate"] == pytest.approx(90 / 95)
    checked = {g.name: g for g in goals("gsp", summaries)}
    assert checked["TTFT p50 vs round-robin"].met
    assert checked["TTFT p95 vs seed design"].met
    assert checked["hit rate vs oracle"].met
    assert goals("nosharing", summaries) == []  # needs least-load
    assert "| kvrouter |" in markdown(summaries, list(checked.values()))
