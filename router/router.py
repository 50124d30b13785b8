"""Every part of one router, built once from its settings, started and stopped together.

Front ends serve over a :class:`Router`: the HTTP proxy (:mod:`router.http.app`) places each
request with its :class:`~router.decide.decider.Decider` and sends it with its upstream client.
"""

from __future__ import annotations

import asyncio
import logging
import random

import redis.asyncio as redis
from prometheus_client import CollectorRegistry

from router.baselines import make_baseline
from router.baselines.baseline import Tools
from router.config import RouterSettings
from router.decide.decider import Decider
from router.decide.estimator import SpeedBook
from router.decide.journal import DecisionJournal
from router.decide.tokenize import TokenizerBook
from router.fleet.health import ReplicaMonitor
from router.fleet.replicas import ReplicaSet
from router.fleet.upstream import UpstreamClient
from router.metrics import MismatchDetector, RouterMetrics
from router.shared.load import Load, LoadBoard, LocalLoadBoard
from router.shared.redis_load import RedisLoadBoard
from router.shared.routefeed import REFRESH_S as ROUTE_REFRESH_S
from router.shared.routefeed import RouteFeed
from router.shared.state import LoopLag, SharedState
from tracker.core.blocks import Namespace
from tracker.core.index import BlockIndex
from tracker.framework.errors import IndexUnavailableError

logger = logging.getLogger(__name__)


def load_board(
    settings: RouterSettings,
    client: redis.Redis | None = None,
    *,
    view_refresh_s: float = 0.0,
    beside_index: bool = False,
    metrics: RouterMetrics | None = None,
) -> LoadBoard:
    """The router's load board: with a Redis ``client``, a
    :class:`~router.shared.redis_load.RedisLoadBoard` shared with every other router, as
    ``settings.router_id``, with ``settings.lease_ttl_s`` and ``settings.load_renew_s`` (and
    ``view_refresh_s``: > 0 reads the others' load in the background; ``beside_index``: the
    client is the shared index's); without, a :class:`~router.shared.load.LocalLoadBoard` of
    this process alone.

    :raises ValueError: with a client and no ``settings.router_id``.
    """
    if client is None:
        return LocalLoadBoard()
    return RedisLoadBoard(
        client,
        settings.router_id or "",
        lease_ttl_s=settings.lease_ttl_s,
        renew_interval_s=settings.load_renew_s,
        view_refresh_s=view_refresh_s,
        beside_index=beside_index,
        on_error=None if metrics is None else metrics.shared_error,
    )


class Router:
    """One router's parts, wired at construction; :meth:`start` and :meth:`stop` them.

    :param index: the block index and replica registry (owned by the caller, not closed here):
        the shared :class:`~tracker.core.redis_index.RedisIndex`, or an in-process
        :class:`~tracker.core.memory_index.MemoryIndex`.
    :param registry: where the router's metrics are registered.
    :param redis: the Redis client that shares the load (and, beside an in-process index, the
        routes) with the other routers; the shared index's own client when the index is
        shared. None: this router alone.
    :param tokenizers: default: loaded from ``settings`` (blocking, at construction).
    """

    def __init__(
        self,
        settings: RouterSettings,
        *,
        index: BlockIndex,
        registry: CollectorRegistry,
        redis: redis.Redis | None = None,
        tokenizers: TokenizerBook | None = None,
    ) -> None:
        self.settings = settings
        self.index = index
        self.registry = registry
        self.metrics = metrics = RouterMetrics(registry)
        # the index is shared through Redis, or this process's own (fed by its events)
        shared_index = bool(settings.redis) and not settings.local_index
        refresh_s = 0.0 if shared_index else settings.load_refresh_ms / 1000
        self.load = load_board(
            settings, redis, view_refresh_s=refresh_s, beside_index=shared_index, metrics=metrics
        )
        self.feed: RouteFeed | None = None
        if redis is not None and not shared_index:
            self.feed = RouteFeed(
                redis,
                settings.router_id or "",
                index,
                refresh_s=refresh_s or ROUTE_REFRESH_S,
                since_s=settings.home_ttl_s,
                on_error=metrics.shared_error,
            )
        self.replicas = ReplicaSet(
            settings.replica_specs,
            model=settings.model,
            block_size=settings.block_size,
            unhealthy_after=settings.unhealthy_after,
            engine_stale_s=settings.metrics_stale_s,
        )
        self.speeds = SpeedBook(settings.prefill_seed)
        self.lag = LoopLag(gauge=metrics.loop_lag)
        self.shared = SharedState(
            index,
            self.load,
            metrics,
            budget_s=settings.lookup_timeout_ms / 1000,
            per_block_s=settings.lookup_timeout_per_block_us / 1e6,
            failures=settings.breaker_failures,
            cooldown_s=settings.breaker_cooldown_s,
            lag=self.lag,
            feed=self.feed,
        )
        self.upstream = UpstreamClient(
            connect_timeout_s=settings.connect_timeout_s,
            max_connections=settings.max_connections,
            api_key=settings.upstream_api_key,
        )
        tokenizers = tokenizers or TokenizerBook.load(settings)
        rng = random.Random(settings.random_seed)
        tools = Tools(self.load, self._shared_loads, tokenizers.token_ids, self.upstream)
        self.decider = Decider(
            settings,
            replicas=self.replicas,
            tokenizers=tokenizers,
            shared=self.shared,
            speeds=self.speeds,
            metrics=metrics,
            detector=MismatchDetector(
                metrics, window=settings.mismatch_window, ratio=settings.mismatch_ratio
            ),
            rng=rng,
            baseline=make_baseline(settings, tools, rng),
            journal=DecisionJournal(settings.decision_log) if settings.decision_log else None,
        )
        self.monitor = ReplicaMonitor(
            self.replicas,
            self.upstream,
            index,
            metrics,
            discover=bool(settings.redis and settings.discover and not settings.local_index),
            registry_interval_s=settings.registry_interval_s,
            health_interval_s=settings.health_interval_s,
            health_timeout_s=settings.health_timeout_s,
            metrics_interval_s=settings.metrics_interval_s,
            on_removed=self._forget_replica,
            load=self.load,
        )

    async def _shared_loads(self, namespace: Namespace) -> dict[str, Load]:
        loads, _ = await self.shared.loads(namespace, self.settings.lookup_timeout_ms / 1000)
        return loads

    async def start(self) -> None:
        await self.lag.start()
        await self.load.start()
        if self.feed is not None:
            await self.feed.start()
        await self.monitor.start()
        await self._warm_up()
        logger.info(
            "router ready",
            extra={
                "replicas": len(self.replicas),
                "models": ",".join(self.replicas.models()),
                "index": type(self.index).__name__,
                "load": type(self.load).__name__,
            },
        )

    async def _warm_up(self) -> None:
        """Open the index and load-board connections and load their scripts before serving.

        A cold connection plus script load can exceed the lookup budget, which would make
        the first requests after a (re)start fall back to load-only routing.
        """
        namespace = Namespace("kvrouter-warm-up", 16)
        try:
            async with asyncio.timeout(5.0):
                await self.index.lookup(namespace, [0])
                await self.load.snapshot(namespace)
        except (IndexUnavailableError, TimeoutError) as exc:
            logger.warning("index not reachable at start-up", extra={"error": str(exc)})

    def _forget_replica(self, replica: str) -> None:
        """A replica left the registry: drop its connection pool and what its cache held."""
        self.upstream.retire(replica)
        self.decider.forget(replica)

    async def stop(self) -> None:
        await self.monitor.stop()
        await self.shared.stop()
        if self.feed is not None:
            await self.feed.stop()
        await self.load.stop()
        await self.lag.stop()
        await self.upstream.aclose()
        if self.decider.journal is not None:
            self.decider.journal.close()
