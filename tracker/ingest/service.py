"""TrackerService: startup -> main loop -> bounded graceful shutdown, and ``run(settings)``.

The service owns the subscriber (one stream per replica), the registry loop (expire replicas
that stopped heartbeating, discover new ones, fence restarted ones) and a small HTTP server
with ``/metrics`` and ``/health`` running on the same event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import zmq
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tracker.core.backends import open_index
from tracker.core.blocks import Namespace
from tracker.core.index import BlockIndex, ReplicaRecord
from tracker.framework.errors import ConfigError, FencedError, IndexUnavailableError
from tracker.framework.http import HTTPServer, bind
from tracker.framework.lifecycle import (
    freeze_heap,
    run_on_loop,
    run_until_signalled,
    running_loop_name,
)
from tracker.ingest.config import TrackerSettings
from tracker.ingest.metrics import TrackerMetrics
from tracker.ingest.subscriber import Subscriber
from tracker.ingest.targets import ReplicaTarget

if TYPE_CHECKING:
    from tracker.core.redis_index import RedisMemory
    from tracker.ingest.lease import TrackerLease

logger = logging.getLogger(__name__)


@runtime_checkable
class _Pinging(Protocol):
    async def ping(self) -> bool: ...


@runtime_checkable
class _Metered(Protocol):
    async def memory(self) -> RedisMemory: ...


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
        self._discovered: dict[str, ReplicaTarget] = {}
        self._instances: dict[str, str] = {}
        self._ttls: dict[str, float] = {}
        self._missing: dict[str, float] = {}  # discovered replica -> first seen missing
        self._rejected: dict[str, ReplicaTarget | None] = {}
        self._stopping = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._http: HTTPServer | None = None
        self._failure: BaseException | None = None
        self._memory: RedisMemory | None = None
        self._memory_problem: str | None = None
        self._started = False
        self._stopped = False

    # ----------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Bind sockets, start the static replicas, the registry loop and the HTTP server
        (with an election: the HTTP server, and the rest once the lease is won)."""
        self._started = True
        await self._check_memory(at_start=True)
        if self.lease is None:
            await self._activate()
        else:
            self.metrics.active.set(0)
            self._spawn(self._election(self.lease), "election")
        if isinstance(self.index, _Metered):
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
        own = list(self._tasks)
        if own:
            _, pending = await asyncio.wait(own, timeout=max(0.0, deadline - loop.time()))
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
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

    @property
    def _budget_bytes(self) -> int:
        return int(self.settings.memory_budget_mb * 2**20)

    async def _memory_loop(self) -> None:
        while not await self._sleep(self.settings.memory_check_s):
            await self._check_memory()

    async def _check_memory(self, *, at_start: bool = False) -> None:
        """Read Redis's eviction policy and memory use: a policy that evicts index keys
        refuses the start (routers would route on an index silently missing placements)
        and degrades ``/health`` if it appears later, as does use over the budget."""
        if not isinstance(self.index, _Metered):
            return
        try:
            memory = await self.index.memory()
        except IndexUnavailableError as exc:
            if at_start:
                logger.warning(
                    "cannot read Redis's memory policy yet; checking again later",
                    extra={"error": str(exc)},
                )
            return
        budget = self._budget_bytes
        self._memory = memory
        self.metrics.redis_memory.set(memory.used_bytes)
        self.metrics.memory_budget.set(budget)
        self.metrics.evicting_policy.set(1 if memory.evicts_index else 0)
        problem: str | None = None
        if memory.evicts_index:
            problem = (
                f"Redis maxmemory-policy is {memory.policy}: at maxmemory it evicts index "
                "keys and routers would route on an index silently missing placements; set "
                "'maxmemory-policy noeviction' on a Redis dedicated to kvrouter"
            )
            if at_start:
                raise ConfigError(problem)
        elif budget and memory.used_bytes > budget:
            problem = (
                f"Redis uses {memory.used_bytes / 2**20:.1f} MiB, over the index's budget of "
                f"{self.settings.memory_budget_mb:g} MiB (--memory-budget-mb)"
            )
        if problem != self._memory_problem:
            if problem:
                logger.error(
                    "redis memory out of bounds",
                    extra={"problem": problem, "policy": memory.policy},
                )
            else:
                logger.info("redis memory within bounds again", extra={"policy": memory.policy})
        self._memory_problem = problem

    # ----------------------------------------------------------- registry

    async def _registry_loop(self) -> None:
        failing = False
        while not self._stopping.is_set():
            try:
                await self._registry_pass()
                if failing:
                    logger.info("replica registry reachable again")
                failing = False
            except IndexUnavailableError as exc:
                if not failing:
                    logger.warning("replica registry unavailable", extra={"error": str(exc)})
                failing = True
            if await self._sleep(self.settings.reap_interval_s):
                return

    async def _registry_pass(self) -> None:
        # a Redis that restarted empty: idle replicas would stay out of the index otherwise
        await self.subscriber.writer.restore_lost()
        for record in await self.index.reap():
            await self._expire(record)
        if self.settings.discover:
            await self._reconcile(await self.index.replicas())

    async def _expire(self, record: ReplicaRecord) -> None:
        logger.warning("replica expired", extra={"replica": record.id})
        self._instances.pop(record.id, None)
        self._ttls.pop(record.id, None)
        self._missing.pop(record.id, None)
        if record.id in self._static:
            # Still configured: drop what it held; its stream resyncs when it speaks again.
            self.subscriber.fence(record.id, "expired", catch_up=False)
            return
        target = self._discovered.pop(record.id, None)
        namespace = target.namespace if target is not None else record.namespace
        self.metrics.resets.labels("expired").inc()  # counted before it shows, never after
        held = await self.subscriber.forget(record.id, namespace)
        logger.info("expired replica forgotten", extra={"replica": record.id, "blocks": held})

    async def _reconcile(self, records: list[ReplicaRecord]) -> None:
        seen: set[str] = set()
        for record in records:
            seen.add(record.id)
            self._ttls[record.id] = record.ttl_s
            self._missing.pop(record.id, None)
            previous = self._instances.get(record.id)
            self._instances[record.id] = record.instance
            restarted = bool(previous is not None and previous != record.instance)
            if record.id in self._static:
                if restarted:
                    self.subscriber.fence(record.id, "instance_change")
                continue
            await self._adopt(record, restarted)
        for replica in [r for r in self._rejected if r not in seen]:
            del self._rejected[replica]
        now = time.monotonic()
        for replica in [r for r in self._discovered if r not in seen]:
            # Deregistered, or gone with a Redis that restarted empty and is refilled by the
            # next heartbeats: forgetting at once would throw away what a replay may not
            # bring back (vLLM buffers 10k batches), so only a record missing for its ttl is.
            since = self._missing.setdefault(replica, now)
            if now - since < self._ttls.get(replica, 0.0):
                continue
            del self._missing[replica]
            self._ttls.pop(replica, None)
            target = self._discovered.pop(replica)
            self._instances.pop(replica, None)
            held = await self.subscriber.forget(replica, target.namespace)
            logger.info("replica deregistered", extra={"replica": replica, "blocks": held})

    async def _adopt(self, record: ReplicaRecord, restarted: bool) -> None:
        if record.block_size <= 0:
            self._reject(record.id, None, "invalid block size")
            return
        target = ReplicaTarget(
            record.id, record.namespace, record.events, record.replay, record.instance
        )
        if self._rejected.get(record.id) == target:
            return  # already reported
        if target.events is None and not self.settings.bind:
            self._reject(record.id, target, "no events endpoint and --bind is not set")
            return
        stream = self.subscriber.get(record.id)
        if stream is not None and (stream.target.events, stream.namespace) != (
            target.events,
            target.namespace,
        ):
            if stream.namespace != target.namespace:
                await self.subscriber.forget(record.id, stream.namespace)
            else:
                await self.subscriber.untrack(record.id)
            stream = None
        try:
            self.subscriber.track(target)
        except zmq.ZMQError as exc:
            self._reject(record.id, target, str(exc))
            return
        self._rejected.pop(record.id, None)
        if stream is None:
            logger.info(
                "replica discovered",
                extra={"replica": record.id, "events": record.events, "replay": record.replay},
            )
        self._discovered[record.id] = target
        if restarted:
            self.subscriber.fence(record.id, "instance_change")

    def _reject(self, replica: str, target: ReplicaTarget | None, reason: str) -> None:
        if replica not in self._rejected or self._rejected[replica] != target:
            logger.warning(
                "cannot track registered replica", extra={"replica": replica, "reason": reason}
            )
        self._rejected[replica] = target

    # ----------------------------------------------------------- HTTP

    async def _start_http(self) -> None:
        app = Starlette(
            routes=[
                Route("/metrics", self._metrics_endpoint),
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
        if self._memory is not None:
            index["memory"] = {
                "policy": self._memory.policy,
                "used_bytes": self._memory.used_bytes,
                "max_bytes": self._memory.max_bytes,
                "budget_bytes": self._budget_bytes,
                "problem": self._memory_problem,
            }
            ok = ok and self._memory_problem is None
        return {
            "status": "ok" if ok else "degraded",
            "role": self.role,
            "index": index,
            "replicas": self.subscriber.status(),
        }

    async def _metrics_endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

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
