"""Streams through the router app: chunk by chunk, aborted on disconnect, drained at shutdown."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from router.http.proxy import PREDICTED_HEADER
from tests.router.harness import (
    SYSTEM,
    base_url,
    chat,
    engines,
    metric,
    router,
    wait_until,
)

pytestmark = pytest.mark.timeout(30)


async def _events(response: httpx.Response) -> list[tuple[float, str]]:
    out = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            out.append((time.monotonic(), line[6:]))
    return out


async def test_streams_pass_through_chunk_by_chunk_and_usage_only_when_asked() -> None:
    async with (
        engines(2, time_scale=1.0, floor_ms=10.0) as fleet,
        router(replica=fleet.specs) as service,
        httpx.AsyncClient(base_url=base_url(service), timeout=10) as client,
    ):
        body = chat(SYSTEM, "stream", stream=True, max_tokens=20)
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = await _events(response)
        assert events[-1][1] == "[DONE]"
        chunks = [json.loads(data) for _, data in events[:-1]]
        assert all(chunk["choices"] for chunk in chunks), "the router's usage chunk leaked"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        # the first token reached the client long before the last one was generated
        assert events[-1][0] - events[0][0] > 0.1

        body = chat(SYSTEM, "stream", stream=True, stream_options={"include_usage": True})
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            events = await _events(response)
            predicted = int(response.headers[PREDICTED_HEADER])
        usage = json.loads(events[-2][1])
        assert usage["choices"] == []
        assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted > 1000
        page = (await client.get("/metrics")).text
        assert metric(page, "kvrouter_router_cache_predictions_total", outcome="agree") == 2
        assert metric(page, "kvrouter_router_ttft_seconds_count") == 2


async def test_client_disconnect_aborts_the_engine_request() -> None:
    async with (
        engines(1, time_scale=1.0, floor_ms=10.0) as fleet,
        router(replica=fleet.specs) as service,
    ):
        body = chat("short", "go", stream=True, max_tokens=2000)
        async with httpx.AsyncClient(base_url=base_url(service), timeout=10) as client:
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                async for _ in response.aiter_bytes():
                    break
            assert fleet.running() == 1
            await wait_until(lambda: fleet.running() == 0, within=3)

            # a non-streamed request is cancelled the same way
            task = asyncio.create_task(
                client.post("/v1/chat/completions", json={**body, "stream": False})
            )
            await wait_until(lambda: fleet.running() == 1, within=3)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await wait_until(lambda: fleet.running() == 0, within=3)
            # and a stream whose first chunk has not come yet (a long prefill)
            long = chat("x" * 30_000, "go", stream=True, max_tokens=2000)

            async def first_chunk() -> None:
                async with client.stream("POST", "/v1/chat/completions", json=long) as answer:
                    async for _ in answer.aiter_bytes():
                        break

            task = asyncio.create_task(first_chunk())
            await wait_until(lambda: fleet.running() == 1, within=3)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await wait_until(lambda: fleet.running() == 0, within=3)
            page = (await client.get("/metrics")).text
            assert metric(page, "kvrouter_router_client_disconnects_total") == 3
            assert metric(page, "kvrouter_router_ttft_seconds_count") == 1  # the first stream's
            replicas = (await client.get("/replicas")).json()["replicas"]
            assert replicas[0]["inflight"] == 0


async def test_graceful_shutdown_drains_streams() -> None:
    async with (
        engines(1, time_scale=1.0, floor_ms=10.0) as fleet,
        router(replica=fleet.specs) as service,
        httpx.AsyncClient(base_url=base_url(service), timeout=10) as client,
    ):
        body = chat("short", "go", stream=True, max_tokens=40)
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            stop = asyncio.create_task(service.stop())
            events = await _events(response)
        await stop
        assert events[-1][1] == "[DONE]"
        assert json.loads(events[-2][1])["choices"][0]["finish_reason"] == "length"
