"""The tracker election against a real redis-server: one lease holder, fencing numbers that
grow with every win, stale writers refused by the index, a standby that takes over."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import redis.asyncio as aredis
import zmq.asyncio
from prometheus_client import CollectorRegistry

from tests.factories import SMALL, batch
from tests.procs import free_port
from tests.tracker.publisher import EventPublisher
from tests.tracker.tracking import (
    A_TOKENS,
    ANY,
    ROOTS,
    block_a,
    held,
    root,
    sample,
    settings,
    wait_until,
)
from tracker.core.redis_index import RedisIndex
from tracker.framework.errors import FencedError
from tracker.ingest.config import TrackerSettings
from tracker.ingest.lease import TrackerLease
from tracker.ingest.service import TrackerService

pytestmark = pytest.mark.redis


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aredis.Redis]:
    connection = aredis.Redis.from_url(redis_url)
    yield connection
    await connection.aclose()


async def test_one_holder_at_a_time_and_every_win_draws_a_higher_fence(
    client: aredis.Redis,
) -> None:
    a = TrackerLease(client, "fleet", 5.0, holder="a")
    b = TrackerLease(client, "fleet", 5.0, holder="b")
    other = TrackerLease(client, "another-fleet", 5.0, holder="b")
    assert await a.acquire() == 1
    assert await b.acquire() == 0  # held by a
    assert await a.acquire() == 1  # a renews through acquire too
    assert await other.acquire() == 1  # elections are independent
    assert await a.renew() and await a.holder_now() == "1 a"
    assert await b.renew() is False and await b.release() is False
    assert await a.release()
    assert await a.holder_now() is None
    assert await b.acquire() == 2
    assert await a.renew() is False  # a's lease is gone: it must not act as the holder


async def test_an_expired_lease_goes_to_the_next_tracker(client: aredis.Redis) -> None:
    a = TrackerLease(client, "fleet", 0.2, holder="a")
    b = TrackerLease(client, "fleet", 0.2, holder="b")
    assert await a.acquire() == 1
    assert await b.acquire() == 0
    await asyncio.sleep(0.3)  # a died: nobody renewed
    assert await b.acquire() == 2
    assert await a.renew() is False


def test_lease_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="needs --redis"):
        TrackerSettings(lease_ttl_s=5.0)
    with pytest.raises(ValueError, match="lease_ttl_s"):
        TrackerSettings(lease_ttl_s=-1.0, redis="redis://x")
    with pytest.raises(ValueError, match="election"):
        TrackerSettings(lease_ttl_s=5.0, redis="redis://x", election="")


async def test_a_stale_tracker_cannot_write_once_the_next_one_claimed_the_partitions(
    redis_url: str,
) -> None:
    old, new = RedisIndex.from_url(redis_url), RedisIndex.from_url(redis_url)
    try:
        step = batch(block_a())
        assert await old.claim_partitions(1, "fleet") == 0  # nothing written yet
        await old.apply("r1", SMALL, step, 0)
        assert await held(new, A_TOKENS) == {"r1": 2}
        # a paused old tracker lost its lease; the new one claims before it reads anything
        assert await new.claim_partitions(2, "fleet") == 1
        with pytest.raises(FencedError):
            await old.apply("r2", SMALL, step, 0)
        with pytest.raises(FencedError):
            await old.clear("r1", SMALL)
        assert await held(new, A_TOKENS) == {"r1": 2}  # neither write landed
        await new.apply("r2", SMALL, step, 0)
        assert await held(new, A_TOKENS) == {"r1": 2, "r2": 2}
        with pytest.raises(FencedError):  # and an old tracker cannot claim them back
            await old.claim_partitions(1, "fleet")
    finally:
        await old.close()
        await new.close()


async def test_elections_over_other_replicas_of_one_model_do_not_fence_each_other(
    redis_url: str,
) -> None:
    # a fleet too big for one tracker: its replicas split over two elections, same model
    east, west = RedisIndex.from_url(redis_url), RedisIndex.from_url(redis_url)
    try:
        step = batch(block_a())
        await east.apply("east-1", SMALL, step, 0)
        await west.apply("west-1", SMALL, step, 0)
        assert await east.claim_partitions(7, "east") == 1
        assert await west.claim_partitions(1, "west") == 1  # a lower number, another election
        await east.apply("east-2", SMALL, step, 0)
        await west.apply("west-2", SMALL, step, 0)
        assert await held(east, A_TOKENS) == {
            f"{s}-{i}": 2 for s in ("east", "west") for i in (1, 2)
        }
    finally:
        await east.close()
        await west.close()


@pytest.fixture
async def publisher(zctx: zmq.asyncio.Context) -> AsyncIterator[EventPublisher]:
    pub = await EventPublisher(zctx, ANY, replay=ANY).start()
    yield pub
    await pub.close()


async def test_the_standby_takes_over_and_the_tracker_that_lost_its_lease_stops(
    redis_url: str, publisher: EventPublisher
) -> None:
    indexes = [RedisIndex.from_url(redis_url) for _ in range(2)]
    services: list[TrackerService] = []

    def tracker(index: RedisIndex, name: str) -> TrackerService:
        config = settings(
            redis=redis_url,
            replica=(f"r1={publisher.endpoint},replay={publisher.replay_endpoint}",),
            http_port=free_port(),
            lease_ttl_s=0.6,
            discover=False,
            shutdown_timeout_s=0.5,
        )
        lease = TrackerLease(index.client, config.election, config.lease_ttl_s, holder=name)
        service = TrackerService(config, index, CollectorRegistry(), lease=lease)
        services.append(service)
        return service

    async def role(service: TrackerService) -> Any:
        async with httpx.AsyncClient() as http:
            body = (await http.get(f"http://127.0.0.1:{service.http_port}/health")).json()
        return body["role"]

    try:
        first, second = tracker(indexes[0], "first"), tracker(indexes[1], "second")
        await first.start()
        await wait_until(lambda: first.role == "active", what="first elected")
        await second.start()
        assert await role(second) == "standby" and await role(first) == "active"
        assert sample(second.registry, "kvrouter_tracker_active") == 0
        await publisher.wait_subscribed()
        await publisher.publish(block_a())
        await wait_until(lambda: held(indexes[1], A_TOKENS), what="first applied seq 0")

        # the first tracker freezes (a long pause): its lease expires, the standby wins it,
        # claims the partitions and resumes r1 from its checkpoint by replay
        first.lease.renew = _never_renewed  # type: ignore[method-assign,union-attr]
        await wait_until(lambda: second.role == "active", timeout_s=5, what="takeover")
        assert second.lease is not None and second.lease.fence == 2
        assert sample(second.registry, "kvrouter_tracker_elections_won_total") == 1
        await publisher.publish(root("D"))
        await wait_until(lambda: held(indexes[1], ROOTS["D"][0]), what="second applied seq 1")
        # the first one's own writes are refused from now on, and it stops
        with pytest.raises(FencedError):
            await indexes[0].apply("r9", SMALL, batch(block_a()), 0)
        await wait_until(first._stopping.is_set, what="first stopped")
        assert isinstance(first._failure, FencedError)
        assert await held(indexes[1], A_TOKENS) == {"r1": 2}

        # a graceful stop hands over at once (no waiting out the TTL)
        third = tracker(RedisIndex.from_url(redis_url), "third")
        indexes.append(third.index)  # type: ignore[arg-type]
        await third.start()
        await second.stop()
        await wait_until(lambda: third.role == "active", timeout_s=0.5, what="handover")
    finally:
        for service in services:
            await service.stop()
        for index in indexes:
            await index.close()


async def _never_renewed() -> bool:
    await asyncio.sleep(3600)
    return True
