"""``kvrouter matrix``: every routing policy, real peers included, across the scenario matrix.

Each cell (:mod:`bench.matrix.cells`) is one ``kvrouter bench`` run of every policy; its result
document goes to a JSON file of its own (``--out``), and a cell already run is not run again
unless ``--force``. ``--report`` renders the tables and plots from those files alone
(docs/benchmarks.md, "Scenario matrix").
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from bench.capacity import ttft_floors
from bench.commands import BenchSettings, plan, runnable
from bench.harness import POLICIES, Harness, PolicyRun
from bench.matrix.cells import AXES, Cell, cells
from bench.matrix.report import full_tables, replace_section, report
from bench.matrix.verdicts import Verdict, headline, verdict
from bench.plots import matrix_plots, require_matplotlib
from bench.report import add_ratios, document
from bench.summary import concatenate, percentile, summarize
from tracker.core.tokens import Tokenizer
from tracker.framework.cli import Command
from tracker.framework.config import LogSettings
from tracker.framework.errors import ConfigError
from tracker.framework.settings import comma_list, setting

# the in-router emulations of the approximate designs (seed, sglang) give way to the real peers
POLICIES_DEFAULT: Final = (
    "round-robin",
    "least-load",
    "kvrouter",
    "oracle",
    "vllm-kv",
    "vllm-cache",
    "smg",
    "smg13",
    "dynamo",
)


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
    gateway: bool = setting(
        False,
        "every cell's routers as endpoint pickers behind a real Envoy (kvrouter bench "
        "--gateway; the peers are skipped); its results are files of their own",
    )
    report: bool = setting(False, "only render the tables from existing results")
    results: str | None = setting(
        None, "also rewrite the matrix section (between its markers) of this Markdown file"
    )
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
        return comma_list(self.axes, str)

    @property
    def policy_list(self) -> tuple[str, ...]:
        return comma_list(self.policies, str)

    def cells(self) -> list[Cell]:
        """The cells on the axes asked for; with ``gateway``, each of them behind Envoy (a
        setting of its own, so its digest and result file differ from the proxy's)."""
        chosen = cells(self.axis_list)
        if not self.gateway:
            return chosen
        return [dataclasses.replace(c, settings={**c.settings, "gateway": True}) for c in chosen]


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
    if settings.gateway:
        values["gateway"] = True
    bench = BenchSettings(**values, policies=",".join(settings.policy_list))
    console = Console()
    chosen = runnable(plan(bench), console.stage)
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


def result_path(cell: Cell, directory: Path) -> Path | None:
    """The cell's result file, or another cell's of the same settings; None if not run yet."""
    own = directory / f"{cell.key}.json"
    if own.exists():
        return own
    return next(iter(sorted(directory.glob(f"*-{cell.digest}.json"))), None)


def load_verdicts(settings: MatrixSettings) -> list[Verdict]:
    out = []
    for cell in settings.cells():
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
        for cell in settings.cells():
            if not settings.force and result_path(cell, Path(settings.out)) is not None:
                continue
            doc = run_cell(cell, settings, Path(settings.out) / f"{cell.key}.json")
            failed += sum(int(p.get("errors") or 0) for p in doc["policies"].values())
    verdicts = load_verdicts(settings)
    text = report(verdicts)
    print(text)
    if settings.results:
        results = Path(settings.results)
        results.write_text(replace_section(results.read_text(), text))
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
