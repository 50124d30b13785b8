"""How a drill decides that routing quality recovered (pure; no stack)."""

from __future__ import annotations

from tests.faults.hit_rates import recovery_s
from tests.faults.workload import Result


def _results(rates: list[float], per_second: int = 25) -> list[Result]:
    """``per_second`` completed requests in each second ``i`` with hit rate ``rates[i]``."""
    out = []
    for second, rate in enumerate(rates):
        for k in range(per_second):
            t = second + (k + 0.5) / per_second
            out.append(
                Result(
                    n=len(out), group=0, stream=False, max_tokens=8, started=t - 0.1, ended=t,
                    outcome="completed", prompt_tokens=1000, cached_tokens=int(rate * 1000),
                )
            )  # fmt: skip
    return out


def _recovery(rates: list[float]) -> float | None:
    return recovery_s(_results(rates), fault_at=0.0, end=len(rates), baseline=0.95, share=0.9)


def test_no_dip_is_zero_and_a_dip_ends_where_its_last_window_ends() -> None:
    assert _recovery([0.95] * 10) == 0.0
    assert _recovery([0.5, 0.5, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95]) == 3.5


def test_a_rate_still_low_at_the_end_never_recovered() -> None:
    assert _recovery([0.5] * 10) is None
    assert _recovery([0.95] * 6 + [0.5] * 4) is None


def test_one_noisy_late_second_is_reported_but_does_not_decide_alone() -> None:
    # a few cold misses in the last window: the last 4 s together are still above 90 %
    late = _recovery([0.5, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95, 0.6, 0.95])
    assert late is not None and late > 8
