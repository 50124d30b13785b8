"""Tracker test fixtures: subscribers and event publishers to drive, an index of each backend."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import zmq.asyncio

from tests.tracker.publisher import EventPublisher
from tests.tracker.tracking import ANY, Tracker, TrackerFactory, settings
from tracker.core.index import BlockIndex
from tracker.core.memory_index import MemoryIndex
from tracker.core.redis_index import RedisIndex


@pytest.fixture
async def make_tracker() -> AsyncIterator[TrackerFactory]:
    started: list[Tracker] = []

    async def make(index: BlockIndex | None = None, **overrides: Any) -> Tracker:
        tracker = Tracker(index or MemoryIndex(), settings(**overrides))
        await tracker.subscriber.start()
        started.append(tracker)
        return tracker

    yield make
    for tracker in started:
        await tracker.subscriber.stop(2.0)
        assert tracker.subscriber.failure is None


@pytest.fixture
async def make_publisher(zctx: zmq.asyncio.Context) -> AsyncIterator[Callable[..., Any]]:
    started: list[EventPublisher] = []

    async def make(*, replay: bool = True, **kwargs: Any) -> EventPublisher:
        endpoint = kwargs.pop("endpoint", ANY)
        publisher = EventPublisher(zctx, endpoint, replay=ANY if replay else None, **kwargs)
        started.append(await publisher.start())
        return publisher

    yield make
    for publisher in started:
        await publisher.close()


@pytest.fixture(params=["memory", "redis", "fakeredis"])
async def index(request: pytest.FixtureRequest) -> AsyncIterator[BlockIndex]:
    backend: BlockIndex
    if request.param == "memory":
        backend = MemoryIndex()
    elif request.param == "redis":
        backend = RedisIndex.from_url(request.getfixturevalue("redis_url"))
    else:
        pytest.importorskip(
            "lupa", reason="fakeredis runs Lua only with lupa: add fakeredis[lua] to test deps"
        )
        import fakeredis

        backend = RedisIndex(fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer()))
    yield backend
    await backend.close()
