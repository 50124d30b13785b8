"""Soak: steady load on the whole stack, time-scaled, watching for leaks.

The engines run 20x faster than an H200 (``--time-scale 0.05``), so an hour of engine time
passes in three minutes: ``KVROUTER_SOAK=1`` runs that hour; by default the drill soaks for
45 s (15 engine-minutes), enough to see a leak that grows with requests. Every few seconds
each process's resident memory, open file descriptors and threads are sampled; at the end,
with the load stopped, nothing may be left in flight (routers, shared load board, engines),
the index must equal the engines' caches, and memory, descriptors and threads must be flat:
no more than a small allowance above what they were once the stack had warmed up.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Final

import pytest

from tests.faults.conftest import DrillFactory
from tests.faults.drill import ENGINES, settle
from tests.faults.drill_course import run_drill
from tests.faults.results import make_row, record

SOAK: Final = os.environ.get("KVROUTER_SOAK", "") not in ("", "0")
SOAK_S: Final = 180.0 if SOAK else 45.0
TIME_SCALE: Final = 0.05
SAMPLE_S: Final = 3.0
# allowances for "flat": above the level once warmed up (a third into the run)
RSS_GROWTH_KB: Final = 12 * 1024
RSS_GROWTH_SHARE: Final = 0.10
FD_GROWTH: Final = 6
THREAD_GROWTH: Final = 2

pytestmark = [
    pytest.mark.faults,
    pytest.mark.redis,
    pytest.mark.timeout(SOAK_S + 150),
]

Samples = list[tuple[float, dict[str, dict[str, int]]]]


def growth(samples: Samples, name: str, what: str, start: float) -> tuple[int, int]:
    """(value once warmed up, the highest value after) of one process's statistic."""
    warmed = [s for t, s in samples if t >= start and name in s]
    assert warmed, f"no sample of {name} after warm-up"
    base = warmed[0][name][what]
    return base, max(s[name][what] for s in warmed)


async def test_soak_flat_memory_no_leaked_load_sockets_or_threads(
    drill_factory: DrillFactory,
) -> None:
    drill = await drill_factory(time_scale=TIME_SCALE)
    workload = drill.workload(max_tokens=(8, 8, 8, 64))
    samples: Samples = []
    max_inflight = 0

    async def sample_until(end: float) -> None:
        nonlocal max_inflight
        while time.monotonic() < end:
            samples.append((time.monotonic(), await asyncio.to_thread(drill.resources)))
            for i in (0, 1):
                max_inflight = max(max_inflight, (await drill.router_health(i))["inflight"])
            await asyncio.sleep(SAMPLE_S)

    async def soak() -> None:
        await sample_until(time.monotonic() + SOAK_S)

    started = time.monotonic()
    marks = await run_drill(workload, soak, after_s=0.0)
    idle_s, consistency = await settle(
        drill, range(ENGINES), dict.fromkeys(range(ENGINES), "exact")
    )
    await asyncio.sleep(1.0)  # let the idle connections settle before the final sample
    samples.append((time.monotonic(), await asyncio.to_thread(drill.resources)))
    warmed_at = marks.fault_at + SOAK_S / 3

    assert set(samples[-1][1]) == set(drill.stack.processes.names()), "a process died"
    bad = [r for r in workload.results if r.outcome != "completed"]
    assert not bad, [(r.outcome, r.detail) for r in bad[:10]]
    assert max_inflight <= workload.clients, max_inflight
    report: dict[str, dict[str, int]] = {}
    problems = []
    for name in drill.stack.processes.names():
        rss0, rss1 = growth(samples, name, "rss_kb", warmed_at)
        fds0, fds1 = growth(samples, name, "fds", warmed_at)
        thr0, thr1 = growth(samples, name, "threads", warmed_at)
        end = samples[-1][1][name]
        report[name] = {
            "rss_kb": rss0,
            "rss_growth_kb": rss1 - rss0,
            "fds": fds0,
            "fds_max": fds1,
            "fds_idle": end["fds"],
            "threads": thr0,
            "threads_max": thr1,
        }
        if rss1 - rss0 > max(RSS_GROWTH_KB, RSS_GROWTH_SHARE * rss0):
            problems.append(f"{name}: memory grew {rss1 - rss0} kB after warm-up ({rss0} kB)")
        if fds1 - fds0 > FD_GROWTH or end["fds"] - fds0 > FD_GROWTH:
            problems.append(f"{name}: file descriptors {fds0} -> {fds1} (idle {end['fds']})")
        if thr1 - thr0 > THREAD_GROWTH:
            problems.append(f"{name}: threads {thr0} -> {thr1}")
    simulated_min = (marks.stopped_at - started) / TIME_SCALE / 60
    rss_growth = max(r["rss_growth_kb"] for r in report.values())
    row = make_row(
        "10",
        f"soak: {SOAK_S:g} s of steady load at 20x ({simulated_min:.0f} engine-minutes)",
        workload,
        marks,
        consistency,
        notes=(
            f"{len(workload.results)} requests; after warm-up no process grew more than "
            f"{rss_growth / 1024:.1f} MB, file descriptors and threads stayed flat; router "
            f"in-flight peaked at {max_inflight} and every router, the shared load board and "
            f"every engine were idle {idle_s:.1f} s after the load stopped. "
            f"{'' if SOAK else 'KVROUTER_SOAK=1 runs the 180 s (one engine-hour) soak.'}"
        ),
        steady=True,
        processes=report,
        simulated_minutes=round(simulated_min, 1),
    )
    record(row)
    assert not problems, (problems, report)
    assert consistency.ok, consistency
