"""In-flight load per replica: leases, the load they add up to, and this process's board.

A :class:`Lease` is one dispatched request: it counts one request in flight, and its prefill
work (its uncached prompt tokens, a long prompt's counting more) as queued until
:meth:`Lease.first_token`; nothing after :meth:`Lease.release`. Boards add leases up per
(index partition, replica): a
:class:`LocalLoadBoard` keeps this process's own, :class:`router.shared.redis_load.RedisLoadBoard`
shares them with every other router.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Protocol

from tracker.core.blocks import Namespace

_Key = tuple[Namespace, str]


@dataclass(frozen=True, slots=True)
class Load:
    """A replica's load: requests in flight, and prefill tokens not yet past first token.

    :param prefill_since: since when the engine has been working on the requests there that
        have not produced their first token (``time.monotonic()``): when the oldest was sent,
        or when the last request before them stopped prefilling, whichever is later
        (:meth:`LoadTotals.since`), through this router or, in
        :meth:`router.shared.redis_load.RedisLoadBoard.merge`, another; None: none is pending.
        That much of ``queued_prefill_tokens`` is already done (:mod:`router.decide.scoring`,
        ``queue_ms``).
    """

    inflight: int = 0
    queued_prefill_tokens: int = 0
    prefill_since: float | None = field(default=None, compare=False)


class Lease:
    """One dispatched request's share of a replica's load; a context manager that releases."""

    __slots__ = (
        "_prefilling",
        "_released",
        "_totals",
        "namespace",
        "prefill_tokens",
        "replica",
        "started",
    )

    def __init__(
        self, totals: LoadTotals, namespace: Namespace, replica: str, prefill_tokens: int
    ) -> None:
        self._totals = totals
        self.namespace = namespace
        self.replica = replica
        self.prefill_tokens = prefill_tokens
        self.started = time.monotonic()
        self._prefilling = True
        self._released = False

    @property
    def prefilling(self) -> bool:
        """True until the first token (or the release)."""
        return self._prefilling

    @property
    def released(self) -> bool:
        return self._released

    def first_token(self) -> None:
        """The request's prefill is done: stop counting its tokens (idempotent)."""
        if self._prefilling and not self._released:
            self._prefilling = False
            self._totals._prefilled(self)
            self._totals._adjust(self.namespace, self.replica, 0, -self.prefill_tokens)

    def release(self) -> None:
        """The request finished, failed or was cancelled (idempotent)."""
        if self._released:
            return
        tokens = self.prefill_tokens if self._prefilling else 0
        if self._prefilling:
            self._totals._prefilled(self)
        self._released = True
        self._prefilling = False
        self._totals._adjust(self.namespace, self.replica, -1, -tokens)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


@dataclass(frozen=True, slots=True)
class SurveyLoad:
    """What the shared index's lookup is given to read a board's entries in its own round
    trip: the reading router (its own entries are exact in its process) and how long its
    presence is kept (:meth:`tracker.core.index.BlockIndex.survey`)."""

    router_id: str
    ttl_s: float


class LoadBoard(Protocol):
    """Where routers record what they dispatched and read what every router dispatched."""

    def acquire(self, namespace: Namespace, replica: str, prefill_tokens: int) -> Lease:
        """Count a request just sent to ``replica`` with ``prefill_tokens`` of prefill work."""

    async def snapshot(self, namespace: Namespace) -> dict[str, Load]:
        """Every router's load per replica (replicas without load are absent)."""

    def local_snapshot(self, namespace: Namespace) -> dict[str, Load]:
        """This router's own load per replica; never fails."""

    def current(self, namespace: Namespace) -> dict[str, Load] | None:
        """Every router's load without a round trip, where this board keeps it in the
        process (its own load, or the last background read of the others'); None: read it
        with :meth:`snapshot`."""

    @property
    def survey_load(self) -> SurveyLoad | None:
        """Set when the board's entries live beside the shared index, whose lookup reads
        them in the same round trip (then :meth:`merge` its answer); None otherwise."""

    def merge(
        self, namespace: Namespace, others: Mapping[str, tuple[int, int, int]]
    ) -> dict[str, Load]:
        """Every router's load: the others' entries as a lookup read them
        (:attr:`tracker.core.index.Survey.load`) plus this router's own."""

    async def start(self) -> None:
        """Start background work."""

    async def stop(self) -> None:
        """Stop background work and withdraw this router's load."""


class LoadTotals:
    """This process's load per (partition, replica), kept exact by its leases.

    :param on_change: called with ``(partition, replica)`` each time that total changes.
    """

    def __init__(self, on_change: Callable[[Namespace, str], None] | None = None) -> None:
        self._on_change = on_change
        self._totals: dict[Namespace, dict[str, list[int]]] = {}
        # per (partition, replica): the leases still prefilling, oldest first (an ordered set),
        # and when the last one before them stopped prefilling (while any still is)
        self._prefilling: dict[_Key, dict[Lease, None]] = {}
        self._finished: dict[_Key, float] = {}

    def acquire(self, namespace: Namespace, replica: str, prefill_tokens: int) -> Lease:
        """Count a request just sent to ``replica``; release the returned lease when done.

        :param prefill_tokens: the request's prefill work, in the tokens of a short prompt
            (:func:`router.decide.scoring.prefill_work`: its uncached tokens, a long
            prompt's counting more).
        """
        if prefill_tokens < 0:
            raise ValueError(f"prefill_tokens must be >= 0, got {prefill_tokens}")
        base = namespace.base()
        self._adjust(base, replica, 1, prefill_tokens)
        lease = Lease(self, base, replica, prefill_tokens)
        self._prefilling.setdefault((base, replica), {})[lease] = None
        return lease

    def _prefilled(self, lease: Lease) -> None:
        key = (lease.namespace, lease.replica)
        pending = self._prefilling.get(key)
        if pending is not None:
            pending.pop(lease, None)
            if pending:
                self._finished[key] = time.monotonic()
            else:
                del self._prefilling[key]
                self._finished.pop(key, None)

    def since(self, namespace: Namespace, replica: str) -> float | None:
        """Since when the engine has been working on this router's requests still prefilling
        on ``replica``: when the oldest of them was sent, or when the last request before
        them stopped prefilling, whichever is later. None: none is prefilling.

        The engine spent the time before on that request: counted from the oldest send, an
        87k-token prefill that had waited 8 s behind a 120k one looked 8 s done when it
        started, and a short prompt was placed behind the 5 s it still had to go.
        """
        key = (namespace, replica)
        pending = self._prefilling.get(key)
        if not pending:
            return None
        oldest = next(iter(pending)).started
        return max(oldest, self._finished.get(key, oldest))

    def _adjust(self, namespace: Namespace, replica: str, inflight: int, tokens: int) -> None:
        per = self._totals.setdefault(namespace, {})
        total = per.get(replica)
        if total is None:
            total = per[replica] = [0, 0]
        total[0] += inflight
        total[1] += tokens
        if total[0] == 0 and total[1] == 0:
            del per[replica]
        if self._on_change is not None:
            self._on_change(namespace, replica)

    def total(self, namespace: Namespace, replica: str) -> tuple[int, int]:
        """``(requests in flight, queued prefill tokens)`` of ``replica`` in a partition."""
        total = self._totals.get(namespace, {}).get(replica)
        return (total[0], total[1]) if total is not None else (0, 0)

    def held(self) -> list[_Key]:
        """Every (partition, replica) with load."""
        return [(namespace, replica) for namespace, per in self._totals.items() for replica in per]

    def snapshot(self, namespace: Namespace) -> dict[str, Load]:
        """This router's own load per replica in ``namespace``'s partition."""
        base = namespace.base()
        per = self._totals.get(base, {})
        return {replica: Load(n, q, self.since(base, replica)) for replica, (n, q) in per.items()}


class LocalLoadBoard:
    """In-process load only: a single router, or the embedded mode."""

    survey_load: SurveyLoad | None = None

    def __init__(self) -> None:
        self.totals = LoadTotals()

    def acquire(self, namespace: Namespace, replica: str, prefill_tokens: int) -> Lease:
        return self.totals.acquire(namespace, replica, prefill_tokens)

    def local_snapshot(self, namespace: Namespace) -> dict[str, Load]:
        return self.totals.snapshot(namespace)

    async def snapshot(self, namespace: Namespace) -> dict[str, Load]:
        return self.totals.snapshot(namespace)

    def current(self, namespace: Namespace) -> dict[str, Load]:
        return self.totals.snapshot(namespace)

    def merge(
        self, namespace: Namespace, others: Mapping[str, tuple[int, int, int]]
    ) -> dict[str, Load]:
        return self.totals.snapshot(namespace)  # no other router shares this board

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None
