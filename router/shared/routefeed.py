"""Routes shared by routers that keep their own index (``--local-index``).

:class:`RouteFeed` appends each route this router records (predicted blocks, home anchors) to
the partition's Redis stream in the background, and every refresh applies the other routers'
entries to its own index, their lifetimes counted from the entry's id (Redis time). Routes are
hints: a failed write is dropped and counted, a failed read retried at the next refresh.
docs/architecture.md ("Index", the router modes) says why.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import redis.asyncio as redis
from redis.exceptions import RedisError
from redis.typing import EncodableT, FieldT

from tracker.core.blocks import Namespace
from tracker.core.index import BlockIndex, Route
from tracker.core.keys import MAX_ROUTES, NamespaceKeys
from tracker.framework.lifecycle import cancel_and_wait

logger = logging.getLogger(__name__)

READ_COUNT: Final = 1024
"""Most entries of one partition applied per refresh (the rest at the next)."""
REFRESH_S: Final = 0.01
"""How often the other routers' routes are read when ``--load-refresh-ms`` is 0 (the load
then read in every request's path: the routes are still read in the background)."""
CLOCK_READ_S: Final = 60.0
"""How often Redis's clock is read again (entry ids are Redis time)."""


@dataclass(slots=True)
class RouteFeedStats:
    """Counters of a :class:`RouteFeed`, for metrics and tests."""

    written: int = 0
    write_errors: int = 0
    applied: int = 0
    read_errors: int = 0
    malformed: int = 0


def _pack(keys: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(keys)}Q", *keys)


def _unpack(data: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(data) // 8}Q", data)


class RouteFeed:
    """Publish this router's routes, apply the other routers' to ``index``.

    :param client: used, not owned (give it a socket timeout).
    :param since_s: how far back a partition's first read starts (the home lifetime).
    :param on_error: called with ``"route_write"`` or ``"route_read"`` on each failed write
        or read.
    """

    def __init__(
        self,
        client: redis.Redis,
        router_id: str,
        index: BlockIndex,
        *,
        refresh_s: float,
        since_s: float,
        push_delay_s: float = 0.002,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        if refresh_s <= 0:
            raise ValueError("refresh_s must be positive")
        self.client = client
        self.router_id = router_id.encode()
        self.index = index
        self.refresh_s = refresh_s
        self.since_s = since_s
        self.push_delay_s = push_delay_s
        self.stats = RouteFeedStats()
        self._pending: list[tuple[str, dict[FieldT, EncodableT]]] = []
        self._pusher: asyncio.Task[None] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._streams: dict[str, Namespace] = {}  # stream key -> partition
        self._keys: dict[Namespace, str] = {}  # partition -> stream key
        self._last: dict[str, bytes] = {}  # stream key -> last id read
        self._clock: tuple[float, int] | None = None  # (monotonic, Redis ms) at one instant
        self._failing = False
        self.on_error = on_error

    def publish(self, namespace: Namespace, route: Route) -> None:
        """Queue a route this router just recorded in its own index; never waits."""
        stream = self._stream(namespace)
        fields: dict[FieldT, EncodableT] = {
            b"r": self.router_id,
            b"p": route.replica.encode(),
            b"k": _pack(route.keys),
            b"t": round(route.ttl_s * 1000),
            b"a": _pack(route.anchors),
            b"h": round(route.home_ttl_s * 1000),
        }
        if route.session is not None:
            fields[b"s"] = _pack([route.session])
            fields[b"w"] = round(route.session_ttl_s * 1000)
        self._pending.append((stream, fields))
        if self._pusher is None or self._pusher.done():
            self._pusher = asyncio.get_running_loop().create_task(
                self._push(), name="kvrouter-route-push"
            )

    def _stream(self, namespace: Namespace) -> str:
        stream = self._keys.get(namespace)
        if stream is None:
            base = namespace.base()
            stream = self._keys[namespace] = NamespaceKeys(base).routes
            self._streams[stream] = base
        return stream

    async def _push(self) -> None:
        if self.push_delay_s > 0:
            await asyncio.sleep(self.push_delay_s)
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                pipe = self.client.pipeline(transaction=False)
                for stream, fields in batch:
                    pipe.xadd(stream, fields, maxlen=MAX_ROUTES, approximate=True)
                await pipe.execute()
            except (RedisError, OSError) as exc:
                self.stats.write_errors += len(batch)
                if self.on_error is not None:
                    self.on_error("route_write")
                self._trouble("cannot share routes with the other routers", exc)
                continue
            self.stats.written += len(batch)

    def _trouble(self, what: str, exc: BaseException) -> None:
        if not self._failing:
            self._failing = True
            logger.error("%s: %s", what, exc)

    async def _redis_ms(self) -> int:
        """Redis's clock now, in ms (read once; the monotonic clock keeps it)."""
        if self._clock is None or time.monotonic() - self._clock[0] > CLOCK_READ_S:
            seconds, micros = await self.client.time()
            self._clock = (time.monotonic(), seconds * 1000 + micros // 1000)
        mono, ms = self._clock
        return ms + round((time.monotonic() - mono) * 1000)

    async def refresh(self) -> int:
        """Apply the routes other routers appended since the last read; how many."""
        if not self._streams:
            return 0
        now_ms = await self._redis_ms()
        for stream in self._streams:
            if stream not in self._last:
                self._last[stream] = f"{max(0, now_ms - round(self.since_s * 1000))}-0".encode()
        reply: Any = await self.client.xread(
            {stream: self._last[stream] for stream in self._streams}, count=READ_COUNT
        )
        applied = 0
        for name, entries in reply or ():
            stream = name.decode() if isinstance(name, bytes) else name
            namespace = self._streams[stream]
            for entry_id, fields in entries:
                self._last[stream] = entry_id
                if fields.get(b"r") == self.router_id:
                    continue
                try:
                    age_s = max(0, now_ms - int(entry_id.split(b"-")[0])) / 1000
                    replica = fields[b"p"].decode()
                    keys, anchors = _unpack(fields[b"k"]), _unpack(fields[b"a"])
                    ttl_s, home_ttl_s = int(fields[b"t"]) / 1000, int(fields[b"h"]) / 1000
                    session = _unpack(fields[b"s"])[0] if b"s" in fields else None
                    session_ttl_s = int(fields.get(b"w", 0)) / 1000
                except (KeyError, ValueError, IndexError, struct.error) as exc:  # not a route
                    self.stats.malformed += 1
                    logger.debug("skipping a malformed route entry", extra={"error": str(exc)})
                    continue
                route = Route(
                    replica,
                    keys,
                    ttl_s,
                    anchors,
                    home_ttl_s,
                    age_s,
                    session=session,
                    session_ttl_s=session_ttl_s,
                )
                self.index.route_now(namespace, route)
                applied += 1
        self.stats.applied += applied
        return applied

    def want(self, namespace: Namespace) -> None:
        """Read ``namespace``'s routes from now on (it is routed in)."""
        self._stream(namespace)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except (RedisError, OSError) as exc:
                self.stats.read_errors += 1
                if self.on_error is not None:
                    self.on_error("route_read")
                self._trouble("cannot read the other routers' routes", exc)
                continue
            if self._failing:
                self._failing = False
                logger.info("sharing routes with the other routers again")

    async def start(self) -> None:
        """Start reading (idempotent)."""
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(
                self._run(), name="kvrouter-route-read"
            )

    async def stop(self) -> None:
        """Stop reading; a write in flight is given up (routes are hints)."""
        tasks = [task for task in (self._reader, self._pusher) if task is not None]
        self._reader = self._pusher = None
        await cancel_and_wait(tasks)
