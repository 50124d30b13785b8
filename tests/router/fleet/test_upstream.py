"""The upstream client against real servers: timeouts, dropped connections, refused ports."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from router.errors import UpstreamError, UpstreamTimeoutError
from router.fleet.upstream import UpstreamClient, failure_kind, passthrough_headers
from tests.procs import free_port
from tracker.framework.http import HTTPServer, bind

pytestmark = pytest.mark.timeout(20)


async def _slow_stream(request: Request) -> Response:
    gap = float(request.query_params.get("gap", "0"))

    async def chunks() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        await asyncio.sleep(gap)
        yield b"data: 2\n\n"

    return StreamingResponse(chunks(), media_type="text/event-stream")


async def _ticking(request: Request) -> Response:
    gap = float(request.query_params["gap"])

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(int(request.query_params["n"])):
            await asyncio.sleep(gap)
            yield f"data: {i}\n\n".encode()

    return StreamingResponse(chunks(), media_type="text/event-stream")


async def _late(request: Request) -> Response:
    await asyncio.sleep(float(request.query_params.get("after", "0")))
    return Response(b'{"ok": true}', media_type="application/json", headers={"x-up": "1"})


@contextlib.asynccontextmanager
async def server() -> AsyncIterator[str]:
    app = Starlette(
        routes=[
            Route("/stream", _slow_stream, methods=["POST"]),
            Route("/ticking", _ticking, methods=["POST"]),
            Route("/late", _late, methods=["POST", "GET"]),
        ]
    )
    http = HTTPServer(app, bind("127.0.0.1", 0), shutdown_timeout_s=1)
    await http.start()
    try:
        yield f"http://127.0.0.1:{http.port}"
    finally:
        await http.stop()


@contextlib.asynccontextmanager
async def client() -> AsyncIterator[UpstreamClient]:
    upstream = UpstreamClient(connect_timeout_s=0.5, max_connections=16, api_key="up-key")
    try:
        yield upstream
    finally:
        await upstream.aclose()


async def test_answers_chunks_and_timeouts() -> None:
    async with server() as url, client() as upstream:
        answer = await upstream.open("r", url, "/late", b"{}", {}, timeout_s=2)
        assert answer.status == 200
        assert await answer.read(1.0) == b'{"ok": true}'
        headers = passthrough_headers(answer.headers)
        assert headers["x-up"] == "1"
        assert not {"date", "server", "content-length"} & set(headers)
        await answer.aclose()

        with pytest.raises(UpstreamTimeoutError) as info:
            await upstream.open("r", url, "/late?after=1", b"{}", {}, timeout_s=0.1)
        assert failure_kind(info.value) == "timeout"
        assert info.value.status == 504

        stream = await upstream.open("r", url, "/stream?gap=1", b"{}", {}, timeout_s=2)
        assert await stream.next_chunk(1.0) == b"data: 1\n\n"
        with pytest.raises(UpstreamTimeoutError, match="sent nothing"):
            await stream.next_chunk(0.1)
        await stream.aclose()

        stream = await upstream.open("r", url, "/stream", b"{}", {}, timeout_s=2)
        assert await stream.read(1.0, limit=100) == b"data: 1\n\ndata: 2\n\n"
        stream = await upstream.open("r", url, "/stream", b"{}", {}, timeout_s=2)
        with pytest.raises(UpstreamError, match="more than 4 bytes"):
            await stream.read(1.0, limit=4)
        await stream.aclose()
        assert (await upstream.get("r", url, "/late", timeout_s=1))[0] == 200


async def test_a_read_times_out_only_on_its_own_wait() -> None:
    """One timer per response keeps every read's timeout: a stream whose chunks come faster
    than the timeout lives longer than it, and time spent between reads (writing to a slow
    client) is not waiting; a read that waits it out fails, and the connection is dropped."""
    async with server() as url, client() as upstream:
        stream = await upstream.open("r", url, "/ticking?n=6&gap=0.1", b"{}", {}, timeout_s=2)
        started = time.monotonic()
        chunks = [await stream.next_chunk(0.25) for _ in range(3)]
        await asyncio.sleep(0.4)  # longer than the timeout, between two reads
        while chunk := await stream.next_chunk(0.25):
            chunks.append(chunk)
        assert b"".join(chunks) == b"".join(f"data: {i}\n\n".encode() for i in range(6))
        assert time.monotonic() - started > 0.6
        await stream.aclose()

        stream = await upstream.open("r", url, "/ticking?n=3&gap=0.5", b"{}", {}, timeout_s=2)
        started = time.monotonic()
        with pytest.raises(UpstreamTimeoutError, match=r"sent nothing for 0\.2s"):
            await stream.next_chunk(0.2)
        assert 0.19 < time.monotonic() - started < 0.45
        with pytest.raises(UpstreamTimeoutError):  # and stays failed
            await stream.next_chunk(0.2)
        await stream.aclose()


async def test_refused_and_dropped_connections() -> None:
    async with client() as upstream:
        dead = f"http://127.0.0.1:{free_port()}"
        with pytest.raises(UpstreamError) as info:
            await upstream.open("r", dead, "/x", b"{}", {}, timeout_s=1)
        assert failure_kind(info.value) == "connect"
        assert info.value.replica == "r"
        with pytest.raises(UpstreamError) as info:
            await upstream.get("r", dead, "/health", timeout_s=1)
        assert failure_kind(info.value) == "connect"

        async def half_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n"
            )
            await writer.drain()
            writer.close()

        async def no_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.close()

        half = await asyncio.start_server(half_answer, "127.0.0.1", 0)
        silent = await asyncio.start_server(no_answer, "127.0.0.1", 0)
        try:
            url = f"http://127.0.0.1:{half.sockets[0].getsockname()[1]}"
            stream = await upstream.open("r", url, "/s", b"{}", {}, timeout_s=1)
            assert await stream.next_chunk(1.0) == b"data: 1\n\n"
            with pytest.raises(UpstreamError) as info:
                await stream.next_chunk(1.0)
            assert failure_kind(info.value) == "transport"
            await stream.aclose()
            url = f"http://127.0.0.1:{silent.sockets[0].getsockname()[1]}"
            with pytest.raises(UpstreamError) as info:
                await upstream.open("r", url, "/s", b"{}", {}, timeout_s=1)
            assert failure_kind(info.value) == "transport"
        finally:
            for srv in (half, silent):
                srv.close()
                await srv.wait_closed()


async def test_each_replica_has_its_own_pool_and_a_retired_one_finishes_its_streams() -> None:
    async with server() as url, client() as upstream:
        # replica "a" holds a stream open while its pool is retired (it left the fleet)
        stream = await upstream.open("a", url, "/stream?gap=0.3", b"{}", {}, timeout_s=2)
        assert await stream.next_chunk(1.0) == b"data: 1\n\n"
        upstream.retire("a")
        assert await stream.next_chunk(2.0) == b"data: 2\n\n"
        await stream.aclose()
        # a request to the same replica afterwards opens a fresh pool
        status, text = await upstream.get("a", url, "/late", timeout_s=2)
        assert (status, text) == (200, '{"ok": true}')
        # the same server under another replica id is another pool: "b"'s slow answer does
        # not hold up "a"
        slow = asyncio.create_task(upstream.get("b", url, "/late?after=0.5", timeout_s=2))
        status, _ = await asyncio.wait_for(upstream.get("a", url, "/late", timeout_s=2), 0.4)
        assert status == 200
        assert (await slow)[0] == 200
