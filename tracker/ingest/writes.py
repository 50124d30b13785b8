"""The tracker's index writes: failures kept pending and flushed with backoff, one flusher.

A Redis index that cannot be reached keeps absorbing batches into its ledgers and holds the
resulting changes pending (see :mod:`tracker.core.redis_writes`). The writer counts such failures,
logs the outage once, and retries ``index.flush()`` with exponential backoff. Writes of
different replicas run concurrently; the flush runs alone, because flushing one replica's
pending state from two tasks at once would send it twice or drop it. A Redis that restarted
empty gets every replica's state back from the ledgers (:meth:`IndexWriter.restore_lost`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Final, Protocol, runtime_checkable

from tracker.core.blocks import Namespace
from tracker.core.events import EventBatch
from tracker.core.index import ApplyResult, BlockIndex
from tracker.framework.errors import FencedError, IndexUnavailableError
from tracker.ingest.metrics import TrackerMetrics

logger = logging.getLogger(__name__)

MAX_BACKOFF_S: Final = 5.0


@runtime_checkable
class Flushing(Protocol):
    """An index that keeps failed writes pending (the Redis index)."""

    async def flush(self) -> int: ...


@runtime_checkable
class Forgetting(Protocol):
    """An index that can also release a departed replica's resources (the Redis index)."""

    async def forget(self, replica: str, namespace: Namespace) -> int: ...


@runtime_checkable
class Restoring(Protocol):
    """An index whose server may lose its data, written back from the ledgers (Redis)."""

    async def restore_lost(self) -> int: ...


class WriteGate:
    """Shared mode for replica writes, exclusive mode for the flusher."""

    def __init__(self) -> None:
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._open = asyncio.Event()
        self._open.set()

    @contextlib.asynccontextmanager
    async def write(self) -> AsyncIterator[None]:
        await self._open.wait()
        self._active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._active -= 1
            if not self._active:
                self._idle.set()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        self._open.clear()
        try:
            await self._idle.wait()
            yield
        finally:
            self._open.set()


class IndexWriter:
    """Every write the tracker makes to the index.

    Args:
        index: the block index.
        metrics: where failed writes are counted.
    """

    def __init__(self, index: BlockIndex, metrics: TrackerMetrics) -> None:
        self.index = index
        self._metrics = metrics
        self._gate = WriteGate()
        self._wanted = asyncio.Event()
        self.down = False

    async def apply(
        self, replica: str, namespace: Namespace, batch: EventBatch, seq: int
    ) -> ApplyResult | None:
        """Apply a batch; ``None`` when the index is unavailable (the write stays pending)."""
        try:
            async with self._gate.write():
                return await self.index.apply(replica, namespace, batch, seq=seq)
        except IndexUnavailableError as exc:
            self._failed(replica, "apply", exc)
            return None

    async def clear(self, replica: str, namespace: Namespace) -> int | None:
        """Forget a replica's blocks; ``None`` when the index is unavailable (kept pending)."""
        try:
            async with self._gate.write():
                return await self.index.clear(replica, namespace)
        except IndexUnavailableError as exc:
            self._failed(replica, "clear", exc)
            return None

    async def forget(self, replica: str, namespace: Namespace) -> int | None:
        """Remove a departed replica's blocks (and, with Redis, release its short id)."""
        try:
            async with self._gate.write():
                if isinstance(self.index, Forgetting):
                    return await self.index.forget(replica, namespace)
                return await self.index.clear(replica, namespace)
        except IndexUnavailableError as exc:
            self._failed(replica, "forget", exc)
            return None

    async def restore_lost(self) -> int:
        """Write back every replica the index lost (see ``RedisIndex.restore_lost``).

        Runs alone, like a flush; an unreachable index restores nothing now (the next call
        will). Returns how many replicas were written back.
        """
        if not isinstance(self.index, Restoring):
            return 0
        async with self._gate.exclusive():
            try:
                restored = await self.index.restore_lost()
            except IndexUnavailableError:
                return 0
        if restored:
            self._metrics.index_restores.inc(restored)
            logger.warning(
                "the index lost replicas' state; written back", extra={"replicas": restored}
            )
        return restored

    def _failed(self, replica: str, op: str, exc: IndexUnavailableError) -> None:
        self._metrics.index_failures.labels(op).inc()
        if not self.down:
            logger.warning(
                "index write failed; kept pending and retried",
                extra={"replica": replica, "op": op, "error": str(exc)},
            )
            self.down = True
        self._wanted.set()

    async def run(self) -> None:
        """The flusher: after a failure, retry ``index.flush()`` with backoff until it is done."""
        if not isinstance(self.index, Flushing):
            return
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            delay = 0.05
            while await self._flush() != 0:
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF_S)
            if self.down and not self._wanted.is_set():
                logger.info("index writes recovered")
                self.down = False

    async def flush(self, budget_s: float) -> int:
        """A last flush at shutdown: replicas still pending, ``-1`` if it did not finish."""
        try:
            async with asyncio.timeout(max(budget_s, 0.1)):
                return await self._flush()
        except TimeoutError:
            return -1
        except FencedError:
            # another tracker won the election and writes the index: what this one still
            # holds is that one's to write (it resumes every replica from its checkpoint)
            logger.warning("pending index writes dropped: another tracker took over")
            return -1

    async def _flush(self) -> int:
        if not isinstance(self.index, Flushing):
            return 0
        async with self._gate.exclusive():
            try:
                return await self.index.flush()
            except IndexUnavailableError:
                return -1
