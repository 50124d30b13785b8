"""``kvrouter matrix``: every routing policy, real peers included, across a matrix of scenarios.

Each cell of the matrix is one ``kvrouter bench`` run (:mod:`bench.harness`): one fleet, one
workload, every policy in turn with the same arrivals. The axes vary one thing each around a
base scenario — 4 simulated engines, 10 groups sharing ~4,800-token system prompts, 32
questions each (320 requests), 64 output tokens — and every cell carries its bounds: the
workload's ideal hit rate and the analytic TTFT floor (:func:`bench.capacity.ttft_floors`).
Cells replay 320 requests (10 x 32) at 8 req/s unless the axis varies that, time scale 3.
The light cells (4,096 and 1,024 blocks at 8 req/s, 25 % load), where every prefix-aware
router keeps each group home and the verdict turns on a few milliseconds, run three passes
with the workloads and arrivals of three seeds, every policy in each, and pool them
(:func:`bench.summary.concatenate`); docs/matrix.md gives each pass's ratios too.

=============  ===========================================================================
axis           cells
=============  ===========================================================================
cache          KV cache per engine from roomy (4,096 blocks) to half the working set (400)
load           arrivals at 25 / 50 / 75 / 100 % of the ideal capacity (1,024 blocks)
routers        1, 2 and 4 routers behind haproxy (peers: as many instances), 700 blocks
bypass         a quarter of the conversations sent straight to an engine, 700 blocks
restart        one engine SIGKILLed and restarted empty 15 s into each pass, 700 blocks
conversation   multi-turn chat with 400-token answers: 16 users whose histories fit the fleet's
               KV when each stays on one engine (2,048 blocks), and 32 users whose
               histories are twice what it holds (1,024 blocks); a conversation-shaped
               Mooncake trace on 8 engines with an H200's cache for an 8B model (58k blocks)
=============  ===========================================================================

Results go to one JSON file per cell (``--out``), with every request's outcome beside it
(``.raw.json``, not kept in git); a cell whose file exists — or whose settings equal a cell
already run (``routers 1`` is ``cache 700``) — is not run again unless ``--force`` (a long
matrix can be resumed). ``--report`` renders the tables (and the
plots with ``--plots``) from the files alone. The README's matrix section and
docs/matrix.md are written from the same files.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from bench.capacity import WorkloadShape, capacity, ttft_floors
from bench.commands import BenchSettings, plan
from bench.harness import POLICIES, Harness, PolicyRun
from bench.peers import INSTALL_HINT, missing
from bench.plots import matrix_plots, require_matplotlib
from bench.report import add_ratios, document
from bench.report import markdown as policy_table
from bench.summary import concatenate, percentile, summarize
from bench.verdicts import Cell, Verdict, best_peers, headline, verdict
from publishers.config import EngineShape
from tracker.core.tokens import Tokenizer
from tracker.framework.cli import Command
from tracker.framework.config import LogSettings
from tracker.framework.errors import ConfigError
from tracker.framework.settings import setting

AXES: Final = ("cache", "load", "routers", "bypass", "restart", "conversation")
# 10 groups x 32: 3 % of the requests are their group's first (cold), so TTFT p95 measures
# the hits and what delays them, p99 the cold prefills (with 5 % cold, p95 sat on the edge
# and one extra miss moved it by half)
BASE: Final[dict[str, Any]] = {
    "workload": "gsp",
    "replicas": 4,
    "groups": 10,
    "prompts_per_group": 32,
    "system_tokens": 4800,
    "question_tokens": 150,
    "output_tokens": 64,
}
BASE_RATE: Final = 8.0  # req/s: light on a roomy cache, beyond cache-blind at 400 blocks
# the in-router emulations of the approximate designs (seed, sglang) give way to the real peers
POLICIES_DEFAULT: Final = (
    "round-robin",
    "least-load",
    "kvrouter",
    "oracle",
    "vllm-kv",
    "vllm-cache",
    "smg",
)
PRESSURE: Final = 700  # blocks: the 10 prefixes (3,010 blocks) do not fit in 4 x 700
# Where the caches hold every prefix at light load, every prefix-aware router keeps each
# group home and the verdict turns on a few milliseconds of p95, which one pass does not
# settle (1,024 blocks: smg's p95 was 54.7, 73.3 and 61.0 ms in three seeds' passes), and
# the best of three peers' noisy values sits below what each would give (4,096 blocks: the
# best peer's p95 52.3-53.4 pass by pass, 54.8 pooled). Those cells pool three seeds.
LIGHT_SEEDS: Final = 3
EVENT_AXES: Final = ("routers", "bypass", "restart")  # where only events know the truth
README_BEGIN: Final = "<!-- bench:matrix:begin -->"
README_END: Final = "<!-- bench:matrix:end -->"


def cells(axes: Sequence[str] = AXES) -> list[Cell]:
    """The matrix (see the module docstring), for the axes asked for."""
    base = {**BASE, "rate": BASE_RATE}
    pressure = {**base, "num_blocks": PRESSURE}
    out: list[Cell] = []
    if "cache" in axes:
        for blocks, label in ((4096, "4096 roomy"), (1024, "1024"), (700, "700"), (400, "400")):
            settings = {**base, "num_blocks": blocks}
            seeds = LIGHT_SEEDS if blocks >= 1024 else 1
            out.append(Cell("cache", label, settings, events=blocks < 1024, seeds=seeds))
    if "load" in axes:
        for load in (0.25, 0.5, 0.75, 1.0):
            settings = {**BASE, "num_blocks": 1024, "load": load}
            seeds = LIGHT_SEEDS if load <= 0.25 else 1
            out.append(Cell("load", f"{load:.0%}", settings, seeds=seeds))
    if "routers" in axes:
        for routers in (1, 2, 4):
            settings = pressure if routers == 1 else {**pressure, "routers": routers}
            out.append(Cell("routers", str(routers), settings, events=True))
    if "bypass" in axes:
        out.append(Cell("bypass", "25%", {**pressure, "bypass": 0.25}, events=True))
    if "restart" in axes:
        restart = {**pressure, "restart_engine_at_s": 15.0}
        out.append(Cell("restart", "engine at 15 s", restart, events=True))
    if "conversation" in axes:
        chat = {
            "workload": "multiturn",
            "replicas": 4,
            "users": 32,
            "rounds": 6,
            "system_tokens": 1000,
            "context_tokens": 2000,
            "question_tokens": 64,
            "output_tokens": 400,
            "think_s": 3.0,
            "num_blocks": 1024,
            "rate": 8.0,
        }
        trace = {
            "workload": "trace",
            "trace": "bench/traces/synthetic_conversation.jsonl",
            "max_requests": 300,
            "replicas": 8,
            "num_blocks": 58_000,
            "time_scale": 1.0,
        }
        # 16 users x ~365 blocks at their last turn: 4 per engine fit in 2,048 blocks when
        # each stays on one engine; 32 users in 1,024 blocks need twice the fleet's KV
        fits = {**chat, "users": 16, "num_blocks": 2048}
        out += [
            Cell("conversation", "multi-turn", fits),
            Cell("conversation", "multi-turn 2x KV", chat),
            Cell("conversation", "trace", trace),
        ]
    return out


@dataclass(frozen=True, kw_only=True)
class MatrixSettings(LogSettings):
    """``kvrouter matrix``: every policy, real peers included, across the scenario matrix."""

    PART = "MATRIX"

    axes: str = setting(",".join(AXES), "comma-separated axes: " + ", ".join(AXES))
    policies: str = setting(
        ",".join(POLICIES_DEFAULT), "comma-separated policies of every cell: " + ", ".join(POLICIES)
    )
    out: str = setting("bench/results/matrix", "directory of the per-cell JSON results")
    force: bool = setting(False, "run cells again even if their result file exists")
    time_scale: float = setting(3.0, "engine time scale of cells that do not set their own")
    report: bool = setting(False, "only render the tables from existing results")
    readme: str | None = setting(None, "also rewrite this README's matrix section")
    doc: str | None = setting(None, "also write every cell's full table to this Markdown file")
    plots: str | None = setting(None, "also write one PNG per axis into this directory")

    def __post_init__(self) -> None:
        unknown = [a for a in self.axis_list if a not in AXES]
        if unknown or not self.axis_list:
            raise ConfigError(f"axes: unknown {unknown}; choose from {', '.join(AXES)}")
        bad = [p for p in self.policy_list if p not in POLICIES]
        if bad or not self.policy_list:
            raise ConfigError(f"policies: unknown {bad}; choose from {', '.join(POLICIES)}")
        if self.time_scale <= 0:
            raise ConfigError("time-scale must be positive")

    @property
    def axis_list(self) -> tuple[str, ...]:
        return tuple(a.strip() for a in self.axes.split(",") if a.strip())

    @property
    def policy_list(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.policies.split(",") if p.strip())


def bounds(chosen: Any) -> dict[str, Any]:
    """The cell's limits: the ideal hit rate and the analytic TTFT floor's percentiles."""
    floors = ttft_floors(chosen.workload, chosen.fleet, Tokenizer.builtin())
    return {
        "ideal_hit_rate": chosen.shape.ideal_hit_rate,
        "ttft_floor_ms": {f"p{q}": percentile(floors, q) for q in (50, 95, 99)},
    }


def run_cell(cell: Cell, settings: MatrixSettings, path: Path) -> dict[str, Any]:
    """One bench run of every available policy; the document is written to ``path``."""
    from bench.console import Console  # rich only when the command runs

    values = {"time_scale": settings.time_scale, **cell.settings}
    bench = BenchSettings(**values, policies=",".join(settings.policy_list))
    chosen = plan(bench)
    console = Console()
    absent = missing(chosen.policies)
    if absent:
        console.stage(f"skipping {', '.join(absent)}: not installed ({INSTALL_HINT})")
        chosen = dataclasses.replace(
            chosen, policies=tuple(p for p in chosen.policies if p not in absent)
        )
    console.stage(f"[{cell.axis}] {cell.label}")
    console.plan(chosen)
    seeds = [bench.seed + i for i in range(cell.seeds)]
    passes: dict[str, list[PolicyRun]] = {}
    per_seed = []
    for seed in seeds:
        if seed != bench.seed:
            console.stage(f"[{cell.axis}] {cell.label}: seed {seed}")
        each = (
            chosen
            if seed == bench.seed
            else dataclasses.replace(
                plan(dataclasses.replace(bench, seed=seed)), policies=chosen.policies
            )
        )
        runs = Harness(each.fleet, each.workload, each.policies, console).run()
        for run in runs:
            passes.setdefault(run.policy, []).append(run)
        seen = {r.policy: summarize(r, each.fleet.time_scale) for r in runs}
        per_seed.append({"seed": seed, "policies": {k: headline(v) for k, v in seen.items()}})
    runs = [concatenate(v) for v in passes.values()]
    summaries = {r.policy: summarize(r, chosen.fleet.time_scale) for r in runs}
    add_ratios(summaries)
    meta = {**chosen.meta(), "cell": {"axis": cell.axis, "label": cell.label}, "seeds": seeds}
    if len(seeds) > 1:
        meta["passes"] = per_seed
    doc = document({**meta, "bound": bounds(chosen)}, summaries, [])
    console.table(summaries, f"[{cell.axis}] {cell.label}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    # every request's outcome beside it, compact, for analysis (not kept in git)
    fields = (
        "sent_s",
        "ttft_s",
        "e2e_s",
        "replica",
        "group",
        "cached_tokens",
        "prompt_tokens",
        "bypass",
    )
    raw = {
        "fields": fields,
        "results": {r.policy: [[getattr(x, f) for f in fields] for x in r.results] for r in runs},
    }
    path.with_suffix(".raw.json").write_text(json.dumps(raw) + "\n")
    return doc


# ------------------------------------------------------------------ report


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
    start, end = text.find(README_BEGIN), text.find(README_END)
    if start < 0 or end < start:
        raise ConfigError(f"no {README_BEGIN} ... {README_END} section to rewrite")
    return text[: start + len(README_BEGIN)] + "\n" + body + text[end:]


def result_path(cell: Cell, directory: Path) -> Path | None:
    """The cell's result file, or another cell's of the same settings; None if not run yet."""
    own = directory / f"{cell.key}.json"
    if own.exists():
        return own
    return next(iter(sorted(directory.glob(f"*-{cell.digest}.json"))), None)


def load_verdicts(settings: MatrixSettings) -> list[Verdict]:
    out = []
    for cell in cells(settings.axis_list):
        path = result_path(cell, Path(settings.out))
        if path is not None:
            out.append(verdict(cell, json.loads(path.read_text())))
    return out


def run(settings: MatrixSettings) -> int:
    if settings.plots:
        require_matplotlib("--plots")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    failed = 0
    if not settings.report:
        for cell in cells(settings.axis_list):
            if not settings.force and result_path(cell, Path(settings.out)) is not None:
                continue
            doc = run_cell(cell, settings, Path(settings.out) / f"{cell.key}.json")
            failed += sum(int(p.get("errors") or 0) for p in doc["policies"].values())
    verdicts = load_verdicts(settings)
    text = report(verdicts)
    print(text)
    if settings.readme:
        readme = Path(settings.readme)
        readme.write_text(replace_section(readme.read_text(), text))
    if settings.doc:
        Path(settings.doc).write_text(
            "# Scenario matrix: every cell's full table\n\n"
            "Generated by `kvrouter matrix` from `bench/results/matrix/` (latencies in "
            "simulated H200 ms; see docs/benchmarks.md for the method).\n\n" + full_tables(verdicts)
        )
    if settings.plots:
        for path in matrix_plots(verdicts, Path(settings.plots)):
            print(f"wrote {path}")
    return 1 if failed else 0


MATRIX = Command(
    "matrix",
    "run every routing policy, real peers included, across the scenario matrix; report",
    MatrixSettings,
    run,
)
