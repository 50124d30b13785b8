"""The load board every router shares through expiring Redis entries.

Each router writes its own totals per replica (requests in flight, queued prefill work, since
when the engine has worked on its requests there still prefilling) into the partition's
``load`` hash, pushed
in the background a moment after they change and renewed every second; readers sum the
others' unexpired entries with their own exact totals. A router alone in a partition writes
only with the renewal; a router with its own index reads the others' load in the background
(:meth:`RedisLoadBoard.view`). The layout and the reasons: docs/architecture.md ("Shared load").
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

import redis.asyncio as redis
from redis.exceptions import RedisError

from router.shared.load import Lease, Load, LoadTotals, SurveyLoad
from tracker.core import lua
from tracker.core.blocks import Namespace
from tracker.core.keys import NamespaceKeys
from tracker.core.redis_index import load_sums
from tracker.framework.errors import IndexUnavailableError
from tracker.framework.lifecycle import cancel_and_wait, finish_or_cancel

logger = logging.getLogger(__name__)

PUSH_DELAY_S: Final = 0.002
"""How long a load change waits to be pushed (module docstring): other routers see it this
much later, next to the tens of milliseconds a prefill takes."""


VIEW_MAX_AGE_S: Final = 1.0
"""The oldest read of the other routers' load that :meth:`RedisLoadBoard.view` serves; older
(Redis unreachable), a router routes on its own load, as it does when a lookup fails."""

_Key = tuple[Namespace, str]


def new_router_id() -> str:
    """A router id unique to this process: host, pid and a random suffix."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@dataclass(slots=True)
class LoadBoardStats:
    """Counters of a :class:`RedisLoadBoard`, for metrics."""

    pushes: int = 0
    push_errors: int = 0
    snapshots: int = 0
    snapshot_errors: int = 0


class RedisLoadBoard:
    """Load shared by every router through one expiring hash per index partition.

    The owner calls :meth:`start` (renewal: without it, requests that outlive
    ``lease_ttl_s`` vanish from other routers' view) and :meth:`stop` on shutdown.
    """

    def __init__(
        self,
        client: redis.Redis,
        router_id: str,
        *,
        lease_ttl_s: float,
        renew_interval_s: float,
        push_delay_s: float = PUSH_DELAY_S,
        view_refresh_s: float = 0.0,
        beside_index: bool = False,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        """Share load through ``client``.

        :param client: used, not owned: the caller closes it. Give it a socket timeout, or
            a black-holed Redis stalls the (background) pushes.
        :param router_id: unique per router process (see :func:`new_router_id`).
        :param lease_ttl_s: how long this router's entries outlive its last renewal.
        :param renew_interval_s: how often non-zero entries are rewritten (< ``lease_ttl_s``).
        :param push_delay_s: how long a change waits for others to share its write (module
            docstring).
        :param view_refresh_s: > 0: a background loop reads the other routers' load of every
            partition read within the last lease this often, and :meth:`view` serves the
            last read without a round trip (a router whose index is in its process keeps
            Redis out of the request path); 0: no loop, :meth:`view` is not used.
        :param beside_index: ``client`` is the shared index's: its lookups read this board
            in the same round trip (:attr:`survey_load`).
        :param on_error: called with ``"load_push"`` or ``"load_read"`` on each failed write
            or read.
        """
        if not router_id or "\x00" in router_id:
            raise ValueError("router_id must be a non-empty string without NUL characters")
        if not 0 < renew_interval_s < lease_ttl_s:
            raise ValueError("need 0 < renew_interval_s < lease_ttl_s")
        self.client = client
        self.totals = LoadTotals(on_change=self._changed)
        self.router_id = router_id
        self.lease_ttl_s = lease_ttl_s
        self.renew_interval_s = renew_interval_s
        self.push_delay_s = push_delay_s
        self.stats = LoadBoardStats()
        self._put = client.register_script(lua.LOAD_PUT)
        self._snapshot = client.register_script(lua.LOAD_SNAPSHOT)
        self._keys: dict[Namespace, str] = {}
        self._dirty: set[_Key] = set()
        self._written: set[_Key] = set()
        self._pusher: asyncio.Task[None] | None = None
        self._renewer: asyncio.Task[None] | None = None
        # partitions where no other router was seen for a lease (nor since this board first
        # read them): changes there wait for the renewal
        self._alone: set[Namespace] = set()
        self._seen: dict[Namespace, float] = {}
        self._failing = False
        self._stopped = False
        self.view_refresh_s = view_refresh_s
        # partition → (when read, the other routers' load then); and when a request last
        # wanted it (the refresher reads the partitions wanted within a lease)
        self._views: dict[Namespace, tuple[float, dict[str, tuple[int, int, int]]]] = {}
        self._wanted: dict[Namespace, float] = {}
        self._refresher: asyncio.Task[None] | None = None
        self._view_failing = False
        self.beside_index = beside_index
        self.on_error = on_error

    def acquire(self, namespace: Namespace, replica: str, prefill_tokens: int) -> Lease:
        return self.totals.acquire(namespace, replica, prefill_tokens)

    def local_snapshot(self, namespace: Namespace) -> dict[str, Load]:
        return self.totals.snapshot(namespace)

    def _key(self, namespace: Namespace) -> str:
        key = self._keys.get(namespace)
        if key is None:
            key = self._keys[namespace] = NamespaceKeys(namespace).load
        return key

    def _changed(self, namespace: Namespace, replica: str) -> None:
        self._dirty.add((namespace, replica))
        if namespace not in self._alone:  # alone, the renew loop writes it within a second
            self._kick()

    def _kick(self) -> None:
        """Make sure the one pusher task runs; it writes whatever is dirty, in order."""
        if self._stopped or (self._pusher is not None and not self._pusher.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a caller outside the loop: the renew loop pushes it
            return
        self._pusher = loop.create_task(self._push_dirty(), name="kvrouter-load-push")

    async def _push_dirty(self) -> None:
        if self.push_delay_s > 0:
            await asyncio.sleep(self.push_delay_s)
        while self._dirty and not self._stopped:
            batch, self._dirty = self._dirty, set()
            if not await self._push(batch):
                return  # the renew loop retries

    async def _push(self, batch: set[_Key]) -> bool:
        """Write the current totals of ``batch``; on failure they stay dirty."""
        by_key: dict[str, list[str | int]] = {}
        now = time.monotonic()
        for key in batch:
            inflight, tokens = self.totals.total(*key)
            since = self.totals.since(*key)
            age_ms = round((now - since) * 1000) if since is not None else 0
            by_key.setdefault(self._key(key[0]), []).extend((key[1], inflight, tokens, age_ms))
        ttl_ms = self.ttl_ms
        try:
            if len(by_key) == 1:
                [(name, args)] = by_key.items()
                await self._put(keys=[name], args=[self.router_id, ttl_ms, *args])
            else:
                pipe = self.client.pipeline(transaction=False)
                for name, args in by_key.items():
                    await self._put(keys=[name], args=[self.router_id, ttl_ms, *args], client=pipe)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            self._dirty |= batch
            self.stats.push_errors += 1
            if self.on_error is not None:
                self.on_error("load_push")
            if not self._failing:
                self._failing = True
                logger.error("cannot publish router load to redis: %s", exc)
            return False
        self._written |= batch
        self.stats.pushes += 1
        if self._failing:
            self._failing = False
            logger.info("publishing router load to redis again")
        return True

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.renew_interval_s)
            self._dirty.update(self.totals.held())
            if self._dirty:
                self._kick()

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(self.view_refresh_s)
            now = time.monotonic()
            for base, wanted in list(self._wanted.items()):
                if now - wanted > self.lease_ttl_s:
                    del self._wanted[base]
                    self._views.pop(base, None)
                    continue
                try:
                    await self._read(base)
                except IndexUnavailableError as exc:
                    if not self._view_failing:
                        self._view_failing = True
                        logger.error("cannot read the other routers' load: %s", exc)
                    continue
                if self._view_failing:
                    self._view_failing = False
                    logger.info("reading the other routers' load again")

    async def start(self) -> None:
        """Start the renew loop and the view's refresher (idempotent)."""
        self._stopped = False
        loop = asyncio.get_running_loop()
        if self._renewer is None or self._renewer.done():
            self._renewer = loop.create_task(self._renew(), name="kvrouter-load-renew")
        if self.view_refresh_s > 0 and (self._refresher is None or self._refresher.done()):
            self._refresher = loop.create_task(self._refresh(), name="kvrouter-load-view")
        if self._dirty:
            self._kick()

    def abandon(self) -> None:
        """Stop renewing without withdrawing anything, as a crashed router would (drills)."""
        self._stopped = True
        for task in (self._renewer, self._pusher, self._refresher):
            if task is not None:
                task.cancel()

    async def stop(self, *, timeout_s: float = 1.0) -> None:
        """Stop renewing, let a push in flight finish, and delete this router's entries."""
        self._stopped = True
        loops = [task for task in (self._renewer, self._refresher) if task is not None]
        self._renewer = self._refresher = None
        await cancel_and_wait(loops)
        pusher, self._pusher = self._pusher, None
        if pusher is not None:
            await finish_or_cancel([pusher], timeout_s)
        fields: dict[str, list[str]] = {}
        for namespace, replica in self._written:
            fields.setdefault(self._key(namespace), []).append(f"{replica}\x00{self.router_id}")
        if not fields:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for name, names in fields.items():
                pipe.hdel(name, *names)
            await pipe.execute()
        except (RedisError, OSError) as exc:
            logger.warning("cannot withdraw router load from redis (it expires anyway): %s", exc)
            return
        self._written.clear()

    async def snapshot(self, namespace: Namespace) -> dict[str, Load]:
        """Every router's load: the others' live entries from Redis plus this router's own.

        :raises IndexUnavailableError: Redis cannot be reached; :meth:`local_snapshot` can.
        """
        base = namespace.base()
        return self._combine(base, await self._read(base), time.monotonic())

    async def _read(self, base: Namespace) -> dict[str, tuple[int, int, int]]:
        """Read the other routers' load of partition ``base`` (and record this router's
        presence there); the view keeps it."""
        try:
            reply = await self._snapshot(keys=[self._key(base)], args=[self.router_id, self.ttl_ms])
        except (RedisError, OSError) as exc:
            self.stats.snapshot_errors += 1
            if self.on_error is not None:
                self.on_error("load_read")
            raise IndexUnavailableError(f"redis load snapshot failed: {exc}") from exc
        others = load_sums(reply)
        self._observed(base, others)
        self._views[base] = (time.monotonic(), others)
        return others

    def view(self, namespace: Namespace) -> dict[str, Load]:
        """Every router's load without a round trip: the other routers' as last read by the
        refresher (``view_refresh_s``), at most :data:`VIEW_MAX_AGE_S` old (older, or
        never read: this router's own only), plus this router's own exact load."""
        base = namespace.base()
        now = time.monotonic()
        self._wanted[base] = now
        read = self._views.get(base)
        if read is None or now - read[0] > VIEW_MAX_AGE_S:
            return self.totals.snapshot(base)
        return self._combine(base, read[1], read[0])

    def current(self, namespace: Namespace) -> dict[str, Load] | None:
        return self.view(namespace) if self.view_refresh_s > 0 else None

    @property
    def survey_load(self) -> SurveyLoad | None:
        return SurveyLoad(self.router_id, self.lease_ttl_s) if self.beside_index else None

    @property
    def ttl_ms(self) -> int:
        """How long this router's entries, and its presence, outlive their last write."""
        return max(1, round(self.lease_ttl_s * 1000))

    def merge(
        self, namespace: Namespace, others: Mapping[str, tuple[int, int, int]]
    ) -> dict[str, Load]:
        """Every router's load: the other routers' (in flight, queued prefill work, ms since
        the engine started on what is still prefilling) per replica, read from Redis
        (:meth:`snapshot`, or an index survey that read the load hash with its lookup), plus
        this router's own. Key "" says another router is there (module docstring: a router
        alone writes its changes once a second)."""
        base = namespace.base()
        self._observed(base, others)
        return self._combine(base, others, time.monotonic())

    def _observed(self, base: Namespace, others: Mapping[str, tuple[int, int, int]]) -> None:
        """A read of partition ``base`` found ``others``: is this router alone there?"""
        now = time.monotonic()
        if others:
            self._seen[base] = now
            if base in self._alone:
                self._alone.discard(base)
                if self._dirty:
                    self._kick()
        elif now - self._seen.setdefault(base, now) > self.lease_ttl_s:
            self._alone.add(base)

    def _combine(
        self, base: Namespace, others: Mapping[str, tuple[int, int, int]], read_at: float
    ) -> dict[str, Load]:
        """This router's own load plus ``others`` (read at ``read_at``, ``time.monotonic``)."""
        self.stats.snapshots += 1
        out = self.totals.snapshot(base)
        for replica, (inflight, tokens, age_ms) in others.items():
            if not replica:
                continue
            mine = out.get(replica, Load())
            since = mine.prefill_since
            if tokens > 0 and age_ms > 0:
                theirs = read_at - age_ms / 1000
                since = theirs if since is None else min(since, theirs)
            queued = mine.queued_prefill_tokens + tokens
            out[replica] = Load(mine.inflight + inflight, queued, since)
        return out
