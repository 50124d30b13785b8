"""Routing policy: the lowest expected TTFT plus what the choice costs others; pure, no I/O.

:func:`decide` picks a candidate (ties, sampling); :mod:`router.scoring` computes each
candidate's score, from the types in :mod:`router.policy_types`.

Score (``mode="ttft"``, the default), in milliseconds
-----------------------------------------------------

For a prompt of ``P`` tokens, a replica whose cached chain covers ``matched_blocks`` blocks of
``B`` tokens (``matched_gpu_blocks`` of them in GPU memory, the rest in an offload tier: the
CPU memory of its host, local storage, a remote store) and whose prefill speed is estimated
as a floor ``f`` (ms) plus ``s`` ms per token::

    usable     = min(matched_blocks, (P - 1) // B)    # vLLM recomputes at least the last token
    gpu        = min(matched_gpu_blocks, usable) * B  # and reuses full blocks only
    offload    = usable * B - gpu                     # CPU, then storage, then remote blocks
    loading    = cpu_cost * cpu + storage_cost * storage + remote_cost * remote
    uncached   = P - usable * B
    active     = inflight + max(0, engine_running + engine_waiting - routed_at_scrape)
    unseen     = max(0, engine_waiting - inflight)    # waiting requests no router sent
    usage      = projected KV usage: the engine's gauge (scaled by what is still in flight)
                 plus this request's uncached, offloaded and output blocks
    queue_ms   = s * (max(0, queued_prefill_tokens - prefill_elapsed_ms / s)
                      + unseen * unseen_request_tokens)
                 + decode_ms_per_request * active
                 + kv_full_penalty_ms * (min(usage, 1.5) - kv_high_watermark)
                   / (1 - kv_high_watermark)      # above the watermark only
    own_work   = uncached + loading
    expected_ttft_ms = queue_ms + f + s * own_work
    compute    = s * own_work * max(active, share * recent_inflight)  # beside it wait
    share      = the part of the new blocks that evict reused ones (0 while room is left)
    split      = the deepest home claim on the prompt minus this replica's own claim
    evict      = (miss_weight - 1) * s * (1 + busy) * (own_work * share * churn + split * share)
    score      = -(expected_ttft_ms + compute + evict)

``queued_prefill_tokens`` is the uncached prompt work of requests every router has sent to
the replica that have not produced their first token yet (:mod:`router.load`), so a queue and
a cache miss are priced in the same unit: milliseconds of prefill. What the engine has done of
it is taken off: it has been prefilling at least since the oldest of the pending requests
there was sent, through any router (``prefill_elapsed_ms`` ago); counted in full, the second
request of a new prefix, sent while the first still prefilled at home, looked cheaper as a
cold copy on an idle engine. The engine's own
``/metrics`` (possibly stale, possibly absent) only add what the routers cannot know:
requests from other clients, a full KV cache, the cache's size. ``busy`` is the candidates'
mean ``active`` (:class:`~router.scoring.Fleet`), ``churn`` how fast the replica's cache turns
over relative to the others' (:func:`~router.scoring.relative_churn`), ``share`` from the
replica's residency in the index against its cache size
(:func:`~router.scoring.eviction_share`), the home claim from the routers' records of where
the prompt's prefixes were sent (:class:`~router.scoring.Fleet`,
``ReplicaState.home_blocks``).
docs/architecture.md says why each term is there and what it changed, with numbers.

Defaults: ``s = 0.032 ms/token`` and ``f = 25 ms`` (:data:`~router.policy_types.DEFAULT_SPEED`,
seeds that :mod:`router.estimator` refines), ``offload_hit_cost = 0.3``,
``storage_hit_cost = 0.75``, ``remote_hit_cost = 0.9``, ``unseen_request_tokens = 1024``,
``decode_ms_per_request = 0.05``, ``kv_high_watermark = 0.9``, ``kv_full_penalty_ms = 250``
(linear from the watermark, 250 ms at 100 % projected usage, at most 1,250 ms at 150 %),
``miss_weight = 3``.

Ties: candidates within ``tie_epsilon_ms`` (1) of the best are an exact tie and go to the
deepest chain; within ``tie_ratio`` (5 %) a near-tie, which goes to the prompt's home, then
to the deepest chain. What is still tied goes to the least busy (:func:`_busyness`), then at
random. ``temperature > 0`` instead samples with probability
``exp((score - best) / temperature)`` (temperature in ms).

docs/architecture.md ("Policy defaults and where they come from") gives each default's
source.

Linear mode (``mode="linear"``)
-------------------------------

The linear form ``score = hit_weight * matched - load_weight * inflight`` where
``matched = gpu_blocks + (1 - offload_hit_cost) * offload_blocks`` (usable blocks only).
It is unitless (one request in flight cancels ``load_weight / hit_weight`` cached blocks,
whatever the block size, model or GPU) and needs tuning per fleet; kept for comparison and
A/B runs. Exact ties go to the fewest requests in flight, then at random. The TTFT
estimate is still computed for every candidate, for logs.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Final

from router.policy_types import Decision, PolicyConfig, ReplicaState, Score
from router.scoring import Fleet, active_requests, fleet_of, score_replica

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


def _near_order(score: Score) -> tuple[int, int]:
    """Which of the candidates within ``tie_ratio`` of the best comes first (least): the
    prompt's home (the least split claim), then the one holding most of the prompt."""
    return round(score.split_tokens), -score.matched_tokens


def decide(
    prompt_tokens: int,
    candidates: Sequence[ReplicaState],
    config: PolicyConfig,
    rng: random.Random,
    output_tokens: int = 0,
) -> Decision:
    """Score every candidate and pick one (best score; ties to the least busy, then at
    random; or a softmax).

    :raises ValueError: if there are no candidates.
    """
    if not candidates:
        raise ValueError("no candidate replicas to choose from")
    fleet = fleet_of(candidates, config)
    scores = tuple(
        score_replica(prompt_tokens, state, config, output_tokens, fleet) for state in candidates
    )
    values = [s.score for s in scores]
    if config.temperature > 0:
        index = _sample(values, config.temperature, rng)
    else:
        best = max(values)
        epsilon = config.tie_epsilon_ms if config.mode == "ttft" else _LINEAR_TIE
        tied = [i for i, v in enumerate(values) if v >= best - epsilon]
        ratio = config.tie_ratio * -best if config.mode == "ttft" else 0.0
        near = [i for i, v in enumerate(values) if v >= best - ratio]
        if len(near) > len(tied):  # within the estimate's error: the home, the deepest chain
            first = min(_near_order(scores[i]) for i in near)
            tied = [i for i in near if _near_order(scores[i]) == first]
        else:  # an exact tie: the deepest chain
            deepest = max(scores[i].matched_tokens for i in tied)
            tied = [i for i in tied if scores[i].matched_tokens == deepest]
        if len(tied) > 1:  # the least busy; at random
            fewest = min(_busyness(candidates[i], fleet) for i in tied)
            tied = [i for i in tied if _busyness(candidates[i], fleet) == fewest]
        index = tied[0] if len(tied) == 1 else tied[rng.randrange(len(tied))]
    return Decision(scores[index].replica, scores, config.mode)


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
