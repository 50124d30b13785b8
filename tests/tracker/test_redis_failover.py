"""Redis that fails over or comes back older: Sentinel URLs, following a promoted replica,
and the index made exact again from the tracker's ledgers (real redis-server processes)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest
import redis

from bench.stack.redis_servers import SENTINEL_SERVICE, RedisSentinels
from tests.factories import LLAMA, batch
from tests.procs import RedisServer
from tests.tracker.redis_ops import OTHER, SEQ, matches, remove, store
from tracker.core.redis_client import SENTINEL_PORT, SentinelURL, open_redis, parse_sentinel_url
from tracker.core.redis_index import RedisIndex
from tracker.framework.errors import ConfigError, IndexUnavailableError

pytestmark = pytest.mark.redis

THIRD = list(range(3000, 3016))


# ------------------------------------------------------------------ URLs


@pytest.mark.parametrize(
    ("url", "parsed"),
    [
        (
            "redis+sentinel://10.0.0.1:26380,10.0.0.2,[::1]:5000/mymaster",
            SentinelURL(
                (("10.0.0.1", 26380), ("10.0.0.2", SENTINEL_PORT), ("::1", 5000)), "mymaster"
            ),
        ),
        (
            "rediss+sentinel://app:s%40cret@h1:1/main/3?sentinel_password=sp",
            SentinelURL(
                (("h1", 1),), "main", db=3, username="app", password="s@cret",
                sentinel_password="sp", ssl=True,
            ),
        ),
        ("redis+sentinel://:pw@h/svc", SentinelURL((("h", SENTINEL_PORT),), "svc", password="pw")),
    ],
)  # fmt: skip
def test_sentinel_urls_parse(url: str, parsed: SentinelURL) -> None:
    assert parse_sentinel_url(url) == parsed


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://h1:26379",  # no service
        "redis+sentinel://h1:26379/",
        "redis+sentinel://h1:26379/svc/db0",
        "redis+sentinel://h1:26379/svc/0/extra",
        "redis+sentinel://h1:99999/svc",
        "redis+sentinel://h1:port/svc",
        "redis+sentinel://h1,,h2/svc",
        "redis+sentinel://:pw@:26379/svc",
        "redis+sentinel://h1/svc?timeout=3",
        "redis://h1/0",  # not a Sentinel URL
    ],
)
def test_bad_sentinel_urls_are_config_errors_without_the_password(url: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_sentinel_url(url.replace("://", "://:hunter2@", 1) if "@" not in url else url)
    assert "hunter2" not in str(caught.value)


def test_a_bad_sentinel_url_is_refused_when_the_index_opens() -> None:
    with pytest.raises(ConfigError, match="service"):
        RedisIndex.from_url("redis+sentinel://127.0.0.1:26379")


# ------------------------------------------------------------------ an older server


async def test_redis_back_with_an_older_snapshot_is_reconciled_with_the_ledgers() -> None:
    # A server that restarts from its last snapshot (or a replica promoted before the last
    # writes reached it) holds an older state of every replica: blocks since removed, blocks
    # since stored missing, ids since allocated unknown.
    server = RedisServer().start()
    index = RedisIndex.from_url(server.url, timeout_s=0.5)
    try:
        await index.apply("r1", LLAMA, batch(store(SEQ)), 1)
        await index.apply("r2", LLAMA, batch(store(OTHER)), 1)
        assert await index.restore_lost() == 0  # the tracker's periodic check: same server
        with redis.Redis.from_url(server.url) as client:
            client.save()  # the snapshot the server will come back with
        await index.apply("r1", LLAMA, batch(remove(SEQ, 2, 3)), 2)
        await index.apply("r3", LLAMA, batch(store(THIRD)), 1)
        server.stop()
        server.start()  # same port and directory: it loads the snapshot
        assert await matches(index, SEQ) == {"r1": (4, 4)}  # stale: r1 removed two since
        assert await matches(index, THIRD) == {}
        assert await index.restore_lost() == 2  # r1's difference, r3 whole; r2 was right
        assert await matches(index, SEQ) == {"r1": (2, 2)}
        assert await matches(index, OTHER) == {"r2": (4, 4)}
        assert await matches(index, THIRD) == {"r3": (4, 4)}
        assert await index.last_seq("r1", LLAMA) == 2
        assert await index.restore_lost() == 0
        # what a tracker that starts now reads back (the engine maps) agrees too
        fresh = RedisIndex.from_url(server.url)
        try:
            assert [await fresh.block_count(r, LLAMA) for r in ("r1", "r2", "r3")] == [2, 4, 4]
            await fresh.apply("r1", LLAMA, batch(remove(SEQ, 1)), 3)
            assert await matches(fresh, SEQ) == {"r1": (1, 1)}
        finally:
            await fresh.close()
    finally:
        await index.close()
        server.close()


# ------------------------------------------------------------------ Sentinel failover


@pytest.fixture
def sentinels() -> Iterator[RedisSentinels]:
    group = RedisSentinels(down_after_ms=500).start()
    try:
        yield group
    finally:
        group.close()


async def _until_written(
    index: RedisIndex, write: Callable[[], Awaitable[object]], timeout_s: float
) -> float:
    """Retry ``write`` until Redis takes it; seconds it took."""
    started = time.monotonic()
    while True:
        try:
            await write()
            if await index.flush() == 0:
                return time.monotonic() - started
        except IndexUnavailableError:
            pass
        if time.monotonic() - started > timeout_s:
            raise TimeoutError("the index never reached a primary")
        await asyncio.sleep(0.1)


async def test_sentinel_url_follows_a_failover_and_the_index_is_exact_after(
    sentinels: RedisSentinels,
) -> None:
    index = RedisIndex.from_url(sentinels.url, timeout_s=0.5)
    try:
        await index.apply("r1", LLAMA, batch(store(SEQ)), 1)
        assert await index.restore_lost() == 0
        first = await index.recovery.server_id()
        sentinels.wait_replicated()
        old = sentinels.primary_port()
        assert old == sentinels.primary.port
        sentinels.primary.stop()  # SIGKILL
        # writes fail while no primary is elected, stay pending, and land on the new one
        took = await _until_written(
            index, lambda: index.apply("r1", LLAMA, batch(remove(SEQ, 3), store(OTHER)), 2), 30
        )
        assert sentinels.wait_failover(old) == sentinels.replica.port
        assert took < 30
        assert await index.recovery.server_id() != first
        await index.restore_lost()  # reconciles whatever the replica had not received
        assert await matches(index, SEQ) == {"r1": (3, 3)}
        assert await matches(index, OTHER) == {"r1": (4, 4)}
        assert await index.last_seq("r1", LLAMA) == 2
        with redis.Redis(port=sentinels.replica.port) as promoted:
            assert promoted.info("replication")["role"] == "master"
    finally:
        await index.close()


async def test_a_sentinel_url_opens_the_primary_the_quorum_names(
    sentinels: RedisSentinels,
) -> None:
    connection = open_redis(sentinels.url)
    try:
        assert connection.service == SENTINEL_SERVICE
        await connection.client.set("k", "v")
        info = await connection.client.info("server")
        assert int(info["tcp_port"]) == sentinels.primary.port
    finally:
        await connection.aclose()
