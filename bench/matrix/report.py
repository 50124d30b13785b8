"""The scenario matrix's report from its result files: per axis a Markdown table of every
cell's bounds, kvrouter, the best peer and the verdict; every cell's full table; the
section of docs/results.md between the matrix markers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final

from bench.capacity import WorkloadShape, capacity
from bench.matrix.cells import AXES
from bench.matrix.verdicts import Verdict, best_peers
from bench.report import markdown as policy_table
from publishers.config import EngineShape
from tracker.framework.errors import ConfigError

SECTION_BEGIN: Final = "<!-- bench:matrix:begin -->"
SECTION_END: Final = "<!-- bench:matrix:end -->"


def _ms(value: float) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.0f}"


def _pct(value: float) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.1%}"


def _times(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}x"


def axis_table(verdicts: Sequence[Verdict]) -> str:
    """One axis as Markdown: per cell the bounds, kvrouter, the best peer, the ratios."""
    lines = [
        "| cell | bound: hit / TTFT p50 / p95 | kvrouter: hit / p50 / p95 | best peer: hit / p50 "
        "/ p95 | hit vs best peer | p50 best peer / kvrouter | p95 best peer / kvrouter | "
        "goal | beside the goal: mean TTFT, output tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        bound, kv = v.doc.get("bound", {}), v.kv
        floor = bound.get("ttft_floor_ms", {})
        best = v.best
        peer = (
            " / ".join(
                (
                    f"{_pct(best['hit_rate'][1])} ({best['hit_rate'][0]})",
                    f"{_ms(best['p50'][1])} ({best['p50'][0]})",
                    f"{_ms(best['p95'][1])} ({best['p95'][0]})",
                )
            )
            if best
            else "-"
        )
        mine = (
            f"{_pct(kv.hit_rate)} / {_ms(kv.ttft_ms['p50'])} / {_ms(kv.ttft_ms['p95'])}"
            if kv
            else "-"
        )
        goal = ("met" if v.met else "**missed**") + (" (events)" if v.cell.events else "")
        hit = v.ratio("hit_rate")
        mean, rate = v.beside()
        seeds = len(v.doc.get("seeds", []))
        label = v.cell.label + (f" ({seeds} seeds)" if seeds > 1 else "")
        lines.append(
            f"| {label} | {_pct(bound.get('ideal_hit_rate', math.nan))} / "
            f"{_ms(floor.get('p50', math.nan))} / {_ms(floor.get('p95', math.nan))} | {mine} | "
            f"{peer} | {'-' if math.isnan(hit) else f'{hit:+.1f} pts'} | "
            f"{v.ratio('p50'):.2f}x | {v.ratio('p95'):.2f}x | {goal} | "
            f"{_times(mean)} / {_times(rate)} |"
        )
    return "\n".join(lines) + "\n"


AXIS_TITLES: Final = {
    "cache": "KV cache per engine (blocks of 16 tokens; 8 req/s)",
    "load": "load, share of the ideal capacity (1,024 blocks)",
    "routers": "routers behind haproxy (700 blocks, 8 req/s)",
    "bypass": "outside traffic straight to the engines (700 blocks, 8 req/s)",
    "restart": "an engine restarted mid-run (700 blocks, 8 req/s)",
    "conversation": "conversation traffic",
    "agents": "coding agents: 8 sessions of 18k-39k-token prompts, subagent bursts after turn 6 "
    "(4 engines, time scale 2)",
    "trace": "Mooncake's conversation trace, its first 600 requests at 1x, 2x and 4x its speed "
    "(1k-121k-token prompts; 8 engines of 32,768 blocks, time scale 1)",
}


def report(verdicts: Sequence[Verdict]) -> str:
    """Every axis's table, in axis order."""
    parts = []
    for axis in AXES:
        mine = [v for v in verdicts if v.cell.axis == axis]
        if mine:
            parts.append(f"**{AXIS_TITLES[axis]}**\n\n{axis_table(mine)}")
    return "\n".join(parts)


def ideal_load(meta: dict[str, Any]) -> float:
    """The cell's arrival rate over the ideal capacity as :mod:`bench.capacity` reckons it now
    (from the workload shape and fleet stored with the run, so that runs made before a fix
    of the capacity model read alike)."""
    fleet = meta["fleet"]
    engine = EngineShape(
        profile=fleet["profile"], num_blocks=fleet["num_blocks"], block_size=fleet["block_size"]
    )
    ideal = capacity(WorkloadShape(**meta["shape"]), engine, fleet["replicas"]).ideal_rps
    return float(meta["rate_rps"]) / ideal if ideal else 0.0


def full_tables(verdicts: Sequence[Verdict]) -> str:
    """Every cell's whole per-policy table (docs/matrix.md)."""
    parts = []
    for v in verdicts:
        meta = v.doc
        seeds = meta.get("seeds", [])
        requests = f"{meta['requests']} requests"
        if len(seeds) > 1:
            requests += f" x {len(seeds)} seeds ({', '.join(map(str, seeds))}; pooled)"
        parts.append(
            f"### {v.cell.axis}: {v.cell.label}\n\n"
            f"{meta['workload']['name']}, {requests}, "
            f"{meta['fleet']['replicas']} engines x {meta['fleet']['num_blocks']} blocks, "
            f"{meta['fleet']['routers']} router(s), {meta['rate_rps']:.1f} req/s "
            f"({ideal_load(meta):.0%} of the ideal capacity), time scale {meta['time_scale']:g}; "
            f"run {meta['date']}\n\n{policy_table(v.summaries, [])}{per_seed(v)}"
        )
    return "\n".join(parts)


def per_seed(v: Verdict) -> str:
    """A pooled cell's verdict ratios seed by seed (best peer / kvrouter), or nothing."""
    lines = []
    for one in v.doc.get("passes", []):
        best, kv = best_peers(one["policies"]), one["policies"].get("kvrouter")
        if not best or not kv:
            continue
        p50, p95 = (best[q][1] / kv[q] for q in ("p50", "p95"))
        hits = 100.0 * (kv["hit_rate"] - best["hit_rate"][1])
        lines.append(f"seed {one['seed']}: p50 {p50:.2f}x, p95 {p95:.2f}x, {hits:+.1f} pts")
    if not lines:
        return ""
    return "\nBest peer / kvrouter in each seed's pass: " + "; ".join(lines) + ".\n"


def replace_section(text: str, body: str) -> str:
    """``text`` with the part between the matrix markers replaced by ``body``."""
    start, end = text.find(SECTION_BEGIN), text.find(SECTION_END)
    if start < 0 or end < start:
        raise ConfigError(f"no {SECTION_BEGIN} ... {SECTION_END} section to rewrite")
    return text[: start + len(SECTION_BEGIN)] + "\n" + body + text[end:]
