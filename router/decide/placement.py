"""A placement: where one request goes, and everything the decision saw."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.decide.policy_types import Decision, ReplicaState, Score
from router.decide.request import PromptRequest
from tracker.core.blocks import Namespace
from tracker.core.index import Home, Match


@dataclass(frozen=True, slots=True)
class Placement:
    """A routing decision and everything that went into it.

    :param request: the request placed.
    :param keys: the prompt's block keys in ``namespace`` (none for a benchmark baseline).
    :param matches: every replica's cached run of ``keys`` (empty on a fallback).
    :param decision: the chosen replica and every candidate's score.
    :param fallback: why the index was not used (``None`` when it was).
    :param stages: seconds spent per stage.
    :param homes: the replicas routers last sent prefixes of the prompt to.
    :param states: what the policy knew of each candidate (none for a baseline).
    :param session: the request's :func:`~tracker.core.blocks.session_key`, if it names one.
    """

    request: PromptRequest
    model: str
    namespace: Namespace
    prompt_tokens: int
    keys: list[int]
    matches: dict[str, Match]
    decision: Decision
    fallback: str | None = None
    stages: dict[str, float] = field(default_factory=dict)
    homes: dict[str, Home] = field(default_factory=dict)
    states: tuple[ReplicaState, ...] = ()
    session: int | None = None

    def order(self) -> list[str]:
        """Candidates best first, the chosen one leading."""
        ranked = sorted(self.decision.scores, key=lambda s: -s.score)
        return [self.decision.replica] + [
            s.replica for s in ranked if s.replica != self.decision.replica
        ]

    def score(self, replica: str) -> Score:
        return next(s for s in self.decision.scores if s.replica == replica)

    def placed_blocks(self, replica: str) -> int:
        """The blocks of the replica's cached run that engines' events place there (the rest
        only extends the run with routers' predictions)."""
        held = self.matches.get(replica)
        return held.blocks - held.predicted_blocks if held is not None else 0

    def state(self, replica: str) -> ReplicaState | None:
        return next((s for s in self.states if s.id == replica), None)
