"""One replica's event stream: sequence tracking, gap replay, restart fencing, orphan resync.

Live messages of a replica are queued by the subscriber and applied, strictly in sequence
order, by the stream's worker. Per replica the stream keeps ``last`` (last applied seq),
``live_high`` (highest seq seen on the live stream) and ``covered`` (the seq range obtained
by replay), and decides for each live message ``m``:

=====================================  ================================================
``last`` unknown (fresh or reset)      replay from 0 first if ``m.seq > 0``, then apply
``m.seq == last + 1``                  apply
``m.seq > last + 1``                   gap: replay from ``last + 1``; incomplete replay
                                       or none -> clear, continue from what is available
``m.seq <= last``, inside ``covered``  already applied through a replay: skip
and above ``live_high``
``m.seq <= last`` otherwise            sequence reset (engine restart): clear, start over
=====================================  ================================================

While a replay runs, live messages keep queueing; afterwards those already covered are
skipped. A malformed batch is counted and skipped but still advances ``last``. Applying,
replaying and clearing themselves are :class:`tracker.ingest.applier.ReplicaApplier`'s.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Final

from tracker.core.events import Message
from tracker.framework.errors import IndexUnavailableError
from tracker.ingest.applier import ReplicaApplier
from tracker.ingest.config import TrackerSettings
from tracker.ingest.metrics import TrackerMetrics
from tracker.ingest.replay import ReplayClient
from tracker.ingest.targets import ReplicaTarget
from tracker.ingest.writes import IndexWriter

logger = logging.getLogger(__name__)

MAX_QUEUE: Final = 100_000
"""Live messages a replica may have waiting; beyond, they are dropped (and later replayed)."""


SILENT_POLL_S: Final = 1.0  # replay poll interval while a live stream is silent


@dataclass(frozen=True, slots=True)
class Fence:
    """Clear the replica's blocks in stream order (registry fencing); ``cause`` labels it."""

    cause: str
    catch_up: bool = True


class _Tick:
    """Wakes the worker when a deferred resync becomes due."""


_TICK: Final = _Tick()
Item = Message | Fence | None


class ReplicaStream(ReplicaApplier):
    """Applies one replica's batches to the index in sequence order.

    Args:
        target: the replica.
        writer: the subscriber's index writer (its ``index`` is read here too).
        metrics: the service's metrics.
        replay: the subscriber's replay client.
        settings: the tracker's settings (``resync_cooldown_s``).
    """

    def __init__(
        self,
        target: ReplicaTarget,
        *,
        writer: IndexWriter,
        metrics: TrackerMetrics,
        replay: ReplayClient,
        settings: TrackerSettings,
    ) -> None:
        super().__init__(target, writer=writer, metrics=metrics, replay=replay)
        self._cooldown_s = settings.resync_cooldown_s
        self._silence_s = settings.silence_check_s
        self._unverified_s = settings.unverified_after_s
        self._live_at = self._heard_at  # last live message (or start)
        self._checked_at = self._live_at
        self.silent = False
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.live_high: int | None = None
        self.primed = False
        self._last_resync = -math.inf

    # ----------------------------------------------------------- producer side

    def offer(self, message: Message) -> bool:
        """Queue a live message; ``False`` (and counted) when the queue is full."""
        if self.queue.qsize() >= MAX_QUEUE:
            self._metrics.dropped.inc()
            return False
        self.queue.put_nowait(message)
        return True

    def fence(self, cause: str, *, catch_up: bool = True) -> None:
        self.queue.put_nowait(Fence(cause, catch_up))

    def finish(self) -> None:
        """Ask the worker to stop once the queued messages are applied."""
        self.queue.put_nowait(None)

    def status(self) -> dict[str, Any]:
        return {
            "model": self.namespace.model,
            "block_size": self.namespace.block_size,
            "mode": "connect" if self.target.events else "bind",
            "events": self.target.events,
            "replay": self.target.replay,
            "instance": self.target.instance,
            "synced": self.primed,
            "last_seq": self.last,
            "live_seq": self.live_high,
            "blocks": self.blocks,
            "queued": self.queue.qsize(),
            "resync_blocked": self.resync_blocked,
            "wire_era": None if self.era is None else self.era.value,
            "live_silent": self.silent,
            "unverified": self.unverified,
            "lookahead_tokens": self.lookahead,
        }

    # ----------------------------------------------------------- worker

    async def run(self) -> None:
        """The worker: prime from the index checkpoint, then apply queued items in order."""
        await self._prime()
        while True:
            item = await self._next()
            if item is None:
                return
            if isinstance(item, Fence):
                await self._fence(item)
            elif isinstance(item, Message):
                await self._on_live(item)
            if self._orphaned:
                await self._maybe_resync()
            if self._silence_wait() == 0:
                await self._check_silence()

    async def _next(self) -> Item | _Tick:
        waits = [w for w in (self._resync_wait(), self._silence_wait()) if w is not None]
        wait = min(waits) if waits else None
        if wait is None:
            return await self.queue.get()
        try:
            async with asyncio.timeout(wait):
                return await self.queue.get()
        except TimeoutError:
            return _TICK

    async def _prime(self) -> None:
        delay = 0.1
        while True:
            try:
                self.blocks = await self._index.block_count(self.id, self.namespace)
                checkpoint = await self._index.last_seq(self.id, self.namespace)
                break
            except IndexUnavailableError as exc:
                logger.warning(
                    "index unavailable, retrying", extra={"replica": self.id, "error": str(exc)}
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        self.last = checkpoint
        self._metrics.replica(self.id, blocks=self.blocks, seq=checkpoint)
        if checkpoint is None and self.blocks:
            await self._clear(None)  # blocks of unknown provenance: no checkpoint to resume
        logger.info(
            "replica tracked",
            extra={
                "replica": self.id,
                "model": self.namespace.model,
                "block_size": self.namespace.block_size,
                "checkpoint": checkpoint,
                "blocks": self.blocks,
            },
        )
        if self.target.replay:
            await self._catch_up()
        self.primed = True

    async def _on_live(self, message: Message) -> None:
        self._metrics.messages.labels("live").inc()
        self._live_at = time.monotonic()
        self._heard()
        if self.silent:
            self.silent = False
            self._metrics.live_silent.labels(self.id).set(0)
            logger.info("live events resumed", extra={"replica": self.id, "seq": message.seq})
        if self.last is None:
            await self._start_fresh(message)
        elif message.seq == self.last + 1:
            self._saw_live(message.seq)
            await self._apply(message)
        elif message.seq > self.last + 1:
            await self._recover_gap(message)
        elif (self.live_high is not None and message.seq <= self.live_high) or not (
            self.covered and self.covered[0] <= message.seq <= self.covered[1]
        ):
            await self._reset(message)
        else:
            self._saw_live(message.seq)  # applied already, through a replay

    async def _start_fresh(self, message: Message) -> None:
        self._saw_live(message.seq)
        if message.seq > 0 and self.target.replay:
            fetched = await self._fetch(0, until=message.seq - 1)
            if fetched is not None:
                await self._apply_replayed(fetched.messages, from_zero=True)
        if self.last is None or message.seq > self.last:
            await self._apply(message)

    async def _recover_gap(self, message: Message) -> None:
        assert self.last is not None
        start = self.last + 1
        self._gap(message.seq - start)
        logger.warning(
            "sequence gap",
            extra={"replica": self.id, "last_seq": self.last, "seq": message.seq},
        )
        fetched = await self._fetch(start, until=message.seq - 1)
        self._saw_live(message.seq)
        if fetched is not None and fetched.complete:
            await self._apply_replayed(fetched.messages)
        else:
            logger.warning(
                "unrecoverable gap: clearing replica",
                extra={"replica": self.id, "last_seq": self.last, "seq": message.seq},
            )
            await self._clear("unrecoverable_gap")
            if fetched is not None:
                await self._apply_replayed(fetched.messages)  # continue from what is left
        if self.last is None or message.seq > self.last:
            await self._apply(message)

    async def _reset(self, message: Message) -> None:
        logger.warning(
            "sequence reset: engine restarted",
            extra={
                "replica": self.id,
                "last_seq": self.last,
                "live_seq": self.live_high,
                "seq": message.seq,
            },
        )
        await self._clear("seq_reset")
        self._forget_stream()
        await self._start_fresh(message)

    async def _fence(self, fence: Fence) -> None:
        logger.warning("fencing replica", extra={"replica": self.id, "cause": fence.cause})
        await self._clear(fence.cause)
        self._forget_stream()
        if fence.catch_up and self.target.replay:
            await self._catch_up()

    def _forget_stream(self) -> None:
        self.live_high = None
        self.covered = None
        self.resync_blocked = False

    def _saw_live(self, seq: int) -> None:
        self.live_high = seq if self.live_high is None else max(self.live_high, seq)

    # ----------------------------------------------------------- resync after orphans

    def _resync_wait(self) -> float | None:
        if not self._orphaned or not self.target.replay or self.resync_blocked:
            return None
        return max(0.0, self._last_resync + self._cooldown_s - time.monotonic())

    async def _maybe_resync(self) -> None:
        wait = self._resync_wait()
        if wait is None:
            self._orphaned = False
            return
        if wait > 0:
            return  # _next() wakes the worker when the cooldown is over
        self._last_resync = time.monotonic()
        logger.info(
            "resyncing replica: stored blocks with unknown parents", extra={"replica": self.id}
        )
        fetched = await self._fetch(0)
        if fetched is None:
            return  # retried after the cooldown
        await self._clear("orphan_resync")
        await self._apply_replayed(fetched.messages, from_zero=True)

    # ----------------------------------------------------------- a silent live stream

    def _silence_wait(self) -> float | None:
        """Seconds until the next replay poll for a quiet live stream; None: never."""
        if not self._silence_s or not self.target.replay or not self.primed:
            return None
        every = min(self._silence_s, SILENT_POLL_S) if self.silent else self._silence_s
        due = max(self._live_at, self._checked_at) + every
        return max(0.0, due - time.monotonic())

    async def _check_silence(self) -> None:
        """No live event for a while: did the engine publish anything? Ask its replay.

        Events that only replay has mean the live stream is silent — the classic cause is a
        vLLM whose endpoint is not ``tcp://*:P``: vLLM then *connects* its PUB socket, the
        tracker's SUB connects too, and nothing flows. They are applied (the index stays
        correct, a second behind at most while silent), and it is said loudly, once.
        """
        self._checked_at = time.monotonic()
        if not await self._catch_up():
            # an idle engine (the replay answered with nothing new), or no answer at all
            await self._check_heard()
            return
        self._metrics.silent_polls.labels(self.id).inc()
        if not self.silent:
            self.silent = True
            self._metrics.live_silent.labels(self.id).set(1)
            logger.error(
                "live events are silent: this replica's events arrive only through replay. "
                "A vLLM engine connects its PUB socket for any endpoint but tcp://*:P "
                '(loopback included): give vLLM "endpoint": "tcp://*:P", or give it the '
                "tracker's address and run the tracker with --bind",
                extra={
                    "replica": self.id,
                    "events": self.target.events,
                    "replay": self.target.replay,
                    "seq": self.last,
                },
            )

    async def _check_heard(self) -> None:
        """The backstop for a registered replica whose events stopped: when neither its live
        stream nor its replay has answered for ``unverified_after_s``, nothing vouches for
        the blocks the index lists for it (its engine may have evicted them all since), so
        they are dropped; the replay restores them once it answers again."""
        quiet = time.monotonic() - self._heard_at
        if not self._unverified_s or self.unverified or quiet < self._unverified_s:
            return
        self.unverified = True
        logger.error(
            "replica unverifiable: neither its live events nor its replay answered; its "
            "placements are dropped until it answers",
            extra={
                "replica": self.id,
                "quiet_s": round(quiet, 1),
                "events": self.target.events,
                "replay": self.target.replay,
            },
        )
        await self._clear("unverifiable")
