"""One policy's run summarized: latency percentiles, throughput, hit rate and spread.

Latencies are in **simulated H200 milliseconds**: the client measures real time and
divides by the time scale (the engines ran ``time_scale`` times slower than an H200). The
router's decision time is real (not scaled): it is CPU time on this machine. Throughput is
output tokens per simulated second over the run's makespan (first arrival to last answer).
The hit rate is the engines' own: sum of ``cached_tokens`` over sum of ``prompt_tokens``.
Several passes of one policy pool into one run with :func:`concatenate`.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from bench.harness import PolicyRun
from bench.loadgen import Result


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, interpolated linearly (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _spread(values: Sequence[float]) -> dict[str, float]:
    out = {f"p{q}": percentile(values, q) for q in (50, 95, 99)}
    out["mean"] = statistics.fmean(values) if values else math.nan
    return out


def latencies_ms(
    run: PolicyRun, time_scale: float, which: str, *, bypass: bool = False
) -> list[float]:
    """Simulated ms of every successful routed request's TTFT (``"ttft"``) or end-to-end time.

    :param bypass: those of the requests that went past the routers instead.
    """
    out = []
    net = run.policy == "oracle"
    for r in run.results:
        if r.bypass != bypass:
            continue
        seconds = r.ttft_s if which == "ttft" else r.e2e_s
        if not r.ok or seconds is None:
            continue
        ms = seconds * 1000.0
        if net:
            ms = max(0.0, ms - (r.decision_ms or 0.0))
        out.append(ms / time_scale)
    return out


@dataclass
class Summary:
    """One policy's results (see the module docstring for units)."""

    policy: str
    requests: int
    errors: int
    ttft_ms: dict[str, float]
    e2e_ms: dict[str, float]
    output_tokens_per_s: float
    hit_rate: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    per_replica: dict[str, int]
    decision_ms: dict[str, float]
    makespan_s: float
    wall_s: float
    router_stats: dict[str, float] = field(default_factory=dict)
    engine_stats: dict[str, float] = field(default_factory=dict)
    vs_round_robin: dict[str, float] = field(default_factory=dict)
    vs_oracle: dict[str, float] = field(default_factory=dict)
    engines_per_group: float = math.nan
    bypass: dict[str, float] = field(default_factory=dict)


def _per_replica(run: PolicyRun, routed: Sequence[Result], ok: Sequence[Result]) -> Counter[str]:
    """Routed requests per engine: from the answers' engine header, or (peer routers drop
    it) from the engines' own request counters less the outside traffic."""
    named = Counter(r.replica for r in routed if r.replica)
    if sum(named.values()) == len(routed) or not run.engine_requests:
        return named
    outside = Counter(r.replica for r in ok if r.bypass)
    return Counter(
        {k: v - outside.get(k, 0) for k, v in run.engine_requests.items() if v > outside.get(k, 0)}
    )


def engines_per_group(routed: Sequence[Result]) -> float:
    """Mean number of engines each prefix group's routed requests went to (NaN: unknown)."""
    engines: dict[int, set[str]] = {}
    for r in routed:
        if r.group < 0:
            continue
        if not r.replica:
            return math.nan
        engines.setdefault(r.group, set()).add(r.replica)
    return statistics.fmean(len(v) for v in engines.values()) if engines else math.nan


def concatenate(runs: Sequence[PolicyRun]) -> PolicyRun:
    """One policy's passes (one per seed) as one run, each pass starting where the one before
    ended: latencies and hits pool over every request, throughput is over the summed
    makespans, and each pass's prefix groups and conversations keep ids of their own, so
    engines per group stays a per-group mean. Counters (router and engine) are summed; the
    mean decision time per stage is averaged over the passes."""
    if not runs:
        raise ValueError("no runs to concatenate")
    if len(runs) == 1:
        return runs[0]
    if len({r.policy for r in runs}) != 1:
        raise ValueError(f"passes of different policies: {sorted({r.policy for r in runs})}")
    results: list[Result] = []
    offset_s = 0.0
    groups = conversations = 0
    for run in runs:
        results += [
            replace(
                r,
                sent_s=r.sent_s + offset_s,
                group=r.group + groups if r.group >= 0 else r.group,
                conversation=r.conversation + conversations,
            )
            for r in run.results
        ]
        offset_s += max((r.sent_s + (r.e2e_s or 0.0) for r in run.results), default=0.0)
        groups += 1 + max((r.group for r in run.results), default=-1)
        conversations += 1 + max((r.conversation for r in run.results), default=-1)
    router_stats: dict[str, float] = {}
    for key in {k for r in runs for k in r.router_stats}:
        values = [r.router_stats[key] for r in runs if key in r.router_stats]
        router_stats[key] = statistics.fmean(values) if key.startswith("stage_") else sum(values)
    return PolicyRun(
        runs[0].policy,
        results,
        wall_s=sum(r.wall_s for r in runs),
        started_at=runs[0].started_at,
        router_stats=dict(sorted(router_stats.items())),
        engine_stats=_summed([r.engine_stats for r in runs]),
        engine_requests={k: int(v) for k, v in _summed([r.engine_requests for r in runs]).items()},
    )


def _summed(counters: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Key by key (adding Counters would drop the zeros)."""
    out: dict[str, float] = {}
    for counter in counters:
        for key, value in counter.items():
            out[key] = out.get(key, 0.0) + value
    return out


def summarize(run: PolicyRun, time_scale: float) -> Summary:
    """Aggregate one policy's results; latencies in simulated ms.

    Everything is over the requests that went through the router(s); outside traffic (the
    bypass scenario) is summarized apart in ``bypass``. The oracle's TTFTs are net of its own
    decision time: no real engine can be probed, and a bound should not pay for the
    simulation's HTTP round trips (its decision time is still reported).
    """
    done = [r for r in run.results if r.ok]
    ok = [r for r in done if not r.bypass]
    outside = [r for r in done if r.bypass]
    ttft = latencies_ms(run, time_scale, "ttft")
    e2e = latencies_ms(run, time_scale, "e2e")
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    if ok:
        start = min(r.sent_s for r in ok)
        end = max(r.sent_s + (r.e2e_s or 0.0) for r in ok)
        makespan = (end - start) / time_scale
    else:
        makespan = math.nan
    decisions = [r.decision_ms for r in ok if r.decision_ms is not None]
    bypass: dict[str, float] = {}
    if any(r.bypass for r in run.results):
        prompt_out = sum(r.prompt_tokens for r in outside)
        bypass = {
            "requests": float(sum(r.bypass for r in run.results)),
            "hit_rate": sum(r.cached_tokens for r in outside) / prompt_out
            if prompt_out
            else math.nan,
            **{
                f"ttft_{k}": v
                for k, v in _spread(latencies_ms(run, time_scale, "ttft", bypass=True)).items()
            },
        }
    routed = [r for r in run.results if not r.bypass]
    return Summary(
        policy=run.policy,
        requests=len(routed),
        errors=len(routed) - len(ok),
        ttft_ms=_spread(ttft),
        e2e_ms=_spread(e2e),
        output_tokens_per_s=output / makespan if makespan and makespan > 0 else math.nan,
        hit_rate=cached / prompt if prompt else math.nan,
        prompt_tokens=prompt,
        cached_tokens=cached,
        output_tokens=output,
        per_replica=dict(sorted(_per_replica(run, ok, done).items())),
        decision_ms=_spread(decisions),
        makespan_s=makespan,
        wall_s=run.wall_s,
        router_stats=dict(run.router_stats),
        engine_stats=dict(run.engine_stats),
        engines_per_group=engines_per_group(ok),
        bypass=bypass,
    )
