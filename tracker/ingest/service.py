"""TrackerService: startup -> main loop -> bounded graceful shutdown, and ``run(settings)``.

The service owns the subscriber (one stream per replica), the registry loop (expire replicas
that stopped heartbeating, discover new ones, fence restarted ones: each pass is
:class:`tracker.ingest.registry.RegistrySync`'s), the watch on Redis's memory
(:class:`tracker.ingest.memory.MemoryWatch`), the tracker election when there is one, and a
small HTTP server with ``/metrics`` and ``/health`` running on the same event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import zmq
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tracker.core.backends import open_index
from tracker.core.blocks import Namespace
from tracker.core.index import BlockIndex
from tracker.framework.errors import ConfigError, FencedError, IndexUnavailableError
from tracker.framework.http import HTTPServer, bind, metrics_endpoint
from tracker.framework.lifecycle import (
    finish_or_cancel,
    freeze_heap,
    run_on_loop,
    run_until_signalled,
    running_loop_name,
)
from tracker.ingest.config import TrackerSettings
from tracker.ingest.memory import MemoryWatch
from tracker.ingest.metrics import TrackerMetrics
from tracker.ingest.registry import RegistrySync
from tracker.ingest.streams import ReplicaTarget
from tracker.ingest.subscriber import Subscriber

if TYPE_CHECKING:
    from tracker.ingest.lease import TrackerLease

logger = logging.getLogger(__name__)


@runtime_checkable
class _Pinging(Protocol):
    async def ping(self) -> bool: ...


@runtime_checkable
class _Fencing(Protocol):
    async def claim_partitions(self, fence: int, election: str) -> int: ...


def static_targets(settings: TrackerSettings) -> list[ReplicaTarget]:
    """The replicas given with ``--replica``, in the settings' namespace unless overridden."""
    return [
        ReplicaTarget(
            spec.id,
            Namespace(spec.model or settings.model, spec.block_size or settings.block_size),
            spec.events,
            spec.replay,
        )
        for spec in settings.replica_specs
    ]


class TrackerService:
    """Consumes KV events of every tracked replica into ``index``.

    Args:
        settings: the tracker's frozen settings.
        index: the block index (not closed by the service: the caller owns it).
        registry: where the service's metrics are registered.
    """

    def __init__(
        self,
        settings: TrackerSettings,
        index: BlockIndex,
        registry: CollectorRegistry,
        *,
        freeze: bool = False,
        lease: TrackerLease | None = None,
    ) -> None:
        """:param freeze: the service owns its process: freeze the start-up heap once it
        runs (:func:`tracker.framework.lifecycle.freeze_heap`).
        :param lease: take part in this tracker election (:mod:`tracker.ingest.lease`): stand by
            until the lease is won, stop when it is lost; None: apply events from the start.
        """
        self.settings = settings
        self.lease = lease
        self.role = "standby" if lease is not None else "active"
        self.freeze = freeze
        self.index = index
        self.registry = registry
        self.metrics = TrackerMetrics(registry)
        self.subscriber = Subscriber(settings, index, self.metrics, on_failure=self._crashed)
        self.http_port: int | None = None
        self._static = {target.id: target for target in static_targets(settings)}
        self._registry_sync = RegistrySync(
            settings, index, self.subscriber, self.metrics, self._static
        )
        self._stopping = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._http: HTTPServer | None = None
        self._failure: BaseException | None = None
        self._memory_watch = MemoryWatch(settings, index, self.metrics)
        self._started = False
        self._stopped = False

    # ----------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Bind sockets, start the static replicas, the registry loop and the HTTP server
        (with an election: the HTTP server, and the rest once the lease is won)."""
        self._started = True
        await self._memory_watch.check(at_start=True)
        if self.lease is None:
            await self._activate()
        else:
            self.metrics.active.set(0)
            self._spawn(self._election(self.lease), "election")
        if self._memory_watch.metered:
            self._spawn(self._memory_loop(), "memory")
        if self.settings.http_port:
            await self._start_http()
        if self.freeze:
            freeze_heap()
        logger.info(
            "tracker started",
            extra={
                "role": self.role,
                "replicas": len(self._static),
                "bind": self.subscriber.bound_endpoint,
                "index": type(self.index).__name__,
                "http_port": self.http_port,
                "loop": running_loop_name(),
            },
        )

    async def _activate(self) -> None:
        await self.subscriber.start()
        for target in self._static.values():
            self.subscriber.track(target)
        self._spawn(self._registry_loop(), "registry")
        self.role = "active"
        self.metrics.active.set(1)

    async def _election(self, lease: TrackerLease) -> None:
        """Stand by until this tracker wins the lease, take over, then keep it; a lease
        lost (another tracker won it while this one could not renew) stops the tracker."""
        interval = lease.ttl_s / 3
        unreachable = False
        while not self._stopping.is_set():
            try:
                fence = await lease.acquire()
                if fence:
                    if isinstance(self.index, _Fencing):
                        await self.index.claim_partitions(fence, lease.election)
                    break
                unreachable = False
            except IndexUnavailableError as exc:
                if not unreachable:
                    logger.warning("cannot reach the tracker election", extra={"error": str(exc)})
                unreachable = True
            if await self._sleep(interval):
                return
        else:
            return
        self.metrics.elections_won.inc()
        logger.info(
            "tracker won the election: taking over",
            extra={"election": lease.election, "fence": lease.fence, "holder": lease.holder},
        )
        await self._activate()
        while not await self._sleep(interval):
            try:
                kept = await lease.renew()
            except IndexUnavailableError:
                continue  # past the TTL another tracker may win; this one's writes are fenced
            if not kept:
                holder = None
                with contextlib.suppress(IndexUnavailableError):
                    holder = await lease.holder_now()
                raise FencedError(f"lost the tracker lease (fence {lease.fence}) to {holder}")

    async def _sleep(self, seconds: float) -> bool:
        """Wait ``seconds`` or until the stop; True if stopping."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stopping.wait()
        return self._stopping.is_set()

    async def run(self) -> int:
        """Start if needed, serve until :meth:`request_stop`, stop; returns an exit status."""
        if not self._started:
            try:
                await self.start()
            except (OSError, zmq.ZMQError, ConfigError) as exc:
                logger.error("tracker failed to start", extra={"error": str(exc)})
                await self.stop()
                return 1
        await self._stopping.wait()
        await self.stop()
        return 0 if self._failure is None else 1

    def request_stop(self) -> None:
        """Ask the main loop to shut down (safe from a signal handler)."""
        if not self._stopping.is_set():
            logger.info("tracker stop requested")
            self._stopping.set()

    async def stop(self) -> None:
        """Bounded graceful shutdown: drain queued events, flush the index, cancel the rest."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.shutdown_timeout_s
        await finish_or_cancel(list(self._tasks), deadline - loop.time())
        counts = await self.subscriber.stop(max(0.0, deadline - loop.time()))
        if self.lease is not None and self.role == "active" and self._failure is None:
            # flushed: hand over now rather than after the TTL
            with contextlib.suppress(IndexUnavailableError):
                if await self.lease.release():
                    logger.info("tracker lease released", extra={"fence": self.lease.fence})
        if self._http is not None:
            await self._http.stop()
        logger.info("tracker stopped", extra=counts)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        logger.error(
            "tracker task crashed", exc_info=task.exception(), extra={"task": task.get_name()}
        )
        self._crashed(task.exception() or RuntimeError(task.get_name()))

    def _crashed(self, exc: BaseException) -> None:
        if isinstance(exc, FencedError) and self._failure is None:
            logger.error(
                "another tracker took over: stopping (restart this one as a standby)",
                extra={"error": str(exc)},
            )
        if self._failure is None:
            self._failure = exc
        self.request_stop()

    # ----------------------------------------------------------- redis memory

    async def _memory_loop(self) -> None:
        while not await self._sleep(self.settings.memory_check_s):
            await self._memory_watch.check()

    # ----------------------------------------------------------- registry

    async def _registry_loop(self) -> None:
        failing = False
        while not self._stopping.is_set():
            try:
                await self._registry_sync.sync()
                if failing:
                    logger.info("replica registry reachable again")
                failing = False
            except IndexUnavailableError as exc:
                if not failing:
                    logger.warning("replica registry unavailable", extra={"error": str(exc)})
                failing = True
            if await self._sleep(self.settings.reap_interval_s):
                return

    # ----------------------------------------------------------- HTTP

    async def _start_http(self) -> None:
        app = Starlette(
            routes=[
                Route("/metrics", metrics_endpoint(self.registry)),
                Route("/health", self._health_endpoint),
            ]
        )
        self._http = HTTPServer(
            app,
            bind(self.settings.http_host, self.settings.http_port, backlog=128),
            shutdown_timeout_s=1.0,
            name="tracker http",
        )
        self.http_port = self._http.port
        await self._http.start()
        logger.info(
            "http server listening",
            extra={"host": self.settings.http_host, "port": self.http_port},
        )

    async def health(self) -> dict[str, Any]:
        """Status, index reachability and each replica's sequence and block count."""
        reachable = True
        if isinstance(self.index, _Pinging):
            try:
                async with asyncio.timeout(1.0):
                    reachable = await self.index.ping()
            except TimeoutError:
                reachable = False
        ok = reachable and self._failure is None and not self._stopping.is_set()
        index: dict[str, Any] = {
            "backend": type(self.index).__name__,
            "reachable": reachable,
            "writes_pending": self.subscriber.index_down,
        }
        memory = self._memory_watch.status()
        if memory is not None:
            index["memory"] = memory
            ok = ok and memory["problem"] is None
        return {
            "status": "ok" if ok else "degraded",
            "role": self.role,
            "index": index,
            "replicas": self.subscriber.status(),
        }

    async def _health_endpoint(self, request: Request) -> Response:
        body = await self.health()
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)


async def serve(settings: TrackerSettings) -> int:
    """Build the index, run a service until SIGINT/SIGTERM, close the index."""
    index = open_index(settings.redis or None)
    lease: TrackerLease | None = None
    if settings.lease_ttl_s:  # TrackerSettings allows a lease only with --redis
        from tracker.core.redis_index import RedisIndex  # noqa: PLC0415
        from tracker.ingest.lease import TrackerLease  # noqa: PLC0415 - redis only when used

        assert isinstance(index, RedisIndex)
        lease = TrackerLease(index.client, settings.election, settings.lease_ttl_s)
    try:
        service = TrackerService(settings, index, CollectorRegistry(), freeze=True, lease=lease)
        return await run_until_signalled(service)
    finally:
        await index.close()


def run(settings: TrackerSettings) -> int:
    """Entry point of ``kvrouter tracker``: returns the process exit status."""
    return run_on_loop(serve(settings), settings.loop)
