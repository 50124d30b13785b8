"""How many requests each replica has been running lately: the load a copy there will meet.

A prompt sent away from its cache is prefilled in full, and every request on that engine
waits for that compute (``compute`` in :mod:`router.decide.policy`). Counting only the requests in
flight at the moment of the decision makes an engine whose requests have just finished look
free: under pressure the next request of a group busy at home went there, copied its prefix
(evicting another group's), and the groups split over more engines (2.5 per group, 71.6 %
engine hits in the 700-block matrix cell, against 2.3 and 76.8 % priced as below). Where
that engine's cache is full of prefixes its groups reuse it does not stay idle — its groups
keep arriving — so the policy prices the compute at the larger of the requests in flight
now and the mean over the last seconds, scaled by the part of the copy that evicts them.
The mean also breaks ties: with sequential traffic nothing is in flight at any decision,
and the replica that served last is the busier.

:class:`OccupancyBook` keeps that mean per replica: the routers' requests in flight at each
decision (the shared load board, so every router sees the others' too) and the count with
each request this router routes, weighed by how long each count held, decaying with
``half_life_s``. It is soft state: a restarted router starts from the counts it sees.
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

    def forget(self, replica: str) -> None:
        """The replica left the fleet."""
        self._means.pop(replica, None)
