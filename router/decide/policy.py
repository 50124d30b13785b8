"""Routing policy: the lowest expected TTFT plus what the choice costs others; pure, no I/O.

:func:`decide` scores every candidate (:func:`router.decide.scoring.score_replica`) and picks
one. The score's formula, each term's reason and the defaults' sources are written once, in
docs/architecture.md ("Score", "Policy defaults and where they come from").
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Final

from router.decide.policy_types import Decision, PolicyConfig, ReplicaState, Score
from router.decide.scoring import Fleet, active_requests, fleet_of, score_replica, work_of

_LINEAR_TIE: Final = 1e-9


def _busyness(state: ReplicaState, fleet: Fleet) -> tuple[int, int, float]:
    """Which tied candidate comes first (least).

    A prompt no router has sent before: the one serving the fewest prefix groups lately
    (``prefixes``), then the fewest requests in flight now, then the least load over the
    last seconds (``recent_inflight``). A prompt with a home: the fewest in flight now.
    docs/architecture.md ("Score", ties) gives the measurements behind this order.
    """
    if fleet.home_tokens:
        return 0, active_requests(state), 0.0
    return state.prefixes, active_requests(state), round(state.recent_inflight, 3)


def _near_order(score: Score, state: ReplicaState) -> tuple[int, ...]:
    """Which of the candidates within ``tie_ratio`` of the best comes first (least): the
    prompt's home (the least split claim), the session's, then the one holding most of the
    prompt."""
    return round(score.split_tokens), not state.session_home, -score.matched_tokens


def _exact_order(score: Score, state: ReplicaState) -> tuple[int, ...]:
    """Which of exactly tied candidates comes first (least): the one holding most of the
    prompt, then the prompt's home, then the session's."""
    return -score.matched_tokens, round(score.split_tokens), not state.session_home


def decide(
    prompt_tokens: int,
    candidates: Sequence[ReplicaState],
    config: PolicyConfig,
    rng: random.Random,
    output_tokens: int = 0,
) -> Decision:
    """Score every candidate and pick one.

    ``mode="ttft"``: the best score. Candidates within ``tie_epsilon_ms`` of the best are an
    exact tie and go to the deepest chain, then to the prompt's home, then to the session's;
    within ``tie_ratio`` of it a near-tie, which goes to the prompt's home, the session's,
    then to the deepest chain. What is
    still tied goes to the least busy (:func:`_busyness`), then at random.
    ``temperature > 0`` instead samples with probability ``exp((score - best) /
    temperature)`` (temperature in ms).

    ``mode="linear"``: ``hit_weight * matched - load_weight * inflight`` with offloaded
    blocks discounted by their tier's cost: unitless and tuned per fleet, kept for A/B
    runs; exact ties go to the fewest requests in flight, then at random.

    :raises ValueError: if there are no candidates.
    """
    if not candidates:
        raise ValueError("no candidate replicas to choose from")
    works = [work_of(prompt_tokens, state, config) for state in candidates]
    fleet = fleet_of(candidates, config, works)
    scores = tuple(
        score_replica(prompt_tokens, state, config, output_tokens, fleet, work=work)
        for state, work in zip(candidates, works, strict=True)
    )
    values = [s.score for s in scores]
    stay = _session_stay(scores, candidates, config)
    if stay is not None:
        index = stay
    elif config.temperature > 0:
        index = _sample(values, config.temperature, rng)
    else:
        best = max(values)
        epsilon = config.tie_epsilon_ms if config.mode == "ttft" else _LINEAR_TIE
        tied = [i for i, v in enumerate(values) if v >= best - epsilon]
        ratio = config.tie_ratio * -best if config.mode == "ttft" else 0.0
        near = [i for i, v in enumerate(values) if v >= best - ratio]
        # within the estimate's error: the homes, the deepest chain; an exact tie: the
        # deepest chain, then the homes (a session's next turn)
        order = _near_order if len(near) > len(tied) else _exact_order
        pool = near if len(near) > len(tied) else tied
        first = min(order(scores[i], candidates[i]) for i in pool)
        tied = [i for i in pool if order(scores[i], candidates[i]) == first]
        if len(tied) > 1:  # the least busy; at random
            fewest = min(_busyness(candidates[i], fleet) for i in tied)
            tied = [i for i in tied if _busyness(candidates[i], fleet) == fewest]
        index = tied[0] if len(tied) == 1 else tied[rng.randrange(len(tied))]
    return Decision(scores[index].replica, scores, config.mode)


def _session_stay(
    scores: Sequence[Score], candidates: Sequence[ReplicaState], config: PolicyConfig
) -> int | None:
    """The session's home, if the request stays there: it would start there no later than
    anywhere else (expected TTFT within ``tie_ratio`` and ``tie_epsilon_ms`` of the soonest
    other; a KV-full home is late by its penalty). None: no home among the candidates, or
    another engine would start it sooner, or not ``mode="ttft"``: the score decides.

    Sticky until saturated, never a pin: what the score adds to a home's TTFT for the
    requests beside it is mostly the session's own subagents there, while a move prefills
    the session's whole history on an engine whose own sessions come back to it.
    docs/architecture.md ("Sessions") gives the measurements.
    """
    if config.mode != "ttft" or config.temperature > 0:
        return None
    home = next((i for i, state in enumerate(candidates) if state.session_home), None)
    if home is None:
        return None
    others = [s.expected_ttft_ms for i, s in enumerate(scores) if i != home]
    if not others:
        return home
    soonest = min(others)
    own = scores[home].expected_ttft_ms
    return home if own <= soonest * (1.0 + config.tie_ratio) + config.tie_epsilon_ms else None


def _sample(values: Sequence[float], temperature: float, rng: random.Random) -> int:
    """Index drawn with probability proportional to ``exp((value - max) / temperature)``."""
    best = max(values)
    weights = [math.exp((v - best) / temperature) for v in values]
    point = rng.random() * sum(weights)
    for i, weight in enumerate(weights):
        point -= weight
        if point < 0:
            return i
    return max(range(len(values)), key=values.__getitem__)
