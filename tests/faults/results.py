"""One row per fault drill: what the drill measured, stored as JSON and rendered as a table.

Drills record their row with :func:`record`; rows go to the JSON file named by the
``KVROUTER_FAULTS_JSON`` environment variable (``python -m tests.faults.report --run`` sets
it to ``bench/results/faults.json``), else nowhere, so a plain test run changes no file.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from tests.faults.drill import Consistency
from tests.faults.drill_course import Marks
from tests.faults.hit_rates import between, hit_rate, min_window_rate, recovery_s
from tests.faults.workload import Result, Workload

ENV: Final = "KVROUTER_FAULTS_JSON"
RECOVERY_SHARE: Final = 0.9  # "recovered": the hit rate is back to 90 % of its pre-fault level


@dataclass
class FaultRow:
    """What one drill measured (times in seconds)."""

    fault: str
    title: str
    sent: int
    completed: int
    clean_errors: int
    conn_errors: int
    lost: int
    cancelled: int
    held_s: float | None
    baseline_hit: float | None
    dip_hit: float | None
    recovery_s: float | None
    consistent: str
    consistent_after_s: float | None
    notes: str = ""
    steady: bool = False  # no fault (the soak): no dip, no recovery
    extra: dict[str, Any] = field(default_factory=dict)


def make_row(
    fault: str,
    title: str,
    workload: Workload,
    marks: Marks,
    consistency: Consistency | None,
    *,
    extra_results: Sequence[Result] = (),
    notes: str = "",
    steady: bool = False,
    **extra: Any,
) -> FaultRow:
    """The row of a drill from its workload's results and the consistency check.

    :param steady: no fault was injected (the soak): the hit rate is the whole run's.
    """
    results = [*workload.results, *extra_results]
    counts = workload.counts(results)
    before = between(workload.results, marks.baseline_from, marks.fault_at)
    baseline = hit_rate(workload.results if steady else before)
    recovery = dip = None
    if baseline and not steady:
        recovery = recovery_s(
            workload.results,
            fault_at=marks.fault_at,
            end=marks.stopped_at,
            baseline=baseline,
            share=RECOVERY_SHARE,
        )
        dip = min_window_rate(workload.results, start=marks.fault_at, end=marks.stopped_at)
    if consistency is None:
        consistent = "n/a"
    elif not consistency.ok:
        consistent = "no"
    elif consistency.unindexed:
        consistent = f"subset: {consistency.unindexed} cached blocks unindexed"
    else:
        consistent = "yes"
    timeline = []  # hit rate per second, from the baseline on (the fault at t = 0)
    t = marks.baseline_from
    while t < marks.stopped_at:
        rate = hit_rate(between(workload.results, t, t + 1.0))
        timeline.append([round(t - marks.fault_at, 1), None if rate is None else round(rate, 3)])
        t += 1.0
    extra["hit_rate_per_s"] = timeline
    return FaultRow(
        fault=fault,
        title=title,
        sent=counts["sent"],
        completed=counts["completed"],
        clean_errors=counts["clean_error"],
        conn_errors=counts["conn_error"],
        lost=counts["lost"],
        cancelled=counts["cancelled"],
        held_s=None if marks.repaired_at is None else marks.repaired_at - marks.fault_at,
        baseline_hit=baseline,
        dip_hit=dip,
        recovery_s=recovery,
        consistent=consistent,
        consistent_after_s=None if consistency is None else consistency.after_s,
        notes=notes,
        steady=steady,
        extra=extra,
    )


def record(row: FaultRow) -> None:
    """Add (or replace) ``row`` in the results file, if one is configured."""
    name = os.environ.get(ENV)
    if not name:
        return
    path = Path(name)
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    rows = data.setdefault("rows", {})
    rows[row.fault] = asdict(row)
    data["machine"] = f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}"
    data["updated"] = time.strftime("%Y-%m-%d %H:%M:%S")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def _seconds(value: float | None, missing: str = "—") -> str:
    return missing if value is None else f"{value:.1f}"


def _rate(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _order(fault: str) -> tuple[int, str]:
    digits = "".join(c for c in fault if c.isdigit())
    return (int(digits) if digits else 99, fault)


def table(rows: dict[str, dict[str, Any]]) -> str:
    """The Markdown table of ``rows`` (as stored), in fault order."""
    lines = [
        "| # | fault | sent | completed | clean errors | conn. errors | lost | fault held (s) "
        "| hit rate before → dip | recovery (s) | index consistent (after s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for fault in sorted(rows, key=_order):
        r = rows[fault]
        cancelled = f" (+{r['cancelled']} cancelled by the client)" if r["cancelled"] else ""
        consistent = r["consistent"]
        if r["consistent_after_s"] is not None and consistent != "n/a":
            consistent += f" ({r['consistent_after_s']:.1f})"
        recovery = _seconds(r["recovery_s"], "not recovered" if r["baseline_hit"] else "—")
        hits = f"{_rate(r['baseline_hit'])} → {_rate(r['dip_hit'])}"
        if r.get("steady"):
            recovery, hits = "— (no fault)", f"{_rate(r['baseline_hit'])} (whole run)"
        lines.append(
            f"| {fault} | {r['title']} | {r['sent']} | {r['completed']}{cancelled} "
            f"| {r['clean_errors']} | {r['conn_errors']} | {r['lost']} | {_seconds(r['held_s'])} "
            f"| {hits} | {recovery} | {consistent} |"
        )
    return "\n".join(lines)


def notes(rows: dict[str, dict[str, Any]]) -> str:
    """One bullet per row that has notes."""
    return "\n".join(
        f"* **{fault}** — {rows[fault]['notes']}"
        for fault in sorted(rows, key=_order)
        if rows[fault]["notes"]
    )
