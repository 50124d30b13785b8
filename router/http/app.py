"""The router's ASGI app: OpenAI routes, operator routes, one error handler, one lifespan.

OpenAI routes (optional bearer key): ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models``. Operator routes (their own key, else the API key): ``POST /index`` (where
is this prompt cached, and where would it go), ``GET /replicas``, ``GET /metrics``.
``GET /health`` is open. Every error is answered in the OpenAI shape.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from redis.asyncio import Redis
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from router.config import RouterSettings
from router.decide.request import parse
from router.decide.tokenize import TokenizerBook
from router.errors import AuthError, BadRequestError, RouterError, openai_error_body, status_of
from router.http.auth import KeyCheck, load_keys
from router.http.body import read_body
from router.http.describe import describe_placement, describe_replica
from router.http.proxy import Proxy
from router.metrics import exposition
from router.router import Router
from tracker.core.index import BlockIndex
from tracker.framework.http import (
    CLIENT_CLOSED,
    Handler,
    answer_errors,
    http_error_handler,
    metrics_endpoint,
)

logger = logging.getLogger(__name__)


class Routes:
    """The router's HTTP routes over its parts.

    :param router: the parts (started and stopped by the app's lifespan).
    :param inflight: requests in flight (default: the proxy's; the endpoint picker's are
        its open streams).
    """

    def __init__(self, router: Router, inflight: Callable[[], int] | None = None) -> None:
        settings = router.settings
        self.router = router
        self.settings = settings
        self.decider = router.decider
        self.replicas = router.replicas
        self.shared = router.shared
        self.metrics = router.metrics
        self.proxy = Proxy(
            settings,
            decider=router.decider,
            replicas=router.replicas,
            upstream=router.upstream,
            metrics=router.metrics,
        )
        api = load_keys(settings.api_key, settings.api_key_file, "api-key")
        admin = load_keys(settings.admin_key, settings.admin_key_file, "admin-key")
        self.api_keys = KeyCheck(api)
        self.admin_keys = KeyCheck(admin or api)
        self.draining = False
        self.created = int(time.time())
        self.inflight = inflight or (lambda: self.proxy.inflight)

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
        placement = await self.decider.place(parse(raw, "index"), dry_run=True)
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
                    describe_replica(r, loads.get(r.id), self.router.speeds.get(r.model), now)
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
            reachable = self.router.monitor.registry_reachable
            status = "ok" if breaker == "closed" and reachable else "degraded"
        body = {
            "status": status,
            "router_id": self.settings.router_id,
            "replicas": {"total": len(replicas), "healthy": healthy},
            "index": {"backend": type(self.router.index).__name__, "breaker": breaker},
            "registry_reachable": self.router.monitor.registry_reachable,
            "inflight": self.inflight(),
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
    redis: Redis | None = None,
    tokenizers: TokenizerBook | None = None,
) -> Starlette:
    """The router app; its parts (:class:`~router.router.Router`) start and stop with the
    app's lifespan.

    :param index: the block index and replica registry (owned by the caller).
    :param registry: where the router's metrics are registered (served on ``/metrics``).
    :param redis: shares the load (and the routes of an in-process index) with the other
        routers; None: this router alone.
    :param tokenizers: per-model tokenizers (default: loaded from ``settings``).
    """
    router = Router(settings, index=index, registry=registry, redis=redis, tokenizers=tokenizers)
    routes = Routes(router)
    api = routes.api_keys

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    table = [
        Route("/v1/chat/completions", routes.guard(routes.chat, api, "chat"), methods=["POST"]),
        Route(
            "/v1/completions",
            routes.guard(routes.completions, api, "completions"),
            methods=["POST"],
        ),
        Route("/v1/models", routes.guard(routes.models, api, None)),
    ]
    return _app(routes, table, lifespan)


def operator_app(routes: Routes) -> Starlette:
    """The operator routes alone, over parts its owner starts and stops (the endpoint
    picker's HTTP port: the gateway carries the OpenAI routes)."""
    return _app(routes, [], None)


def _app(
    routes: Routes,
    table: list[Route],
    lifespan: Callable[[Starlette], contextlib.AbstractAsyncContextManager[None]] | None,
) -> Starlette:
    admin = routes.admin_keys
    metrics = metrics_endpoint(routes.router.registry, exposition=exposition)
    table = [
        *table,
        Route("/index", routes.guard(routes.index_query, admin, None), methods=["POST"]),
        Route("/replicas", routes.guard(routes.replica_list, admin, None)),
        Route("/metrics", routes.guard(metrics, admin, None)),
        Route("/health", routes.guard(routes.health, None, None)),
    ]
    handlers = {HTTPException: http_error_handler(_http_error)}
    app = Starlette(routes=table, lifespan=lifespan, exception_handlers=handlers)
    app.state.router = routes.router
    app.state.routes = routes
    return app
