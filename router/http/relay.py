"""The streamed answer's ASGI response: relayed in the request's own task, closed however the
client left (finished, disconnected, or its connection broke under a write).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tracker.framework.http import ClientWatch


class RelayResponse(StreamingResponse):
    """A stream relayed in the request's own task, closed however the client left.

    :param cleanup: idempotent; also runs when the relay never started (a generator closed
        before its first step skips its ``finally``).
    """

    def __init__(
        self,
        relay: AsyncGenerator[bytes, None],
        cleanup: Callable[[], Awaitable[None]],
        watch: ClientWatch,
        *,
        status_code: int,
        headers: dict[str, str],
    ) -> None:
        super().__init__(relay, status_code=status_code, headers=headers)
        self._relay = relay
        self._cleanup = cleanup
        self._watch = watch

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            start = {"type": "http.response.start", "status": self.status_code}
            await send({**start, "headers": self.raw_headers})
            async for chunk in self._relay:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not self._watch.absorb():
                raise
        except OSError:
            pass  # the client's connection broke under a write (ASGI 2.4 servers raise it)
        finally:
            self._watch.close()
            with anyio.CancelScope(shield=True):
                await self._relay.aclose()
                await self._cleanup()
