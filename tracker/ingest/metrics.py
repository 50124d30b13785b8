"""Prometheus metrics of the tracker, registered on a ``CollectorRegistry`` the caller owns."""

from __future__ import annotations

import contextlib
from collections import Counter as Tally
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tracker.core.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

RESET_CAUSES: Final = (
    "seq_reset",
    "instance_change",
    "unrecoverable_gap",
    "orphan_resync",
    "expired",
    "unverifiable",
)
"""Why a replica's blocks were dropped from the index (label ``cause``)."""

REPLAY_OUTCOMES: Final = ("ok", "overrun", "timeout", "error", "no_endpoint")
"""How a replay request ended (label ``outcome``)."""

_APPLY_BUCKETS: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def _event_type(event: object) -> str:
    if isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared):
        return type(event).__name__
    return "unknown"


class TrackerMetrics:
    """Every metric of ``kvrouter tracker``; nothing is registered on the default registry.

    Args:
        registry: where the metrics are registered (one per service, fresh in each test).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.events = Counter(
            "kvrouter_tracker_events_total",
            "KV events applied to the index, by event type",
            ["type"],
            registry=registry,
        )
        self.blocks_stored = Counter(
            "kvrouter_tracker_blocks_stored_total",
            "Block hashes announced by applied BlockStored events",
            registry=registry,
        )
        self.blocks_removed = Counter(
            "kvrouter_tracker_blocks_removed_total",
            "Block hashes announced by applied BlockRemoved events",
            registry=registry,
        )
        self.messages = Counter(
            "kvrouter_tracker_messages_total",
            "Event batches received, by source (live stream or replay)",
            ["source"],
            registry=registry,
        )
        self.decode_errors = Counter(
            "kvrouter_tracker_decode_errors_total",
            "Frames or payloads that could not be decoded and were skipped, by reason",
            ["reason"],
            registry=registry,
        )
        self.gaps = Counter(
            "kvrouter_tracker_gaps_total",
            "Sequence gaps detected on a replica's stream",
            ["replica"],
            registry=registry,
        )
        self.missed = Counter(
            "kvrouter_tracker_gap_batches_total",
            "Batches missing from the live stream when gaps were detected",
            registry=registry,
        )
        self.replays = Counter(
            "kvrouter_tracker_replays_total",
            "Replay requests to publishers' ROUTER sockets, by outcome",
            ["outcome"],
            registry=registry,
        )
        self.resets = Counter(
            "kvrouter_tracker_resets_total",
            "Times a replica's blocks were cleared to fence stale state, by cause",
            ["cause"],
            registry=registry,
        )
        self.orphans = Counter(
            "kvrouter_tracker_orphan_blocks_total",
            "Stored blocks whose parent chain was unknown (missed events)",
            registry=registry,
        )
        self.dropped = Counter(
            "kvrouter_tracker_dropped_messages_total",
            "Live messages dropped because a replica's queue was full",
            registry=registry,
        )
        self.index_failures = Counter(
            "kvrouter_tracker_index_write_failures_total",
            "Index writes that failed (kept pending and retried), by operation",
            ["op"],
            registry=registry,
        )
        self.index_restores = Counter(
            "kvrouter_tracker_index_restores_total",
            "Replicas whose state Redis lost or holds older (restart, failover), written back",
            registry=registry,
        )
        self.ledger_stats = Counter(
            "kvrouter_tracker_ledger_stats_total",
            "What the replica ledgers did with applied events, by statistic",
            ["stat"],
            registry=registry,
        )
        self.apply_seconds = Histogram(
            "kvrouter_tracker_apply_seconds",
            "Time to apply one batch to the index",
            buckets=_APPLY_BUCKETS,
            registry=registry,
        )
        self.replica_blocks = Gauge(
            "kvrouter_tracker_replica_blocks",
            "Distinct blocks each replica holds, as the tracker last saw it",
            ["replica"],
            registry=registry,
        )
        self.replica_seq = Gauge(
            "kvrouter_tracker_replica_last_seq",
            "Last sequence number applied per replica",
            ["replica"],
            registry=registry,
        )
        self.live_silent = Gauge(
            "kvrouter_tracker_replica_live_silent",
            "1 while a replica's events reach the tracker only by polling its replay (its live "
            "stream is silent: e.g. vLLM connects its PUB socket unless the endpoint is tcp://*)",
            ["replica"],
            registry=registry,
        )
        self.silent_polls = Counter(
            "kvrouter_tracker_silent_polls_total",
            "Replay polls that found events the replica's live stream had not delivered",
            ["replica"],
            registry=registry,
        )
        self.replicas = Gauge(
            "kvrouter_tracker_replicas",
            "Replicas currently tracked",
            registry=registry,
        )
        self.redis_memory = Gauge(
            "kvrouter_tracker_redis_memory_used_bytes",
            "Redis used_memory at the last check (the index, on a Redis dedicated to kvrouter)",
            registry=registry,
        )
        self.memory_budget = Gauge(
            "kvrouter_tracker_redis_memory_budget_bytes",
            "The index's configured Redis memory budget (0: none)",
            registry=registry,
        )
        self.active = Gauge(
            "kvrouter_tracker_active",
            "1 while this tracker applies events (it won the election, or there is none); "
            "0 on standby",
            registry=registry,
        )
        self.elections_won = Counter(
            "kvrouter_tracker_elections_won_total",
            "Times this tracker won the tracker election and became the active one",
            registry=registry,
        )
        self.evicting_policy = Gauge(
            "kvrouter_tracker_redis_evicting_policy",
            "1 while Redis's maxmemory-policy would evict index keys (allkeys-*)",
            registry=registry,
        )
        for cause in RESET_CAUSES:
            self.resets.labels(cause)
        for outcome in REPLAY_OUTCOMES:
            self.replays.labels(outcome)

    def batch(self, batch: EventBatch) -> None:
        """Count the events of an applied batch."""
        types: Tally[str] = Tally()
        stored = removed = 0
        for event in batch.events:
            types[_event_type(event)] += 1
            if isinstance(event, BlockStored):
                stored += len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                removed += len(event.block_hashes)
        for name, count in types.items():
            self.events.labels(name).inc(count)
        if stored:
            self.blocks_stored.inc(stored)
        if removed:
            self.blocks_removed.inc(removed)

    def ledger(self, stats: Tally[str]) -> None:
        """Count what the ledger reported for one batch."""
        for stat, count in stats.items():
            if count:
                self.ledger_stats.labels(stat).inc(count)
        if stats.get("orphan"):
            self.orphans.inc(stats["orphan"])

    def replica(self, replica: str, *, blocks: int | None = None, seq: int | None = None) -> None:
        """Update a replica's gauges."""
        if blocks is not None:
            self.replica_blocks.labels(replica).set(blocks)
        if seq is not None:
            self.replica_seq.labels(replica).set(seq)

    def forget(self, replica: str) -> None:
        """Drop the per-replica series of a replica no longer tracked."""
        for metric in (
            self.replica_blocks,
            self.replica_seq,
            self.gaps,
            self.live_silent,
            self.silent_polls,
        ):
            with contextlib.suppress(KeyError):
                metric.remove(replica)
