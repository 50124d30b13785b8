"""How fast each replica's prefix cache turns over, from the index's count of stored blocks.

:class:`ChurnBook` turns the stored-block counts every lookup returns into a rate per replica
(smoothed over a half-life, known once its counts span ``settle_s``) and compares replicas:
:meth:`ChurnBook.relative` is a replica's rate over the candidates' mean. Churn comes from the
engines' events, so it includes every router's and every outside client's traffic.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Final

from tracker.core.index import Residency

_MIN_RATE: Final = 1e-9


class _Rate:
    __slots__ = ("at", "rate", "since", "stored")

    def __init__(self, at: float, stored: int) -> None:
        self.since = self.at = at
        self.stored = stored
        self.rate: float | None = None


class ChurnBook:
    """Blocks stored per second per replica, from successive :class:`Residency` counts.

    :param half_life_s: older rates weigh half as much every this many seconds.
    :param min_interval_s: counts closer together than this are not differenced (noise).
    :param settle_s: a rate is known once its counts span this long (default: a half-life).
    """

    def __init__(
        self,
        *,
        half_life_s: float = 10.0,
        min_interval_s: float = 1.0,
        settle_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if half_life_s <= 0 or min_interval_s <= 0:
            raise ValueError("half_life_s and min_interval_s must be > 0")
        self.half_life_s = half_life_s
        self.min_interval_s = min_interval_s
        self.settle_s = half_life_s if settle_s is None else settle_s
        self.clock = clock
        self._rates: dict[str, _Rate] = {}

    def observe(self, residency: Mapping[str, Residency]) -> None:
        """Take the counts of one lookup (cheap: most calls only compare a timestamp)."""
        now = self.clock()
        for replica, counts in residency.items():
            entry = self._rates.get(replica)
            if entry is None:
                self._rates[replica] = _Rate(now, counts.stored)
                continue
            elapsed = now - entry.at
            if elapsed < self.min_interval_s:
                continue
            grown = counts.stored - entry.stored
            entry.at, entry.stored = now, counts.stored
            if grown < 0:  # the index was rebuilt: start over
                entry.rate = None
                entry.since = now
                continue
            current = grown / elapsed
            if entry.rate is None:
                entry.rate = current
            else:
                keep = 0.5 ** (elapsed / self.half_life_s)
                entry.rate = keep * entry.rate + (1.0 - keep) * current

    def rate(self, replica: str) -> float | None:
        """Blocks per second the replica's cache stores (None until its counts span
        ``settle_s``)."""
        entry = self._rates.get(replica)
        if entry is None or entry.at - entry.since < self.settle_s:
            return None
        return entry.rate

    def relative(self, replicas: Iterable[str]) -> dict[str, float | None]:
        """Each replica's rate over the mean of those known; None where unknown."""
        rates = {r: self.rate(r) for r in replicas}
        known = [v for v in rates.values() if v is not None]
        if not known:
            return dict.fromkeys(rates)
        mean = sum(known) / len(known)
        if mean <= _MIN_RATE:
            return {r: (None if v is None else 1.0) for r, v in rates.items()}
        return {r: (None if v is None else v / mean) for r, v in rates.items()}

    def forget(self, replica: str) -> None:
        self._rates.pop(replica, None)
