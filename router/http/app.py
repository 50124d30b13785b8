"""The router's ASGI app: OpenAI routes, operator routes, one error handler, one lifespan.

OpenAI routes (optional bearer key): ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models``. Operator routes (their own key, else the API key): ``POST /index`` (where
is this prompt cached, and where would it go), ``GET /replicas``, ``GET /metrics``.
``GET /health`` is open. Every error is answered in the OpenAI shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from router.baselines import make_baseline
from router.baselines.baseline import Tools
from router.config import RouterSettings
from router.decide.estimator import SpeedBook
from router.decide.journal import DecisionJournal
from router.decide.placement import Placer
from router.decide.request import parse, read_body
from router.decide.tokenize import TokenizerBook
from router.errors import AuthError, BadRequestError, RouterError, openai_error_body, status_of
from router.fleet.health import ReplicaMonitor
from router.fleet.replicas import ReplicaSet
from router.fleet.upstream import UpstreamClient
from router.http.auth import KeyCheck, load_keys
from router.http.describe import describe_placement, describe_replica
from router.http.proxy import Proxy
from router.metrics import MismatchDetector, RouterMetrics, exposition
from router.shared.load import Load, LoadBoard, LocalLoadBoard
from router.shared.redis_load import RedisLoadBoard
from router.shared.routefeed import RouteFeed
from router.shared.state import GuardedIndex, LoopLag
from tracker.core.blocks import Namespace
from tracker.core.index import BlockIndex
from tracker.framework.errors import IndexUnavailableError
from tracker.framework.http import (
    CLIENT_CLOSED,
    Handler,
    answer_errors,
    http_error_handler,
    metrics_endpoint,
)

logger = logging.getLogger(__name__)


class Router:
    """Every part of one router, wired together; started and stopped by the app's lifespan.

    :param index: the block index and registry (not closed here: the caller owns it).
    :param load: the load board (default: this process only); started and stopped here.
    :param tokenizers: default: loaded from ``settings`` (blocking, at construction).
    """

    def __init__(
        self,
        settings: RouterSettings,
        *,
        index: BlockIndex,
        registry: CollectorRegistry,
        load: LoadBoard | None = None,
        tokenizers: TokenizerBook | None = None,
        feed: RouteFeed | None = None,
    ) -> None:
        self.settings = settings
        self.feed = feed
        self.index = index
        self.registry = registry
        self.metrics = RouterMetrics(registry)
        self.load = load or LocalLoadBoard()
        for shared in (self.load, feed):
            if isinstance(shared, RedisLoadBoard | RouteFeed):
                shared.on_error = self._shared_error
        self.replicas = ReplicaSet(
            settings.replica_specs,
            model=settings.model,
            block_size=settings.block_size,
            unhealthy_after=settings.unhealthy_after,
            engine_stale_s=settings.metrics_stale_s,
        )
        self.speeds = SpeedBook(settings.prefill_seed)
        self.lag = LoopLag(gauge=self.metrics.loop_lag)
        self.shared = GuardedIndex(
            index,
            self.load,
            self.metrics,
            budget_s=settings.lookup_timeout_ms / 1000,
            per_block_s=settings.lookup_timeout_per_block_us / 1e6,
            failures=settings.breaker_failures,
            cooldown_s=settings.breaker_cooldown_s,
            lag=self.lag,
            feed=feed,
        )
        self.upstream = UpstreamClient(
            connect_timeout_s=settings.connect_timeout_s,
            max_connections=settings.max_connections,
            api_key=settings.upstream_api_key,
        )
        self.placer = Placer(
            settings,
            replicas=self.replicas,
            tokenizers=tokenizers or TokenizerBook.load(settings),
            shared=self.shared,
            speeds=self.speeds,
            metrics=self.metrics,
            journal=DecisionJournal(settings.decision_log) if settings.decision_log else None,
        )
        self.placer.baseline = make_baseline(
            settings,
            Tools(self.load, self._shared_loads, self.placer.token_ids, self.upstream),
            self.placer.rng,
        )
        detector = MismatchDetector(
            self.metrics, window=settings.mismatch_window, ratio=settings.mismatch_ratio
        )
        self.proxy = Proxy(
            settings,
            placer=self.placer,
            upstream=self.upstream,
            load=self.load,
            shared=self.shared,
            speeds=self.speeds,
            metrics=self.metrics,
            detector=detector,
        )
        self.monitor = ReplicaMonitor(
            self.replicas,
            self.upstream,
            index,
            self.metrics,
            discover=bool(settings.redis and settings.discover and not settings.local_index),
            registry_interval_s=settings.registry_interval_s,
            health_interval_s=settings.health_interval_s,
            health_timeout_s=settings.health_timeout_s,
            metrics_interval_s=settings.metrics_interval_s,
            on_removed=self._forget_replica,
            load=self.load,
        )
        api = load_keys(settings.api_key, settings.api_key_file, "api-key")
        admin = load_keys(settings.admin_key, settings.admin_key_file, "admin-key")
        self.api_keys = KeyCheck(api)
        self.admin_keys = KeyCheck(admin or api)
        self.draining = False
        self.created = int(time.time())

    def _shared_error(self, what: str) -> None:
        self.metrics.shared_errors.labels(what).inc()

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
        """A replica left the registry: drop its connection pool and what its cache held
        (speeds are per model)."""
        self.upstream.retire(replica)
        if self.placer.reuse is not None:
            self.placer.reuse.forget(replica)
        if self.placer.occupancy is not None:
            self.placer.occupancy.forget(replica)

    async def stop(self) -> None:
        await self.monitor.stop()
        await self.shared.stop()
        if self.feed is not None:
            await self.feed.stop()
        await self.load.stop()
        await self.lag.stop()
        await self.upstream.aclose()
        if self.placer.journal is not None:
            self.placer.journal.close()

    # ------------------------------------------------------------------ OpenAI routes

    async def chat(self, request: Request) -> Response:
        return await self.proxy.handle(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self.proxy.handle(request, "completions")

    async def models(self, request: Request) -> Response:
        cards = [
            {"id": m, "object": "model", "created": self.created, "owned_by": "kvrouter", "root": m}
            for m in self.replicas.models()
        ]
        return JSONResponse({"object": "list", "data": cards})

    # ------------------------------------------------------------------ operator routes

    async def index_query(self, request: Request) -> Response:
        """Where is this prompt cached, and where would it go (nothing is sent or recorded)."""
        raw = await read_body(request, self.settings.max_body_bytes)
        placement = await self.placer.place(parse(raw, "index"), dry_run=True)
        return JSONResponse(describe_placement(placement))

    async def replica_list(self, request: Request) -> Response:
        loads: dict[str, Any] = {}
        shared = True
        for namespace in {r.namespace for r in self.replicas.all()}:
            found, fresh = await self.shared.loads(namespace)
            loads.update(found)
            shared = shared and fresh
        now = time.monotonic()
        return JSONResponse(
            {
                "load_shared": shared,
                "replicas": [
                    describe_replica(r, loads.get(r.id), self.speeds.get(r.model), now)
                    for r in self.replicas.all()
                ],
            }
        )

    async def health(self, request: Request) -> Response:
        replicas = self.replicas.all()
        healthy = sum(r.healthy for r in replicas)
        breaker = self.shared.breaker.state
        if self.draining:
            status = "draining"
        elif not healthy:
            status = "no_healthy_replica"
        else:
            status = "ok" if breaker == "closed" and self.monitor.registry_reachable else "degraded"
        body = {
            "status": status,
            "router_id": self.settings.router_id,
            "replicas": {"total": len(replicas), "healthy": healthy},
            "index": {"backend": type(self.index).__name__, "breaker": breaker},
            "registry_reachable": self.monitor.registry_reachable,
            "inflight": self.proxy.inflight,
        }
        return JSONResponse(body, status_code=200 if status in ("ok", "degraded") else 503)

    # ------------------------------------------------------------------ plumbing

    def guard(self, handler: Handler, keys: KeyCheck | None, endpoint: str | None) -> Handler:
        """``handler`` behind ``keys``, with every error answered in the OpenAI shape (a
        client that left while sending gets 499); errors of ``endpoint`` are counted."""

        async def checked(request: Request) -> Response:
            if keys is not None and not keys.allows(request):
                raise AuthError("Incorrect API key provided.")
            return await handler(request)

        def answer(error: Exception) -> Response:
            if isinstance(error, ClientDisconnect):
                return Response(status_code=CLIENT_CLOSED)
            status = status_of(error)
            if endpoint is not None:
                self.metrics.requests.labels(endpoint, str(status), "").inc()
            headers = {"www-authenticate": "Bearer"} if isinstance(error, AuthError) else None
            return JSONResponse(openai_error_body(error), status_code=status, headers=headers)

        inner = handler if keys is None else checked
        return answer_errors(inner, answer, expected=(RouterError, ClientDisconnect), log=logger)


def _http_error(detail: str, status: int, headers: Mapping[str, str] | None) -> Response:
    """Starlette's own 404 / 405 in the router's error shape instead of plain text."""
    body = openai_error_body(BadRequestError(detail))
    body["error"]["type"] = "not_found_error" if status == 404 else body["error"]["type"]
    return JSONResponse(body, status_code=status, headers=headers)


def create_app(
    settings: RouterSettings,
    *,
    index: BlockIndex,
    registry: CollectorRegistry,
    load: LoadBoard | None = None,
    tokenizers: TokenizerBook | None = None,
    feed: RouteFeed | None = None,
) -> Starlette:
    """The router app; its parts start and stop with the app's lifespan.

    :param index: the block index and replica registry (owned by the caller).
    :param registry: where the router's metrics are registered (served on ``/metrics``).
    :param load: the load board (default :class:`~router.shared.load.LocalLoadBoard`).
    :param tokenizers: per-model tokenizers (default: loaded from ``settings``).
    :param feed: shares an in-process index's routes with the other routers.
    """
    router = Router(
        settings, index=index, registry=registry, load=load, tokenizers=tokenizers, feed=feed
    )
    api, admin = router.api_keys, router.admin_keys
    metrics = metrics_endpoint(registry, exposition=exposition)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    routes = [
        Route("/v1/chat/completions", router.guard(router.chat, api, "chat"), methods=["POST"]),
        Route(
            "/v1/completions",
            router.guard(router.completions, api, "completions"),
            methods=["POST"],
        ),
        Route("/v1/models", router.guard(router.models, api, None)),
        Route("/index", router.guard(router.index_query, admin, None), methods=["POST"]),
        Route("/replicas", router.guard(router.replica_list, admin, None)),
        Route("/metrics", router.guard(metrics, admin, None)),
        Route("/health", router.guard(router.health, None, None)),
    ]
    handlers = {HTTPException: http_error_handler(_http_error)}
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)
    app.state.router = router
    return app
