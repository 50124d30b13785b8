"""What the routing policy takes and gives: a candidate's state, the parameters, a replica's
prefill speed, each candidate's score and the decision.

The policy itself (:func:`router.decide.policy.decide`) and its arithmetic
(:mod:`router.decide.scoring`)
work on these; the decider builds the states, the proxy and the journal read the scores.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal

Mode = Literal["ttft", "linear"]


@dataclass(frozen=True, slots=True)
class SpeedEstimate:
    """A replica's prefill speed: fixed cost per prefill plus cost per uncached token."""

    floor_ms: float
    prefill_ms_per_token: float

    def prefill_ms(self, tokens: float) -> float:
        """Expected time to prefill ``tokens`` uncached tokens in one request."""
        return self.floor_ms + self.prefill_ms_per_token * tokens


DEFAULT_SPEED: Final = SpeedEstimate(floor_ms=25.0, prefill_ms_per_token=0.028)
"""Llama-3.1-8B on one H200 (see :mod:`router.decide.policy`); a seed, refined online."""


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """What the policy knows about one candidate replica for one request.

    :param matched_blocks: length of the replica's contiguous cached run of the prompt's
        block chain; ``matched_gpu_blocks`` of those are in GPU memory,
        ``matched_storage_blocks`` in local storage and ``matched_remote_blocks`` in a remote
        store (at best), the rest in the CPU memory of its host.
    :param inflight: requests in flight on this replica, summed over every router.
    :param queued_prefill_tokens: prefill work of in-flight requests that have not produced
        their first token yet, summed over every router, in the tokens of a short prompt
        (:func:`router.decide.scoring.prefill_work`: a long prompt's count more).
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
    :param session_home: the request's session (``prompt_cache_key`` or the session header)
        was last routed here: ties go here, the score does not change.
    :param routed_at_scrape: of the engine's requests when ``kv_usage`` was scraped, those
        taken as the routers' (the rest came from other clients: ``EngineLoad.routed``);
        None: unknown, every running request counts as the routers'.
    :param valued_blocks: the blocks of its cache that routed requests reused lately
        (:class:`router.decide.reuse.ReuseBook`): what new blocks would push out at a cost; the
        rest of ``resident_blocks`` is finished requests' own blocks, free to evict. None:
        unknown, every resident block counts.
    :param recent_inflight: the routers' requests in flight on it over the last seconds
        (:class:`router.decide.occupancy.OccupancyBook`): the load a prefill there will meet even
        when the requests of the moment have just finished.
    :param returns: the part of the requests in flight that come back bound here within a
        window of so many ms of their finish (:meth:`router.decide.returns.ReturnBook.share`):
        those a prefill here delays. None: all of them.
    :param prefill_elapsed_ms: how long the engine has been working on the requests there
        that have not produced their first token (through any router; since the oldest was
        sent or the one before them stopped prefilling,
        :meth:`router.shared.load.LoadTotals.since`): that much of ``queued_prefill_tokens``
        is done.
    :param prefixes: the prefix groups (chains by their first block, or sessions) this router
        sent here lately (:meth:`router.decide.reuse.ReuseBook.prefixes`).
    :param sessions: the sessions other than the request's own that routers sent here
        within the reuse window and nowhere since (the index's count,
        :attr:`tracker.core.index.Survey.sessions`): their next turns will come back here, so
        a prefill here delays at least as many requests.
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
    returns: Callable[[float], float] | None = None
    prefill_elapsed_ms: float = 0.0
    matched_storage_blocks: int = 0
    matched_remote_blocks: int = 0
    prefixes: int = 0
    sessions: int = 0
    session_home: bool = False


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Policy parameters; defaults and their sources: :mod:`router.decide.policy`."""

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
    attention_tokens: float = 26_000.0

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
            "attention_tokens",
        ):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")


@dataclass(frozen=True, slots=True)
class Score:
    """One candidate's score with its breakdown (for logs, metrics and a dry-run endpoint).

    ``work_tokens`` is the prefill work ahead of the request's first token in token units
    (:func:`router.decide.scoring.prefill_work`: queued + unseen + its own, uncached and
    offload-weighted cached): what :meth:`router.decide.estimator.SpeedBook.observe` wants
    next to the measured TTFT; ``prefill_work`` its own share, which its lease queues.
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
    prefill_work: float = 0.0
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
