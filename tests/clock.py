"""A clock the test sets by hand, for the classes that take ``clock=`` (seconds)."""

from __future__ import annotations


class ManualClock:
    """Returns ``now``; a test moves it forward (``clock.now += 5``)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
