"""A prefix whose only home runs short of KV memory gets a second home, off the request path.

The plan is a pure function of what the policy knows (:func:`router.replicate.plan_copy`);
the copy itself is a real one-token request to a real simulated engine, whose cache must
hold the prefix afterwards.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from router.policy import ReplicaState
from router.replicate import CopyConfig, CopyPlan, plan_copy
from tests.router.harness import SYSTEM, base_url, chat, engines, metric, router, wait_until

CONFIG = CopyConfig()
PREFIX = 300  # blocks: a 4,800-token system prompt


def _home(**changes: object) -> ReplicaState:
    state = {
        "id": "home",
        "matched_blocks": PREFIX,
        "matched_gpu_blocks": PREFIX,
        "inflight": 4,
        "kv_usage": 0.93,
        "cache_blocks": 1024,
        "valued_blocks": 903,  # three groups' prefixes
    }
    state.update(changes)
    return ReplicaState(**state)  # type: ignore[arg-type]


def _other(name: str, **changes: object) -> ReplicaState:
    state = {
        "id": name,
        "inflight": 0,
        "engine_waiting": 0,
        "kv_usage": 0.2,
        "cache_blocks": 1024,
        "valued_blocks": 602,  # two groups' prefixes
    }
    state.update(changes)
    return ReplicaState(**state)  # type: ignore[arg-type]


def test_a_tight_home_copies_its_prefix_to_the_idle_replica_with_most_room() -> None:
    states = [_home(), _other("a", valued_blocks=602), _other("b", valued_blocks=301)]
    assert plan_copy(states, "home", CONFIG) == CopyPlan("b", PREFIX)


def test_a_home_with_kv_to_spare_keeps_its_prefix_alone() -> None:
    states = [_home(kv_usage=0.6), _other("a")]
    assert plan_copy(states, "home", CONFIG) is None
    assert plan_copy([_home(kv_usage=None), _other("a")], "home", CONFIG) is None


def test_a_prefix_with_a_second_home_is_not_copied_again() -> None:
    states = [_home(), _other("a", matched_blocks=PREFIX), _other("b")]
    assert plan_copy(states, "home", CONFIG) is None


def test_a_miss_or_a_short_prefix_is_not_copied() -> None:
    assert plan_copy([_home(matched_gpu_blocks=10), _other("a")], "home", CONFIG) is None
    states = [_other("x", kv_usage=0.95, matched_gpu_blocks=0), _other("a")]
    assert plan_copy(states, "x", CONFIG) is None


def test_no_copy_to_a_busy_replica() -> None:
    busy = [
        _other("a", inflight=2),
        _other("b", engine_waiting=1),
        _other("c", kv_usage=0.7),
        _other("d", kv_usage=None),
    ]
    assert plan_copy([_home(), *busy], "home", CONFIG) is None


def test_no_copy_where_the_cache_cannot_hold_it_beside_the_prefixes_in_use() -> None:
    # 700-block caches holding two 300-block prefixes each: a third would evict one
    states = [_home(cache_blocks=700), _other("a", cache_blocks=700, valued_blocks=602)]
    assert plan_copy(states, "home", CONFIG) is None
    unknown = [_home(), _other("a", valued_blocks=None), _other("b", cache_blocks=None)]
    assert plan_copy(unknown, "home", CONFIG) is None


def test_no_copy_where_the_fleet_needs_the_room_for_its_requests() -> None:
    """Four 1,024-block caches holding ten 300-block prefixes keep 1,087 blocks beside them
    after a copy: three times the KV of 10 requests of 15 blocks in flight, not of 30."""
    states = [_home(), _other("a"), _other("b"), _other("c")]
    light = plan_copy(states, "home", CONFIG, fleet_inflight=10, request_blocks=15)
    assert light == CopyPlan("a", PREFIX)
    assert plan_copy(states, "home", CONFIG, fleet_inflight=30, request_blocks=15) is None


def test_off_above_one() -> None:
    states = [_home(kv_usage=1.0), _other("a")]
    assert plan_copy(states, "home", CopyConfig(kv_usage=1.01)) is None
    assert plan_copy(states, "home", CopyConfig(kv_usage=1.0)) == CopyPlan("a", PREFIX)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("copy_at", [0.0, 2.0])
async def test_a_hit_on_a_single_home_copies_the_prefix_into_the_idle_engine(
    copy_at: float,
) -> None:
    """With the trigger at 0 every hit on a one-replica prefix copies it (2: never); the
    copy lands in the other engine's cache, which a request sent straight to it then reuses."""
    system = SYSTEM * 4  # ~1,000 tokens
    async with (
        engines(2) as fleet,
        router(replica=fleet.specs, copy_at_kv_usage=copy_at, copy_watch_s=0.0) as service,
        httpx.AsyncClient(base_url=base_url(service), timeout=20) as client,
    ):
        await wait_until(lambda: all(r.engine is not None for r in service.router.replicas.all()))
        first = await client.post("/v1/chat/completions", json=chat(system, "first"))
        assert first.status_code == 200
        home = first.headers["x-kvrouter-replica"]
        other = next(r for r in service.router.replicas.all() if r.id != home)

        async def indexed() -> bool:
            index = await client.post("/index", json=chat(system, "second"))
            match = index.json()["replicas"].get(home, {})
            return match.get("matched_tokens", 0) - match.get("predicted_blocks", 0) * 16 > 500

        await wait_until(indexed)
        second = await client.post("/v1/chat/completions", json=chat(system, "second"))
        assert second.status_code == 200
        assert second.headers["x-kvrouter-replica"] == home

        async def copies() -> float:
            text = (await client.get("/metrics")).text
            return metric(text, "kvrouter_router_prefix_copies_total", replica=other.id)

        if copy_at <= 1:
            await wait_until(copies)
            assert await copies() == 1
            ok = metric(
                (await client.get("/metrics")).text,
                "kvrouter_router_prefix_copies_total",
                outcome="ok",
            )
            assert ok == 1
        async with httpx.AsyncClient(base_url=other.url, timeout=20) as direct:
            third = await direct.post("/v1/chat/completions", json=chat(system, "third"))
        cached = third.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        if copy_at <= 1:
            assert cached > 500
        else:
            assert cached == 0
            assert await copies() == 0
        # a prefix with two homes is not copied again, wherever its next request goes
        fourth = await client.post("/v1/chat/completions", json=chat(system, "fourth"))
        assert fourth.status_code == 200
        await asyncio.sleep(0.3)
        total = metric((await client.get("/metrics")).text, "kvrouter_router_prefix_copies_total")
        assert total == (1 if copy_at <= 1 else 0)
