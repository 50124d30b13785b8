"""The tracker inside another process: the entry point of a router that keeps its own index.

A router without a shared index (no ``--redis``, or ``--local-index``) consumes the engines'
KV events itself, into its in-process :class:`~tracker.core.memory_index.MemoryIndex`.
:func:`start_embedded` starts that consumer over the router's index and metrics registry;
what it returns is all the host needs afterwards: :meth:`EmbeddedTracker.stop`.
"""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CollectorRegistry

from tracker.core.index import BlockIndex
from tracker.ingest.config import TrackerSettings
from tracker.ingest.service import TrackerService


class EmbeddedTracker(Protocol):
    """A running embedded tracker."""

    async def stop(self) -> None:
        """Stop consuming events; the index stays open (its owner closes it)."""


async def start_embedded(
    settings: TrackerSettings, index: BlockIndex, registry: CollectorRegistry
) -> EmbeddedTracker:
    """Consume the events of ``settings.replica`` (and the registry's replicas, when the
    settings name one) into ``index``, with the tracker's metrics in ``registry``.

    :raises Exception: whatever made the start fail, after undoing what had started.
    """
    tracker = TrackerService(settings, index, registry)
    try:
        await tracker.start()
    except BaseException:
        await tracker.stop()
        raise
    return tracker
