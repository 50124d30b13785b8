"""The tracker's side of the replica registry, one pass at a time.

A pass reaps the records whose heartbeat stopped (their blocks are cleared: a replica given
with ``--replica`` keeps being tracked, a discovered one is forgotten), and with
``--discover`` tracks the registered replicas: new ones are adopted, those whose
``instance`` changed (a restarted engine) are fenced, and those missing from the registry
for their ``ttl_s`` are forgotten. Each pass first has the subscriber's writer write back
what a Redis that restarted empty lost.
"""

from __future__ import annotations

import logging
import time

import zmq

from tracker.core.index import BlockIndex, ReplicaRecord
from tracker.ingest.config import TrackerSettings
from tracker.ingest.metrics import TrackerMetrics
from tracker.ingest.streams import ReplicaTarget
from tracker.ingest.subscriber import Subscriber

logger = logging.getLogger(__name__)


class RegistrySync:
    """Keeps the subscriber's streams in step with the replica registry.

    Args:
        settings: the tracker's settings (``discover``, ``bind``).
        index: the block index, which holds the registry.
        subscriber: the service's subscriber, whose streams are started, fenced and stopped.
        metrics: the service's metrics.
        static: the replicas given with ``--replica``, by id (never forgotten).
    """

    def __init__(
        self,
        settings: TrackerSettings,
        index: BlockIndex,
        subscriber: Subscriber,
        metrics: TrackerMetrics,
        static: dict[str, ReplicaTarget],
    ) -> None:
        self.settings = settings
        self.index = index
        self.subscriber = subscriber
        self.metrics = metrics
        self._static = static
        self._discovered: dict[str, ReplicaTarget] = {}
        self._instances: dict[str, str] = {}
        self._ttls: dict[str, float] = {}
        self._missing: dict[str, float] = {}  # discovered replica -> first seen missing
        self._rejected: dict[str, ReplicaTarget | None] = {}

    async def sync(self) -> None:
        """One pass: expired records, then (with ``--discover``) the registered replicas."""
        # a Redis that restarted empty: idle replicas would stay out of the index otherwise
        await self.subscriber.writer.restore_lost()
        for record in await self.index.reap():
            await self._expire(record)
        if self.settings.discover:
            await self._reconcile(await self.index.replicas())

    async def _expire(self, record: ReplicaRecord) -> None:
        logger.warning("replica expired", extra={"replica": record.id})
        self._instances.pop(record.id, None)
        self._ttls.pop(record.id, None)
        self._missing.pop(record.id, None)
        if record.id in self._static:
            # Still configured: drop what it held; its stream resyncs when it speaks again.
            self.subscriber.fence(record.id, "expired", catch_up=False)
            return
        target = self._discovered.pop(record.id, None)
        namespace = target.namespace if target is not None else record.namespace
        self.metrics.resets.labels("expired").inc()  # counted before it shows, never after
        held = await self.subscriber.forget(record.id, namespace)
        logger.info("expired replica forgotten", extra={"replica": record.id, "blocks": held})

    async def _reconcile(self, records: list[ReplicaRecord]) -> None:
        seen: set[str] = set()
        for record in records:
            seen.add(record.id)
            self._ttls[record.id] = record.ttl_s
            self._missing.pop(record.id, None)
            previous = self._instances.get(record.id)
            self._instances[record.id] = record.instance
            restarted = bool(previous is not None and previous != record.instance)
            if record.id in self._static:
                if restarted:
                    self.subscriber.fence(record.id, "instance_change")
                continue
            await self._adopt(record, restarted)
        for replica in [r for r in self._rejected if r not in seen]:
            del self._rejected[replica]
        now = time.monotonic()
        for replica in [r for r in self._discovered if r not in seen]:
            # Deregistered, or gone with a Redis that restarted empty and is refilled by the
            # next heartbeats: forgetting at once would throw away what a replay may not
            # bring back (vLLM buffers 10k batches), so only a record missing for its ttl is.
            since = self._missing.setdefault(replica, now)
            if now - since < self._ttls.get(replica, 0.0):
                continue
            del self._missing[replica]
            self._ttls.pop(replica, None)
            target = self._discovered.pop(replica)
            self._instances.pop(replica, None)
            held = await self.subscriber.forget(replica, target.namespace)
            logger.info("replica deregistered", extra={"replica": replica, "blocks": held})

    async def _adopt(self, record: ReplicaRecord, restarted: bool) -> None:
        if record.block_size <= 0:
            self._reject(record.id, None, "invalid block size")
            return
        target = ReplicaTarget(
            record.id, record.namespace, record.events, record.replay, record.instance
        )
        if self._rejected.get(record.id) == target:
            return  # already reported
        if target.events is None and not self.settings.bind:
            self._reject(record.id, target, "no events endpoint and --bind is not set")
            return
        stream = self.subscriber.get(record.id)
        if stream is not None and (stream.target.events, stream.namespace) != (
            target.events,
            target.namespace,
        ):
            if stream.namespace != target.namespace:
                await self.subscriber.forget(record.id, stream.namespace)
            else:
                await self.subscriber.untrack(record.id)
            stream = None
        try:
            self.subscriber.track(target)
        except zmq.ZMQError as exc:
            self._reject(record.id, target, str(exc))
            return
        self._rejected.pop(record.id, None)
        if stream is None:
            logger.info(
                "replica discovered",
                extra={"replica": record.id, "events": record.events, "replay": record.replay},
            )
        self._discovered[record.id] = target
        if restarted:
            self.subscriber.fence(record.id, "instance_change")

    def _reject(self, replica: str, target: ReplicaTarget | None, reason: str) -> None:
        if replica not in self._rejected or self._rejected[replica] != target:
            logger.warning(
                "cannot track registered replica", extra={"replica": replica, "reason": reason}
            )
        self._rejected[replica] = target
