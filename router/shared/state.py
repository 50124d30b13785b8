"""Fail-open access to the shared state: index and load reads under a time budget and a breaker.

A routing decision reads the index (placements) and the load board (every router's load) in
one round trip bounded by ``budget_s``, plus how late the router's own event loop is running
(:class:`LoopLag`): the budget is the index's, and a reply that waits in the socket while the
loop is busy elsewhere is not the index's delay. Failures and timeouts count towards a
:class:`CircuitBreaker`; while it is open the router does not even try and routes on its own
load only. After the cool-down one request probes (half-open); success closes it again.
Predictions and home claims are written in the background, never delaying a request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from prometheus_client import Gauge

from router.metrics import RouterMetrics
from router.shared.load import Load, LoadBoard
from router.shared.routefeed import RouteFeed
from tracker.core.blocks import Namespace
from tracker.core.index import BlockIndex, Home, Match, Residency, Route, Survey
from tracker.framework.errors import IndexUnavailableError
from tracker.framework.lifecycle import cancel_and_wait

logger = logging.getLogger(__name__)

State = Literal["closed", "open", "half_open"]
PREDICT_TIMEOUT_S: Final = 1.0
MAX_PENDING_PREDICTIONS: Final = 1024
MAX_LAG_ALLOWANCE: Final = 10  # budgets: a loop this late is overloaded, and load-only it is


class LoopLag:
    """How late this process's event loop runs a timer: the most over the last ``window``
    samples, one every ``interval_s`` (~1 s by default).

    A busy loop runs a due timer only when the callbacks ahead of it are done, and uvloop
    runs due timers before it reads the sockets: a lookup whose reply has arrived times out
    if the loop was busy for its budget. Measured at 400 requests/s on two shared cores
    (docs/benchmarks.md), such timeouts opened the breaker for 15 % of the requests.
    """

    def __init__(
        self, *, interval_s: float = 0.05, window: int = 20, gauge: Gauge | None = None
    ) -> None:
        self.interval_s = interval_s
        self._samples: deque[float] = deque([0.0], maxlen=window)
        self._gauge = gauge
        self._task: asyncio.Task[None] | None = None

    @property
    def seconds(self) -> float:
        """The most a timer ran late over the window."""
        return max(self._samples)

    def record(self, late_s: float) -> None:
        self._samples.append(max(0.0, late_s))
        if self._gauge is not None:
            self._gauge.set(self.seconds)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.record(loop.time() - due)


class CircuitBreaker:
    """Opens after ``failures`` failures in a row; lets one probe through after ``cooldown_s``."""

    def __init__(
        self,
        failures: int,
        cooldown_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[State], None] | None = None,
    ) -> None:
        self.failures = failures
        self.cooldown_s = cooldown_s
        self.state: State = "closed"
        self._clock = clock
        self._on_change = on_change
        self._count = 0
        self._opened = 0.0
        self._probing = False

    def allow(self) -> bool:
        """Whether to try now (an open breaker past its cool-down lets one probe through)."""
        if self.state == "closed":
            return True
        if self.state == "open" and self._clock() - self._opened >= self.cooldown_s:
            self._set("half_open")
        if self.state == "half_open" and not self._probing:
            self._probing = True
            return True
        return False

    def abandon(self) -> None:
        """The attempt :meth:`allow` let through ended without a verdict (cancelled)."""
        self._probing = False

    def success(self) -> None:
        self._count = 0
        self._probing = False
        if self.state != "closed":
            self._set("closed")

    def failure(self) -> None:
        self._count += 1
        self._probing = False
        if self.state == "half_open" or (self.state == "closed" and self._count >= self.failures):
            self._opened = self._clock()
            self._set("open")

    def _set(self, state: State) -> None:
        self.state = state
        if self._on_change is not None:
            self._on_change(state)


@dataclass(frozen=True, slots=True)
class SharedView:
    """What a decision knows: placements, load, and why the index was skipped (if it was)."""

    matches: dict[str, Match]
    loads: dict[str, Load]
    fallback: str | None = None
    residency: dict[str, Residency] = field(default_factory=dict)
    homes: dict[str, Home] = field(default_factory=dict)
    lookahead: dict[str, int] = field(default_factory=dict)
    session: dict[str, Home] = field(default_factory=dict)
    sessions: dict[str, int] = field(default_factory=dict)


def _view_of(survey: Survey, loads: dict[str, Load]) -> SharedView:
    return SharedView(
        survey.matches,
        loads,
        residency=survey.residency,
        homes=survey.homes,
        lookahead=survey.lookahead,
        session=survey.session,
        sessions=survey.sessions,
    )


class SharedState:
    """The index and the load board behind a time budget and a circuit breaker.

    :param budget_s: how long one lookup (placements and load, concurrently) may take.
    :param per_block_s: extra budget per block of the chain: the server-side walk is linear
        in the prompt's cached blocks (~1 µs each), so a 100k-token prompt needs more time
        than a short one, and a fixed budget would route long prompts on load alone.
    :param feed: an in-process index's routes are shared through it with the other routers
        (``--local-index``).
    :param lag: the event loop's lateness, added to the budget twice (the reply waits for
        the loop once to be read and once more for the request's task to resume), at most
        ``MAX_LAG_ALLOWANCE`` budgets.
    """

    def __init__(
        self,
        index: BlockIndex,
        load: LoadBoard,
        metrics: RouterMetrics,
        *,
        budget_s: float,
        failures: int,
        cooldown_s: float,
        per_block_s: float = 0.0,
        lag: LoopLag | None = None,
        feed: RouteFeed | None = None,
    ) -> None:
        self.index = index
        self.load = load
        self.lag = lag
        self.feed = feed
        self.metrics = metrics
        self.budget_s = budget_s
        self.per_block_s = per_block_s
        self.breaker = CircuitBreaker(failures, cooldown_s, on_change=self._changed)
        self._pending: set[asyncio.Task[None]] = set()
        self._outage = False

    def _changed(self, state: State) -> None:
        self.metrics.breaker_open.set(1 if state == "open" else 0)
        if state == "open" and not self._outage:
            self._outage = True
            logger.warning(
                "index circuit breaker open: routing on load only until the index answers",
                extra={"cooldown_s": self.breaker.cooldown_s},
            )
        elif state == "closed":
            self._outage = False
            logger.info("index circuit breaker closed: cache-aware routing again")

    async def view(
        self, namespace: Namespace, keys: Sequence[int], session: int | None = None
    ) -> SharedView:
        """Placements of ``keys``, every router's load and the home of ``session`` (a
        :func:`~tracker.core.blocks.session_key`); never raises for the index's sake."""
        if self.feed is not None:
            self.feed.want(namespace)
        loads = self.load.current(namespace)
        if loads is not None:
            survey = self.index.survey_now(namespace, keys, session)
            if survey is not None:  # nothing to wait for, nothing that fails: no budget
                return _view_of(survey, loads)
        if not self.breaker.allow():
            return self._fallback(namespace, "breaker_open")
        try:
            async with asyncio.timeout(self._budget(len(keys))):
                beside = self.load.survey_load
                if beside is not None:  # the board lives beside the index: one script reads both
                    survey = await self.index.survey(
                        namespace,
                        keys,
                        load_except=beside.router_id,
                        load_ttl_s=beside.ttl_s,
                        session=session,
                    )
                    loads = self.load.merge(namespace, survey.load or {})
                else:
                    survey = await self.index.survey(namespace, keys, session=session)
                    loads = self.load.current(namespace)
                    if loads is None:
                        loads = await self.load.snapshot(namespace)
        except TimeoutError:
            self.breaker.failure()
            return self._fallback(namespace, "timeout")
        except IndexUnavailableError as exc:
            self.breaker.failure()
            logger.debug("index lookup failed", extra={"error": str(exc)})
            return self._fallback(namespace, "error")
        except asyncio.CancelledError:
            self.breaker.abandon()
            raise
        self.breaker.success()
        return _view_of(survey, loads)

    def _budget(self, blocks: int) -> float:
        budget = self.budget_s + self.per_block_s * blocks
        if self.lag is None:
            return budget
        return budget + min(2 * self.lag.seconds, MAX_LAG_ALLOWANCE * self.budget_s)

    async def loads(
        self, namespace: Namespace, timeout_s: float = 1.0
    ) -> tuple[dict[str, Load], bool]:
        """Every router's load for an operator query: ``(loads, shared)``; local if unshared."""
        if self.breaker.state == "closed":
            try:
                async with asyncio.timeout(timeout_s):
                    return await self.load.snapshot(namespace), True
            except (TimeoutError, IndexUnavailableError):
                pass
        return self.load.local_snapshot(namespace), False

    def _fallback(self, namespace: Namespace, reason: str) -> SharedView:
        self.metrics.fallbacks.labels(reason).inc()
        return SharedView({}, self.load.local_snapshot(namespace), reason)

    def record(self, namespace: Namespace, route: Route) -> None:
        """Record that ``route.replica`` is about to hold ``route.keys`` and is the home of
        ``route.anchors`` (:meth:`tracker.core.index.BlockIndex.route`): at once in an index
        in this process, in the background in a remote one."""
        if route.ttl_s <= 0 or route.home_ttl_s <= 0:
            route = dataclasses.replace(
                route,
                keys=route.keys if route.ttl_s > 0 else (),
                anchors=route.anchors if route.home_ttl_s > 0 else (),
            )
        if not route.keys and not route.anchors:
            return
        if self.breaker.state != "closed" or len(self._pending) >= MAX_PENDING_PREDICTIONS:
            self.metrics.predictions.labels("skipped").inc()
            return
        # In this process: recorded now. As a task, a request tokenized meanwhile (its
        # resumption queued first) was placed without the first's prediction or home and
        # copied a new prefix to an idle engine (tests/router/test_startup_copies.py).
        if self.index.route_now(namespace, route):
            if self.feed is not None:
                self.feed.publish(namespace, route)
            self.metrics.predictions.labels("ok").inc()
            return
        task = asyncio.get_running_loop().create_task(self._record(namespace, route))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _record(self, namespace: Namespace, route: Route) -> None:
        try:
            async with asyncio.timeout(max(PREDICT_TIMEOUT_S, self.budget_s)):
                await self.index.route(namespace, route)
        except (TimeoutError, IndexUnavailableError) as exc:
            self.breaker.failure()
            self.metrics.predictions.labels("error").inc()
            logger.debug("prediction failed", extra={"replica": route.replica, "error": str(exc)})
            return
        self.metrics.predictions.labels("ok").inc()

    async def stop(self) -> None:
        """Cancel predictions still in flight."""
        await cancel_and_wait(list(self._pending))
