"""RouterService: open the index (:mod:`router.backing`), serve, drain.

Shutdown: stop accepting, let requests in flight finish within ``shutdown_timeout_s``, close
everything; a second signal cuts it short.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import socket

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette

from router.backing import Backing
from router.config import RouterSettings
from router.decide.tokenize import TokenizerBook
from router.http.app import Routes, create_app
from router.router import Router
from router.shared.redis_load import new_router_id
from tracker.framework.http import HTTPServer, bind
from tracker.framework.lifecycle import (
    freeze_heap,
    run_on_loop,
    run_until_signalled,
    running_loop_name,
    serve_until,
)

logger = logging.getLogger(__name__)


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
        self.backing = Backing()
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
            index = await self.backing.open(settings, self.registry)
            tokenizers = await asyncio.to_thread(TokenizerBook.load, settings)
            self.app = create_app(
                settings,
                index=index,
                registry=self.registry,
                redis=self.backing.client,
                tokenizers=tokenizers,
            )
            await self._serve(self.app)
        except BaseException:
            await self.backing.close()
            raise
        if self.freeze:
            freeze_heap()
        logger.info(
            "router listening",
            extra={
                "host": settings.host,
                "port": self.port,
                "router_id": self.router_id,
                "embedded_tracker": self.backing.tracker is not None,
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
        failed = await serve_until(self._stopping, self._http.task)
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
        await self.backing.close()
        logger.info("router stopped", extra={"drained": inflight - left, "cancelled": left})


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
