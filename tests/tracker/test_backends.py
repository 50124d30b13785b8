"""open_index: the in-process index without a URL, the Redis index for every Redis URL form."""

from __future__ import annotations

import pytest

from tracker.core.backends import REDIS_SCHEMES, open_index
from tracker.core.index import ReplicaRecord
from tracker.core.memory_index import MemoryIndex
from tracker.core.redis_client import CLUSTER_SCHEMES, SENTINEL_SCHEMES
from tracker.core.redis_index import RedisIndex
from tracker.framework.errors import ConfigError

RECORD = ReplicaRecord(id="r1", model="llama", block_size=4, url="http://127.0.0.1:9")


async def test_no_url_opens_a_fresh_memory_index() -> None:
    first, second = open_index(None), open_index(None)
    assert isinstance(first, MemoryIndex) and isinstance(second, MemoryIndex)
    assert first is not second
    await first.register(RECORD)
    assert await second.replicas() == []
    await first.close()
    await second.close()


async def test_a_redis_url_opens_the_shared_index(redis_url: str) -> None:
    writer, reader = open_index(redis_url), open_index(redis_url)
    try:
        assert isinstance(writer, RedisIndex) and isinstance(reader, RedisIndex)
        await writer.register(RECORD)
        assert [r.id for r in await reader.replicas()] == ["r1"]
    finally:
        await writer.close()
        await reader.close()


async def test_the_timeout_reaches_every_redis_connection(redis_url: str) -> None:
    index = open_index(redis_url, timeout_s=0.25)
    try:
        kwargs = index.client.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == kwargs["socket_connect_timeout"] == 0.25
    finally:
        await index.close()


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://127.0.0.1:1/service",
        "REDISS+SENTINEL://127.0.0.1:1/service/2",
        "redis+cluster://127.0.0.1:1,127.0.0.1:2",
    ],
)
async def test_sentinel_and_cluster_urls_open_without_connecting(url: str) -> None:
    index = open_index(url)
    assert isinstance(index, RedisIndex)
    await index.close()


def test_every_scheme_redis_client_parses_is_a_redis_scheme() -> None:
    assert {"redis", "rediss", "unix", *SENTINEL_SCHEMES, *CLUSTER_SCHEMES} == set(REDIS_SCHEMES)


@pytest.mark.parametrize(
    "url",
    [
        "",
        "memory://",
        "http://:hunter2@127.0.0.1:6379",
        "localhost:6379",
        "redis:127.0.0.1:6379",
        "sentinel://127.0.0.1:26379/service",
    ],
)
def test_any_other_url_is_a_config_error_without_the_password(url: str) -> None:
    with pytest.raises(ConfigError, match="not a Redis URL") as caught:
        open_index(url)
    message = str(caught.value)
    assert "hunter2" not in message
    assert all(f"{scheme}://" in message for scheme in REDIS_SCHEMES)


def test_a_malformed_redis_url_is_still_a_config_error() -> None:
    with pytest.raises(ConfigError, match="service"):
        open_index("redis+sentinel://127.0.0.1:26379")
