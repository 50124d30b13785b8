"""The replicas a tracker consumes: :class:`ReplicaTarget`, from a ``--replica`` flag or a
registry record."""

from __future__ import annotations

from dataclasses import dataclass

from tracker.core.blocks import Namespace


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
