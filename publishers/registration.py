"""Keeping replicas in the registry: heartbeats every few seconds, deregistration on stop.

The registry entry is how trackers find a replica's event endpoints and routers its URL; an
entry whose heartbeats stop expires after its ``ttl_s``. Redis being down is logged once per
outage and retried on the next beat: a replica keeps serving without its registry entry.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

from tracker.core.index import BlockIndex, ReplicaRecord
from tracker.framework.errors import IndexUnavailableError
from tracker.framework.lifecycle import cancel_and_wait

logger = logging.getLogger(__name__)

HealthCheck = Callable[[], Awaitable[bool]]

DOWN_AFTER: Final = 3
"""Failed health probes in a row that deregister the records, unless told otherwise
(``kvrouter attach --down-after``)."""


class RegistrationService:
    """Heartbeats ``records`` into ``index`` every ``interval_s`` while ``alive()`` says so.

    :param index: the registry (normally a :class:`tracker.core.redis_index.RedisIndex`).
    :param records: one entry per replica this process stands for.
    :param interval_s: time between heartbeats; keep it well under the records' ``ttl_s``.
    :param alive: optional health probe; while it fails ``down_after`` times in a row the
        records are deregistered, and when it recovers they come back with ``on_recover()``'s
        records (e.g. a new ``instance``, since the engine probably restarted).
    :param stop_timeout_s: bound on the final deregistration.
    """

    def __init__(
        self,
        index: BlockIndex,
        records: Sequence[ReplicaRecord],
        *,
        interval_s: float,
        alive: HealthCheck | None = None,
        down_after: int = DOWN_AFTER,
        on_recover: Callable[[Sequence[ReplicaRecord]], Sequence[ReplicaRecord]] | None = None,
        stop_timeout_s: float = 2.0,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("heartbeat interval must be positive")
        self.index = index
        self.records = list(records)
        self.interval_s = interval_s
        self.alive = alive
        self.down_after = max(1, down_after)
        self.on_recover = on_recover
        self.stop_timeout_s = stop_timeout_s
        self.beats = 0
        self.failures = 0
        self._reachable = True
        self._health_failures = 0
        # with a probe, nothing is registered before the first healthy answer
        self._down = alive is not None
        self._task: asyncio.Task[None] | None = None

    @property
    def registered(self) -> bool:
        """Whether the last beat put every record in the registry."""
        return self._reachable and not self._down and self.beats > 0

    async def start(self) -> None:
        """Beat once now (so the replica is visible immediately), then every ``interval_s``."""
        await self.beat()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="registration")
        self._task.add_done_callback(_log_crash)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.beat()

    async def beat(self) -> None:
        """One heartbeat round: probe health, then register (or deregister when down)."""
        if self.alive is not None and not await self._healthy():
            return
        try:
            for record in self.records:
                await self.index.register(record)
        except IndexUnavailableError as exc:
            self.failures += 1
            if self._reachable:
                logger.warning("registry unreachable; will retry", extra={"error": str(exc)})
            self._reachable = False
            return
        if not self._reachable:
            logger.info("registry reachable again", extra={"replicas": self._ids()})
        elif self.beats == 0:
            logger.info("registered", extra={"replicas": self._ids()})
        self._reachable = True
        self.beats += 1

    async def _healthy(self) -> bool:
        assert self.alive is not None
        if await self.alive():
            self._health_failures = 0
            if self._down:
                self._down = False
                if self.on_recover is not None:
                    self.records = list(self.on_recover(self.records))
                logger.info("replica healthy; registering", extra={"replicas": self._ids()})
            return True
        self._health_failures += 1
        if not self._down and self._health_failures >= self.down_after:
            self._down = True
            logger.warning("replica unhealthy; deregistering", extra={"replicas": self._ids()})
            await self._deregister()
        return False

    async def _deregister(self) -> bool:
        for record in self.records:
            try:
                await self.index.deregister(record.id)
            except IndexUnavailableError as exc:
                logger.warning(
                    "deregistration failed; the entries will expire",
                    extra={"replica": record.id, "error": str(exc)},
                )
                return False
        return True

    async def stop(self) -> None:
        """Stop beating and remove the records (bounded by ``stop_timeout_s``)."""
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait([task])
        try:
            done = await asyncio.wait_for(self._deregister(), self.stop_timeout_s)
        except TimeoutError:
            logger.warning("deregistration timed out; the entries will expire")
        else:
            if done:
                logger.info("deregistered", extra={"replicas": self._ids()})

    def _ids(self) -> str:
        return ",".join(r.id for r in self.records)


def _log_crash(task: asyncio.Task[None]) -> None:
    # a bug in the loop must not silently stop the heartbeats
    if not task.cancelled() and task.exception() is not None:
        logger.error("registration loop crashed", exc_info=task.exception())
