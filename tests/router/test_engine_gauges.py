"""The router's scrapes of engine gauges: which of an engine's running requests were routed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest

from router.fleet.health import _PARALLEL
from tests.router.harness import (
    base_url,
    chat,
    engines,
    router,
    wait_until,
)

pytestmark = pytest.mark.timeout(30)


async def test_engine_gauges_are_scraped_with_the_requests_routed_then() -> None:
    """The KV projection needs which of an engine's running requests were the routers' when
    its gauges were read: those free their blocks when they finish, outside traffic may not.
    A request no router counted is outside traffic once two scrapes in a row see it."""
    async with (
        engines(1, time_scale=1.0, floor_ms=10.0) as fleet,
        router(replica=fleet.specs, metrics_interval_s=0) as service,  # scraped by the test only
    ):
        replica = service.router.replicas.all()[0]
        body = chat("long", "go", stream=True, max_tokens=2000)
        async with httpx.AsyncClient(base_url=base_url(service), timeout=10) as client:
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                async for _ in response.aiter_bytes():
                    break
                await service.router.monitor.scrape_engines()
                assert replica.engine is not None
                assert (replica.engine.running, replica.engine.routed) == (1, 1)
            await wait_until(lambda: fleet.running() == 0, within=3)
            await service.router.monitor.scrape_engines()
            assert (replica.engine.running, replica.engine.routed) == (0, 0)
            # a request from another client (straight to the engine) is not the routers'
            direct = httpx.AsyncClient(base_url=fleet.url(0), timeout=10)
            async with direct, direct.stream("POST", "/v1/chat/completions", json=body) as other:
                async for _ in other.aiter_bytes():
                    break
                await service.router.monitor.scrape_engines()  # seen once: maybe a race
                assert (replica.engine.running, replica.engine.routed) == (1, 1)
                await service.router.monitor.scrape_engines()  # seen twice: outside traffic
                assert (replica.engine.running, replica.engine.routed) == (1, 0)


async def test_a_request_routed_while_the_gauges_are_read_is_not_outside_traffic() -> None:
    """Requests routed after the routers' counts were read but before the engine's gauges
    were, running when they were, are the routers' (the counts bracket the read). Counted as
    outside traffic, their blocks looked like memory that may never free, and the next
    prompt of a group left home (tests/test_topology.py). Twice in a row: a single miscount
    would wait for a second scrape before it counted as outside traffic."""
    async with (
        engines(1, time_scale=1.0, floor_ms=10.0) as fleet,
        router(replica=fleet.specs, metrics_interval_s=0) as service,  # scraped by the test only
        httpx.AsyncClient(base_url=base_url(service), timeout=10) as client,
        contextlib.AsyncExitStack() as streams,
    ):
        monitor = service.router.monitor
        replica = service.router.replicas.all()[0]
        body = chat("long", "go", stream=True, max_tokens=2000)
        reading: list[AsyncIterator[bytes]] = []
        for running in (1, 2):
            # every probe slot taken: the scrape counts the routers' requests, then waits for
            # a slot to read the engine
            for _ in range(_PARALLEL):
                await monitor._limit.acquire()
            scrape = asyncio.create_task(monitor.scrape_engines())
            await asyncio.sleep(0.05)
            assert not scrape.done()
            response = await streams.enter_async_context(
                client.stream("POST", "/v1/chat/completions", json=body)
            )
            reading.append(response.aiter_bytes())  # held: a dropped reader closes the stream
            await anext(reading[-1])
            for _ in range(_PARALLEL):
                monitor._limit.release()
            await asyncio.wait_for(scrape, 5)
            assert replica.engine is not None
            assert (replica.engine.running, replica.engine.routed) == (running, running)
