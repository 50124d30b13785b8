"""What a router process reads its decisions from: the block index, the Redis client that
shares load and routes, and (without a shared index) the embedded tracker that feeds it.

With ``--redis`` the index, the registry and the load are shared through Redis; without it,
an in-process index fed by an embedded tracker; with ``--local-index``, the index is the
process's own and the load and routes are shared.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from router.config import RouterSettings
from tracker.core.backends import open_index
from tracker.core.index import BlockIndex
from tracker.core.redis_client import RedisConnection, open_redis
from tracker.ingest.config import TrackerSettings
from tracker.ingest.embedded import EmbeddedTracker, start_embedded

if TYPE_CHECKING:
    import redis.asyncio as redis


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


class Backing:
    """The index, the shared Redis client and the embedded tracker of one router process;
    :meth:`open` them, :meth:`close` them (idempotent, also after a failed open)."""

    def __init__(self) -> None:
        self.index: BlockIndex | None = None
        self.client: redis.Redis | None = None
        self.tracker: EmbeddedTracker | None = None
        self._redis: RedisConnection | None = None

    async def open(self, settings: RouterSettings, registry: CollectorRegistry) -> BlockIndex:
        """Open the index (and the tracker feeding an in-process one); returns it."""
        if settings.redis and not settings.local_index:  # the shared index
            shared = open_index(settings.redis)
            self.index, self.client = shared, shared.client
            return shared
        # the index is this process's own; load and routes shared through Redis
        self.index = index = open_index(None)
        if settings.redis:
            self._redis = open_redis(settings.redis)
            self.client = self._redis.client
        if settings.replica:
            self.tracker = await start_embedded(tracker_settings(settings), index, registry)
        return index

    async def close(self) -> None:
        if self.tracker is not None:
            await self.tracker.stop()
            self.tracker = None
        if self.index is not None:
            await self.index.close()
            self.index = None
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None
        self.client = None
