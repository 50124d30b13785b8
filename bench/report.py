"""What a benchmark run measured, across policies: ratios, goals, table and JSON.

Each policy's summary comes from :mod:`bench.summary` (units there). Ratios:
``vs_round_robin`` is round-robin's value over the policy's for latencies (how many
times better) and the policy's over round-robin's for throughput and hit rate;
``vs_oracle`` is the policy's value over the oracle's (latency: 1.2 = 20 % slower than the
oracle; throughput and hit rate: 0.9 = 90 % of the oracle's). The plots are drawn by
:mod:`bench.plots`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass
from pathlib import Path
from typing import Any

from bench.summary import Summary
from tracker.framework.cli import parse_argv
from tracker.framework.settings import Settings, setting


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
    """Header and rows of the results table (terminal and docs)."""
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
