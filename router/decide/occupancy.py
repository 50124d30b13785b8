"""How many requests each replica has been running lately: the load a copy there will meet.

:class:`OccupancyBook` keeps a time-weighted mean of each replica's requests in flight, from the
counts seen at each decision and each committed request; the policy prices a miss's compute at
the larger of the count now and this mean (docs/architecture.md, "Score", compute).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class _Mean:
    __slots__ = ("at", "count", "mean")

    def __init__(self, at: float, count: int) -> None:
        self.at = at
        self.count = count
        self.mean = float(count)


class OccupancyBook:
    """Time-weighted mean of each replica's requests in flight (module docstring).

    :param half_life_s: a count weighs half as much this many seconds after it was replaced.
    """

    def __init__(self, half_life_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self.half_life_s = half_life_s
        self.clock = clock
        self._means: dict[str, _Mean] = {}

    def observe(self, replica: str, count: int) -> float:
        """Take the replica's requests in flight now; return its mean up to now.

        The previous count is taken to have held since it was observed (decisions are
        frequent when the mean matters: a quiet fleet's counts decay between them).
        """
        now = self.clock()
        entry = self._means.get(replica)
        if entry is None:
            self._means[replica] = _Mean(now, count)
            return float(count)
        elapsed = max(0.0, now - entry.at)
        keep = 0.5 ** (elapsed / self.half_life_s)
        entry.mean = keep * entry.mean + (1.0 - keep) * entry.count
        entry.at, entry.count = now, count
        return entry.mean

    def count(self, replica: str) -> int | None:
        """The replica's requests in flight as last observed (None: never observed)."""
        entry = self._means.get(replica)
        return None if entry is None else entry.count

    def forget(self, replica: str) -> None:
        """The replica left the fleet."""
        self._means.pop(replica, None)
