"""Cache-blind baselines, for the benchmark: round-robin and least-load.

``round-robin``
    The next healthy replica in id order.
``least-load``
    Fewest requests in flight, summed over every router (the shared load board); ties at
    random.
"""

from __future__ import annotations

import random

from router.baselines.baseline import (
    Baseline,
    BaselineSettings,
    Choice,
    Tools,
    baseline_score,
    best,
)
from router.decide.policy_types import Decision


class RoundRobin(Baseline):
    """The next healthy replica in id order."""

    name = "round-robin"

    def __init__(self, settings: BaselineSettings, tools: Tools, rng: random.Random) -> None:
        super().__init__(settings, tools, rng)
        self._next = 0

    async def choose(self, choice: Choice, stages: dict[str, float]) -> tuple[Decision, int]:
        picked = choice.candidates[self._next % len(choice.candidates)].id
        self._next += 1
        scores = tuple(baseline_score(r.id, float(r.id == picked)) for r in choice.candidates)
        return Decision(picked, scores, self.name), 0


class LeastLoad(Baseline):
    """Fewest requests in flight over every router; ties at random."""

    name = "least-load"

    async def choose(self, choice: Choice, stages: dict[str, float]) -> tuple[Decision, int]:
        loads = await self.tools.shared_loads(choice.namespace)
        scores = [
            baseline_score(r.id, -float(loads[r.id].inflight if r.id in loads else 0))
            for r in choice.candidates
        ]
        return best(scores, self.rng, self.name), 0
