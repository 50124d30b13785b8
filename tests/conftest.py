"""Shared fixtures: a real redis-server per session (flushed per test), an index, a ZMQ context."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
import zmq.asyncio

from tests.procs import RedisServer

DATA = Path(__file__).resolve().parent / "data"  # copies of shared data: tests/data/README.md
VECTORS = DATA / "vectors" / "vllm-kv-events"


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.close()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """URL of the session's redis-server, flushed before each test."""
    if redis_server.proc is None:
        redis_server.start()
    with redis.Redis.from_url(redis_server.url) as client:
        client.flushall()
    yield redis_server.url


@pytest.fixture
async def redis_index(redis_url: str) -> AsyncIterator[object]:
    from tracker.core.redis_index import RedisIndex

    index = RedisIndex.from_url(redis_url)
    yield index
    await index.close()


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    """A ZeroMQ context for the test's sockets, destroyed (linger 0) after it."""
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)
