"""The relay passes an engine's stream through byte for byte, however the engine cut it:
events split across writes or packed together, comments, an engine's own error event, the
usage chunk (kept when the client asked for it, dropped when only the router did)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from itertools import pairwise

import httpx
import pytest

from tests.procs import free_port
from tests.router.harness import base_url, chat, router

pytestmark = pytest.mark.timeout(60)

TOKEN = b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"%s"},"finish_reason":null}]}\n\n'  # noqa: E501
USAGE = b'data: {"id":"c1","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":3,"total_tokens":12,"prompt_tokens_details":{"cached_tokens":0}}}\n\n'  # noqa: E501
ERROR = (
    b'data: {"error":{"message":"engine hiccup \\u00e9","type":"internal_error","code":500}}\n\n'
)
DONE = b"data: [DONE]\n\n"
EVENTS = [TOKEN % b"a", b": keep-alive\n\n", TOKEN % "\u00e9\\n".encode(), ERROR, USAGE, DONE]
STREAM = b"".join(EVENTS)
# the stream as the engine writes it: the first event cut in three, a cut inside the UTF-8
# "é" of the third, the rest of it, the error event and half the usage chunk in one write,
# and a cut between the two newlines that end the usage chunk
_E = len(EVENTS[0]) + len(EVENTS[1]) + TOKEN.index(b"%s") + 1
CUTS = (7, 20, len(EVENTS[0]) + 3, _E, len(STREAM) - 40, len(STREAM) - len(DONE) - 1)


@asynccontextmanager
async def scripted_engine() -> AsyncIterator[tuple[str, list[bytes]]]:
    """A raw HTTP/1.1 server answering every POST with STREAM in the pieces CUTS makes (each
    its own chunk of the chunked encoding, flushed apart); the request bodies it saw."""
    bodies: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while head := await reader.readuntil(b"\r\n\r\n"):
            length = next(
                (int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                 if line.startswith(b"content-length:")),
                0,
            )  # fmt: skip
            body = await reader.readexactly(length)
            if not head.startswith(b"POST"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()
                continue
            bodies.append(body)
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            edges = [0, *CUTS, len(STREAM)]
            for start, end in pairwise(edges):
                piece = STREAM[start:end]
                writer.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                await writer.drain()
                await asyncio.sleep(0.02)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"script-0=tcp://127.0.0.1:{free_port()},url=http://127.0.0.1:{port}", bodies
    finally:
        server.close()


async def _received(client: httpx.AsyncClient, body: dict[str, object]) -> bytes:
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return b"".join([chunk async for chunk in response.aiter_raw()])


async def test_the_stream_arrives_byte_for_byte() -> None:
    async with (
        scripted_engine() as (spec, bodies),
        router(replica=(spec,), health_interval_s=30) as service,
        httpx.AsyncClient(base_url=base_url(service), timeout=10) as client,
    ):
        asked = chat("s", "u", stream=True, stream_options={"include_usage": True})
        assert await _received(client, asked) == STREAM
        # the router asks for usage itself (its accounting) and drops the chunk again
        plain = await _received(client, chat("s", "u", stream=True))
        assert plain == STREAM.replace(USAGE, b"")
        assert b'"include_usage":true' in bodies[-1].replace(b" ", b"")
