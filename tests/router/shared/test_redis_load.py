"""RedisLoadBoard: load shared across routers through Redis (real server), and its view."""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
import redis.asyncio as redis

from bench.stack.redis_servers import RedisServer
from router.shared.load import Load, LoadBoard
from router.shared.redis_load import VIEW_MAX_AGE_S, RedisLoadBoard, new_router_id
from tests.factories import LOAD as NS
from tests.factories import LOAD_OTHER as OTHER
from tests.procs import free_port
from tracker.core.keys import NamespaceKeys
from tracker.core.redis_index import RedisIndex
from tracker.framework.errors import IndexUnavailableError

Factory = Callable[..., Awaitable[RedisLoadBoard]]


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server this test may stop and restart (not the shared session one)."""
    server = RedisServer().start()
    yield server
    server.close()


@pytest.fixture
async def boards(redis_url: str) -> AsyncIterator[Factory]:
    """Routers sharing one redis-server: each with its own client, all closed afterwards."""
    made: list[tuple[RedisLoadBoard, redis.Redis]] = []

    async def make(
        ttl: float = 5.0, renew: float = 1.0, url: str = redis_url, refresh: float = 0.0
    ) -> RedisLoadBoard:
        client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        board = RedisLoadBoard(
            client, new_router_id(), lease_ttl_s=ttl, renew_interval_s=renew, view_refresh_s=refresh
        )
        protocol: LoadBoard = board
        await protocol.start()
        made.append((board, client))
        return board

    yield make
    for board, client in made:
        await board.stop()
        await client.aclose()


async def _until(
    check: Callable[[], Awaitable[bool]], within: float = 2.0, step: float = 0.001
) -> float:
    """Seconds until ``check()`` holds (fails the test after ``within`` seconds)."""
    start = time.monotonic()
    while not await check():
        if time.monotonic() - start > within:
            pytest.fail("condition not reached in time")
        await asyncio.sleep(step)
    return time.monotonic() - start


@pytest.mark.redis
async def test_load_on_one_router_is_seen_by_another_within_milliseconds(boards: Factory) -> None:
    a, b = await boards(), await boards()
    lease = a.acquire(NS, "r1", 2048)

    def seen(load: Load) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            return (await b.snapshot(NS)).get("r1", Load()) == load

        return check

    assert await _until(seen(Load(1, 2048))) < 0.05
    mine = b.acquire(NS, "r1", 100)
    assert (await b.snapshot(NS))["r1"] == Load(2, 2148)  # own load included, exact at once
    lease.first_token()
    assert await _until(seen(Load(2, 100))) < 0.05
    lease.release()
    mine.release()
    assert await _until(seen(Load())) < 0.05
    assert await b.snapshot(NS) == {}
    assert a.stats.push_errors == 0 and a.stats.pushes >= 3


@pytest.mark.redis
async def test_another_routers_pending_prefill_arrives_with_its_age(
    boards: Factory, redis_url: str
) -> None:
    """What the engine has done of the others' queue is taken off as it is of a router's own:
    the entries carry when their oldest request still prefilling was sent (Redis time)."""
    a, b = await boards(), await boards()
    first = a.acquire(NS, "r1", 2048)
    await asyncio.sleep(0.2)
    a.acquire(NS, "r1", 10)  # pushes the totals again; the oldest is still the first

    async def both() -> bool:
        return (await b.snapshot(NS)).get("r1") == Load(2, 2058)

    await _until(both)
    read = time.monotonic()
    since = (await b.snapshot(NS))["r1"].prefill_since
    assert since is not None and 0.15 < read - since < 1.5  # the first's age, not the second's
    mine = b.acquire(NS, "r1", 5)  # b's own younger request does not hide the older one
    assert (await b.snapshot(NS))["r1"].prefill_since == pytest.approx(since, abs=0.01)
    mine.release()
    first.first_token()  # the next oldest: sent ~0.2 s later

    async def younger() -> bool:
        view = (await b.snapshot(NS))["r1"]
        return view.queued_prefill_tokens == 10 and view.prefill_since not in (None, since)

    await _until(younger)
    assert (await b.snapshot(NS))["r1"].prefill_since > since + 0.1  # type: ignore[operator]
    # an entry of the earlier 24-byte format counts, with no age
    async with redis.Redis.from_url(redis_url) as client:
        seconds, micros = await client.time()
        expiry = seconds * 1000 + micros // 1000 + 5000
        old = struct.pack("<ddd", 1, 64, expiry)
        await client.hset(NamespaceKeys(NS).load, "r9\x00old-router", old)
    view = await b.snapshot(NS)
    assert view["r9"] == Load(1, 64) and view["r9"].prefill_since is None


@pytest.mark.redis
async def test_partitions_are_separate_and_stored_under_the_schema_key(
    boards: Factory, redis_url: str
) -> None:
    a, b = await boards(), await boards()
    a.acquire(NS, "r1", 1)
    a.acquire(OTHER, "r9", 2)

    async def both() -> bool:
        return "r1" in await b.snapshot(NS) and "r9" in await b.snapshot(OTHER)

    await _until(both)
    assert await b.snapshot(NS) == {"r1": Load(1, 1)}
    async with redis.Redis.from_url(redis_url) as client:
        key = NamespaceKeys(NS).load
        assert await client.type(key) == b"hash"
        # a's entry, and b's presence (it read the partition)
        fields = set(await client.hkeys(key))
        assert fields == {f"r1\x00{a.router_id}".encode(), f"\x00{b.router_id}".encode()}
        assert 0 < await client.pttl(key) <= 2 * 5000


@pytest.mark.redis
async def test_a_dead_router_leaks_nothing(boards: Factory, redis_url: str) -> None:
    a, b = await boards(ttl=0.3, renew=0.1), await boards(ttl=0.3, renew=0.1)
    a.acquire(NS, "r1", 500)
    b.acquire(NS, "r2", 10)

    async def a_seen() -> bool:
        return "r1" in await b.snapshot(NS)

    await _until(a_seen)
    await asyncio.sleep(0.6)  # two TTLs: renewal keeps a live router's load alive
    assert (await b.snapshot(NS))["r1"] == Load(1, 500)
    a.abandon()  # crash: no renewal, no cleanup

    async def a_gone() -> bool:
        return "r1" not in await b.snapshot(NS)

    waited = await _until(a_gone)
    assert 0.05 < waited < 0.5
    assert await b.snapshot(NS) == {"r2": Load(1, 10)}
    async with redis.Redis.from_url(redis_url) as client:
        fields = await client.hkeys(NamespaceKeys(NS).load)
        assert not [f for f in fields if a.router_id.encode() in f]  # the dead entry was pruned


@pytest.mark.redis
async def test_stop_withdraws_at_once(boards: Factory) -> None:
    a, b = await boards(), await boards()
    a.acquire(NS, "r1", 5)

    async def seen() -> bool:
        return "r1" in await b.snapshot(NS)

    await _until(seen)
    await a.stop()
    assert await b.snapshot(NS) == {}
    a.acquire(NS, "r1", 5)  # a stopped board still counts locally, publishes nothing
    await asyncio.sleep(0.02)
    assert await b.snapshot(NS) == {}
    assert a.local_snapshot(NS) == {"r1": Load(2, 10)}


@pytest.mark.redis
async def test_many_changes_are_coalesced(boards: Factory) -> None:
    a, b = await boards(), await boards()
    leases = [a.acquire(NS, f"r{i % 4}", i) for i in range(200)]
    for lease in leases[::2]:
        lease.release()

    async def settled() -> bool:
        return await b.snapshot(NS) == a.local_snapshot(NS)

    await _until(settled)
    assert a.stats.pushes < 20  # one task, writing the latest totals, not one write per change


async def test_redis_down_snapshot_raises_and_local_view_works(boards: Factory) -> None:
    a = await boards(url=f"redis://127.0.0.1:{free_port()}/0")
    lease = a.acquire(NS, "r1", 64)  # never raises, never blocks
    with pytest.raises(IndexUnavailableError):
        await a.snapshot(NS)
    assert a.local_snapshot(NS) == {"r1": Load(1, 64)}

    async def counted() -> bool:
        return a.stats.push_errors > 0

    await _until(counted)
    lease.release()
    assert a.local_snapshot(NS) == {}
    assert a.stats.snapshot_errors == 1


@pytest.mark.redis
async def test_the_view_serves_the_others_load_as_last_read_in_the_background(
    boards: Factory,
) -> None:
    """A router whose index is its own reads the other routers' load off the request path:
    ``view`` never waits, and is at most a push delay and a refresh behind."""
    a, b = await boards(), await boards(refresh=0.01)
    assert b.view(NS) == {}  # never read: its own load only (none), and now wanted
    lease = a.acquire(NS, "r1", 2048)
    mine = b.acquire(NS, "r2", 16)

    async def seen() -> bool:
        return b.view(NS) == {"r1": Load(1, 2048), "r2": Load(1, 16)}

    assert await _until(seen) < 0.2
    since = b.view(NS)["r1"].prefill_since  # dated from when it was read, not when served
    await asyncio.sleep(0.05)
    assert b.view(NS)["r1"].prefill_since == pytest.approx(since, abs=0.015)
    reads = b.stats.snapshots
    lease.release()

    async def gone() -> bool:
        return b.view(NS) == {"r2": Load(1, 16)}

    assert await _until(gone) < 0.2
    assert b.stats.snapshots > reads
    assert b.local_snapshot(OTHER) == {} and b.view(OTHER) == {}
    mine.release()


@pytest.mark.redis
async def test_the_view_falls_back_to_own_load_when_its_reads_stop(
    boards: Factory, own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis gone: the last read is served for at most ``VIEW_MAX_AGE_S``, then the router's
    own load alone, and the error is logged once; the reads resume with Redis."""
    redis_server = own_redis
    a, b = await boards(url=redis_server.url), await boards(url=redis_server.url, refresh=0.01)
    b.view(NS)
    lease = a.acquire(NS, "r1", 64)
    mine = b.acquire(NS, "r2", 16)

    async def seen() -> bool:
        return "r1" in b.view(NS)

    await _until(seen)
    redis_server.stop()
    assert "r1" in b.view(NS)  # the last read, while it is recent
    await asyncio.sleep(VIEW_MAX_AGE_S + 0.2)
    assert b.view(NS) == {"r2": Load(1, 16)}
    errors = [r for r in caplog.records if "cannot read the other routers' load" in r.message]
    assert len(errors) == 1 and b.stats.snapshot_errors > 1
    redis_server.start()
    await _until(seen, within=10.0, step=0.05)
    lease.release()
    mine.release()


async def test_bad_arguments() -> None:
    async with redis.Redis() as client:
        with pytest.raises(ValueError):
            RedisLoadBoard(client, "", lease_ttl_s=5.0, renew_interval_s=1.0)
        with pytest.raises(ValueError):
            RedisLoadBoard(client, "a\x00b", lease_ttl_s=5.0, renew_interval_s=1.0)
        with pytest.raises(ValueError):
            RedisLoadBoard(client, "a", lease_ttl_s=1.0, renew_interval_s=1.0)


@pytest.mark.redis
async def test_an_index_survey_reads_the_other_routers_load_in_its_lookup(boards: Factory) -> None:
    """A router's whole view in one script call: the lookup and the load snapshot."""
    a, b = await boards(), await boards()
    index = RedisIndex(b.client)
    a.acquire(NS, "r1", 2048)
    b.acquire(NS, "r2", 10)

    async def pushed() -> bool:
        return (await b.snapshot(NS)).get("r1") == Load(1, 2048)

    await _until(pushed)
    survey = await index.survey(NS, [1, 2, 3], load_except=b.router_id)
    assert survey.load is not None and set(survey.load) == {"r1"}  # b knows its own exactly
    assert survey.load["r1"][:2] == (1, 2048) and 0 <= survey.load["r1"][2] < 2000
    assert b.merge(NS, survey.load) == await b.snapshot(NS)
    # b is there (its entry, and its presence from its reads: replica "")
    survey = await index.survey(NS, [1, 2, 3], load_except=a.router_id)
    assert survey.load is not None and survey.load[""] == (0, 0, 0)
    assert survey.load["r2"][:2] == (1, 10)
    assert (await index.survey(NS, [1, 2, 3])).load is None


@pytest.mark.redis
async def test_a_router_alone_writes_its_changes_with_the_renewal(
    boards: Factory, redis_url: str
) -> None:
    """Nobody reads a lone router's load: it saves the writes until another router shows."""
    a = await boards(ttl=0.6, renew=0.5)
    key = NamespaceKeys(NS).load
    async with redis.Redis.from_url(redis_url) as client:

        def written(replica: str) -> Callable[[], Awaitable[bool]]:
            async def check() -> bool:
                return bool(await client.hexists(key, f"{replica}\x00{a.router_id}"))

            return check

        assert await a.snapshot(NS) == {}  # nobody else, but a has just started: not alone
        a.acquire(NS, "r1", 1)
        # pushed at once, not with the renewal half a second later (a loaded host took 0.11 s)
        assert await _until(written("r1")) < 0.4
        await asyncio.sleep(0.7)  # a lease without any other router
        assert await a.snapshot(NS) == {"r1": Load(1, 1)}  # alone now
        pushes = a.stats.pushes

        async def renewed() -> bool:
            return a.stats.pushes > pushes

        await _until(renewed, within=1.0)  # the next renewal is half a second away
        lease = a.acquire(NS, "r2", 500)
        await asyncio.sleep(0.1)
        assert not await written("r2")()  # a pushed nothing at once
        await _until(written("r2"), within=1.0)  # the renewal did
        # another router reads the partition: its presence is seen by a's next read
        b = await boards()
        assert (await b.snapshot(NS))["r2"] == Load(1, 500)
        await a.snapshot(NS)
        lease.first_token()

        async def seen() -> bool:
            return (await b.snapshot(NS)).get("r2") == Load(1, 0)

        assert await _until(seen) < 0.1  # pushed at once again, not at the next renewal
