"""The engines' hit rate over a drill's requests: overall, per window, its dip and recovery."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tests.faults.workload import Result


def hit_rate(results: Iterable[Result]) -> float | None:
    """Cached over prompt tokens of the completed requests (token-weighted)."""
    prompt = cached = 0
    for result in results:
        if result.outcome == "completed" and result.prompt_tokens:
            prompt += result.prompt_tokens
            cached += result.cached_tokens or 0
    return cached / prompt if prompt else None


def between(results: Iterable[Result], start: float, end: float) -> list[Result]:
    """The requests that ended in ``[start, end)``."""
    return [r for r in results if start <= r.ended < end]


def recovery_s(
    results: Sequence[Result],
    *,
    fault_at: float,
    end: float,
    baseline: float,
    share: float = 0.8,
    window_s: float = 2.0,
    step_s: float = 0.25,
    min_requests: int = 8,
    final_s: float = 4.0,
) -> float | None:
    """Seconds from ``fault_at`` until the hit rate is back for good; None if it never is.

    Windows of ``window_s`` (by completion time, stepped by ``step_s``) from the fault to
    ``end``: recovery is the end of the last window whose hit rate is below ``share`` of
    ``baseline`` (0 when none is). "For good": the requests of the last ``final_s`` taken
    together must be above it, or it never recovered (one 2 s window holds ~50 requests, so a
    few cold misses in the very last one must not decide it alone).
    Windows with fewer than ``min_requests`` completed requests say nothing and are skipped.
    """
    target = share * baseline
    last_bad: float | None = None
    start = fault_at
    while start + window_s <= end:
        window = [r for r in between(results, start, start + window_s) if r.hit_rate is not None]
        if len(window) >= min_requests:
            rate = hit_rate(window)
            if rate is None or rate < target:
                last_bad = start + window_s
        start += step_s
    final = [
        r for r in between(results, max(fault_at, end - final_s), end) if r.hit_rate is not None
    ]
    final_rate = hit_rate(final) if len(final) >= min_requests else None
    if last_bad is not None and (final_rate is None or final_rate < target):
        return None
    return 0.0 if last_bad is None else last_bad - fault_at


def min_window_rate(
    results: Sequence[Result], *, start: float, end: float, window_s: float = 2.0
) -> float | None:
    """The lowest hit rate of any window in ``[start, end)`` (the depth of the dip)."""
    rates: list[float] = []
    t = start
    while t + window_s <= end:
        window = [r for r in between(results, t, t + window_s) if r.hit_rate is not None]
        rate = hit_rate(window) if len(window) >= 8 else None
        if rate is not None:
            rates.append(rate)
        t += 0.25
    return min(rates) if rates else None
