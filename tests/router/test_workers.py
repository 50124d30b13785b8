"""``kvrouter router --workers 2``: two router processes on one port, one Redis, one drain.

Real processes: ``kvrouter replica`` (two engines, registered in Redis), ``kvrouter
tracker`` and one ``kvrouter router --workers 2``; with ``--local-index``, in-process engines
whose events each worker reads itself.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import httpx
import pytest

from router.config import RouterSettings
from router.http.proxy import PREDICTED_HEADER, REPLICA_HEADER
from tests.procs import free_port
from tests.router.harness import (
    SYSTEM,
    Process,
    chat,
    engines,
    metric,
    slow_fleet,
    wait_healthy,
    wait_until,
)
from tracker.framework.errors import ConfigError

pytestmark = [pytest.mark.redis, pytest.mark.timeout(90)]


def _pid(router_id: str) -> int:
    """The pid in a default router id (``host-pid-random``)."""
    return int(router_id.rsplit("-", 2)[1])


async def _fresh(url: str, path: str) -> httpx.Response:
    """``GET path`` on a new connection: the kernel may hand it to either worker."""
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        return await client.get(path)


async def _workers_seen(url: str, within: float = 15.0) -> set[str]:
    seen: set[str] = set()

    async def both() -> bool:
        seen.add((await _fresh(url, "/health")).json()["router_id"])
        return len(seen) >= 2

    await wait_until(both, within=within, interval=0.01)
    return seen


def _pool(tmp_path: Path, *args: str) -> tuple[Process, str]:
    """``kvrouter router --workers 2 ARGS`` on a free port, with short intervals, and its URL."""
    port = free_port()
    pool = Process(
        [
            "router", "--workers", "2", "--port", str(port), *args,
            "--health-interval-s", "0.5", "--metrics-interval-s", "0.3",
            "--lease-ttl-s", "1.5", "--load-renew-s", "0.3", "--shutdown-timeout-s", "20",
        ],
        tmp_path / "router.log",
    )  # fmt: skip
    return pool, f"http://127.0.0.1:{port}"


async def _stream(url: str, i: int) -> str:
    body = chat(f"long {i}", "go", stream=True, max_tokens=300)
    async with (
        httpx.AsyncClient(base_url=url, timeout=30) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        return "".join([chunk async for chunk in response.aiter_text()])


async def _three_streams_seen_by_every_worker(url: str) -> list[asyncio.Task[str]]:
    """Three long streams through the pool, once every worker counts all three in flight."""
    streams = [asyncio.create_task(_stream(url, i)) for i in range(3)]

    async def every_worker_sees_three() -> bool:
        for _ in range(6):
            replicas = (await _fresh(url, "/replicas")).json()["replicas"]
            if sum(int(r["inflight"]) for r in replicas) != 3:
                return False
        return True

    await wait_until(every_worker_sees_three, within=10)
    return streams


async def _drained(pool: Process, streams: list[asyncio.Task[str]]) -> None:
    """SIGTERM: the streams still running finish whole and the pool exits 0."""
    pool.signal(signal.SIGTERM)
    bodies = await asyncio.gather(*streams)
    assert all(body.rstrip().endswith("data: [DONE]") for body in bodies), bodies
    assert await pool.wait(within=30) == 0, pool.log()


async def test_two_workers_serve_one_port_share_index_and_load_and_drain(
    redis_url: str, tmp_path: Path
) -> None:
    replica, tracker = slow_fleet(redis_url, tmp_path)
    pool, url = _pool(
        tmp_path, "--redis", redis_url, "--registry-interval-s", "0.3", "--lookup-timeout-ms", "50"
    )
    streams: list[asyncio.Task[str]] = []
    try:
        await wait_healthy(url, pool)
        first = await _workers_seen(url)  # both processes accept on the one port

        async def both_replicas_known() -> bool:
            for _ in range(4):
                replicas = (await _fresh(url, "/replicas")).json()["replicas"]
                if len(replicas) != 2:
                    return False
            return True

        await wait_until(both_replicas_known, within=15)

        # a shared prefix sent over fresh connections (either worker) stays on one replica
        chosen, predicted = [], []
        for i in range(8):
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                answer = await client.post("/v1/chat/completions", json=chat(SYSTEM, str(i)))
            assert answer.status_code == 200, answer.text
            chosen.append(answer.headers[REPLICA_HEADER])
            predicted.append(int(answer.headers[PREDICTED_HEADER]))
        assert len(set(chosen)) == 1, chosen
        assert predicted[0] == 0 and min(predicted[1:]) > 1000, predicted
        for _ in range(4):  # /metrics on either worker counts both workers' requests
            page = (await _fresh(url, "/metrics")).text
            assert metric(page, "kvrouter_router_requests_total", endpoint="chat") == 8

        # a worker that dies is replaced; the port keeps serving meanwhile
        victim = next(iter(first))
        os.kill(_pid(victim), signal.SIGKILL)
        replaced = await _workers_seen(url, within=20)
        assert victim not in replaced and len(replaced) == 2, (first, replaced)

        # load dispatched through one worker is seen by the other; SIGTERM drains
        streams = await _three_streams_seen_by_every_worker(url)
        await _drained(pool, streams)
        log = pool.log()
        assert "router worker died; starting another" in log
        assert "router workers stopped" in log
        for proc in (tracker, replica):
            proc.signal(signal.SIGTERM)
            assert await proc.wait() == 0, proc.log()
    finally:
        for task in streams:
            task.cancel()
        for proc in (pool, tracker, replica):
            proc.close()


async def test_two_local_index_workers_index_the_events_and_share_load_and_routes(
    redis_url: str, tmp_path: Path
) -> None:
    """``--workers 2 --local-index``: each process keeps its own index from the engines'
    events; the load and the routes go through Redis; SIGTERM drains both."""
    async with engines(2, time_scale=0.01, floor_ms=300.0) as fleet:
        replicas = [arg for spec in fleet.specs for arg in ("--replica", spec)]
        pool, url = _pool(
            tmp_path, "--redis", redis_url, "--local-index", "--model", "sim", *replicas
        )
        streams: list[asyncio.Task[str]] = []
        try:
            await wait_healthy(url, pool)
            await _workers_seen(url)

            # a shared prefix over fresh connections (either worker) stays on one replica,
            # and every worker predicts what the engine then reports cached
            chosen = []
            for i in range(8):
                async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                    answer = await client.post("/v1/chat/completions", json=chat(SYSTEM, f"q {i}"))
                assert answer.status_code == 200, answer.text
                chosen.append(answer.headers[REPLICA_HEADER])
                cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                predicted = int(answer.headers[PREDICTED_HEADER])
                assert predicted == cached and (i == 0 or cached > 1000), (i, predicted, cached)
            assert len(set(chosen)) == 1, chosen
            for _ in range(4):  # no decision fell back to load-only routing
                page = (await _fresh(url, "/metrics")).text
                for reason in ("timeout", "error", "breaker_open"):
                    assert metric(page, "kvrouter_router_fallbacks_total", reason=reason) == 0

            streams = await _three_streams_seen_by_every_worker(url)
            await _drained(pool, streams)
        finally:
            for task in streams:
                task.cancel()
            pool.close()


def test_more_than_one_worker_needs_redis() -> None:
    with pytest.raises(ConfigError, match="needs --redis"):
        RouterSettings(workers=2)
    with pytest.raises(ConfigError, match="workers must be >= 0"):
        RouterSettings(workers=-1, redis="redis://127.0.0.1:1")
    assert RouterSettings(workers=0, redis="redis://127.0.0.1:1").workers == 0
