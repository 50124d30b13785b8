"""Routing policy: the lowest expected TTFT plus what the choice costs others; pure, no I/O.

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
mean ``active`` (:class:`Fleet`), ``churn`` how fast the replica's cache turns over relative
to the others' (:func:`relative_churn`), ``share`` from the replica's residency in the index
against its cache size (:func:`eviction_share`), the home claim from the routers' records of
where the prompt's prefixes were sent (:class:`Fleet`, ``ReplicaState.home_blocks``).
docs/architecture.md says why each term is there and what it changed, with numbers.

Defaults: ``s = 0.032 ms/token`` and ``f = 25 ms`` (:data:`DEFAULT_SPEED`, seeds that
:mod:`router.estimator` refines), ``offload_hit_cost = 0.3``, ``storage_hit_cost = 0.75``,
``remote_hit_cost = 0.9``, ``unseen_request_tokens = 1024``, ``decode_ms_per_request =
0.05``, ``kv_high_watermark = 0.9``, ``kv_full_penalty_ms = 250`` (linear from the watermark,
250 ms at 100 % projected usage, at most 1,250 ms at 150 %), ``miss_weight = 3``.

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
from dataclasses import dataclass
from typing import Final, Literal

Mode = Literal["ttft", "linear"]
_LINEAR_TIE: Final = 1e-9
MAX_CHURN: Final = 2.0  # churn weighs evictions within [1/2, 2]
MAX_KV_USAGE: Final = 1.5  # past this projected usage the KV penalty stops growing


@dataclass(frozen=True, slots=True)
class SpeedEstimate:
    """A replica's prefill speed: fixed cost per prefill plus cost per uncached token."""

    floor_ms: float
    prefill_ms_per_token: float

    def prefill_ms(self, tokens: float) -> float:
        """Expected time to prefill ``tokens`` uncached tokens in one request."""
        return self.floor_ms + self.prefill_ms_per_token * tokens


DEFAULT_SPEED: Final = SpeedEstimate(floor_ms=25.0, prefill_ms_per_token=0.032)
"""Llama-3.1-8B on one H200 (see the module docstring); a seed, refined online."""


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """What the policy knows about one candidate replica for one request.

    :param matched_blocks: length of the replica's contiguous cached run of the prompt's
        block chain; ``matched_gpu_blocks`` of those are in GPU memory,
        ``matched_storage_blocks`` in local storage and ``matched_remote_blocks`` in a remote
        store (at best), the rest in the CPU memory of its host.
    :param inflight: requests in flight on this replica, summed over every router.
    :param queued_prefill_tokens: uncached prompt tokens of in-flight requests that have not
        produced their first token yet, summed over every router.
    :param engine_waiting: / :param engine_running: / :param kv_usage: the replica's own
        vLLM ``/metrics`` (``num_requests_waiting``, ``num_requests_running``,
        ``kv_cache_usage_perc`` in 0..1); None when unknown.
    :param speed: the replica's prefill speed estimate.
    :param cache_blocks: the replica's KV cache in blocks (vLLM ``cache_config_info``).
    :param resident_blocks: blocks its KV events say its prefix cache holds now.
    :param churn: how fast its cache turns over relative to the other candidates' (1: the
        mean; from the rate its events store new blocks); None when unknown.
    :param home_blocks: how much of the prompt's chain routers last sent here (its home
        claim, faded with age), whether or not those blocks are still cached.
    :param routed_at_scrape: of the engine's requests when ``kv_usage`` was scraped, those
        taken as the routers' (the rest came from other clients: ``EngineLoad.routed``);
        None: unknown, every running request counts as the routers'.
    :param valued_blocks: the blocks of its cache that routed requests reused lately
        (:class:`router.reuse.ReuseBook`): what new blocks would push out at a cost; the
        rest of ``resident_blocks`` is finished requests' own blocks, free to evict. None:
        unknown, every resident block counts.
    :param recent_inflight: the routers' requests in flight on it over the last seconds
        (:class:`router.occupancy.OccupancyBook`): the load a prefill there will meet even
        when the requests of the moment have just finished.
    :param prefill_elapsed_ms: how long ago the oldest of the requests there that have not
        produced their first token was sent (through any router): the engine has been prefilling the
        queue at least that long, so that much of ``queued_prefill_tokens`` is done.
    :param prefixes: the prefix groups (chains by their first block) this router sent here
        lately (:meth:`router.reuse.ReuseBook.prefixes`).
    """

    id: str
    matched_blocks: int = 0
    matched_gpu_blocks: int = 0
    inflight: int = 0
    queued_prefill_tokens: int = 0
    engine_waiting: int | None = None
    engine_running: int | None = None
    kv_usage: float | None = None
    speed: SpeedEstimate = DEFAULT_SPEED
    cache_blocks: int | None = None
    resident_blocks: int | None = None
    churn: float | None = None
    home_blocks: float = 0.0
    routed_at_scrape: int | None = None
    valued_blocks: int | None = None
    recent_inflight: float = 0.0
    prefill_elapsed_ms: float = 0.0
    matched_storage_blocks: int = 0
    matched_remote_blocks: int = 0
    prefixes: int = 0


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Policy parameters; defaults and their sources are in the module docstring."""

    mode: Mode = "ttft"
    block_size: int = 16
    hit_weight: float = 1.0
    load_weight: float = 1.0
    offload_hit_cost: float = 0.3
    storage_hit_cost: float = 0.75
    remote_hit_cost: float = 0.9
    temperature: float = 0.0
    tie_epsilon_ms: float = 1.0
    tie_ratio: float = 0.05
    unseen_request_tokens: int = 1024
    decode_ms_per_request: float = 0.05
    kv_high_watermark: float = 0.9
    kv_full_penalty_ms: float = 250.0
    miss_weight: float = 3.0

    def __post_init__(self) -> None:
        if self.mode not in ("ttft", "linear"):
            raise ValueError(f"mode must be 'ttft' or 'linear', got {self.mode!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        for name in ("offload_hit_cost", "storage_hit_cost", "remote_hit_cost"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if not 0.0 <= self.kv_high_watermark < 1.0:
            raise ValueError(f"kv_high_watermark must be in [0, 1), got {self.kv_high_watermark}")
        if not (self.miss_weight >= 1.0 and math.isfinite(self.miss_weight)):
            raise ValueError(f"miss_weight must be a finite number >= 1, got {self.miss_weight}")
        for name in (
            "temperature",
            "tie_epsilon_ms",
            "tie_ratio",
            "unseen_request_tokens",
            "decode_ms_per_request",
            "kv_full_penalty_ms",
        ):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")


@dataclass(frozen=True, slots=True)
class Score:
    """One candidate's score with its breakdown (for logs, metrics and a dry-run endpoint).

    ``work_tokens`` is the prefill work ahead of the request's first token in token units
    (queued + unseen + uncached + offload-weighted cached): what
    :meth:`router.estimator.SpeedBook.observe` wants next to the measured TTFT.
    ``loading_tokens`` is the offloaded part's share of it (each tier's tokens times its cost).
    """

    replica: str
    matched_tokens: int
    gpu_cached_tokens: int
    offload_cached_tokens: int
    uncached_tokens: int
    queue_ms: float
    prefill_ms: float
    expected_ttft_ms: float
    score: float
    work_tokens: float = 0.0
    loading_tokens: float = 0.0
    regret: float = 1.0
    compute_ms: float = 0.0
    evict_ms: float = 0.0
    split_tokens: float = 0.0


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen replica and every candidate's score, in candidate order."""

    replica: str
    scores: tuple[Score, ...]
    mode: str

    @property
    def chosen(self) -> Score:
        return next(s for s in self.scores if s.replica == self.replica)


@dataclass(frozen=True, slots=True)
class Fleet:
    """What one decision knows of all candidates together.

    :param home_tokens: the deepest home claim any candidate has on the prompt, in tokens.
    :param busy: requests in flight per candidate, on average: the compute a miss spends
        delays that many others (running ones share its engine steps, queued ones wait for
        it), and on a busy fleet an idle engine does not stay idle.
    """

    home_tokens: float = 0.0
    busy: float = 0.0


def fleet_of(candidates: Sequence[ReplicaState], config: PolicyConfig) -> Fleet:
    """The :class:`Fleet` facts of one decision."""
    home = max((s.home_blocks for s in candidates), default=0.0) * config.block_size
    active = [_active(s) for s in candidates]
    busy = sum(active) / len(active) if active else 0.0
    return Fleet(home_tokens=home, busy=busy)


def _active(state: ReplicaState) -> int:
    """Requests in flight on the replica: every router's, plus the ones other clients sent
    (the engine's count at the scrape beyond the routers' then; when that split is unknown,
    the engine's own count if more than the routers')."""
    engine = (state.engine_running or 0) + (state.engine_waiting or 0)
    if state.routed_at_scrape is not None:
        # the routers' requests counted then may have finished since: an engine scraped
        # while a group's last request ran looked busy after it, and the group left home
        return state.inflight + max(0, engine - state.routed_at_scrape)
    return max(state.inflight, engine)


def _busyness(state: ReplicaState, fleet: Fleet) -> tuple[int, int, float]:
    """Which tied candidate comes first (least).

    A prompt no router has sent before: the one serving the fewest prefix groups lately
    (``prefixes``), then the fewest requests in flight now, then the least load over the
    last seconds (``recent_inflight``). A prompt with a home: the fewest in flight now.
    docs/architecture.md ("Score", ties) gives the measurements behind this order.
    """
    if fleet.home_tokens:
        return 0, _active(state), 0.0
    return state.prefixes, _active(state), round(state.recent_inflight, 3)


def _near_order(score: Score) -> tuple[int, int]:
    """Which of the candidates within ``tie_ratio`` of the best comes first (least): the
    prompt's home (the least split claim), then the one holding most of the prompt."""
    return round(score.split_tokens), -score.matched_tokens


def _queued_tokens(state: ReplicaState, config: PolicyConfig) -> float:
    """Prefill work ahead of a new request: every router's queue, less what the engine has
    done of it since the oldest pending request was sent, plus unseen waiting ones."""
    unseen = max(0, (state.engine_waiting or 0) - state.inflight) * config.unseen_request_tokens
    done = max(0.0, state.prefill_elapsed_ms) / state.speed.prefill_ms_per_token
    return max(0.0, state.queued_prefill_tokens - done) + unseen


def score_replica(
    prompt_tokens: int,
    state: ReplicaState,
    config: PolicyConfig,
    output_tokens: int = 0,
    fleet: Fleet | None = None,
) -> Score:
    """Expected TTFT and score of sending a ``prompt_tokens``-token prompt to ``state``.

    :param output_tokens: the most the request may generate (its KV memory grows to it).
    :param fleet: facts of the other candidates too (:func:`fleet_of`); default: none.
    """
    fleet = fleet or Fleet()
    size = config.block_size
    usable = max(0, min(state.matched_blocks, (prompt_tokens - 1) // size))
    gpu = max(0, min(state.matched_gpu_blocks, usable)) * size
    offload = usable * size - gpu
    loading = _loading_tokens(state, offload // size, config) * size
    uncached = max(0, prompt_tokens - usable * size)
    speed = state.speed

    queued = _queued_tokens(state, config)
    active = _active(state)
    queue_ms = speed.prefill_ms_per_token * queued + config.decode_ms_per_request * active
    usage = projected_kv_usage(state, uncached + offload + output_tokens, size)
    if usage is not None and usage > config.kv_high_watermark:
        excess = min(usage, MAX_KV_USAGE) - config.kv_high_watermark
        queue_ms += config.kv_full_penalty_ms * excess / (1.0 - config.kv_high_watermark)

    own_work = uncached + loading
    prefill_ms = speed.prefill_ms(own_work)
    ttft = queue_ms + prefill_ms
    share = eviction_share(state, (uncached + offload) / size)  # offload hits load into GPU
    regret = share * relative_churn(state)
    compute = evict = split = 0.0
    if config.mode == "ttft":
        # What a miss costs beyond its own TTFT. Its compute delays the requests in flight
        # beside it. The blocks it writes push cached ones out (nothing while the cache has
        # room; worse where the cache turns over fastest: the blocks pushed out are young). And
        # leaving a prefix's home splits its group (the home will likely get it again): that
        # costs the home's claim over again wherever the cache is full, churn or not, even
        # where the blocks are cached too (a copy left by outside traffic, or by an earlier
        # split, that routing there would keep alive beside the home's).
        claimed = min(state.home_blocks * size, prompt_tokens)
        split = max(0.0, min(fleet.home_tokens, prompt_tokens) - claimed)
        s = speed.prefill_ms_per_token
        compute = s * own_work * max(active, share * state.recent_inflight)
        weight = (config.miss_weight - 1.0) * s * (1.0 + fleet.busy)
        evict = weight * (own_work * regret + split * share)
        value = -(ttft + compute + evict)
    else:
        matched = (gpu + offload - loading) / size
        value = config.hit_weight * matched - config.load_weight * state.inflight
    return Score(
        replica=state.id,
        matched_tokens=usable * size,
        gpu_cached_tokens=gpu,
        offload_cached_tokens=offload,
        uncached_tokens=uncached,
        queue_ms=queue_ms,
        prefill_ms=prefill_ms,
        expected_ttft_ms=ttft,
        score=value,
        work_tokens=queued + own_work,
        loading_tokens=loading,
        regret=regret,
        compute_ms=compute,
        evict_ms=evict,
        split_tokens=split,
    )


def _loading_tokens(state: ReplicaState, offload_blocks: int, config: PolicyConfig) -> float:
    """What loading ``offload_blocks`` of the run from the replica's offload tiers costs, in
    blocks of recompute: the run's GPU blocks come first, then CPU, storage and remote ones
    (an engine's LRU keeps a prefix's head on the faster tiers), so a prompt shorter than
    the run drops the slowest."""
    held = state.matched_blocks - state.matched_gpu_blocks
    cpu = min(
        max(0, held - state.matched_storage_blocks - state.matched_remote_blocks), offload_blocks
    )
    storage = min(state.matched_storage_blocks, offload_blocks - cpu)
    remote = offload_blocks - cpu - storage
    return (
        config.offload_hit_cost * cpu
        + config.storage_hit_cost * storage
        + config.remote_hit_cost * remote
    )


def projected_kv_usage(state: ReplicaState, new_tokens: float, block_size: int) -> float | None:
    """The replica's KV usage once this request holds its blocks (None: usage unknown).

    The engine's own gauge, scraped up to seconds ago: scaled down when fewer of the
    routers' requests are in flight now than then (they finished and freed their blocks;
    requests from other clients are taken to be still running), plus the blocks this
    request will allocate: its uncached prompt and its output. Without the cache's size
    only the gauge.
    """
    if state.kv_usage is None:
        return None
    usage = state.kv_usage
    if state.engine_running:
        routed = state.engine_running if state.routed_at_scrape is None else state.routed_at_scrape
        outside = max(0, state.engine_running - routed)
        usage *= min(1.0, (outside + state.inflight) / state.engine_running)
    if not state.cache_blocks:
        return usage
    return usage + new_tokens / block_size / state.cache_blocks


def eviction_share(state: ReplicaState, new_blocks: float) -> float:
    """The share of ``new_blocks`` written on the replica that push a cached block out.

    0 while the cache has room for them: never used, or held by blocks no request reuses
    (``valued_blocks``); 1 (all of them) when its size or residency is unknown.
    """
    if state.cache_blocks is None or state.resident_blocks is None or new_blocks <= 0:
        return 1.0
    held = state.resident_blocks
    if state.valued_blocks is not None:
        held = min(held, state.valued_blocks)
    room = state.cache_blocks - held
    return min(1.0, max(0.0, (new_blocks - room) / new_blocks))


def relative_churn(state: ReplicaState) -> float:
    """How much the replica's churn weighs its evictions: 1 when unknown or average.

    Where the cache turns over fast, the blocks at the end of its LRU queue were used
    recently and will be missed; where it is slow they are old. Churn is measured over the
    last seconds and reacts to the routing itself, so it weighs as its square root, within
    [1/2, 2]: enough to place new prefixes on quiet caches, not enough to chase the rate
    from one cache to another.
    """
    if state.churn is None:
        return 1.0
    return math.sqrt(min(max(state.churn, 1.0 / MAX_CHURN**2), MAX_CHURN**2))


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
