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
skipped. A malformed batch is counted and skipped but still advances ``last``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Final

from tracker.core.blocks import Namespace
from tracker.core.events import (
    NEWEST_ERA,
    BlockStored,
    EventBatch,
    Message,
    WireEra,
    decode_batch,
    wire_era,
)
from tracker.core.index import BlockIndex
from tracker.framework.errors import DecodeError, IndexUnavailableError
from tracker.ingest.config import TrackerSettings
from tracker.ingest.metrics import TrackerMetrics
from tracker.ingest.replay import ReplayClient, ReplayResult
from tracker.ingest.writes import IndexWriter

logger = logging.getLogger(__name__)

MAX_QUEUE: Final = 100_000
"""Live messages a replica may have waiting; beyond, they are dropped (and later replayed)."""


_SNIFF_EVERY: Final = 64
SILENT_POLL_S: Final = 1.0  # replay poll interval while a live stream is silent


@dataclass(frozen=True, slots=True)
class ReplicaTarget:
    """A replica to consume: where its events come from and what it serves.

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
        self.target = target
        self._index: BlockIndex = writer.index
        self._writer = writer
        self._metrics = metrics
        self._replay = replay
        self._cooldown_s = settings.resync_cooldown_s
        self._silence_s = settings.silence_check_s
        self._unverified_s = settings.unverified_after_s
        self._live_at = time.monotonic()  # last live message (or start)
        self._checked_at = self._live_at
        self._heard_at = self._live_at  # last live message or replay answer (or start)
        self.silent = False
        self.unverified = False
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.last: int | None = None
        self.live_high: int | None = None
        self.covered: tuple[int, int] | None = None
        self.blocks = 0
        self.primed = False
        self.resync_blocked = False
        self._orphaned = False
        self._last_resync = -math.inf
        self.era: WireEra | None = None
        self.lookahead = 0  # tokens after each block its hash covers (_note_lookahead)
        self._lookahead_written = False  # the first batch says it, 0 too (clears a stale one)
        self._applied = 0

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

    async def _catch_up(self) -> bool:
        """Replay what was missed while nobody listened (tracker restart, fence, a silent
        live stream); whether the replay had any batch past the checkpoint."""
        start = 0 if self.last is None else self.last + 1
        fetched = await self._fetch(start)
        if fetched is None:
            return False  # best effort: the first live message takes the regular path
        messages = fetched.messages
        if not fetched.complete and self.last is not None:
            self._gap(messages[0].seq - start)
            logger.warning(
                "events since the checkpoint are gone",
                extra={"replica": self.id, "checkpoint": self.last, "first": messages[0].seq},
            )
            await self._clear("unrecoverable_gap")
        await self._apply_replayed(messages, from_zero=start == 0)
        return bool(messages)

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

    def _gap(self, missing: int) -> None:
        self._metrics.gaps.labels(self.id).inc()
        self._metrics.missed.inc(max(missing, 0))

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

    def _heard(self) -> None:
        self._heard_at = time.monotonic()
        if self.unverified:
            self.unverified = False
            logger.info("replica answers again", extra={"replica": self.id})

    # ----------------------------------------------------------- index operations

    async def _fetch(self, start: int, until: int | None = None) -> ReplayResult | None:
        """Replay from ``start`` (needing everything up to ``until``); ``None`` if none came."""
        if not self.target.replay:
            self._metrics.replays.labels("no_endpoint").inc()
            return None
        result = await self._replay.fetch(self.id, self.target.replay, start, until)
        if result.received:
            self._heard()
        return result if result.received else None

    async def _apply_replayed(self, messages: list[Message], *, from_zero: bool = False) -> None:
        for message in messages:
            if self.last is not None:
                if message.seq <= self.last:
                    continue
                if message.seq > self.last + 1:  # a batch the publisher never buffered
                    self._gap(message.seq - self.last - 1)
            await self._apply(message)
        if messages:
            low, high = messages[0].seq, messages[-1].seq
            if self.covered is not None:
                low, high = min(low, self.covered[0]), max(high, self.covered[1])
            self.covered = (low, high)
        if from_zero and self._orphaned:
            # Everything the publisher still has was applied; parents older than its
            # buffer cannot be recovered, so resyncing again would only churn the index.
            logger.info("orphans remain after a full replay", extra={"replica": self.id})
            self.resync_blocked = True
            self._orphaned = False

    async def _apply(self, message: Message) -> None:
        try:
            batch = decode_batch(message.payload)
        except DecodeError as exc:
            self._metrics.decode_errors.labels(exc.reason).inc()
            logger.warning(
                "skipping malformed batch",
                extra={
                    "replica": self.id,
                    "seq": message.seq,
                    "reason": exc.reason,
                    "detail": str(exc),
                },
            )
            self._advance(message.seq)
            return
        self._sniff(message.payload)
        await self._note_lookahead(batch)
        started = time.perf_counter()
        result = await self._writer.apply(self.id, self.namespace, batch, message.seq)
        self._metrics.batch(batch)
        if result is None:  # index unavailable: the ledger absorbed it, the write is pending
            self._advance(message.seq)
            return
        self._metrics.apply_seconds.observe(time.perf_counter() - started)
        self._metrics.ledger(result.stats)
        if result.cleared:
            self.resync_blocked = False  # the engine starts over: new orphans are news
        if result.stats.get("orphan"):
            self._orphaned = True
        self.blocks = result.blocks
        self._advance(message.seq)

    def _sniff(self, payload: bytes) -> None:
        """Learn the replica's wire era (a lower bound, for operators): its first 64 batches,
        then every 64th."""
        self._applied += 1
        if self.era is NEWEST_ERA or (
            self._applied > _SNIFF_EVERY and self._applied % _SNIFF_EVERY
        ):
            return
        era = wire_era(payload)
        if era is not None and (self.era is None or not self.era.at_least(era)):
            self.era = era
            logger.info("replica wire era", extra={"replica": self.id, "era": era.value})

    async def _note_lookahead(self, batch: EventBatch) -> None:
        """How many tokens after each block the engine folds into its hash (vLLM 0.33's
        lookahead hashing): the routers hash prompts the same way, learning it from the
        index (:meth:`BlockIndex.set_lookahead`); said once per change, and in ``/health``.
        A write the index refused is tried again with the next batch."""
        for event in batch.events:
            if not isinstance(event, BlockStored) or not event.token_ids:
                continue
            lists = event.lookahead_token_ids
            width = len(lists[0] or ()) if lists else 0
            if width != self.lookahead:
                self.lookahead = width
                self._lookahead_written = False
                logger.info(
                    "replica's lookahead hashing changed",
                    extra={"replica": self.id, "lookahead_tokens": width},
                )
            break
        if not self._lookahead_written:
            try:
                await self._index.set_lookahead(self.id, self.namespace, self.lookahead)
            except IndexUnavailableError:
                return
            self._lookahead_written = True

    def _advance(self, seq: int) -> None:
        self.last = seq
        self._metrics.replica(self.id, blocks=self.blocks, seq=seq)

    async def _clear(self, cause: str | None) -> None:
        held = await self._writer.clear(self.id, self.namespace)
        if cause is not None:
            self._metrics.resets.labels(cause).inc()
        logger.warning(
            "replica blocks cleared",
            extra={
                "replica": self.id,
                "cause": cause,
                "blocks": self.blocks if held is None else held,
            },
        )
        self.last = None
        self.blocks = 0
        self._orphaned = False
        self._metrics.replica(self.id, blocks=0)
