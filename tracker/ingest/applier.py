"""What one replica's stream applies to the index, and what it has applied so far.

:class:`ReplicaApplier` decodes the replica's batches, live or replayed, and writes them
through the subscriber's :class:`~tracker.ingest.writes.IndexWriter`; it keeps the applied
state (last seq, the range obtained by replay, block count, orphans, wire era, lookahead) that
its :class:`tracker.ingest.streams.ReplicaStream` sequences by.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Final

from tracker.core.blocks import Namespace
from tracker.core.event_codec import NEWEST_ERA, WireEra, decode_batch, wire_era
from tracker.core.events import BlockStored, EventBatch, Message
from tracker.core.index import BlockIndex
from tracker.framework.errors import DecodeError, IndexUnavailableError
from tracker.ingest.metrics import TrackerMetrics
from tracker.ingest.writes import IndexWriter

logger = logging.getLogger(__name__)

_SNIFF_EVERY: Final = 64


class ReplicaApplier:
    """Applies one replica's batches, live or replayed, to the index; keeps what it applied.

    Args:
        replica: the replica's id.
        namespace: the index partition it writes.
        writer: the subscriber's index writer (its ``index`` is read here too).
        metrics: the service's metrics.
    """

    def __init__(
        self,
        replica: str,
        namespace: Namespace,
        *,
        writer: IndexWriter,
        metrics: TrackerMetrics,
    ) -> None:
        self.id = replica
        self.namespace = namespace
        self._index: BlockIndex = writer.index
        self._writer = writer
        self._metrics = metrics
        self.last: int | None = None
        """The last applied sequence number (None: none, or cleared)."""
        self.covered: tuple[int, int] | None = None
        """The sequence range obtained by replay since the stream last started over."""
        self.blocks = 0
        self.orphaned = False
        """Stored blocks arrived with unknown parents: a resync from replay may be due."""
        self.resync_blocked = False
        """A full replay left orphans: resyncing again would only churn the index."""
        self.era: WireEra | None = None
        self.lookahead = 0  # tokens after each block its hash covers (_note_lookahead)
        self._lookahead_written = False  # the first batch says it, 0 too (clears a stale one)
        self._applied = 0

    async def resume(self) -> int | None:
        """Continue from the index's checkpoint, retrying while the index is unavailable;
        blocks held without a checkpoint (unknown provenance) are cleared. Returns the
        checkpoint."""
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
            await self.clear(None)  # blocks of unknown provenance: no checkpoint to resume
        return checkpoint

    def gap(self, missing: int) -> None:
        """Count ``missing`` events of the replica that will never be applied."""
        self._metrics.gaps.labels(self.id).inc()
        self._metrics.missed.inc(max(missing, 0))

    async def apply_replayed(self, messages: list[Message], *, from_zero: bool = False) -> None:
        """Apply a replay's run of batches, skipping those already applied; ``from_zero``:
        the run is everything the publisher still buffers."""
        for message in messages:
            if self.last is not None:
                if message.seq <= self.last:
                    continue
                if message.seq > self.last + 1:  # a batch the publisher never buffered
                    self.gap(message.seq - self.last - 1)
            await self.apply(message)
        if messages:
            low, high = messages[0].seq, messages[-1].seq
            if self.covered is not None:
                low, high = min(low, self.covered[0]), max(high, self.covered[1])
            self.covered = (low, high)
        if from_zero and self.orphaned:
            # Everything the publisher still has was applied; parents older than its
            # buffer cannot be recovered, so resyncing again would only churn the index.
            logger.info("orphans remain after a full replay", extra={"replica": self.id})
            self.resync_blocked = True
            self.orphaned = False

    async def apply(self, message: Message) -> None:
        """Apply one batch; a malformed one is counted and skipped, but still advances
        :attr:`last`."""
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
            self.orphaned = True
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

    def start_over(self) -> None:
        """Forget the replayed range and a blocked resync: the replica's stream starts over
        (an engine restart, a fence)."""
        self.covered = None
        self.resync_blocked = False

    async def clear(self, cause: str | None) -> None:
        """Clear the replica's blocks (``cause`` labels the reset; None: not counted)."""
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
        self.orphaned = False
        self._metrics.replica(self.id, blocks=0)
