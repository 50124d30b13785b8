"""One replica's event stream: sequence tracking, gap replay, restart fencing, orphan resync.

The subscriber queues a replica's live messages; the stream's worker applies them strictly
in sequence order (:meth:`ReplicaStream._on_live` decides each), through the stream's
:class:`~tracker.ingest.applier.ReplicaApplier`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Final

from tracker.core.blocks import Namespace
from tracker.core.events import Message
from tracker.ingest.applier import ReplicaApplier
from tracker.ingest.config import TrackerSettings
from tracker.ingest.metrics import TrackerMetrics
from tracker.ingest.replay import ReplayClient, ReplayResult
from tracker.ingest.writes import IndexWriter

logger = logging.getLogger(__name__)

MAX_QUEUE: Final = 100_000
"""Live messages a replica may have waiting; beyond, they are dropped (and later replayed)."""


SILENT_POLL_S: Final = 1.0  # replay poll interval while a live stream is silent


@dataclass(frozen=True, slots=True)
class ReplicaTarget:
    """A replica to consume: where its events come from and what it serves; from a
    ``--replica`` flag (:func:`tracker.ingest.service.static_targets`) or a registry record.

    ``events`` is ``None`` for replicas that publish into the tracker's bound socket.
    """

    id: str
    namespace: Namespace
    events: str | None = None
    replay: str | None = None
    instance: str = ""


@dataclass(frozen=True, slots=True)
class Fence:
    """Clear the replica's blocks in stream order (registry fencing); ``cause`` labels it."""

    cause: str
    catch_up: bool = True


class _Tick:
    """Wakes the worker when a deferred resync becomes due."""


_TICK: Final = _Tick()
Item = Message | Fence | None


class ReplicaStream:
    """Applies one replica's batches to the index in sequence order, through its
    :attr:`applier`.

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
        self.target = target
        self.applier = ReplicaApplier(target.id, target.namespace, writer=writer, metrics=metrics)
        self._metrics = metrics
        self._replay = replay
        self._cooldown_s = settings.resync_cooldown_s
        self._silence_s = settings.silence_check_s
        self._unverified_s = settings.unverified_after_s
        self._heard_at = time.monotonic()  # last live message or replay answer (or start)
        self._live_at = self._heard_at  # last live message (or start)
        self._checked_at = self._live_at
        self.silent = False
        self.unverified = False
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.live_high: int | None = None
        self.primed = False
        self._last_resync = -math.inf

    @property
    def id(self) -> str:
        return self.target.id

    @property
    def namespace(self) -> Namespace:
        return self.target.namespace

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
        applied = self.applier
        return {
            "model": self.namespace.model,
            "block_size": self.namespace.block_size,
            "mode": "connect" if self.target.events else "bind",
            "events": self.target.events,
            "replay": self.target.replay,
            "instance": self.target.instance,
            "synced": self.primed,
            "last_seq": applied.last,
            "live_seq": self.live_high,
            "blocks": applied.blocks,
            "queued": self.queue.qsize(),
            "resync_blocked": applied.resync_blocked,
            "wire_era": None if applied.era is None else applied.era.value,
            "live_silent": self.silent,
            "unverified": self.unverified,
            "lookahead_tokens": applied.lookahead,
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
            if self.applier.orphaned:
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
        checkpoint = await self.applier.resume()
        logger.info(
            "replica tracked",
            extra={
                "replica": self.id,
                "model": self.namespace.model,
                "block_size": self.namespace.block_size,
                "checkpoint": checkpoint,
                "blocks": self.applier.blocks,
            },
        )
        if self.target.replay:
            await self._catch_up()
        self.primed = True

    # ----------------------------------------------------------- sequencing

    async def _on_live(self, message: Message) -> None:
        """Apply a live message ``m`` in sequence, by ``last`` (last applied seq),
        ``live_high`` (highest seq seen live) and ``covered`` (the seq range obtained by
        replay):

        =====================================  ===========================================
        ``last`` unknown (fresh or reset)      replay from 0 first if ``m.seq > 0``, then
                                               apply
        ``m.seq == last + 1``                  apply
        ``m.seq > last + 1``                   gap: replay from ``last + 1``; incomplete
                                               replay or none -> clear, continue from
                                               what is available
        ``m.seq <= last``, inside ``covered``  already applied through a replay: skip
        and above ``live_high``
        ``m.seq <= last`` otherwise            sequence reset (engine restart): clear,
                                               start over
        =====================================  ===========================================

        While a replay runs, live messages keep queueing; afterwards those already covered
        are skipped.
        """
        self._metrics.messages.labels("live").inc()
        self._live_at = time.monotonic()
        self._heard()
        if self.silent:
            self.silent = False
            self._metrics.live_silent.labels(self.id).set(0)
            logger.info("live events resumed", extra={"replica": self.id, "seq": message.seq})
        last, covered = self.applier.last, self.applier.covered
        if last is None:
            await self._start_fresh(message)
        elif message.seq == last + 1:
            self._saw_live(message.seq)
            await self.applier.apply(message)
        elif message.seq > last + 1:
            await self._recover_gap(message)
        elif (self.live_high is not None and message.seq <= self.live_high) or not (
            covered and covered[0] <= message.seq <= covered[1]
        ):
            await self._reset(message)
        else:
            self._saw_live(message.seq)  # applied already, through a replay

    async def _start_fresh(self, message: Message) -> None:
        self._saw_live(message.seq)
        if message.seq > 0 and self.target.replay:
            fetched = await self._fetch(0, until=message.seq - 1)
            if fetched is not None:
                await self.applier.apply_replayed(fetched.messages, from_zero=True)
        if self.applier.last is None or message.seq > self.applier.last:
            await self.applier.apply(message)

    async def _recover_gap(self, message: Message) -> None:
        assert self.applier.last is not None
        start = self.applier.last + 1
        self.applier.gap(message.seq - start)
        logger.warning(
            "sequence gap",
            extra={"replica": self.id, "last_seq": self.applier.last, "seq": message.seq},
        )
        fetched = await self._fetch(start, until=message.seq - 1)
        self._saw_live(message.seq)
        if fetched is not None and fetched.complete:
            await self.applier.apply_replayed(fetched.messages)
        else:
            logger.warning(
                "unrecoverable gap: clearing replica",
                extra={"replica": self.id, "last_seq": self.applier.last, "seq": message.seq},
            )
            await self.applier.clear("unrecoverable_gap")
            if fetched is not None:
                await self.applier.apply_replayed(fetched.messages)  # continue from what is left
        if self.applier.last is None or message.seq > self.applier.last:
            await self.applier.apply(message)

    async def _reset(self, message: Message) -> None:
        logger.warning(
            "sequence reset: engine restarted",
            extra={
                "replica": self.id,
                "last_seq": self.applier.last,
                "live_seq": self.live_high,
                "seq": message.seq,
            },
        )
        await self.applier.clear("seq_reset")
        self._forget_stream()
        await self._start_fresh(message)

    async def _fence(self, fence: Fence) -> None:
        logger.warning("fencing replica", extra={"replica": self.id, "cause": fence.cause})
        await self.applier.clear(fence.cause)
        self._forget_stream()
        if fence.catch_up and self.target.replay:
            await self._catch_up()

    def _forget_stream(self) -> None:
        self.live_high = None
        self.applier.start_over()

    def _saw_live(self, seq: int) -> None:
        self.live_high = seq if self.live_high is None else max(self.live_high, seq)

    # ----------------------------------------------------------- replay

    async def _catch_up(self) -> bool:
        """Replay what was missed while nobody listened (tracker restart, fence, a silent
        live stream); whether the replay had any batch past the checkpoint."""
        last = self.applier.last
        start = 0 if last is None else last + 1
        fetched = await self._fetch(start)
        if fetched is None:
            return False  # best effort: the first live message takes the regular path
        messages = fetched.messages
        if not fetched.complete and last is not None:
            self.applier.gap(messages[0].seq - start)
            logger.warning(
                "events since the checkpoint are gone",
                extra={"replica": self.id, "checkpoint": last, "first": messages[0].seq},
            )
            await self.applier.clear("unrecoverable_gap")
        await self.applier.apply_replayed(messages, from_zero=start == 0)
        return bool(messages)

    async def _fetch(self, start: int, until: int | None = None) -> ReplayResult | None:
        """Replay from ``start`` (needing everything up to ``until``); ``None`` if none came."""
        if not self.target.replay:
            self._metrics.replays.labels("no_endpoint").inc()
            return None
        result = await self._replay.fetch(self.id, self.target.replay, start, until)
        if result.received:
            self._heard()
        return result if result.received else None

    def _heard(self) -> None:
        self._heard_at = time.monotonic()
        if self.unverified:
            self.unverified = False
            logger.info("replica answers again", extra={"replica": self.id})

    # ----------------------------------------------------------- resync after orphans

    def _resync_wait(self) -> float | None:
        applied = self.applier
        if not applied.orphaned or not self.target.replay or applied.resync_blocked:
            return None
        return max(0.0, self._last_resync + self._cooldown_s - time.monotonic())

    async def _maybe_resync(self) -> None:
        wait = self._resync_wait()
        if wait is None:
            self.applier.orphaned = False
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
        await self.applier.clear("orphan_resync")
        await self.applier.apply_replayed(fetched.messages, from_zero=True)

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
                    "seq": self.applier.last,
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
        await self.applier.clear("unverifiable")
