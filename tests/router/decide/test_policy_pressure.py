"""The policy when caches cannot hold every prefix: homes, eviction regret, busy fleets."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from router.decide.policy import decide
from router.decide.policy_types import DEFAULT_SPEED, PolicyConfig, ReplicaState
from router.decide.scoring import (
    eviction_share,
    fleet_of,
    prefill_work,
    projected_kv_usage,
    relative_churn,
    score_replica,
)

CONFIG = PolicyConfig()
PROMPT = 3200  # a 3,000-token system prompt and a question: 200 blocks of 16
PREFIX = 187  # blocks of the shared system prompt
CACHE = 700  # blocks per engine: four such prefixes do not fit


def work(tokens: int, cached: int = 0) -> float:
    """Prefill work of ``tokens`` after ``cached`` ones (a long prompt's attention counts)."""
    return prefill_work(tokens, cached, CONFIG.attention_tokens)


COLD_MS = DEFAULT_SPEED.prefill_ms(work(PROMPT))


def full(name: str, **fields: object) -> ReplicaState:
    """A replica whose cache is full (every miss evicts), average churn."""
    values: dict[str, object] = {"cache_blocks": CACHE, "resident_blocks": CACHE, "churn": 1.0}
    values.update(fields)
    return ReplicaState(name, **values)  # type: ignore[arg-type]


def choose(states: list[ReplicaState], seed: int = 0) -> str:
    return decide(PROMPT, states, CONFIG, random.Random(seed)).replica


@pytest.mark.parametrize("queued_prefills", [0, 1, 2])
def test_a_group_stays_home_through_a_short_busy_spell(queued_prefills: int) -> None:
    """Home holds the prefix and has a few cold prefills queued; the others are idle."""
    home = full(
        "home",
        matched_blocks=PREFIX,
        matched_gpu_blocks=PREFIX,
        home_blocks=PREFIX,
        inflight=queued_prefills,
        queued_prefill_tokens=queued_prefills * PROMPT,
    )
    others = [full(f"idle-{i}") for i in range(3)]
    assert all(choose([*others, home], seed) == "home" for seed in range(20))


def test_a_prefix_evicted_at_home_stays_home() -> None:
    """Nothing of the prompt is cached anywhere; only the home claim tells them apart."""
    home = full("home", home_blocks=PREFIX, inflight=1)
    others = [full(f"other-{i}", inflight=1) for i in range(3)]
    assert all(choose([*others, home], seed) == "home" for seed in range(20))
    # the evicted home still pays its recompute: no TTFT advantage, only the split it avoids
    scores = decide(PROMPT, [*others, home], CONFIG, random.Random(0)).scores
    assert len({round(s.expected_ttft_ms, 6) for s in scores}) == 1


def test_an_overloaded_home_lets_its_prefix_go() -> None:
    queue = 30 * PROMPT  # thirty cold prefills ahead: seconds of waiting
    home = full("home", home_blocks=PREFIX, inflight=30, queued_prefill_tokens=queue)
    others = [full(f"other-{i}", inflight=1) for i in range(3)]
    assert choose([*others, home]) != "home"


def test_a_new_prefix_goes_where_it_evicts_least() -> None:
    # room left in one cache: its new blocks evict nothing there
    roomy = ReplicaState("roomy", cache_blocks=CACHE, resident_blocks=300, churn=1.0)
    assert choose([full("a"), full("b"), roomy]) == "roomy"
    # every cache full: where it turns over slowest, the blocks pushed out are oldest
    slow, fast = full("slow", churn=0.5), full("fast", churn=1.8)
    assert all(choose([fast, slow], seed) == "slow" for seed in range(20))
    # but not at any price: a slow-churn replica with a long queue loses to an idle one
    queued = full("slow", churn=0.5, inflight=6, queued_prefill_tokens=6 * PROMPT)
    assert choose([fast, queued]) == "fast"


def test_eviction_share_weighed_by_churn() -> None:
    def eviction_regret(state: ReplicaState, new_blocks: float) -> float:
        return eviction_share(state, new_blocks) * relative_churn(state)

    assert eviction_regret(ReplicaState("unknown"), 100) == 1.0
    room = ReplicaState("r", cache_blocks=1000, resident_blocks=850)
    assert eviction_regret(room, 100) == 0.0  # fits in the room
    assert eviction_regret(room, 200) == pytest.approx(0.25)  # 50 of 200 evict
    # churn weighs as its square root, within [1/2, 2]
    assert eviction_regret(full("f", churn=2.25), 10) == pytest.approx(1.5)
    assert eviction_regret(full("f", churn=50.0), 10) == 2.0
    assert eviction_regret(full("f", churn=0.0), 10) == 0.5
    assert eviction_regret(full("f", churn=None), 10) == 1.0


def test_misses_cost_more_on_a_busy_fleet() -> None:
    """Sending a prompt away from its cache spends compute that delays what runs beside it."""
    warm = full("warm", matched_blocks=PREFIX, matched_gpu_blocks=PREFIX, home_blocks=PREFIX)
    cold = full("cold")
    light = [warm, cold]
    busy = [
        full("warm", matched_blocks=PREFIX, matched_gpu_blocks=PREFIX, home_blocks=PREFIX,
             inflight=8),
        full("cold", inflight=8),
    ]  # fmt: skip
    assert fleet_of(light, CONFIG).busy == 0
    assert fleet_of(busy, CONFIG).busy == 8

    def gap(states: list[ReplicaState]) -> float:
        scores = decide(PROMPT, states, CONFIG, random.Random(0)).scores
        return scores[0].score - scores[1].score

    assert gap(busy) > 4 * gap(light) > 0


def test_an_engine_whose_requests_just_finished_is_no_cheap_place_for_a_copy() -> None:
    """Home holds the prefix behind a long queue; another engine has nothing in flight and
    a cache full of three prefixes its groups reuse. Idle for a while, it takes the copy.
    Its requests just finished (four in flight over the last seconds): its groups keep
    arriving, the copy's compute is charged at that load, and the group stays home.
    Charged at the count of the moment, groups split over 2.5 engines in the 700-block
    matrix cell (71.6 % hits, smg 77.2 %)."""
    home = full(
        "home", matched_blocks=PREFIX, matched_gpu_blocks=PREFIX, home_blocks=PREFIX,
        inflight=4, recent_inflight=4.0, queued_prefill_tokens=20_000, valued_blocks=3 * PREFIX,
    )  # fmt: skip
    others = [full(f"other-{i}", inflight=4, recent_inflight=4.0) for i in range(2)]
    cold = COLD_MS - DEFAULT_SPEED.floor_ms
    for recent, winner in ((0.0, "spare"), (4.0, "home")):
        spare = full("spare", valued_blocks=3 * PREFIX, recent_inflight=recent)
        assert all(choose([home, spare, *others], seed) == winner for seed in range(20)), recent
        share = eviction_share(spare, PROMPT / 16)
        assert score_replica(PROMPT, spare, CONFIG).compute_ms == pytest.approx(
            cold * share * recent
        )
    # an engine with room is not serving enough to fill it: the count of the moment prices
    # its compute (under load, bursts at a KV-bound home overflow there; charged at its
    # recent load, the 75 % load cell's TTFT p50 went from 56 to 108 ms)
    roomy = full("spare", valued_blocks=2 * PREFIX, recent_inflight=4.0, inflight=1)
    assert eviction_share(roomy, PROMPT / 16) == 0.0
    assert score_replica(PROMPT, roomy, CONFIG).compute_ms == pytest.approx(cold)


def test_kv_memory_a_request_will_hold_counts_before_the_engine_reports_it() -> None:
    state = ReplicaState("r", kv_usage=0.8, cache_blocks=1000)
    assert projected_kv_usage(state, 1600, 16) == pytest.approx(0.9)
    assert projected_kv_usage(ReplicaState("r", kv_usage=0.8), 1600, 16) == 0.8
    assert projected_kv_usage(ReplicaState("r"), 1600, 16) is None
    # scraped with 4 running, 1 in flight now: 3 finished and freed their blocks since
    stale = ReplicaState("r", kv_usage=0.8, engine_running=4, inflight=1, cache_blocks=1000)
    assert projected_kv_usage(stale, 1600, 16) == pytest.approx(0.3)
    # every request it ran then has finished: none of the gauge's blocks are held any more
    # (a floor of one request here made a home look full for a scrape interval after its
    # last request, and sent the next one of its group elsewhere)
    done = ReplicaState("r", kv_usage=0.8, engine_running=1, inflight=0, cache_blocks=1000)
    assert projected_kv_usage(done, 1600, 16) == pytest.approx(0.1)
    # ... but requests other clients sent are still running: 2 of the 4 were not routed
    mixed = ReplicaState(
        "r", kv_usage=0.8, engine_running=4, inflight=1, routed_at_scrape=2, cache_blocks=1000
    )
    assert projected_kv_usage(mixed, 1600, 16) == pytest.approx(0.7)
    outside = ReplicaState("r", kv_usage=0.95, engine_running=3, routed_at_scrape=0)
    assert projected_kv_usage(outside, 0, 16) == pytest.approx(0.95)
    # a long answer fills the cache: the penalty starts above the 90 % watermark
    short = score_replica(1000, state, CONFIG, output_tokens=100)
    long = score_replica(1000, state, CONFIG, output_tokens=3000)
    assert short.queue_ms == pytest.approx(0.0)
    assert long.queue_ms > 100
    roomy = ReplicaState("roomy", kv_usage=0.2, cache_blocks=1000)
    assert decide(1000, [state, roomy], CONFIG, random.Random(0), 3000).replica == "roomy"


def test_ties_go_to_the_least_busy() -> None:
    states = [ReplicaState("a", inflight=3), ReplicaState("b", inflight=1)]
    assert all(decide(100, states, CONFIG, random.Random(s)).replica == "b" for s in range(20))
    # none in flight (sequential traffic): the one that served last is the busier; drawn at
    # random, new prefixes piled three or four on one engine and split groups later
    lately = [ReplicaState("a", recent_inflight=0.4), ReplicaState("b", recent_inflight=0.1)]
    assert all(decide(100, lately, CONFIG, random.Random(s)).replica == "b" for s in range(20))
    # now before lately
    mixed = [ReplicaState("a", inflight=1), ReplicaState("b", recent_inflight=1.5)]
    assert all(decide(16, mixed, CONFIG, random.Random(s)).replica == "b" for s in range(20))
    # a prompt with a home goes home, however busy the home was lately: ordered by recent
    # load, 4 routers drew groups off their homes to the engines that had been quiet
    # (3.2-3.7 engines per group, not 2.9); among the others it keeps the draw
    room = {"cache_blocks": 1000, "resident_blocks": 0}
    homed = [ReplicaState("other", **room), ReplicaState("home", home_blocks=6,
             recent_inflight=2.0, **room), ReplicaState("third", **room)]  # fmt: skip
    scores = decide(100, homed, CONFIG, random.Random(0)).scores
    assert max(s.score for s in scores) - min(s.score for s in scores) < CONFIG.tie_epsilon_ms
    assert all(decide(100, homed, CONFIG, random.Random(s)).replica == "home" for s in range(20))
    away = homed[:1] + homed[2:]
    drawn = Counter(decide(100, away, CONFIG, random.Random(s)).replica for s in range(40))
    assert set(drawn) == {"other", "third"}


def test_a_new_prefix_tie_goes_to_the_replica_serving_the_fewest_groups() -> None:
    """An engine's load follows the prefix groups it serves: early in an overload the one
    serving a single group can have more requests in flight than one serving two, and a new
    group sent by the count of the moment left the groups 3-2-2-1 over four engines."""
    one = ReplicaState("one", inflight=3, recent_inflight=2.0, prefixes=1)
    two = ReplicaState("two", inflight=2, prefixes=2)
    scores = decide(16, [one, two], CONFIG, random.Random(0)).scores
    assert abs(scores[0].score - scores[1].score) < CONFIG.tie_epsilon_ms  # an exact tie
    assert all(decide(16, [one, two], CONFIG, random.Random(s)).replica == "one"
               for s in range(20))  # fmt: skip
    # serving as many groups: the fewest in flight, as before
    even = [ReplicaState("a", inflight=3, prefixes=2), ReplicaState("b", inflight=2, prefixes=2)]
    assert all(decide(16, even, CONFIG, random.Random(s)).replica == "b" for s in range(20))


def test_an_exact_tie_goes_to_the_deepest_chain_before_the_least_busy() -> None:
    """Waiting for 32 queued tokens where 32 of the prompt are cached costs what prefilling
    them does on an idle engine: the engine that holds more of the prompt gets it (a new
    prompt's second request, predicted where its first prefilled, went to the idle engine on
    a loaded host; tests/router/test_startup_copies.py)."""
    room = {"cache_blocks": 1000, "resident_blocks": 0}
    idle = ReplicaState("idle", **room)
    holder = ReplicaState(
        "holder", matched_blocks=2, queued_prefill_tokens=32, recent_inflight=1.0, **room
    )
    scores = decide(100, [idle, holder], CONFIG, random.Random(0)).scores
    assert abs(scores[0].score - scores[1].score) < CONFIG.tie_epsilon_ms  # an exact tie
    assert all(decide(100, [idle, holder], CONFIG, random.Random(s)).replica == "holder"
               for s in range(20))  # fmt: skip


def test_a_copy_left_by_outside_traffic_does_not_pull_a_group_from_home() -> None:
    """A client that bypasses the routers left the prefix on another engine: routing there
    would keep two copies alive in full caches; the group stays home, which also holds it."""
    cached = {"matched_blocks": PREFIX, "matched_gpu_blocks": PREFIX}
    home = full("home", home_blocks=PREFIX, inflight=1, **cached)
    stray = full("stray", inflight=0, **cached)
    assert all(choose([stray, home], seed) == "home" for seed in range(20))
    # on a fleet with room to spare either copy will do: the idler one wins
    roomy = {"cache_blocks": 4 * CACHE, "resident_blocks": CACHE}
    home = ReplicaState("home", home_blocks=PREFIX, inflight=1, **cached, **roomy)
    stray = ReplicaState("stray", **cached, **roomy)
    assert choose([stray, home]) == "stray"


def test_blocks_no_request_reuses_are_room() -> None:
    """A warm engine's cache is always full, mostly of finished requests' own blocks: those
    are free to evict; only the prefixes routed requests reuse there are worth keeping."""
    assert eviction_share(full("r"), 200) == 1.0  # reuse unknown: every resident block counts
    assert eviction_share(full("r", valued_blocks=2 * PREFIX), 200) == 0.0  # 326 free
    assert eviction_share(full("r", valued_blocks=3 * PREFIX), 200) == pytest.approx(0.305)
    # the index says what is there at all: reuse seen before a restart holds nothing now
    assert eviction_share(full("r", resident_blocks=0, valued_blocks=CACHE), 200) == 0.0


def test_a_burst_at_a_kv_full_home_overflows_where_nothing_reused_is_evicted() -> None:
    """Home holds its prefix but its KV memory is taken (it would queue the request behind
    decodes); another replica's full cache holds two reused prefixes and finished requests'
    blocks. The copy evicts nothing anyone reuses: it goes there. Were that cache full of
    reused prefixes, the copy would push one out and split the group: it stays home."""
    busy = {"inflight": 8, "engine_running": 8, "routed_at_scrape": 8, "kv_usage": 0.97}
    home = full(
        "home", matched_blocks=PREFIX, matched_gpu_blocks=PREFIX, home_blocks=PREFIX,
        queued_prefill_tokens=8 * (PROMPT - PREFIX * 16), valued_blocks=3 * PREFIX, **busy,
    )  # fmt: skip
    spare = full("spare", inflight=1, kv_usage=0.1, valued_blocks=2 * PREFIX)
    assert all(choose([home, spare], seed) == "spare" for seed in range(20))
    taken = full("taken", inflight=1, kv_usage=0.1, valued_blocks=CACHE)
    assert all(choose([home, taken], seed) == "home" for seed in range(20))


def test_a_scrape_taken_while_the_last_request_ran_does_not_make_home_busy() -> None:
    """The engine counted the group's previous request, which has finished since: home is
    idle (seen with two routers and sequential groups: the home looked busy for a scrape
    interval and the group's next request left it). Other clients' requests still count."""
    stale = {"engine_running": 1, "routed_at_scrape": 1, "kv_usage": 0.8}
    home = full("home", home_blocks=PREFIX, **stale)
    assert score_replica(PROMPT, home, CONFIG).compute_ms == 0.0
    assert all(choose([full("other"), home], seed) == "home" for seed in range(20))
    outside = full("home", engine_running=3, engine_waiting=1, routed_at_scrape=1, inflight=1)
    own = score_replica(PROMPT, outside, CONFIG)
    assert own.compute_ms == pytest.approx(DEFAULT_SPEED.prefill_ms_per_token * work(PROMPT) * 4)


def test_a_session_stays_home_unless_another_engine_starts_it_sooner() -> None:
    """A session's home wins while no other engine would give the first token sooner, even
    over the prompt's own home (the key is explicit, the chain's home inferred); a cached
    hit, a queue or a full KV cache at home let it go."""
    room = {"cache_blocks": 1000, "resident_blocks": 0}
    fresh = [ReplicaState("a", **room), ReplicaState("b", session_home=True, **room),
             ReplicaState("c", **room)]  # fmt: skip
    assert all(decide(800, fresh, CONFIG, random.Random(s)).replica == "b" for s in range(20))
    homed = [fresh[0], fresh[1], ReplicaState("c", home_blocks=10, **room)]
    assert all(decide(800, homed, CONFIG, random.Random(s)).replica == "b" for s in range(20))
    cached = [ReplicaState("a", matched_blocks=40, matched_gpu_blocks=40, **room), fresh[1]]
    assert decide(800, cached, CONFIG, random.Random(0)).replica == "a"
    busy = [fresh[0], ReplicaState("b", session_home=True, inflight=4,
            queued_prefill_tokens=20_000, **room)]  # fmt: skip
    assert decide(800, busy, CONFIG, random.Random(0)).replica == "a"
    full_kv = [fresh[0], ReplicaState("b", session_home=True, kv_usage=0.99, engine_running=1,
               inflight=1, **room)]  # fmt: skip
    assert decide(800, full_kv, CONFIG, random.Random(0)).replica == "a"


def test_a_session_stays_beside_its_own_subagents() -> None:
    """A 30k-token turn whose history (1,800 blocks) is cached at home, where 30 of the
    session's subagents run: the score alone prices their delay above a cold prefill on an
    idle engine and would move the session, but home starts it far sooner (decision log of
    the agents matrix cell, 2026-12-07: such moves were its slowest requests)."""
    prompt, history = 30_000, 1_800
    home = {
        "matched_blocks": history,
        "matched_gpu_blocks": history,
        "inflight": 30,
        "queued_prefill_tokens": 1_600,
        "cache_blocks": 8_000,
        "resident_blocks": 2_000,
    }
    idle = ReplicaState("idle", cache_blocks=8_000, resident_blocks=0)
    keyless = [ReplicaState("home", **home), idle]  # type: ignore[arg-type]
    assert decide(prompt, keyless, CONFIG, random.Random(0)).replica == "idle"
    keyed = [ReplicaState("home", session_home=True, **home), idle]  # type: ignore[arg-type]
    decision = decide(prompt, keyed, CONFIG, random.Random(0))
    assert decision.replica == "home"
    assert decision.scores[0].score < decision.scores[1].score  # not by the score


def test_a_new_session_goes_where_fewer_sessions_live() -> None:
    """Two idle engines, one the home of two other sessions in their think time: a new
    session's cold prefill there would delay their next turns, so it goes to the other."""
    room = {"cache_blocks": 8_000, "resident_blocks": 0}
    hosts = ReplicaState("hosts", sessions=2, matched_blocks=180, matched_gpu_blocks=180,
                         **room)  # fmt: skip
    empty = ReplicaState("empty", **room)
    assert decide(18_000, [hosts, empty], CONFIG, random.Random(0)).replica == "empty"
    own = score_replica(18_000, hosts, CONFIG)
    own_work = work(18_000 - 180 * 16, 180 * 16)
    assert own.compute_ms == pytest.approx(DEFAULT_SPEED.prefill_ms_per_token * own_work * 2)
