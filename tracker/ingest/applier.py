"""What one replica's stream applies to the index, and what it has applied so far.

:class:`ReplicaApplier` is the index side of :class:`tracker.ingest.streams.ReplicaStream`:
it decodes a batch and writes it through the subscriber's :class:`IndexWriter`, fetches
replays and applies their runs of batches (skipping those already applied, counting the ones
the publisher never buffered), catches up from the checkpoint, clears the replica's blocks,
and notes the replica's wire era and lookahead hashing on the way. It holds the replica's
applied state: the last applied seq, the seq range obtained by replay, the block count,
whether orphans await a resync, and when the replica last answered.
"""

from __future__ import annotations

import logging
import time
from typing import Final

from tracker.core.blocks import Namespace
from tracker.core.event_codec import NEWEST_ERA, WireEra, decode_batch, wire_era
from tracker.core.events import BlockStored, EventBatch, Message
from tracker.core.index import BlockIndex
from tracker.framework.errors import DecodeError, IndexUnavailableError
from tracker.ingest.metrics import TrackerMetrics
from tracker.ingest.replay import ReplayClient, ReplayResult
from tracker.ingest.targets import ReplicaTarget
from tracker.ingest.writes import IndexWriter

logger = logging.getLogger(__name__)

_SNIFF_EVERY: Final = 64


class ReplicaApplier:
    """Applies one replica's batches, live or replayed, to the index; keeps what it applied.

    Args:
        target: the replica.
        writer: the subscriber's index writer (its ``index`` is read here too).
        metrics: the service's metrics.
        replay: the subscriber's replay client.
    """

    def __init__(
        self,
        target: ReplicaTarget,
        *,
        writer: IndexWriter,
        metrics: TrackerMetrics,
        replay: ReplayClient,
    ) -> None:
        self.target = target
        self._index: BlockIndex = writer.index
        self._writer = writer
        self._metrics = metrics
        self._replay = replay
        self._heard_at = time.monotonic()  # last live message or replay answer (or start)
        self.unverified = False
        self.last: int | None = None
        self.covered: tuple[int, int] | None = None
        self.blocks = 0
        self.resync_blocked = False
        self._orphaned = False
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

    def _gap(self, missing: int) -> None:
        self._metrics.gaps.labels(self.id).inc()
        self._metrics.missed.inc(max(missing, 0))

    def _heard(self) -> None:
        self._heard_at = time.monotonic()
        if self.unverified:
            self.unverified = False
            logger.info("replica answers again", extra={"replica": self.id})

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
