"""The benchmark's terminal side (rich): the plan, a progress bar per policy, the results table.

Also writes the JSON document and the plots when asked. Used by ``kvrouter bench`` and the
demo; with no terminal attached rich prints plain lines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console as RichConsole
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from bench.harness import Hooks, PolicyRun
from bench.loadgen import Result
from bench.plan import Plan
from bench.plots import plot
from bench.report import Goal, add_ratios, document, goals, rows, write_json
from bench.summary import Summary, summarize


def summaries_of(runs: Sequence[PolicyRun], time_scale: float) -> dict[str, Summary]:
    """Per-policy summaries with their ratios, in run order."""
    out = {run.policy: summarize(run, time_scale) for run in runs}
    add_ratios(out)
    return out


class Console(Hooks):
    """Progress and results on the terminal."""

    def __init__(self, console: RichConsole | None = None) -> None:
        self.out = console or RichConsole()
        if not self.out.is_terminal:
            self.out.width = max(self.out.width, 200)  # logs and CI: keep the table whole
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._errors = 0

    # ------------------------------------------------------------------ hooks

    def plan(self, chosen: Plan) -> None:
        fleet, cap, shape = chosen.fleet, chosen.capacity, chosen.shape
        self.out.print(
            f"[bold]workload[/] {chosen.workload.describe()}: {chosen.workload.requests} requests"
        )
        routers = "embedded router" if not fleet.redis else f"{fleet.routers} router(s) + Redis"
        if fleet.gateway is not None:
            routers = routers.replace("router", "endpoint picker") + " behind Envoy"
        blocks = f"{fleet.num_blocks} x {fleet.block_size}-token KV blocks each"
        if fleet.vllm is not None:
            engines = (
                f"{fleet.replicas} real vLLM engines (CPU build, {fleet.vllm.model.name}, "
                f"{blocks}), {routers} (latencies below are real time)"
            )
        else:
            engines = (
                f"{fleet.replicas} simulated engines ({fleet.profile}, H200 profile, {blocks}), "
                f"{routers}, time scale {fleet.time_scale:g} (latencies below are simulated "
                "H200 time)"
            )
        self.out.print(f"[bold]fleet[/] {engines}")
        self.out.print(
            f"[bold]capacity[/] {cap.ideal_rps:.1f} req/s with every shared prefix cached "
            f"({cap.ideal_limit}-bound), {cap.blind_rps:.1f} req/s cache-blind; "
            f"ideal hit rate {shape.ideal_hit_rate:.1%}; "
            f"arrivals {chosen.rate_rps:.1f} req/s = {chosen.load:.0%} load"
        )

    def stage(self, message: str) -> None:
        self.out.print(f"[dim]{message}[/]")

    def policy_started(self, policy: str, requests: int) -> None:
        self._errors = 0
        self._progress = Progress(
            TextColumn("[bold]{task.description:<12}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[errors]}"),
            TimeElapsedColumn(),
            console=self.out,
            transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task(policy, total=requests, errors="")

    def result(self, policy: str, result: Result) -> None:
        if self._progress is None or self._task is None:
            return
        if result.error is not None:
            self._errors += 1
        errors = f"[red]{self._errors} errors[/]" if self._errors else ""
        self._progress.update(self._task, advance=1, errors=errors)
        if not self.out.is_terminal:  # a log file: a line per tenth instead of a live bar
            task = self._progress.tasks[0]
            step = max(1, int(task.total or 1) // 10)
            if int(task.completed) % step == 0:
                self.out.print(
                    f"{policy}: {int(task.completed)}/{int(task.total or 0)} requests done, "
                    f"{task.elapsed or 0:.0f}s {errors}"
                )

    def policy_done(self, run: PolicyRun) -> None:
        if self._progress is not None:
            self._progress.stop()
        self._progress = self._task = None
        failed = [r for r in run.results if r.error is not None]
        if failed:
            self.out.print(f"[red]{len(failed)} requests failed, e.g. {failed[0].error}[/]")
        troubles = {
            k: int(v) for k, v in run.router_stats.items() if v and not k.startswith("stage_")
        }
        if troubles:
            self.out.print(f"[yellow]router counters: {troubles}[/]")
        stages = {
            k.removeprefix("stage_").removesuffix("_ms"): round(v, 2)
            for k, v in run.router_stats.items()
            if k.startswith("stage_")
        }
        engines = {k: int(v) for k, v in run.engine_stats.items()}
        self.out.print(f"[dim]decision stages, mean real ms: {stages}; engines: {engines}[/]")

    # ------------------------------------------------------------------ results

    def table(self, summaries: dict[str, Summary], title: str) -> None:
        header, body = rows(summaries)
        table = Table(title=title, title_justify="left")
        for i, name in enumerate(header):
            table.add_column(name, justify="left" if i == 0 else "right")
        for row in body:
            table.add_row(*row)
        self.out.print(table)

    def goals(self, checked: list[Goal]) -> None:
        for goal in checked:
            mark = "[green]met[/]" if goal.met else "[red]missed[/]"
            self.out.print(f"  {mark}  {goal.name}: {goal.measured} (target {goal.target})")

    def finish(
        self,
        chosen: Plan,
        runs: Sequence[PolicyRun],
        *,
        json_path: Path | None,
        plot_path: Path | None,
        raw: bool = False,
    ) -> int:
        """Print the table and goals, write JSON and plots; exit status 1 if requests failed."""
        scale = chosen.fleet.time_scale
        summaries = summaries_of(runs, scale)
        self.table(
            summaries,
            f"{chosen.workload.describe()} — {chosen.fleet.replicas} engines, "
            f"{chosen.load:.0%} load; latencies in "
            + ("real ms" if chosen.fleet.vllm is not None else "simulated H200 ms"),
        )
        checked = goals(chosen.workload.name, summaries)
        self.goals(checked)
        doc: dict[str, Any] = document(chosen.meta(), summaries, checked)
        if raw:
            doc["results"] = {run.policy: [asdict(r) for r in run.results] for run in runs}
        if json_path is not None:
            write_json(doc, json_path)
            self.out.print(f"wrote {json_path}")
        if plot_path is not None:
            title = f"{chosen.workload.describe()}, {chosen.fleet.replicas} engines"
            for path in plot(runs, summaries, scale, plot_path, title):
                self.out.print(f"wrote {path}")
        failed = sum(s.errors for s in summaries.values())
        return 1 if failed or any(math.isnan(s.hit_rate) for s in summaries.values()) else 0
