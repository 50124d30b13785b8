"""RouterService: open the index and the Redis client, start the embedded tracker, serve, drain.

With ``--redis`` the index, the registry and the load are shared through Redis; without it, an
in-process index fed by an embedded tracker; with ``--local-index``, the index is the
router's own and the load and routes are shared. Shutdown: stop accepting, let requests in
flight finish within ``shutdown_timeout_s``, close everything; a second signal cuts it short.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import socket
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette

from router.config import RouterSettings
from router.decide.tokenize import TokenizerBook
from router.http.app import Routes, create_app
from router.router import Router
from router.shared.redis_load import new_router_id
from tracker.core.backends import open_index
from tracker.core.index import BlockIndex
from tracker.core.redis_client import RedisConnection, open_redis
from tracker.framework.http import HTTPServer, bind
from tracker.framework.lifecycle import (
    freeze_heap,
    run_on_loop,
    run_until_signalled,
    running_loop_name,
)
from tracker.ingest.config import TrackerSettings
from tracker.ingest.embedded import EmbeddedTracker, start_embedded

if TYPE_CHECKING:
    import redis.asyncio as redis

logger = logging.getLogger(__name__)


def tracker_settings(settings: RouterSettings) -> TrackerSettings:
    """The embedded tracker's settings: the router's replicas, no registry, no HTTP server."""
    return TrackerSettings(
        replica=settings.replica,
        discover=False,
        model=settings.model,
        block_size=settings.block_size,
        http_port=0,
        shutdown_timeout_s=min(5.0, settings.shutdown_timeout_s),
        log_level=settings.log_level,
        log_format=settings.log_format,
    )


class RouterService:
    """One router process: :meth:`start`, :meth:`run` until :meth:`request_stop`, :meth:`stop`.

    :param registry: where every metric goes (default: a fresh one).
    """

    def __init__(
        self,
        settings: RouterSettings,
        *,
        registry: CollectorRegistry | None = None,
        freeze: bool = False,
        sock: socket.socket | None = None,
    ) -> None:
        """:param freeze: the service owns its process: freeze the start-up heap once it
        serves (:func:`tracker.framework.lifecycle.freeze_heap`).
        :param sock: serve on this listening socket (a worker of :mod:`router.workers`)
            instead of binding ``host:port``."""
        self.router_id = settings.router_id or new_router_id()
        self.settings = dataclasses.replace(settings, router_id=self.router_id)
        self.freeze = freeze
        self._sock = sock
        self.registry = registry or CollectorRegistry()
        self.index: BlockIndex | None = None
        self.tracker: EmbeddedTracker | None = None
        self._redis: RedisConnection | None = None
        self.app: Starlette | None = None
        self.port: int | None = None
        self._http: HTTPServer | None = None
        self._stopping = asyncio.Event()
        self._stopped = False

    @property
    def router(self) -> Router:
        assert self.app is not None, "not started"
        router: Router = self.app.state.router
        return router

    @property
    def routes(self) -> Routes:
        assert self.app is not None, "not started"
        routes: Routes = self.app.state.routes
        return routes

    async def start(self) -> None:
        """Open the index, start the embedded tracker, serve; undo everything on failure."""
        settings = self.settings
        try:
            client: redis.Redis | None = None
            if settings.redis and not settings.local_index:  # the shared index
                shared = open_index(settings.redis)
                self.index, client = shared, shared.client
            else:  # the index is this process's own; load and routes shared through Redis
                self.index = open_index(None)
                if settings.redis:
                    self._redis = open_redis(settings.redis)
                    client = self._redis.client
                if settings.replica:
                    self.tracker = await start_embedded(
                        tracker_settings(settings), self.index, self.registry
                    )
            tokenizers = await asyncio.to_thread(TokenizerBook.load, settings)
            self.app = create_app(
                settings,
                index=self.index,
                registry=self.registry,
                redis=client,
                tokenizers=tokenizers,
            )
            await self._serve(self.app)
        except BaseException:
            await self._close()
            raise
        if self.freeze:
            freeze_heap()
        logger.info(
            "router listening",
            extra={
                "host": settings.host,
                "port": self.port,
                "router_id": self.router_id,
                "embedded_tracker": self.tracker is not None,
                "loop": running_loop_name(),
            },
        )

    async def _serve(self, app: Starlette) -> None:
        settings = self.settings
        self._http = HTTPServer(
            app,
            self._sock or bind(settings.host, settings.port),
            shutdown_timeout_s=settings.shutdown_timeout_s,
            lifespan="on",
            name="the router app",
        )
        self.port = self._http.port
        await self._http.start()

    def request_stop(self) -> None:
        """Begin the graceful shutdown (safe from a signal handler); twice: cut it short."""
        if self._stopping.is_set():
            if self._http is not None:
                logger.warning("second stop request: not waiting for in-flight requests")
                self._http.force_exit()
            return
        logger.info("router stop requested")
        self._stopping.set()

    async def run(self) -> int:
        """Serve until :meth:`request_stop`, then shut down; returns an exit status."""
        if self._http is None:
            await self.start()
        assert self._http is not None
        serving = self._http.task
        stopping = asyncio.ensure_future(self._stopping.wait())
        await asyncio.wait({stopping, serving}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        failed = serving.done() and not self._stopping.is_set()
        await self.stop()
        return 1 if failed else 0

    async def stop(self) -> None:
        """Drain in-flight requests (bounded), stop the app, the tracker and the index."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        inflight = 0
        if self.app is not None:
            self.routes.draining = True
            inflight = self.routes.proxy.inflight
        logger.info("router draining", extra={"inflight": inflight})
        if self._http is not None:
            await self._http.stop()
        left = self.routes.proxy.inflight if self.app is not None else 0
        await self._close()
        logger.info("router stopped", extra={"drained": inflight - left, "cancelled": left})

    async def _close(self) -> None:
        if self.tracker is not None:
            await self.tracker.stop()
            self.tracker = None
        if self.index is not None:
            await self.index.close()
            self.index = None
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None


async def serve(settings: RouterSettings, *, sock: socket.socket | None = None) -> int:
    """Run a router until SIGINT/SIGTERM (a worker on ``sock``: until SIGTERM)."""
    service = RouterService(settings, freeze=True, sock=sock)
    if sock is None:
        return await run_until_signalled(service)
    return await run_until_signalled(service, signals=(signal.SIGTERM,))


def run(settings: RouterSettings) -> int:
    """One router in this process until SIGINT/SIGTERM; returns the process exit status.

    ``kvrouter router --workers N`` runs N of them under :class:`router.workers.WorkerPool`.
    """
    return run_on_loop(serve(settings), settings.loop)
