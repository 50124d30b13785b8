"""The routing policy: expected-TTFT arithmetic, caps, crossovers, tie-breaks, softmax."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.decide.policy import decide
from router.decide.policy_types import DEFAULT_SPEED, PolicyConfig, ReplicaState, SpeedEstimate
from router.decide.scoring import score_replica

# the linear terms' arithmetic; a long prompt's attention has tests of its own
# (test_policy_attention.py)


def linear(**changes: object) -> PolicyConfig:
    """A policy whose prefill costs the same per token at any length."""
    return PolicyConfig(attention_tokens=0.0, **changes)  # type: ignore[arg-type]


CONFIG = linear()
S = DEFAULT_SPEED.prefill_ms_per_token
F = DEFAULT_SPEED.floor_ms


# (prompt tokens, state, matched, gpu, offload, uncached tokens, queue_ms, prefill_ms)
Case = tuple[int, ReplicaState, int, int, int, int, float, float]


@pytest.mark.parametrize(
    "case",
    [
        # cold replica: everything is prefilled
        (1000, ReplicaState("r"), 0, 0, 0, 1000, 0.0, F + S * 1000),
        # whole prompt cached: vLLM still recomputes the last token, so the last block goes
        (160, ReplicaState("r", 10, 10), 144, 144, 0, 16, 0.0, F + S * 16),
        # only full blocks of the prompt count, however long the cached chain
        (170, ReplicaState("r", 50, 50), 160, 160, 0, 10, 0.0, F + S * 10),
        # offload-tier blocks cost offload_hit_cost of a recompute
        (1000, ReplicaState("r", 8, 5), 128, 80, 48, 872, 0.0, F + S * (872 + 0.3 * 48)),
        # GPU count never exceeds the usable match
        (40, ReplicaState("r", 9, 9), 32, 32, 0, 8, 0.0, F + S * 8),
        # queued prefill work of every router ahead of us
        (
            1000,
            ReplicaState("r", queued_prefill_tokens=5000),
            0,
            0,
            0,
            1000,
            S * 5000,
            F + S * 1000,
        ),
        # the engine reports 3 waiting, we know of 1: 2 unseen requests of 1024 tokens
        (
            100,
            ReplicaState("r", inflight=1, engine_waiting=3),
            0,
            0,
            0,
            100,
            S * 2 * 1024 + 0.05 * 3,
            F + S * 100,
        ),
        # running requests slow every engine step a little
        (
            100,
            ReplicaState("r", inflight=4, engine_running=10),
            0,
            0,
            0,
            100,
            0.05 * 10,
            F + S * 100,
        ),
        # KV cache above the watermark: linear penalty up to kv_full_penalty_ms at 100 %
        (100, ReplicaState("r", kv_usage=0.95), 0, 0, 0, 100, 125.0, F + S * 100),
        (100, ReplicaState("r", kv_usage=0.5), 0, 0, 0, 100, 0.0, F + S * 100),
        # degenerate prompts
        (1, ReplicaState("r", 5, 5), 0, 0, 0, 1, 0.0, F + S),
        (0, ReplicaState("r", 5, 5), 0, 0, 0, 0, 0.0, F),
    ],
)
def test_score_breakdown(case: Case) -> None:
    prompt, state, matched, gpu, offload, uncached, queue_ms, prefill_ms = case
    score = score_replica(prompt, state, CONFIG)
    assert (score.matched_tokens, score.gpu_cached_tokens, score.offload_cached_tokens) == (
        matched,
        gpu,
        offload,
    )
    assert score.uncached_tokens == uncached
    assert score.queue_ms == pytest.approx(queue_ms)
    assert score.prefill_ms == pytest.approx(prefill_ms)
    assert score.expected_ttft_ms == pytest.approx(queue_ms + prefill_ms)
    # the score counts the replica's own prefill work miss_weight times (what it evicts:
    # nothing is known of the cache, so every block evicts), and once more for each request
    # in flight beside it (its compute delays them)
    own_work = prefill_ms - F if prompt else 0.0
    active = max(state.inflight, (state.engine_running or 0) + (state.engine_waiting or 0))
    extra = (CONFIG.miss_weight - 1) * own_work + active * own_work
    assert score.score == pytest.approx(-(score.expected_ttft_ms + extra))
    assert score_replica(prompt, state, linear(miss_weight=1.0)).score == pytest.approx(
        -(score.expected_ttft_ms + active * own_work)
    )


def test_work_tokens_are_what_the_estimator_regresses_on() -> None:
    state = ReplicaState("r", 8, 5, inflight=2, queued_prefill_tokens=300, engine_waiting=4)
    score = score_replica(1000, state, CONFIG)
    assert score.work_tokens == pytest.approx(300 + 2 * 1024 + 872 + 0.3 * 48)
    # with no engine-side terms, queue + prefill == the speed model at work_tokens
    plain = score_replica(1000, ReplicaState("r", 8, 5, queued_prefill_tokens=300), CONFIG)
    assert plain.expected_ttft_ms == pytest.approx(DEFAULT_SPEED.prefill_ms(plain.work_tokens))


@pytest.mark.parametrize("miss_weight", [1.0, 2.0, 3.5])
def test_cache_hit_wins_until_its_queue_costs_more_than_the_weighted_miss(
    miss_weight: float,
) -> None:
    """The crossover is where queued work on the warm replica equals ``miss_weight`` times
    the prefill it saves (1: pure expected TTFT); exactly so without the tie window."""
    config = linear(miss_weight=miss_weight, tie_ratio=0.0)
    prompt, size = 4096, 16
    warm_blocks = (prompt - 1) // size
    saved = warm_blocks * size  # tokens the warm replica need not prefill
    crossover = miss_weight * saved
    rng = random.Random(0)
    for queued, winner in [(0, "warm"), (crossover - 100, "warm"), (crossover + 100, "cold")]:
        warm = ReplicaState("warm", warm_blocks, warm_blocks, queued_prefill_tokens=int(queued))
        cold = ReplicaState("cold")
        assert decide(prompt, [cold, warm], config, rng).replica == winner, queued


def test_miss_weight_below_one_is_rejected() -> None:
    with pytest.raises(ValueError, match="miss_weight"):
        linear(miss_weight=0.5)


def test_a_faster_replica_can_beat_a_cache_hit() -> None:
    fast = SpeedEstimate(floor_ms=10, prefill_ms_per_token=0.004)
    slow = SpeedEstimate(floor_ms=25, prefill_ms_per_token=0.25)
    prompt = 2048
    hit = ReplicaState("slow-warm", 64, 64, speed=slow)  # half the prompt cached
    miss = ReplicaState("fast-cold", speed=fast)
    decision = decide(prompt, [hit, miss], CONFIG, random.Random(0))
    assert decision.replica == "fast-cold"
    assert decision.chosen.replica == "fast-cold"
    assert [s.replica for s in decision.scores] == ["slow-warm", "fast-cold"]


def test_gpu_hits_beat_offload_hits() -> None:
    gpu = ReplicaState("gpu", 60, 60)
    cpu = ReplicaState("cpu", 60, 0)
    assert decide(1024, [cpu, gpu], CONFIG, random.Random(0)).replica == "gpu"
    free = linear(offload_hit_cost=0.0)
    scores = decide(1024, [cpu, gpu], free, random.Random(0)).scores
    assert scores[0].expected_ttft_ms == scores[1].expected_ttft_ms


def test_ties_are_broken_at_random() -> None:
    states = [ReplicaState(f"r{i}", 4, 4) for i in range(4)]
    rng = random.Random(7)
    picks = Counter(decide(100, states, CONFIG, rng).replica for _ in range(4000))
    assert set(picks) == {"r0", "r1", "r2", "r3"}
    assert all(800 < n < 1200 for n in picks.values()), picks


def test_tie_epsilon() -> None:
    close = SpeedEstimate(F + 0.5, S)
    far = SpeedEstimate(F + 2.0, S)
    rng = random.Random(1)
    tied = {
        decide(100, [ReplicaState("a"), ReplicaState("b", speed=close)], CONFIG, rng).replica
        for _ in range(200)
    }
    assert tied == {"a", "b"}
    apart = {
        decide(100, [ReplicaState("a"), ReplicaState("b", speed=far)], CONFIG, rng).replica
        for _ in range(200)
    }
    assert apart == {"a"}
    exact = linear(tie_epsilon_ms=0.0, tie_ratio=0.0)
    assert {
        decide(100, [ReplicaState("a"), ReplicaState("b", speed=close)], exact, rng).replica
        for _ in range(200)
    } == {"a"}


def test_the_queue_counts_what_is_left_of_the_prefills_ahead() -> None:
    sent = ReplicaState("r", inflight=1, queued_prefill_tokens=4000)
    busy = score_replica(100, sent, CONFIG)
    assert busy.queue_ms == pytest.approx(S * 4000 + CONFIG.decode_ms_per_request)
    # the oldest pending request was sent a while ago: the engine has done that much of it
    later = score_replica(100, replace(sent, prefill_elapsed_ms=S * 1000), CONFIG)
    assert later.queue_ms == pytest.approx(S * 3000 + CONFIG.decode_ms_per_request)
    assert later.work_tokens == pytest.approx(3000 + 100)  # what the estimator learns from
    done = score_replica(100, replace(sent, prefill_elapsed_ms=S * 9000), CONFIG)
    assert done.queue_ms == pytest.approx(CONFIG.decode_ms_per_request)


def test_a_near_tie_goes_to_the_replica_holding_the_prompt() -> None:
    # the second request of a new prefix while the first is still prefilling at home: the
    # wait there and a cold prefill elsewhere are within the estimate's error; a copy would
    # cost cache the score cannot see while the caches have room
    prompt = 4000
    room = {"cache_blocks": 1024, "resident_blocks": 0}  # the first's blocks not stored yet
    home = ReplicaState("home", 249, 249, inflight=1, queued_prefill_tokens=prompt, **room)
    idle = ReplicaState("idle", **room)
    rng = random.Random(2)
    costs = {s.replica: -s.score for s in decide(prompt, [home, idle], CONFIG, rng).scores}
    assert costs["idle"] < costs["home"] < costs["idle"] * (1 + CONFIG.tie_ratio)
    assert {decide(prompt, [home, idle], CONFIG, rng).replica for _ in range(50)} == {"home"}
    # strictly by the estimate, the idle replica is faster
    strict = linear(tie_ratio=0.0, tie_epsilon_ms=0.0)
    assert decide(prompt, [home, idle], strict, rng).replica == "idle"
    # a wait well beyond the estimate's error is not a tie
    queued = ReplicaState("home", 249, 249, inflight=2, queued_prefill_tokens=2 * prompt, **room)
    assert decide(prompt, [queued, idle], CONFIG, rng).replica == "idle"


def test_softmax_temperature_samples_by_score_difference() -> None:
    temperature = 10.0
    gap = temperature * math.log(3)  # the better replica should win 3 times as often
    states = [ReplicaState("best"), ReplicaState("worse", speed=SpeedEstimate(F + gap, S))]
    config = linear(temperature=temperature)
    rng = random.Random(3)
    picks = Counter(decide(100, states, config, rng).replica for _ in range(8000))
    assert picks["best"] / picks["worse"] == pytest.approx(3.0, rel=0.1)


def test_linear_mode_is_the_card_formula() -> None:
    config = linear(mode="linear", hit_weight=2.0, load_weight=3.0)
    state = ReplicaState("r", 10, 6, inflight=5)
    score = score_replica(1000, state, config)
    assert score.score == pytest.approx(2.0 * (6 + 0.7 * 4) - 3.0 * 5)
    assert score.expected_ttft_ms > 0  # still reported
    loaded = ReplicaState("loaded", 10, 10, inflight=4)
    idle = ReplicaState("idle", 0, 0, inflight=0)
    card = linear(mode="linear")
    assert decide(1000, [loaded, idle], card, random.Random(0)).replica == "loaded"  # 10-4 > 0
    assert decide(1000, [loaded, idle], config, random.Random(0)).replica == "loaded"  # 20-12 > 0
    heavy = linear(mode="linear", load_weight=3.0)
    assert decide(1000, [loaded, idle], heavy, random.Random(0)).replica == "idle"  # 10-12 < 0


def test_no_candidates_and_bad_configs_are_errors() -> None:
    with pytest.raises(ValueError, match="no candidate"):
        decide(10, [], CONFIG, random.Random(0))
    for bad in (
        {"mode": "fastest"},
        {"block_size": 0},
        {"offload_hit_cost": 1.5},
        {"temperature": -1.0},
        {"tie_epsilon_ms": math.nan},
        {"kv_high_watermark": 1.0},
    ):
        with pytest.raises(ValueError):
            linear(**bad)


STATES = st.builds(
    ReplicaState,
    id=st.sampled_from(["a", "b", "c", "d", "e"]),
    matched_blocks=st.integers(0, 600),
    matched_gpu_blocks=st.integers(0, 600),
    inflight=st.integers(0, 200),
    queued_prefill_tokens=st.integers(0, 500_000),
    engine_waiting=st.none() | st.integers(0, 100),
    engine_running=st.none() | st.integers(0, 300),
    kv_usage=st.none() | st.floats(0.0, 1.0),
    speed=st.builds(SpeedEstimate, st.floats(0.0, 500.0), st.floats(0.001, 2.0)),
    matched_storage_blocks=st.integers(0, 600),
    matched_remote_blocks=st.integers(0, 600),
)


@given(prompt=st.integers(0, 10_000), state=STATES, block=st.sampled_from([1, 16, 64]))
def test_score_invariants(prompt: int, state: ReplicaState, block: int) -> None:
    config = linear(block_size=block)
    score = score_replica(prompt, state, config)
    assert score.matched_tokens % block == 0
    assert 0 <= score.matched_tokens <= max(0, prompt - 1)
    assert score.gpu_cached_tokens + score.offload_cached_tokens == score.matched_tokens
    assert score.matched_tokens + score.uncached_tokens == prompt
    assert score.queue_ms >= 0 and score.prefill_ms >= state.speed.floor_ms
    assert score.expected_ttft_ms == pytest.approx(score.queue_ms + score.prefill_ms)
    # more GPU-cached blocks never make it slower; more queued work never makes it faster
    better = replace(
        state,
        matched_blocks=state.matched_blocks + 1,
        matched_gpu_blocks=state.matched_gpu_blocks + 1,
    )
    assert score_replica(prompt, better, config).expected_ttft_ms <= score.expected_ttft_ms + 1e-9
    busier = replace(state, queued_prefill_tokens=state.queued_prefill_tokens + 100)
    assert score_replica(prompt, busier, config).expected_ttft_ms > score.expected_ttft_ms
    # a block that loads from a faster tier never makes it slower
    faster = replace(state, matched_remote_blocks=max(0, state.matched_remote_blocks - 1))
    assert score_replica(prompt, faster, config).expected_ttft_ms <= score.expected_ttft_ms + 1e-9
    assert 0 <= score.loading_tokens <= score.offload_cached_tokens


@pytest.mark.parametrize(
    ("tiers", "loading"),
    [
        pytest.param({}, 0.3 * 64, id="cpu"),
        pytest.param({"matched_storage_blocks": 4}, 0.75 * 64, id="storage"),
        pytest.param({"matched_remote_blocks": 4}, 0.9 * 64, id="remote"),
        pytest.param(
            {"matched_storage_blocks": 1, "matched_remote_blocks": 1},
            (2 * 0.3 + 0.75 + 0.9) * 16,
            id="mix",
        ),
    ],
)
def test_each_offload_tier_costs_its_own_share_of_a_recompute(
    tiers: dict[str, int], loading: float
) -> None:
    """Four blocks of 16 tokens past the GPU-cached ones: loading them costs each tier's share
    of recomputing them (CPU 0.3, storage 0.75, remote 0.9 by default)."""
    config = linear(block_size=16)
    state = ReplicaState("a", matched_blocks=8, matched_gpu_blocks=4, **tiers)
    score = score_replica(16 * 10, state, config)
    assert score.gpu_cached_tokens == 64 and score.offload_cached_tokens == 64
    assert score.loading_tokens == pytest.approx(loading)
    assert score.prefill_ms == pytest.approx(DEFAULT_SPEED.prefill_ms(32 + loading))


def test_a_prompt_shorter_than_the_run_drops_its_slowest_tier_first() -> None:
    """The last block is recomputed (vLLM keeps at least one token to prefill), and the run's
    tail is its remote part: the CPU and storage blocks before it still load."""
    config = linear(block_size=16)
    state = ReplicaState(
        "a",
        matched_blocks=4,
        matched_gpu_blocks=1,
        matched_storage_blocks=1,
        matched_remote_blocks=1,
    )
    score = score_replica(16 * 4, state, config)
    assert score.matched_tokens == 48
    assert score.loading_tokens == pytest.approx((0.3 + 0.75) * 16)


def test_an_engine_holding_the_prompt_in_cpu_memory_beats_one_holding_it_remotely() -> None:
    config = linear(block_size=16)
    cpu = ReplicaState("cpu", matched_blocks=300, matched_gpu_blocks=0)
    remote = ReplicaState("remote", matched_blocks=300, matched_remote_blocks=300)
    cold = ReplicaState("cold")
    decision = decide(16 * 310, [remote, cold, cpu], config, random.Random(0))
    assert decision.replica == "cpu"
    ranked = sorted(decision.scores, key=lambda s: -s.score)
    assert [s.replica for s in ranked] == ["cpu", "remote", "cold"]


@given(
    prompt=st.integers(1, 10_000),
    states=st.lists(STATES, min_size=1, max_size=6),
    seed=st.integers(0, 2**32),
)
def test_decision_is_the_best_within_epsilon(
    prompt: int, states: list[ReplicaState], seed: int
) -> None:
    decision = decide(prompt, states, CONFIG, random.Random(seed))
    best = max(s.score for s in decision.scores)
    assert len(decision.scores) == len(states)
    window = max(CONFIG.tie_epsilon_ms, CONFIG.tie_ratio * -best)
    assert any(s.replica == decision.replica and s.score >= best - window for s in decision.scores)
    sampled = decide(prompt, states, linear(temperature=5.0), random.Random(seed))
    assert sampled.replica in {s.id for s in states}
