"""What a benchmark run measured, per policy: summaries, ratios, goals, table and JSON.

Latencies are reported in **simulated H200 milliseconds**: the client measures real time and
divides by the time scale (the engines ran ``time_scale`` times slower than an H200). The
router's decision time is real (not scaled): it is CPU time on this machine. Throughput is
output tokens per simulated second over the run's makespan (first arrival to last answer).
The hit rate is the engines' own: sum of ``cached_tokens`` over sum of ``prompt_tokens``.

Ratios: ``vs_round_robin`` is round-robin's value over the policy's for latencies (how many
times better) and the policy's over round-robin's for throughput and hit rate;
``vs_oracle`` is the policy's value over the oracle's (latency: 1.2 = 20 % slower than the
oracle; throughput and hit rate: 0.9 = 90 % of the oracle's). The plots are drawn by
:mod:`bench.plots`.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.harness import PolicyRun
from bench.loadgen import Result
from tracker.framework.cli import parse_argv
from tracker.framework.settings import Settings, setting

LATENCY_KEYS = ("p50", "p95", "p99", "mean")


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


def _metrics(summary: Summary) -> dict[str, float]:
    out = {f"ttft_{k}": v for k, v in summary.ttft_ms.items()}
    out |= {f"e2e_{k}": v for k, v in summary.e2e_ms.items()}
    out["output_tokens_per_s"] = summary.output_tokens_per_s
    out["hit_rate"] = summary.hit_rate
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) and not math.isnan(a) else math.nan


def add_ratios(summaries: dict[str, Summary]) -> None:
    """Fill each summary's ``vs_round_robin`` / ``vs_oracle`` (module docstring)."""
    for summary in summaries.values():
        mine = _metrics(summary)
        for reference, slot, better in (
            ("round-robin", summary.vs_round_robin, True),
            ("oracle", summary.vs_oracle, False),
        ):
            if reference not in summaries:
                continue
            theirs = _metrics(summaries[reference])
            for key, value in mine.items():
                latency = key not in ("output_tokens_per_s", "hit_rate")
                if better and latency:  # how many times lower than round-robin's
                    slot[key] = _ratio(theirs[key], value)
                else:
                    slot[key] = _ratio(value, theirs[key])


@dataclass(frozen=True)
class Goal:
    """One routing goal and whether this run met it."""

    name: str
    target: str
    measured: float
    met: bool


def _goal(name: str, target: str, measured: float, met: bool) -> Goal:
    return Goal(name, target, round(measured, 3), bool(met) and not math.isnan(measured))


def goals(workload: str, summaries: dict[str, Summary]) -> list[Goal]:
    """The routing goals that this run's workload and policies can check."""
    out: list[Goal] = []
    kv = summaries.get("kvrouter")
    if kv is None:
        return out
    rr, oracle = summaries.get("round-robin"), summaries.get("oracle")
    seed, least = summaries.get("seed"), summaries.get("least-load")
    if workload == "gsp":
        if rr is not None:
            ratio = _ratio(rr.ttft_ms["p50"], kv.ttft_ms["p50"])
            out.append(_goal("TTFT p50 vs round-robin", ">= 10x better", ratio, ratio >= 10))
            for q in ("p95", "p99"):
                ratio = _ratio(rr.ttft_ms[q], kv.ttft_ms[q])
                out.append(_goal(f"TTFT {q} vs round-robin", ">= 2x better", ratio, ratio >= 2))
        if oracle is not None:
            for q in ("p95", "p99"):
                ratio = _ratio(kv.ttft_ms[q], oracle.ttft_ms[q])
                out.append(
                    _goal(f"TTFT {q} vs oracle", "<= 1.2x the oracle's", ratio, ratio <= 1.2)
                )
            ratio = _ratio(kv.hit_rate, oracle.hit_rate)
            out.append(_goal("hit rate vs oracle", ">= 0.9x the oracle's", ratio, ratio >= 0.9))
        if seed is not None:
            ratio = _ratio(seed.ttft_ms["p95"], kv.ttft_ms["p95"])
            out.append(_goal("TTFT p95 vs seed design", "better (> 1x)", ratio, ratio > 1))
    if workload == "nosharing" and least is not None:
        for q in ("p50", "p95", "p99"):
            ratio = _ratio(kv.ttft_ms[q], least.ttft_ms[q])
            out.append(_goal(f"TTFT {q} vs least-load", "<= 1.05x", ratio, ratio <= 1.05))
        ratio = _ratio(kv.output_tokens_per_s, least.output_tokens_per_s)
        out.append(_goal("throughput vs least-load", ">= 0.95x", ratio, ratio >= 0.95))
    return out


def _clean(value: Any) -> Any:
    """NaN → None, so the JSON is strict."""
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def document(
    meta: dict[str, Any], summaries: dict[str, Summary], checked: list[Goal]
) -> dict[str, Any]:
    """The JSON document of a run."""
    doc: dict[str, Any] = _clean(
        {
            **meta,
            "units": {
                "latency": "simulated H200 milliseconds (measured / time_scale)",
                "decision_ms": "real milliseconds on the benchmark machine",
                "output_tokens_per_s": "per simulated second",
            },
            "policies": {name: asdict(s) for name, s in summaries.items()},
            "goals": [asdict(g) for g in checked],
        }
    )
    return doc


def write_json(doc: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


def _fmt(value: float, digits: int = 0) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def _x(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.2f}x"


def rows(summaries: dict[str, Summary]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the results table (terminal and README)."""
    header = [
        "policy",
        "TTFT p50",
        "TTFT p95",
        "TTFT p99",
        "E2E p50",
        "E2E p99",
        "out tok/s",
        "hit rate",
        "req/replica min-max",
        "engines/group",
        "decision ms p50/p99",
        "p50 vs RR",
        "p99 vs RR",
        "p95 / oracle",
        "p99 / oracle",
    ]
    body = []
    for s in summaries.values():
        counts = list(s.per_replica.values())
        body.append(
            [
                s.policy + (f" ({s.errors} errors)" if s.errors else ""),
                _fmt(s.ttft_ms["p50"]),
                _fmt(s.ttft_ms["p95"]),
                _fmt(s.ttft_ms["p99"]),
                _fmt(s.e2e_ms["p50"]),
                _fmt(s.e2e_ms["p99"]),
                _fmt(s.output_tokens_per_s),
                "-" if math.isnan(s.hit_rate) else f"{s.hit_rate:.1%}",
                f"{min(counts)}-{max(counts)}" if counts else "-",
                _fmt(s.engines_per_group, 2),
                f"{_fmt(s.decision_ms['p50'], 2)} / {_fmt(s.decision_ms['p99'], 2)}",
                _x(s.vs_round_robin.get("ttft_p50")),
                _x(s.vs_round_robin.get("ttft_p99")),
                _x(s.vs_oracle.get("ttft_p95")),
                _x(s.vs_oracle.get("ttft_p99")),
            ]
        )
    return header, body


def markdown(summaries: dict[str, Summary], checked: list[Goal]) -> str:
    """The results table (latencies in simulated ms) and the goals, as Markdown."""
    header, body = rows(summaries)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    if checked:
        lines += ["", "| goal | target | measured | met |", "|---|---|---|---|"]
        lines += [
            f"| {g.name} | {g.target} | {g.measured} | {'yes' if g.met else '**no**'} |"
            for g in checked
        ]
    return "\n".join(lines) + "\n"


def from_document(doc: dict[str, Any]) -> tuple[dict[str, Summary], list[Goal]]:
    """Summaries and goals back from a JSON document (to re-render its table)."""

    def number(value: Any) -> Any:
        return math.nan if value is None else value

    summaries = {}
    for name, raw in doc["policies"].items():
        fields: dict[str, Any] = {
            k: ({kk: number(vv) for kk, vv in v.items()} if isinstance(v, dict) else number(v))
            for k, v in raw.items()
        }
        fields["per_replica"] = raw["per_replica"]
        summaries[name] = Summary(**fields)
    return summaries, [Goal(**g) for g in doc.get("goals", [])]


@dataclass(frozen=True, kw_only=True)
class ReportSettings(Settings):
    """``python -m bench.report``: the result document to render."""

    PART = "REPORT"

    result: str = setting(MISSING, "a kvrouter bench --json document", positional=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.report RESULT.json``: print the run's table and goals as Markdown."""
    settings = parse_argv(ReportSettings, argv, description=main.__doc__)
    doc = json.loads(Path(settings.result).read_text())
    summaries, checked = from_document(doc)
    print(markdown(summaries, checked), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
