"""The replicas a tracker consumes: :class:`ReplicaTarget`, from a ``--replica`` flag
(:func:`static_targets`) or a registry record."""

from __future__ import annotations

from dataclasses import dataclass

from tracker.core.blocks import Namespace
from tracker.ingest.config import TrackerSettings


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


def static_targets(settings: TrackerSettings) -> list[ReplicaTarget]:
    """The replicas given with ``--replica``, in the settings' namespace unless overridden."""
    return [
        ReplicaTarget(
            spec.id,
            Namespace(spec.model or settings.model, spec.block_size or settings.block_size),
            spec.events,
            spec.replay,
        )
        for spec in settings.replica_specs
    ]
