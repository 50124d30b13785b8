"""The route feed between routers with their own index (real redis-server)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio as redis

from router.shared.routefeed import RouteFeed
from tests.factories import SIM
from tests.procs import free_port
from tracker.core.index import Route
from tracker.core.keys import NamespaceKeys
from tracker.core.memory_index import MemoryIndex

pytestmark = pytest.mark.redis

KEYS = [11, 12, 13, 14]
Factory = Callable[..., RouteFeed]


@pytest.fixture
async def feeds(redis_url: str) -> AsyncIterator[Factory]:
    """Route feeds of routers sharing one redis-server, each with its own index."""
    made: list[tuple[RouteFeed, redis.Redis]] = []

    def make(name: str, url: str = redis_url, since_s: float = 60.0) -> RouteFeed:
        client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        feed = RouteFeed(client, name, MemoryIndex(), refresh_s=0.01, since_s=since_s)
        made.append((feed, client))
        return feed

    yield make
    for feed, client in made:
        await feed.stop()
        await client.aclose()


async def _drain(feed: RouteFeed) -> None:
    """Until the background write of what was published is done."""
    if feed._pusher is not None:
        await feed._pusher


async def test_routes_reach_the_other_routers_index_not_their_own(feeds: Factory) -> None:
    a, b = feeds("a"), feeds("b")
    b.want(SIM)
    assert await b.refresh() == 0
    a.publish(SIM, Route("r1", KEYS, 3.0, [11], 120.0))
    await _drain(a)
    assert a.stats.written == 1
    assert await b.refresh() == 1 and await b.refresh() == 0  # read once
    survey = await b.index.survey(SIM, KEYS)
    assert survey.matches["r1"].predicted_blocks == 4
    assert set(survey.homes) == {"r1"} and survey.homes["r1"].blocks == 1
    a.want(SIM)
    assert await a.refresh() == 0  # its own route is already in its index (the router's)
    assert (await a.index.survey(SIM, KEYS)).matches == {}


async def test_a_keyed_route_carries_its_session(feeds: Factory) -> None:
    """A route that names a session makes the session live on its replica in the other
    routers' indexes too, for the route's window."""
    a, b = feeds("a"), feeds("b")
    b.want(SIM)
    a.publish(SIM, Route("r1", KEYS, 3.0, [11, 77], 120.0, session=77, session_ttl_s=30.0))
    a.publish(SIM, Route("r2", KEYS, 3.0, [11], 120.0))  # keyless: no session
    await _drain(a)
    assert await b.refresh() == 2
    assert (await b.index.survey(SIM, KEYS, session=99)).sessions == {"r1": 1}
    assert set((await b.index.survey(SIM, KEYS, session=77)).session) == {"r1"}


async def test_a_route_counts_from_when_it_was_made(feeds: Factory) -> None:
    """Lifetimes run from the entry's time: an old prediction is not revived, its home
    claim keeps its age, and a claim made later is not overwritten by an earlier one."""
    a, b = feeds("a"), feeds("b")
    a.publish(SIM, Route("r1", KEYS, 0.2, [11], 120.0))
    await _drain(a)
    await asyncio.sleep(0.3)
    b.index.record_route(SIM, Route("r2", anchors=[11], home_ttl_s=120.0))  # b's own
    b.want(SIM)
    assert await b.refresh() == 1
    survey = await b.index.survey(SIM, KEYS)
    assert "r1" not in survey.matches  # the prediction expired before b read it
    assert set(survey.homes) == {"r2"}  # b's later claim stands
    c = feeds("c")
    c.want(SIM)
    await c.refresh()
    home = (await c.index.survey(SIM, KEYS)).homes["r1"]
    assert home.age_s >= 0.25


async def test_a_new_router_reads_the_live_homes_and_the_stream_is_capped(
    feeds: Factory, redis_url: str
) -> None:
    a = feeds("a")
    for i in range(3):
        a.publish(SIM, Route(f"r{i}", [100 + i], 3.0, [100 + i], 120.0))
    await _drain(a)
    late = feeds("late", since_s=60.0)
    late.want(SIM)
    assert await late.refresh() == 3
    none = feeds("none", since_s=0.0)  # homes older than its window are not read
    none.want(SIM)
    await asyncio.sleep(0.01)
    assert await none.refresh() == 0
    async with redis.Redis.from_url(redis_url) as client:
        info = await client.xinfo_stream(NamespaceKeys(SIM).routes)
    assert info["length"] == 3


async def test_redis_down_drops_routes_and_never_raises(feeds: Factory) -> None:
    a = feeds("a", url=f"redis://127.0.0.1:{free_port()}/0")
    await a.start()
    a.want(SIM)
    a.publish(SIM, Route("r1", KEYS, 3.0, [11], 120.0))
    await _drain(a)
    await asyncio.sleep(0.05)
    assert a.stats.write_errors == 1 and a.stats.written == 0
    assert a.stats.read_errors >= 1


async def test_a_malformed_entry_is_skipped_and_the_rest_applied(
    feeds: Factory, redis_url: str
) -> None:
    a, b = feeds("a"), feeds("b")
    b.want(SIM)
    await b.refresh()
    async with redis.Redis.from_url(redis_url) as client:
        await client.xadd(NamespaceKeys(SIM).routes, {"r": "old-router", "p": "r9", "k": "x"})
    a.publish(SIM, Route("r1", KEYS, 3.0, [11], 120.0))
    await _drain(a)
    assert await b.refresh() == 1
    assert b.stats.malformed == 1
    assert (await b.index.survey(SIM, KEYS)).matches["r1"].predicted_blocks == 4
