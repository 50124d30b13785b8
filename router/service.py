"""RouterService: build the index, load board and (embedded) tracker, serve, drain, shut down.

With ``--redis`` the index, the replica registry and the load are shared through Redis with
every other router and tracker. Without it the router is self-contained: an in-process
:class:`~tracker.index.MemoryIndex` fed by an in-process
:class:`~tracker.service.TrackerService` consuming the ``--replica`` event endpoints.
Shutdown (SIGTERM/SIGINT): stop accepting, let in-flight requests and streams finish within
``shutdown_timeout_s`` (uvicorn cancels the rest), then close everything; a second signal
cuts the drain short.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import socket
from collections.abc import Iterator

import uvicorn
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette

from router.app import Router, create_app
from router.config import RouterSettings
from router.load import LoadBoard, LocalLoadBoard, RedisLoadBoard, new_router_id
from router.placement import TokenizerBook
from tracker.config import TrackerSettings
from tracker.errors import ConfigError
from tracker.index import BlockIndex, MemoryIndex
from tracker.service import TrackerService

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the service decides when to stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host.strip("[]"), port), family=family, backlog=2048)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    # asyncio disables Nagle (TCP_NODELAY) only on accepted sockets whose proto says TCP, and
    # create_server leaves it 0: without this, small SSE chunks on a kept-alive connection
    # wait for the client's delayed ACK (up to 40 ms on Linux).
    return socket.socket(sock.family, sock.type, socket.IPPROTO_TCP, fileno=sock.detach())


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

    def __init__(self, settings: RouterSettings, *, registry: CollectorRegistry | None = None):
        self.settings = settings
        self.registry = registry or CollectorRegistry()
        self.router_id = settings.router_id or new_router_id()
        self.index: BlockIndex | None = None
        self.tracker: TrackerService | None = None
        self.app: Starlette | None = None
        self.port: int | None = None
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._stopped = False

    @property
    def router(self) -> Router:
        assert self.app is not None, "not started"
        router: Router = self.app.state.router
        return router

    async def start(self) -> None:
        """Open the index, start the embedded tracker, serve; undo everything on failure."""
        settings = self.settings
        try:
            load: LoadBoard
            if settings.redis:
                from tracker.redis_index import RedisIndex  # noqa: PLC0415 - only when used

                index = RedisIndex.from_url(settings.redis)
                self.index = index
                load = RedisLoadBoard(
                    index.client,
                    self.router_id,
                    lease_ttl_s=settings.lease_ttl_s,
                    renew_interval_s=settings.load_renew_s,
                )
            else:
                self.index = MemoryIndex()
                load = LocalLoadBoard()
                if settings.replica:
                    self.tracker = TrackerService(
                        tracker_settings(settings), self.index, self.registry
                    )
                    await self.tracker.start()
            tokenizers = await asyncio.to_thread(TokenizerBook.load, settings)
            self.app = create_app(
                settings, index=self.index, registry=self.registry, load=load, tokenizers=tokenizers
            )
            await self._serve(self.app)
        except BaseException:
            await self._close()
            raise
        logger.info(
            "router listening",
            extra={
                "host": settings.host,
                "port": self.port,
                "router_id": self.router_id,
                "embedded_tracker": self.tracker is not None,
            },
        )

    async def _serve(self, app: Starlette) -> None:
        sock = _bind(self.settings.host, self.settings.port)
        self.port = int(sock.getsockname()[1])
        config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="on",
            ws="none",
            timeout_graceful_shutdown=max(1, math.ceil(self.settings.shutdown_timeout_s)),
        )
        self._server = _Server(config)
        self._task = asyncio.get_running_loop().create_task(
            self._server.serve(sockets=[sock]), name="kvrouter-http"
        )
        while not self._server.started:
            if self._task.done():
                sock.close()
                self._task.result()
                raise ConfigError("the router app failed to start (see the log above)")
            await asyncio.sleep(0.01)

    def request_stop(self) -> None:
        """Begin the graceful shutdown (safe from a signal handler); twice: cut it short."""
        if self._stopping.is_set():
            if self._server is not None:
                logger.warning("second stop request: not waiting for in-flight requests")
                self._server.force_exit = True
            return
        logger.info("router stop requested")
        self._stopping.set()

    async def run(self) -> int:
        """Serve until :meth:`request_stop`, then shut down; returns an exit status."""
        if self._task is None:
            await self.start()
        assert self._task is not None
        stopping = asyncio.ensure_future(self._stopping.wait())
        await asyncio.wait({stopping, self._task}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        failed = self._task.done() and not self._stopping.is_set()
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
            self.router.draining = True
            inflight = self.router.proxy.inflight
        logger.info("router draining", extra={"inflight": inflight})
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await asyncio.gather(self._task, return_exceptions=True)
        left = self.router.proxy.inflight if self.app is not None else 0
        await self._close()
        logger.info("router stopped", extra={"drained": inflight - left, "cancelled": left})

    async def _close(self) -> None:
        if self.tracker is not None:
            await self.tracker.stop()
            self.tracker = None
        if self.index is not None:
            await self.index.close()
            self.index = None


async def serve(settings: RouterSettings) -> int:
    """Run a router until SIGINT/SIGTERM."""
    service = RouterService(settings)
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, service.request_stop)
    try:
        return await service.run()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def run(settings: RouterSettings) -> int:
    """Entry point of ``kvrouter router``: returns the process exit status."""
    # one line per health check and scrape would drown the router's own log
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return asyncio.run(serve(settings))
