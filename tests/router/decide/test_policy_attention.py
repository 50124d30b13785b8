"""A long prompt's attention in the policy: prefill work grows faster than its token count,
so an engine midway through a 100k-token prefill is not free once the linear estimate of it
has passed (issue 41: short prompts waited ~6 s behind such prefills)."""

from __future__ import annotations

import random

import pytest

from bench.fleet import lone_prefill_speed
from publishers.sim.latency import load_profile
from router.decide.policy import decide
from router.decide.policy_types import DEFAULT_SPEED, PolicyConfig, ReplicaState
from router.decide.scoring import prefill_work, score_replica

CONFIG = PolicyConfig()
L = CONFIG.attention_tokens
LONG = 100_000


def test_prefill_work_counts_each_tokens_attention_to_what_comes_before() -> None:
    assert prefill_work(1_000, 0, 0.0) == 1_000  # linear when switched off
    assert prefill_work(0, 50_000, L) == 0.0
    assert prefill_work(-5, 0, L) == 0.0
    # a short prompt is nearly linear; a 100k-token one ~2.9x per token on Llama-8B
    assert prefill_work(1_000, 0, L) == pytest.approx(1_000, rel=0.02)
    assert prefill_work(LONG, 0, L) / LONG == pytest.approx(1 + 50_000 / L)
    # a hit's tail attends to the cached context: 2k new tokens after 100k cost ~5x 2k cold
    assert prefill_work(2_000, LONG, L) == pytest.approx(2_000 * (1 + 101_000 / L))
    # chunks add up to the whole (chunked prefill does the same work)
    halves = prefill_work(LONG // 2, 0, L) + prefill_work(LONG // 2, LONG // 2, L)
    assert halves == pytest.approx(prefill_work(LONG, 0, L))


def test_the_estimate_of_a_long_prefill_matches_the_simulated_engine() -> None:
    """The policy's seed and attention constant, taken from the simulator's H200 profile as
    the benchmark takes them, price a lone 100k-token prefill within 5 % of what the engine
    takes (a line through short prompts said 37 % of it)."""
    profile = load_profile("llama-8b")
    speed = lone_prefill_speed(profile, 8192)
    engine_ms = profile.lone_prefill_ms(LONG, 8192)
    config = PolicyConfig(attention_tokens=profile.attention_tokens)
    state = ReplicaState("r", speed=speed)
    assert score_replica(LONG, state, config).expected_ttft_ms == pytest.approx(engine_ms, 0.05)
    linear = score_replica(LONG, state, PolicyConfig(attention_tokens=0.0)).expected_ttft_ms
    assert linear < 0.4 * engine_ms


def _midway(config: PolicyConfig, elapsed_ms: float) -> ReplicaState:
    """An engine prefilling a cold 100k-token prompt sent ``elapsed_ms`` ago: its lease
    queued the prompt's work as the router priced it."""
    queued = round(prefill_work(LONG, 0, config.attention_tokens))
    return ReplicaState(
        "midway", inflight=1, queued_prefill_tokens=queued, prefill_elapsed_ms=elapsed_ms
    )


def test_a_short_prompt_avoids_an_engine_midway_through_a_100k_prefill() -> None:
    # 4 s in, the 100k prefill has ~4.5 s to go (8.5 s in all); a line through short
    # prompts (0.028 ms a token) had it finished after 2.8 s
    decoding = ReplicaState("decoding", inflight=2, engine_running=2)
    remaining = DEFAULT_SPEED.prefill_ms_per_token * prefill_work(LONG, 0, L) - 4_000
    midway = _midway(CONFIG, 4_000)
    queue = score_replica(8_000, midway, CONFIG).queue_ms
    assert queue == pytest.approx(remaining + CONFIG.decode_ms_per_request, rel=0.01)
    assert remaining > 4_000
    for seed in range(10):
        chosen = decide(8_000, [midway, decoding], CONFIG, random.Random(seed)).replica
        assert chosen == "decoding"
    # priced linearly, the engine looks done and wins on its smaller batch: the bug
    linear = PolicyConfig(attention_tokens=0.0)
    assert decide(8_000, [_midway(linear, 4_000), decoding], linear, random.Random(0)).replica == (
        "midway"
    )
    # near its end it is the sooner start again
    late = _midway(CONFIG, remaining + 3_950)
    assert decide(8_000, [late, decoding], CONFIG, random.Random(0)).replica == "midway"


def test_a_long_prompt_with_a_real_hit_still_goes_home() -> None:
    """A session's 100k-token turn whose previous 98k tokens are cached at home goes home,
    behind a short request prefilling there, rather than to an idle engine: its new 2k
    tokens cost more with the context they attend to, the cold copy 100k tokens' worth."""
    cached_blocks = 98_000 // 16
    home = ReplicaState(
        "home", matched_blocks=cached_blocks, matched_gpu_blocks=cached_blocks, inflight=1,
        queued_prefill_tokens=8_000, home_blocks=cached_blocks, cache_blocks=20_000,
        resident_blocks=0,
    )  # fmt: skip
    idle = ReplicaState("idle", cache_blocks=20_000, resident_blocks=0)
    decision = decide(LONG, [home, idle], CONFIG, random.Random(0))
    assert decision.replica == "home"
    at_home = decision.scores[0]
    assert at_home.prefill_work == pytest.approx(prefill_work(LONG - 98_000, 98_000, L))
    assert at_home.work_tokens == pytest.approx(8_000 + at_home.prefill_work)
