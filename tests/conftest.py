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


# Under pytest-xdist (--dist loadgroup, scripts/test) these run one after another on one
# worker: the fault drills each start a whole stack and time its recovery; the HTTP fuzz
# module's last test checks what all the others sent.
SERIAL = {"tests/faults/": "faults", "tests/security/test_http_fuzz.py": "http_fuzz"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for prefix, group in SERIAL.items():
            if item.nodeid.startswith(prefix):
                item.add_marker(pytest.mark.xdist_group(group))


def pytest_xdist_node_collection_finished(node: object, ids: list[str]) -> None:
    """A worker of ``--dist loadgroup`` whose grouped tests come untagged would run them on
    every worker at once, silently (pytest-dev/pytest-xdist#1386): stop instead."""
    if node.config.getvalue("dist") != "loadgroup":  # type: ignore[attr-defined]
        return
    lost = [nodeid for nodeid in ids if nodeid.startswith(tuple(SERIAL)) and "@" not in nodeid]
    if lost:
        pytest.exit(
            f"pytest-xdist's --dist loadgroup does not group with this pytest ({lost[0]} and "
            f"{len(lost) - 1} more would run on every worker at once): install the test "
            "extra's pytest (pytest-dev/pytest-xdist#1386)",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )
