"""A fault drill's course (warm-up, baseline, the fault, load after it) and what it observed."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

from tests.faults.workload import Result, Workload

WARM_S: Final = 3.0  # every group's prefix gets cached somewhere
BASELINE_S: Final = 3.0  # the hit rate before the fault
AFTER_S: Final = 9.0  # steady load after the fault (and its repair)


@dataclass
class Seen:
    """What a drill's fault step observed, for the checks after the drill."""

    victim: str = ""
    at: float = 0.0  # when the fault had hit (the process gone, stopped, ...)
    streams: list[asyncio.Task[Result]] = field(default_factory=list)
    gone: list[Result] = field(default_factory=list)
    numbers: dict[str, float] = field(default_factory=dict)
    metrics: list[dict[tuple[str, Any], float]] = field(default_factory=list)


@dataclass(frozen=True)
class Marks:
    """When a drill's phases began (``time.monotonic()``)."""

    baseline_from: float
    fault_at: float
    repaired_at: float | None
    stopped_at: float


async def run_drill(
    workload: Workload,
    fault: Callable[[], Awaitable[float | None]],
    *,
    after_s: float = AFTER_S,
) -> Marks:
    """Warm up, measure the baseline, run ``fault`` (it returns when it repaired the stack, or
    None), keep the load on for ``after_s``, stop the workload (its requests in flight finish).
    """
    workload.start()
    try:
        await asyncio.sleep(WARM_S)
        baseline_from = time.monotonic()
        await asyncio.sleep(BASELINE_S)
        fault_at = time.monotonic()
        repaired_at = await fault()
        await asyncio.sleep(after_s)
    finally:
        await workload.stop()
    return Marks(baseline_from, fault_at, repaired_at, workload.stopped_at)


def busiest(workload: Workload, since: float) -> tuple[str, list[int]]:
    """The replica that answered the most requests since ``since``, and the groups it serves."""
    recent = [r for r in workload.results if r.started >= since and r.replica is not None]
    if not recent:
        raise AssertionError("no request was answered by a replica")
    replicas = Counter(r.replica for r in recent)
    victim = replicas.most_common(1)[0][0]
    assert victim is not None
    by_group: dict[int, Counter[str | None]] = {}
    for r in recent:
        by_group.setdefault(r.group, Counter())[r.replica] += 1
    groups = [g for g, seen in sorted(by_group.items()) if seen.most_common(1)[0][0] == victim]
    return victim, groups
