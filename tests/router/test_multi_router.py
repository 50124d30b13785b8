"""Two router processes sharing one redis-server: placements, predictions and load are shared.

Real processes throughout: ``kvrouter replica`` (two engines, registered in Redis),
``kvrouter tracker`` (events -> Redis) and two ``kvrouter router`` instances.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.http.proxy import PREDICTED_HEADER, REPLICA_HEADER
from tests.procs import free_port
from tests.router.harness import (
    SYSTEM,
    Process,
    chat,
    slow_fleet,
    wait_healthy,
    wait_until,
)

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


def _router(port: int, redis_url: str, tmp_path: Path, name: str) -> Process:
    args = [
        "router", "--port", str(port), "--redis", redis_url,
        "--registry-interval-s", "0.3", "--health-interval-s", "0.5",
        "--metrics-interval-s", "0.3", "--lease-ttl-s", "1.5", "--load-renew-s", "0.3",
        "--lookup-timeout-ms", "50", "--router-id", name,
    ]  # fmt: skip
    return Process(args, tmp_path / f"{name}.log")


async def _loads(client: httpx.AsyncClient) -> dict[str, Any]:
    replicas = (await client.get("/replicas")).json()["replicas"]
    return {r["id"]: r for r in replicas}


async def test_two_routers_share_placements_and_load(redis_url: str, tmp_path: Path) -> None:
    replica, tracker = slow_fleet(redis_url, tmp_path)
    ports = free_port(), free_port()
    routers = [_router(p, redis_url, tmp_path, f"router-{i}") for i, p in enumerate(ports)]
    procs = [replica, tracker, *routers]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    streams: list[asyncio.Task[None]] = []
    try:
        for url, proc in zip(urls, routers, strict=True):
            await wait_healthy(url, proc)
        async with (
            httpx.AsyncClient(base_url=urls[0], timeout=10) as a,
            httpx.AsyncClient(base_url=urls[1], timeout=10) as b,
        ):
            for client in (a, b):

                async def both_known(client: httpx.AsyncClient = client) -> bool:
                    return len(await _loads(client)) == 2

                await wait_until(both_known, within=15)

            # a shared-prefix workload sent alternately to both lands on one replica
            chosen: list[str] = []
            predicted: list[int] = []
            for i in range(8):
                answer = await (a, b)[i % 2].post("/v1/chat/completions", json=chat(SYSTEM, str(i)))
                assert answer.status_code == 200, answer.text
                chosen.append(answer.headers[REPLICA_HEADER])
                predicted.append(int(answer.headers[PREDICTED_HEADER]))
            assert len(set(chosen)) == 1, chosen
            assert predicted[0] == 0 and min(predicted[1:]) > 1000, predicted

            # load dispatched through router 0 is visible to router 1
            async def stream(i: int) -> None:
                body = chat(f"long {i}", "go", stream=True, max_tokens=400)
                with contextlib.suppress(httpx.HTTPError):
                    async with a.stream("POST", "/v1/chat/completions", json=body) as response:
                        async for _ in response.aiter_bytes():
                            pass

            streams = [asyncio.create_task(stream(i)) for i in range(3)]

            async def seen_by_b(expected: int) -> bool:
                loads = await _loads(b)
                return sum(int(r["inflight"]) for r in loads.values()) == expected

            await wait_until(lambda: seen_by_b(3), within=10)

            # router 0 dies without a word: its load expires, no phantom remains
            routers[0].proc.send_signal(signal.SIGKILL)
            await routers[0].wait()
            await wait_until(lambda: seen_by_b(0), within=6)
            # ...and the engines aborted the orphaned requests (the connections closed)

            async def engines_idle() -> bool:
                loads = await _loads(b)
                return all(
                    r["engine"] is not None and r["engine"]["running"] == 0 for r in loads.values()
                )

            await wait_until(engines_idle, within=10)
            await asyncio.gather(*streams)
        for proc in (routers[1], tracker, replica):
            proc.signal(signal.SIGTERM)
            assert await proc.wait() == 0, proc.log()
    finally:
        for task in streams:
            task.cancel()
        for proc in procs:
            proc.close()
