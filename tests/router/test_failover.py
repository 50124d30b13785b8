"""Failures: dead and failing replicas, broken streams, and Redis stopped under real processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from router.http.proxy import FALLBACK_HEADER, PREDICTED_HEADER, REPLICA_HEADER
from router.service import RouterService
from tests.factories import SIM
from tests.procs import RedisServer, free_port, free_ports
from tests.router.harness import (
    SYSTEM,
    Engines,
    Process,
    base_url,
    chat,
    engines,
    metric,
    router,
    wait_healthy,
    wait_until,
)
from tracker.core.blocks import block_keys
from tracker.framework.http import HTTPServer, bind

pytestmark = pytest.mark.timeout(60)


async def prefer(service: RouterService, replica: str, body: dict[str, Any]) -> None:
    """Make ``replica`` the best choice for ``body`` (a prediction covering its prompt)."""
    ids = service.router.decider.tokenizers.default.chat_sync(body["messages"])
    await service.router.index.predict(SIM, replica, block_keys(ids, SIM), 60.0)


async def dead_replica(
    stack: contextlib.AsyncExitStack,
) -> tuple[RouterService, httpx.AsyncClient, Engines]:
    """A router in front of a live engine (replica-0) and of one that died after the router
    saw it (doomed-0, whose ports are returned)."""
    live = await stack.enter_async_context(engines(1))
    doomed_cm = engines(1, id_prefix="doomed-")
    doomed = await doomed_cm.__aenter__()
    service = await stack.enter_async_context(
        router(replica=(*live.specs, *doomed.specs), health_interval_s=30)
    )
    client = await stack.enter_async_context(
        httpx.AsyncClient(base_url=base_url(service), timeout=10)
    )

    def checked() -> bool:  # the start-up health check passed both, before one dies
        value = service.registry.get_sample_value(
            "kvrouter_router_health_checks_total", {"result": "ok"}
        )
        return (value or 0) >= 2

    await wait_until(checked)
    await doomed_cm.__aexit__(None, None, None)
    return service, client, doomed


async def test_connect_failure_is_retried_and_the_replica_comes_back() -> None:
    async with contextlib.AsyncExitStack() as stack:
        service, client, doomed = await dead_replica(stack)
        body = chat(SYSTEM, "q")
        await prefer(service, "doomed-0", body)
        answer = await client.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200
        assert answer.headers[REPLICA_HEADER] == "replica-0"
        page = (await client.get("/metrics")).text
        assert metric(page, "kvrouter_router_retries_total", reason="connect") == 1
        assert metric(page, "kvrouter_router_upstream_errors_total", kind="connect") == 1
        health = (await client.get("/health")).json()
        assert health["replicas"] == {"total": 2, "healthy": 1}
        # out of rotation: no more attempts on it
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        page = (await client.get("/metrics")).text
        assert metric(page, "kvrouter_router_retries_total") == 1

        # it restarts on the same ports; the next health check brings it back
        back = await stack.enter_async_context(engines(1, id_prefix="doomed-", ports=doomed.ports))
        await service.router.monitor.check_health()
        replicas = {r["id"]: r for r in (await client.get("/replicas")).json()["replicas"]}
        assert replicas["doomed-0"]["healthy"]
        fresh = chat("another system prompt " * 60, "q")
        await prefer(service, "doomed-0", fresh)
        answer = await client.post("/v1/chat/completions", json=fresh)
        assert answer.headers[REPLICA_HEADER] == "doomed-0"
        assert back.engine(0).stats().prefix_cache_queries > 0


async def test_after_a_retry_the_books_say_the_chain_went_where_it_was_served() -> None:
    """The chosen replica refuses the connection and the next-best serves the request: the
    reuse book, the occupancy, the home claim and the load all say the chain went to the one
    that served it, and nothing of it is left on the one that never got it."""
    async with contextlib.AsyncExitStack() as stack:
        service, client, _ = await dead_replica(stack)
        body = chat(SYSTEM, "q")
        await prefer(service, "doomed-0", body)
        answer = await client.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200
        assert answer.headers[REPLICA_HEADER] == "replica-0"

        decider = service.router.decider
        assert decider.reuse is not None and decider.occupancy is not None
        assert decider.reuse.prefixes("replica-0") == 1
        assert decider.reuse.prefixes("doomed-0") == 0
        assert decider.occupancy.count("replica-0") == 1  # the request joined it
        assert decider.occupancy.count("doomed-0") == 0  # and left the one it never reached
        ids = decider.tokenizers.default.chat_sync(body["messages"])
        survey = service.router.index.survey_now(SIM, block_keys(ids, SIM))
        assert survey is not None and set(survey.homes) == {"replica-0"}
        assert service.router.load.local_snapshot(SIM) == {}  # every lease released
        page = (await client.get("/metrics")).text
        assert metric(page, "kvrouter_router_retries_total", reason="connect") == 1
        assert metric(page, "kvrouter_router_prompt_tokens_total", replica="replica-0") > 0
        assert metric(page, "kvrouter_router_prompt_tokens_total", replica="doomed-0") == 0


@contextlib.asynccontextmanager
async def failing_replica(status: int = 500) -> AsyncIterator[str]:
    """An upstream whose generation routes fail with ``status``; its spec is yielded."""

    async def fail(request: Request) -> Response:
        error = {"message": "engine dead", "type": "InternalServerError", "code": status}
        return JSONResponse({"error": error}, status_code=status)

    async def healthy(request: Request) -> Response:
        return Response(status_code=200)

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", fail, methods=["POST"]),
            Route("/health", healthy),
        ]
    )
    server = HTTPServer(app, bind("127.0.0.1", 0), shutdown_timeout_s=1)
    await server.start()
    try:
        yield f"bad-0=tcp://127.0.0.1:{free_port()},url=http://127.0.0.1:{server.port}"
    finally:
        await server.stop()


async def test_5xx_before_the_first_byte_is_retried_else_passed_through() -> None:
    async with engines(1) as live, failing_replica() as bad:
        for retries, expected in ((1, 200), (0, 500)):
            body = chat(f"{retries} {SYSTEM}", "q", stream=True)
            async with (
                router(replica=(*live.specs, bad), retries=retries) as service,
                httpx.AsyncClient(base_url=base_url(service), timeout=10) as client,
            ):
                await prefer(service, "bad-0", body)
                answer = await client.post("/v1/chat/completions", json=body)
                assert answer.status_code == expected
                page = (await client.get("/metrics")).text
                assert metric(page, "kvrouter_router_upstream_errors_total", kind="status") == 1
                if retries:
                    assert answer.headers[REPLICA_HEADER] == "replica-0"
                    assert answer.text.rstrip().endswith("data: [DONE]")
                    assert metric(page, "kvrouter_router_retries_total", reason="status") == 1
                else:
                    assert answer.headers[REPLICA_HEADER] == "bad-0"
                    assert answer.json()["error"]["message"] == "engine dead"


async def test_upstream_4xx_is_passed_through_as_is() -> None:
    async with (
        engines(1) as live,
        router(replica=live.specs) as service,
        httpx.AsyncClient(base_url=base_url(service), timeout=10) as client,
    ):
        answer = await client.post("/v1/chat/completions", json=chat("s", "u", max_tokens=0))
        assert answer.status_code == 400
        assert "max_tokens must be at least 1" in answer.json()["error"]["message"]
        assert service.router.replicas.get("replica-0").failures == 0  # type: ignore[union-attr]


async def test_a_stream_broken_after_its_first_byte_ends_with_an_error_event() -> None:
    async def half_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"POST"):
            chunk = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
                + f"{len(chunk):x}\r\n".encode()
                + chunk
                + b"\r\n"
            )
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    fake = await asyncio.start_server(half_answer, "127.0.0.1", 0)
    port = fake.sockets[0].getsockname()[1]
    spec = f"half-0=tcp://127.0.0.1:{free_port()},url=http://127.0.0.1:{port}"
    try:
        async with (
            router(replica=(spec,), health_interval_s=30) as service,
            httpx.AsyncClient(base_url=base_url(service), timeout=10) as client,
        ):
            body = chat("s", "u", stream=True)
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                lines = [line async for line in response.aiter_lines() if line]
            # the relayed chunk, then an OpenAI-shaped error (never a silent truncation)
            assert len(lines) == 3 and '"content":"a"' in lines[0], lines
            error = json.loads(lines[1].removeprefix("data: "))["error"]
            assert error["code"] == "upstream_error" and "half-0" in error["message"]
            assert lines[2] == "data: [DONE]"
            page = (await client.get("/metrics")).text
            assert metric(page, "kvrouter_router_stream_errors_total", replica="half-0") == 1
            assert metric(page, "kvrouter_router_inflight_requests", replica="half-0") == 0
    finally:
        fake.close()
        await fake.wait_closed()


async def test_every_replica_down_is_a_fast_503() -> None:
    doomed_cm = engines(1)
    doomed = await doomed_cm.__aenter__()
    async with router(replica=doomed.specs, health_interval_s=30) as service:
        await doomed_cm.__aexit__(None, None, None)
        async with httpx.AsyncClient(base_url=base_url(service), timeout=10) as client:
            for _ in range(2):
                started = time.monotonic()
                answer = await client.post("/v1/chat/completions", json=chat("s", "u"))
                assert answer.status_code == 503
                assert answer.json()["error"]["code"] == "no_replica_available"
                assert time.monotonic() - started < 1.0
            health = await client.get("/health")
            assert health.status_code == 503
            assert health.json()["status"] == "no_healthy_replica"


# --------------------------------------------------------------------- real processes


async def _ask(client: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
    answer = await client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    return answer


@pytest.mark.redis
async def test_redis_stopped_mid_run_routes_on_load_then_recovers(tmp_path: Path) -> None:
    redis = RedisServer().start()
    http, events, replay, port = free_ports(2), free_ports(2), free_ports(2), free_port()
    procs = [
        Process(
            [
                "replica", "--count", "2", "--port", str(http),
                "--events", f"tcp://*:{events}", "--replay", f"tcp://*:{replay}",
                "--model", "sim", "--redis", redis.url, "--time-scale", "0.01",
                "--heartbeat-s", "0.3", "--ttl-s", "3",
            ],
            tmp_path / "replica.log",
        ),
        Process(["tracker", "--redis", redis.url, "--http-port", "0",
                 "--reap-interval-s", "0.3"], tmp_path / "tracker.log"),
        Process(
            [
                "router", "--port", str(port), "--redis", redis.url,
                "--registry-interval-s", "0.3", "--health-interval-s", "0.5",
                "--breaker-cooldown-s", "0.5", "--lookup-timeout-ms", "25",
            ],
            tmp_path / "router.log",
        ),
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(url, procs[2])
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:

            async def replicas() -> bool:
                found = (await client.get("/replicas")).json()["replicas"]
                return len(found) == 2

            await wait_until(replicas, within=15)
            body = chat(SYSTEM, "warm")
            home = (await _ask(client, body)).headers[REPLICA_HEADER]

            async def cache_aware(where: set[str]) -> bool:
                answer = await _ask(client, chat(SYSTEM, f"q{time.monotonic()}"))
                return (
                    answer.headers[REPLICA_HEADER] in where
                    and int(answer.headers[PREDICTED_HEADER]) > 1000
                    and FALLBACK_HEADER not in answer.headers
                )

            async def routed_home() -> bool:
                return await cache_aware({home})

            async def routed_to_a_copy() -> bool:
                # on load alone the prefix was copied: a replica holding it, the last routed
                return await cache_aware({"replica-0", "replica-1"})

            await wait_until(routed_home, within=10)

            # Redis hangs: every request still succeeds, quickly, on load alone
            redis.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
            fallbacks = 0
            for i in range(12):
                started = time.monotonic()
                answer = await _ask(client, chat(SYSTEM, f"stalled {i}"))
                assert time.monotonic() - started < 2.0
                fallbacks += FALLBACK_HEADER in answer.headers
            assert fallbacks >= 10
            health = (await client.get("/health")).json()
            assert health["status"] == "degraded"
            redis.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
            await wait_until(routed_to_a_copy, within=15)

            # Redis dies and comes back empty: still serving, then cache-aware again
            redis.stop()
            for i in range(5):
                answer = await _ask(client, chat(SYSTEM, f"down {i}"))
                assert FALLBACK_HEADER in answer.headers
            redis.start()
            await wait_until(routed_to_a_copy, within=20)
            page = (await client.get("/metrics")).text
            assert metric(page, "kvrouter_router_fallbacks_total", reason="breaker_open") > 0
            assert metric(page, "kvrouter_router_fallbacks_total") >= 15
            assert metric(page, "kvrouter_router_requests_total", status="200") >= 20
        for proc in reversed(procs):
            proc.signal(signal.SIGTERM)
        for proc in procs:
            assert await proc.wait() == 0, proc.log()
    finally:
        for proc in procs:
            proc.close()
        if redis.proc is not None:
            redis.proc.send_signal(signal.SIGCONT)
        redis.close()
