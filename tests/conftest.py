"""Shared fixtures: a real redis-server per session (flushed per test), an index, a ZMQ context."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
import zmq.asyncio

from bench.stack.ports import share_ports
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


def pytest_configure(config: pytest.Config) -> None:
    """Each pytest-xdist worker picks its loopback ports from its own part of the range."""
    worker, workers = (
        os.environ.get("PYTEST_XDIST_WORKER"),
        os.environ.get("PYTEST_XDIST_WORKER_COUNT"),
    )
    if worker and workers:
        share_ports(int(worker.removeprefix("gw")), int(workers))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``--dist loadgroup``) the fault drills run one after another on one
    worker: each starts a whole stack and times its recovery."""
    for item in items:
        if item.get_closest_marker("faults") is not None:
            item.add_marker(pytest.mark.xdist_group("faults"))
