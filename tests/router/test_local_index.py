"""``--local-index``: each router's own index fed by the engines' events, the load shared
through Redis (real redis-server, real engines' ZMQ events, real uvicorn)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from router.http.proxy import PREDICTED_HEADER, REPLICA_HEADER
from router.service import RouterService
from router.shared.load import Load
from router.shared.redis_load import RedisLoadBoard
from tests.factories import SIM
from tests.procs import RedisServer
from tests.router.harness import SYSTEM, base_url, chat, engines, metric, router, wait_until
from tracker.core.memory_index import MemoryIndex

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

SHARED = {"load_refresh_ms": 10.0, "lease_ttl_s": 1.5, "load_renew_s": 0.3}


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server this test may stop (not the shared session one)."""
    server = RedisServer().start()
    yield server
    server.close()


async def _cached(client: httpx.AsyncClient, system: str, user: str) -> tuple[str, int, int]:
    answer = await client.post("/v1/chat/completions", json=chat(system, user))
    assert answer.status_code == 200, answer.text
    cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return answer.headers[REPLICA_HEADER], int(answer.headers[PREDICTED_HEADER]), cached


async def test_each_router_indexes_the_events_and_sees_the_others_load(redis_url: str) -> None:
    async with (
        engines(2, time_scale=1.0, floor_ms=20.0) as fleet,
        router(replica=fleet.specs, redis=redis_url, local_index=True, **SHARED) as a,
        # without engine scrapes, b knows a's requests only from the shared load
        router(
            replica=fleet.specs, redis=redis_url, local_index=True, metrics_interval_s=0, **SHARED
        ) as b,
        httpx.AsyncClient(base_url=base_url(a), timeout=20) as ca,
        httpx.AsyncClient(base_url=base_url(b), timeout=20) as cb,
    ):
        assert isinstance(a.backing.index, MemoryIndex) and isinstance(b.backing.index, MemoryIndex)
        # a prefix routed by a is found by b in its own index, exactly as the engine has it
        home, predicted, cached = await _cached(ca, SYSTEM, "one")
        assert predicted == cached == 0
        for i in range(3):
            replica, predicted, cached = await _cached(cb, SYSTEM, f"q {i}")
            assert replica == home and predicted == cached > 1000

        # three long streams through a, on the prefix's home: b sends a new prefix elsewhere
        async def stream(i: int) -> None:
            body = chat(SYSTEM, f"long {i}", stream=True, max_tokens=300)
            async with ca.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.headers[REPLICA_HEADER] == home
                async for _ in response.aiter_bytes():
                    pass

        streams = [asyncio.create_task(stream(i)) for i in range(3)]
        try:

            async def seen() -> bool:
                return _inflight(b, home) == 3

            await wait_until(seen, within=5)
            other, _, _ = await _cached(cb, "A different system prompt. " * 40, "new")
            assert other != home
        finally:
            await asyncio.gather(*streams, return_exceptions=True)
        page = (await cb.get("/metrics")).text
        assert metric(page, "kvrouter_router_fallbacks_total", reason="timeout") == 0


def _inflight(service: RouterService, replica: str) -> int:
    """What ``service``'s decisions see of ``replica``'s requests in flight (every router's)."""
    board = service.router.load
    assert isinstance(board, RedisLoadBoard)
    return board.view(SIM).get(replica, Load()).inflight


async def test_redis_down_costs_only_the_shared_load(own_redis: RedisServer) -> None:
    """The index is the router's own: with Redis gone, prefixes are still found and homed,
    nothing falls back to load-only routing, and the load is shared again once Redis is back."""
    async with (
        engines(2) as fleet,
        router(replica=fleet.specs, redis=own_redis.url, local_index=True, **SHARED) as a,
        router(replica=fleet.specs, redis=own_redis.url, local_index=True, **SHARED) as b,
        httpx.AsyncClient(base_url=base_url(a), timeout=20) as client,
    ):
        home, _, _ = await _cached(client, SYSTEM, "one")
        own_redis.stop()
        for i in range(4):
            replica, predicted, cached = await _cached(client, SYSTEM, f"q {i}")
            assert replica == home and predicted == cached > 1000
        page = (await client.get("/metrics")).text
        for reason in ("timeout", "error", "breaker_open"):
            assert metric(page, "kvrouter_router_fallbacks_total", reason=reason) == 0

        async def counted() -> bool:  # what went unshared is counted for the operator
            page = (await client.get("/metrics")).text
            errors = "kvrouter_router_shared_state_errors_total"
            return all(metric(page, errors, what=w) > 0 for w in ("load_read", "route_write"))

        await wait_until(counted, within=5)
        own_redis.start()
        board = a.router.load
        assert isinstance(board, RedisLoadBoard)
        lease = board.acquire(SIM, home, 64)  # a's load reaches b again

        async def shared() -> bool:
            return _inflight(b, home) == 1

        await wait_until(shared, within=10)
        lease.release()


async def test_a_route_through_one_router_is_known_to_the_other_before_the_engine_says_so(
    redis_url: str,
) -> None:
    """A new prefix sent through a, and its group's next request through b while the first
    still prefills (no event yet): b sees a's prediction and home through the route feed and
    sends it to the same engine, not to the idle one its load view prefers."""
    async with (
        engines(2, time_scale=1.0, floor_ms=600.0) as fleet,
        router(replica=fleet.specs, redis=redis_url, local_index=True, **SHARED) as a,
        router(replica=fleet.specs, redis=redis_url, local_index=True, **SHARED) as b,
        httpx.AsyncClient(base_url=base_url(a), timeout=20) as ca,
        httpx.AsyncClient(base_url=base_url(b), timeout=20) as cb,
    ):
        await cb.post("/index", json=chat("warm", "up"))  # from now on b reads "sim" routes
        first = asyncio.create_task(_cached(ca, SYSTEM, "one"))
        feed = b.router.feed
        assert feed is not None

        async def applied() -> bool:
            return feed.stats.applied >= 1

        await wait_until(applied, within=5)
        assert not first.done()  # still prefilling: the engine has published nothing
        replica, predicted, _ = await _cached(cb, SYSTEM, "two")
        home, _, _ = await first
        assert replica == home and predicted > 1000
