"""Background upkeep of the replica set: registry refresh, health checks, engine metrics.

Each runs in its own loop owned by :class:`ReplicaMonitor`, never on the request path. Engine
metrics are vLLM's ``/metrics`` gauges (``num_requests_running``, ``num_requests_waiting``,
``kv_cache_usage_perc``); only their lines are parsed, so a large metrics page costs little.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, Final

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from router.errors import UpstreamError
from router.fleet.replicas import EngineLoad, Replica, ReplicaSet
from router.fleet.upstream import UpstreamClient, failure_kind
from router.metrics import RouterMetrics
from router.shared.load import LoadBoard
from tracker.core.blocks import Namespace
from tracker.core.index import BlockIndex
from tracker.framework.errors import IndexUnavailableError
from tracker.framework.lifecycle import cancel_and_wait

logger = logging.getLogger(__name__)

RUNNING: Final = "vllm:num_requests_running"
WAITING: Final = "vllm:num_requests_waiting"
KV_USAGE: Final = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
CACHE_CONFIG: Final = "vllm:cache_config_info"
_WANTED: Final = (RUNNING, WAITING, *KV_USAGE, CACHE_CONFIG)
_PARALLEL: Final = 64  # concurrent probes per pass


def parse_engine_metrics(text: str, at: float) -> EngineLoad:
    """Running and waiting requests (summed over engines), the highest KV usage, and the KV
    cache's size in blocks (``num_gpu_blocks`` of ``cache_config_info``, summed)."""
    lines = [line for line in text.splitlines() if line.startswith(_WANTED)]
    running: float | None = None
    waiting: float | None = None
    usage: float | None = None
    blocks: int | None = None
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            if sample.name == CACHE_CONFIG:
                size = sample.labels.get("num_gpu_blocks", "")
                if size.isdigit():
                    blocks = (blocks or 0) + int(size)
            elif sample.name == RUNNING:
                running = (running or 0.0) + sample.value
            elif sample.name == WAITING:
                waiting = (waiting or 0.0) + sample.value
            elif sample.name in KV_USAGE:
                usage = sample.value if usage is None else max(usage, sample.value)
    return EngineLoad(
        None if running is None else round(running),
        None if waiting is None else round(waiting),
        usage,
        at,
        blocks,
    )


class ReplicaMonitor:
    """Keeps a :class:`ReplicaSet` current; :meth:`start` / :meth:`stop`.

    :param index: the registry (only read when ``discover`` is set).
    :param on_removed: called with the id of a replica that left the registry.
    """

    def __init__(
        self,
        replicas: ReplicaSet,
        upstream: UpstreamClient,
        index: BlockIndex,
        metrics: RouterMetrics,
        *,
        discover: bool,
        registry_interval_s: float,
        health_interval_s: float,
        health_timeout_s: float,
        metrics_interval_s: float,
        on_removed: Callable[[str], None] | None = None,
        load: LoadBoard | None = None,
    ) -> None:
        self.replicas = replicas
        self.upstream = upstream
        self.index = index
        self.metrics = metrics
        self.discover = discover
        self.registry_interval_s = registry_interval_s
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.metrics_interval_s = metrics_interval_s
        self.on_removed = on_removed
        self.load = load
        self.registry_reachable = True
        self._tasks: list[asyncio.Task[None]] = []
        self._limit = asyncio.Semaphore(_PARALLEL)

    async def start(self) -> None:
        """Read the registry once (so discovered replicas are known at once), start loops."""
        if self.discover:
            await self.refresh_registry()
            self._spawn(self._refresh_later(), "registry")
        self._spawn(self._every(self.health_interval_s, self.check_health), "health")
        if self.metrics_interval_s > 0:
            self._spawn(self._every(self.metrics_interval_s, self.scrape_engines), "engines")
        self._publish_health()

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        await cancel_and_wait(tasks)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=f"kvrouter-{name}")
        task.add_done_callback(_log_crash)
        self._tasks.append(task)

    @staticmethod
    async def _every(interval_s: float, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        while True:
            await work()
            await asyncio.sleep(interval_s)

    # ------------------------------------------------------------------ registry

    async def _refresh_later(self) -> None:
        while True:
            await asyncio.sleep(self.registry_interval_s)
            await self.refresh_registry()

    async def refresh_registry(self) -> None:
        """Adopt the registry's replicas; an unreachable registry keeps the current view."""
        try:
            async with asyncio.timeout(max(1.0, self.registry_interval_s)):
                records = await self.index.replicas()
        except (IndexUnavailableError, TimeoutError) as exc:
            if self.registry_reachable:
                logger.warning(
                    "replica registry unreachable; keeping the last view",
                    extra={"error": str(exc) or "timeout"},
                )
            self.registry_reachable = False
            return
        if not self.registry_reachable:
            logger.info("replica registry reachable again")
        self.registry_reachable = True
        _, removed = self.replicas.reconcile(records)
        for replica in removed:
            self.metrics.forget_replica(replica)
            if self.on_removed is not None:
                self.on_removed(replica)
        self._publish_health()

    # ------------------------------------------------------------------ health

    async def check_health(self) -> None:
        """Probe every replica's ``GET /health`` once."""
        await asyncio.gather(*(self._probe(r) for r in self.replicas.all()))
        self._publish_health()

    async def _probe(self, replica: Replica) -> None:
        async with self._limit:
            try:
                status, _ = await self.upstream.get(
                    replica.id, replica.url, "/health", timeout_s=self.health_timeout_s
                )
            except UpstreamError as exc:
                self.metrics.health_checks.labels("error").inc()
                self.replicas.failed(replica.id, exc.message, now=failure_kind(exc) == "connect")
                return
        if status == 200:
            self.metrics.health_checks.labels("ok").inc()
            self.replicas.succeeded(replica.id)
            await self._adapters(replica)
        else:
            self.metrics.health_checks.labels("unhealthy").inc()
            self.replicas.failed(replica.id, f"GET /health answered {status}")

    async def _adapters(self, replica: Replica) -> None:
        """The LoRA adapters a replica serves: its ``/v1/models`` entries whose ``parent`` is
        its model (vLLM lists each loaded adapter so; they come and go at runtime)."""
        async with self._limit:
            try:
                status, text = await self.upstream.get(
                    replica.id, replica.url, "/v1/models", timeout_s=self.health_timeout_s
                )
            except UpstreamError:
                return  # keep what it served last; health checks judge the replica
        if status != 200:
            return
        try:
            adapters = parse_adapters(text, replica.model)
        except ValueError as exc:
            logger.debug("unparsable model list", extra={"replica": replica.id, "error": exc})
            return
        if adapters != replica.adapters:
            logger.info(
                "replica adapters", extra={"replica": replica.id, "adapters": sorted(adapters)}
            )
            replica.adapters = adapters

    def _publish_health(self) -> None:
        for replica in self.replicas.all():
            self.metrics.replica_healthy.labels(replica.id).set(1 if replica.healthy else 0)

    # ------------------------------------------------------------------ engine metrics

    async def scrape_engines(self) -> None:
        """Read every healthy replica's engine gauges once, with how many of its requests are
        the routers': the part of its KV usage that finishes with them.

        The rest is outside traffic, but only once seen in two scrapes in a row. A request
        that a router sends while the gauges are read, or that another router's board entry
        shows a few milliseconds late, ran on the engine uncounted; taken as outside traffic
        whose blocks may never free, it priced the engine as nearly full until the next
        scrape, and the next prompt of its group left home (tests/test_topology.py under
        eviction pressure, on a loaded host). The routers' counts bracket the read (the board
        before and after it), which narrows that window but cannot close it for a request
        that starts and ends inside it. Real outside traffic is noticed a scrape later.
        """
        healthy = [r for r in self.replicas.all() if r.healthy]
        if self.load is None:
            read = await asyncio.gather(*(self._scrape(r) for r in healthy))
            self._adopt(healthy, read, None, None)
            return
        namespaces = {r.namespace for r in healthy}
        before = await self._routed(namespaces)
        read = await asyncio.gather(*(self._scrape(r) for r in healthy))
        self._adopt(healthy, read, before, await self._routed(namespaces))

    async def _routed(self, namespaces: Iterable[Namespace]) -> dict[str, int]:
        """Every router's requests in flight per replica now (this router's own when the board
        is unreachable)."""
        assert self.load is not None
        routed: dict[str, int] = {}
        for namespace in namespaces:
            try:
                loads = await self.load.snapshot(namespace)
            except IndexUnavailableError:
                loads = self.load.local_snapshot(namespace)
            routed.update((replica, load.inflight) for replica, load in loads.items())
        return routed

    def _adopt(
        self,
        replicas: Sequence[Replica],
        read: Sequence[EngineLoad | None],
        before: Mapping[str, int] | None,
        after: Mapping[str, int] | None,
    ) -> None:
        for replica, gauges in zip(replicas, read, strict=True):
            if gauges is None:
                continue  # stale values expire; health checks judge the replica
            engine = gauges
            if before is not None and after is not None:
                total = (gauges.running or 0) + (gauges.waiting or 0)
                counted = max(before.get(replica.id, 0), after.get(replica.id, 0))
                unrouted = max(0, total - counted)
                last = replica.engine.unrouted if replica.engine is not None else 0
                engine = dataclasses.replace(
                    gauges, routed=total - min(unrouted, last), unrouted=unrouted
                )
            replica.engine = engine
            if engine.cache_blocks is not None:
                replica.cache_blocks = engine.cache_blocks

    async def _scrape(self, replica: Replica) -> EngineLoad | None:
        """One replica's gauges, or None if they could not be read."""
        async with self._limit:
            try:
                status, text = await self.upstream.get(
                    replica.id, replica.url, "/metrics", timeout_s=self.health_timeout_s
                )
            except UpstreamError:
                return None
        if status != 200:
            return None
        try:
            return parse_engine_metrics(text, time.monotonic())
        except ValueError as exc:
            logger.debug("unparsable engine metrics", extra={"replica": replica.id, "error": exc})
            return None


def parse_adapters(text: str, model: str) -> frozenset[str]:
    """The adapters of ``model`` in an OpenAI ``/v1/models`` answer (vLLM's ``parent``)."""
    try:
        cards = msgspec.json.decode(text)["data"]
        return frozenset(
            str(card["id"]) for card in cards if card.get("parent") == model and card["id"]
        )
    except (msgspec.DecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a model list: {exc}") from None


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("replica monitor loop crashed", exc_info=task.exception())
