"""One try of a placement on one replica, from its commit to its end."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from router.decide.placement import Placement
from router.decide.policy_types import Score
from router.decide.reuse import Booking
from router.shared.load import Lease


@dataclass(slots=True, eq=False)
class Attempt:
    """What :meth:`router.decide.decider.Decider.commit` booked for one try, so that
    :meth:`~router.decide.decider.Decider.finish` (or ``fail``) can close it exactly once.

    :param replica: the replica actually tried (the chosen one, or the next-best after a
        failure).
    :param score: that replica's score in the placement.
    :param lease: its share of the replica's load.
    :param booking: the chain booked as reused there (taken back if the try fails).
    :param timer: for an answer that is not streamed, when its prefill is taken as done.
    """

    placement: Placement
    replica: str
    score: Score
    lease: Lease
    booking: Booking | None = None
    timer: asyncio.TimerHandle | None = None
    dispatched: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    done: bool = False
