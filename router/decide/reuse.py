"""Which of each replica's cached blocks routed requests keep using: what evicting them costs.

:class:`ReuseBook` keeps, per replica, the chains this router sent there within a window (the
first block key and the deepest run a request left cached) and sums their depths: the blocks
an eviction would cost, where the index's residency also counts finished requests' own blocks,
which are free to evict. Soft state, per router. docs/architecture.md ("Score", evict) gives
the rule and what the earlier ones cost.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

_MAX_PREFIXES: Final = 8_192  # per replica (~1 MB); the oldest go first beyond this


@dataclass(frozen=True, slots=True)
class Booking:
    """One :meth:`ReuseBook.record`: the entry it wrote, and the one it replaced."""

    replica: str
    root: int
    written: tuple[int, float]
    replaced: tuple[int, float] | None


class _Replica:
    __slots__ = ("blocks", "prefixes")

    def __init__(self) -> None:
        self.prefixes: OrderedDict[int, tuple[int, float]] = OrderedDict()  # root -> depth, at
        self.blocks = 0

    def drop(self, root: int) -> None:
        depth, _ = self.prefixes.pop(root)
        self.blocks -= depth


class ReuseBook:
    """Blocks per replica that routed requests left cached within ``window_s`` (module docstring).

    :param window_s: a chain counts this long after a request was last sent there with it (> 0).
    """

    def __init__(self, window_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.clock = clock
        self._since = clock()
        self._replicas: dict[str, _Replica] = {}

    def record(self, replica: str, root: int, blocks: int) -> Booking | None:
        """A request routed to ``replica`` left ``blocks`` blocks of the chain that starts
        with block key ``root`` cached there (its deepest there since it last lapsed counts).

        A request that names a session books under the session's key instead of its first
        block: sessions that share a preamble are chains of their own (and a session's
        subagents part of the session's).

        Returns what to hand :meth:`withdraw` if the request never reaches the replica.
        """
        if blocks <= 0:
            return None
        entry = self._replicas.get(replica)
        if entry is None:
            entry = self._replicas[replica] = _Replica()
        old = entry.prefixes.pop(root, None)
        if old is not None:
            entry.blocks -= old[0]
            blocks = max(blocks, old[0])
        written = (blocks, self.clock())
        entry.prefixes[root] = written
        entry.blocks += blocks
        if len(entry.prefixes) > _MAX_PREFIXES:
            entry.drop(next(iter(entry.prefixes)))
        return Booking(replica, root, written, old)

    def withdraw(self, booking: Booking) -> None:
        """Take back a :meth:`record` whose request never reached the replica: the chain's
        entry there is what it was before, unless a request recorded it again since."""
        entry = self._replicas.get(booking.replica)
        if entry is None or entry.prefixes.get(booking.root) != booking.written:
            return
        entry.drop(booking.root)
        if booking.replaced is not None:
            entry.prefixes[booking.root] = booking.replaced
            entry.prefixes.move_to_end(booking.root, last=False)
            entry.blocks += booking.replaced[0]

    def valued(self, replica: str, resident: int | None) -> int | None:
        """Blocks of ``replica``'s cache in use lately: those this router saw sent there, or,
        before it has watched for a whole window, the share of the ``resident`` blocks the
        rest of the window may hide if that is more (None when ``resident`` is unknown)."""
        now = self.clock()
        unseen = 1.0 - (now - self._since) / self.window_s
        watched = self._watched(replica, now)
        if unseen <= 0.0:
            return watched
        if resident is None:
            return None
        return max(watched, math.ceil(resident * unseen))

    def prefixes(self, replica: str) -> int:
        """How many chains (by their first block) were sent to ``replica`` within the window:
        the prefix groups it serves, which its load will follow."""
        self._watched(replica, self.clock())
        entry = self._replicas.get(replica)
        return len(entry.prefixes) if entry is not None else 0

    def _watched(self, replica: str, now: float) -> int:
        entry = self._replicas.get(replica)
        if entry is None:
            return 0
        horizon = now - self.window_s
        prefixes = entry.prefixes
        while prefixes:
            root, (_, at) = next(iter(prefixes.items()))
            if at >= horizon:
                break
            entry.drop(root)
        return entry.blocks

    def forget(self, replica: str) -> None:
        """A replica restarted or left: nothing of its old cache is worth anything."""
        self._replicas.pop(replica, None)
