"""RouterService plumbing: the listening socket."""

from __future__ import annotations

import asyncio
import socket

from router.service import _bind


async def test_accepted_connections_disable_nagle() -> None:
    # Without TCP_NODELAY a streamed chunk can wait for the client's delayed ACK (40 ms).
    sock = _bind("127.0.0.1", 0)
    accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = writer.get_extra_info("socket")
        accepted.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(on_connect, sock=sock)
    async with server:
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        assert await asyncio.wait_for(accepted, 5) != 0
        writer.close()
