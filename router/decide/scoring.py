"""One candidate's score: expected TTFT plus what the choice costs others; pure arithmetic.

:func:`score_replica` computes the terms :mod:`router.decide.policy`'s docstring lays out (queue,
prefill, loading offloaded blocks, the KV-full penalty, the compute a miss takes from the
requests beside it, the evictions and group splits it causes); :func:`fleet_of` gathers
what one decision knows of all candidates together.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

from router.decide.policy_types import PolicyConfig, ReplicaState, Score

MAX_CHURN: Final = 2.0  # churn weighs evictions within [1/2, 2]
MAX_KV_USAGE: Final = 1.5  # past this projected usage the KV penalty stops growing


@dataclass(frozen=True, slots=True)
class Fleet:
    """What one decision knows of all candidates together.

    :param home_tokens: the deepest home claim any candidate has on the prompt, in tokens.
    :param busy: requests in flight per candidate, on average: the compute a miss spends
        delays that many others (running ones share its engine steps, queued ones wait for
        it), and on a busy fleet an idle engine does not stay idle.
    :param least_work: the least prefill work the prompt needs on any candidate (where most
        of it is cached): what a copy elsewhere does beyond it is work no placement needed.
    """

    home_tokens: float = 0.0
    busy: float = 0.0
    least_work: float = 0.0


def fleet_of(
    candidates: Sequence[ReplicaState], config: PolicyConfig, works: Sequence[Work] = ()
) -> Fleet:
    """The :class:`Fleet` facts of one decision (``works``: what the prompt needs on each
    candidate, :func:`work_of`, for ``least_work``)."""
    home = max((s.home_blocks for s in candidates), default=0.0) * config.block_size
    active = [active_requests(s) for s in candidates]
    busy = sum(active) / len(active) if active else 0.0
    least = min((w.own for w in works), default=0.0)
    return Fleet(home_tokens=home, busy=busy, least_work=least)


class Work(NamedTuple):
    """What a prompt needs on one replica: the blocks it reuses and the work left."""

    usable: int  # blocks of the prompt cached there, and reusable
    gpu: int  # tokens cached in GPU memory
    offload: int  # tokens cached in an offload tier
    loading: float  # the offloaded tokens' loading, in prefill tokens
    uncached: int  # tokens to prefill
    own: float  # prefill work (:func:`prefill_work` units), loading included


def work_of(prompt_tokens: int, state: ReplicaState, config: PolicyConfig) -> Work:
    """What a ``prompt_tokens``-token prompt needs on ``state`` (:class:`Work`)."""
    size = config.block_size
    usable = max(0, min(state.matched_blocks, (prompt_tokens - 1) // size))
    gpu = max(0, min(state.matched_gpu_blocks, usable)) * size
    offload = usable * size - gpu
    loading = _loading_tokens(state, offload // size, config) * size
    uncached = max(0, prompt_tokens - usable * size)
    own = prefill_work(uncached, usable * size, config.attention_tokens) + loading
    return Work(usable, gpu, offload, loading, uncached, own)


def active_requests(state: ReplicaState) -> int:
    """Requests in flight on the replica: every router's, plus the ones other clients sent
    (the engine's count at the scrape beyond the routers' then; when that split is unknown,
    the engine's own count if more than the routers')."""
    engine = (state.engine_running or 0) + (state.engine_waiting or 0)
    if state.routed_at_scrape is not None:
        # the routers' requests counted then may have finished since: an engine scraped
        # while a group's last request ran looked busy after it, and the group left home
        return state.inflight + max(0, engine - state.routed_at_scrape)
    return max(state.inflight, engine)


def prefill_work(tokens: float, context: float, attention_tokens: float) -> float:
    """The work of prefilling ``tokens`` new tokens after ``context`` cached ones, in tokens
    of a short prompt (the unit of the learned speed).

    Each new token also attends to every token before it, which costs ``1 /
    attention_tokens`` of its own forward pass per token attended: a 100k-token prompt is
    ~2.9 short prompts' worth of work per token on Llama-3.1-8B, not one (a linear price
    said its engine was free while two thirds of its prefill was still to run).
    ``attention_tokens`` 0: linear.
    """
    if tokens <= 0:
        return 0.0
    if attention_tokens <= 0:
        return float(tokens)
    return tokens * (1.0 + (context + tokens / 2.0) / attention_tokens)


def _queued_tokens(state: ReplicaState, config: PolicyConfig) -> float:
    """Prefill work ahead of a new request (:func:`prefill_work` units): every router's
    queue, less what the engine has done of it since it started on it
    (``prefill_elapsed_ms``), plus unseen waiting ones."""
    unseen = max(0, (state.engine_waiting or 0) - state.inflight) * config.unseen_request_tokens
    done = max(0.0, state.prefill_elapsed_ms) / state.speed.prefill_ms_per_token
    return max(0.0, state.queued_prefill_tokens - done) + unseen


def score_replica(
    prompt_tokens: int,
    state: ReplicaState,
    config: PolicyConfig,
    output_tokens: int = 0,
    fleet: Fleet | None = None,
    *,
    work: Work | None = None,
) -> Score:
    """Expected TTFT and score of sending a ``prompt_tokens``-token prompt to ``state``.

    :param output_tokens: the most the request may generate (its KV memory grows to it).
    :param fleet: facts of the other candidates too (:func:`fleet_of`); default: none.
    :param work: :func:`work_of` the prompt on ``state``, when the caller has it already.
    """
    fleet = fleet or Fleet()
    size = config.block_size
    if work is None:
        work = work_of(prompt_tokens, state, config)
    usable, gpu, offload, loading, uncached, own_work = work
    speed = state.speed

    queued = _queued_tokens(state, config)
    active = active_requests(state)
    queue_ms = speed.prefill_ms_per_token * queued + config.decode_ms_per_request * active
    usage = projected_kv_usage(state, uncached + offload + output_tokens, size)
    if usage is not None and usage > config.kv_high_watermark:
        excess = min(usage, MAX_KV_USAGE) - config.kv_high_watermark
        queue_ms += config.kv_full_penalty_ms * excess / (1.0 - config.kv_high_watermark)

    own_tokens = uncached + loading
    prefill_ms = speed.prefill_ms(own_work)
    ttft = queue_ms + prefill_ms
    share = eviction_share(state, (uncached + offload) / size)  # offload hits load into GPU
    regret = share * relative_churn(state)
    compute = evict = split = 0.0
    if config.mode == "ttft":
        # What a miss costs beyond its own TTFT. Its compute delays the requests bound to the
        # engine that arrive before it ends: the part of those in flight there that come back
        # within its wait and prefill (a subagent's next call: most; a chat's next turn, a
        # minute later: few), and the sessions living there between turns. The blocks it
        # writes push cached ones out (nothing while the cache has room; worse where the
        # cache turns over fastest: the blocks pushed out are young). And
        # leaving a prefix's home splits its group (the home will likely get it again): that
        # costs the home's claim over again wherever the cache is full, churn or not, even
        # where the blocks are cached too (a copy left by outside traffic, or by an earlier
        # split, that routing there would keep alive beside the home's).
        claimed = min(state.home_blocks * size, prompt_tokens)
        split = max(0.0, min(fleet.home_tokens, prompt_tokens) - claimed)
        s = speed.prefill_ms_per_token
        # The work any placement needs is charged to what comes back within it; the work
        # this one adds over the cheapest (a copy of a prefix cached elsewhere), to every
        # request in flight there: capacity no placement needed, taken from them.
        back = state.returns(ttft) if state.returns is not None else 1.0
        count = max(active * back, share * state.recent_inflight, state.sessions)
        least = min(fleet.least_work, own_work)
        compute = s * (least * count + (own_work - least) * max(count, active))
        weight = (config.miss_weight - 1.0) * s * (1.0 + fleet.busy)
        evict = weight * (own_tokens * regret + split * share)
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
        prefill_work=own_work,
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
