"""HTTP middleware of the simulated engines' servers: request ids and a body-size limit.

The servers themselves are :class:`tracker.http.HTTPServer` (several share one process in
``kvrouter replica --count N``; the fleet handles SIGINT/SIGTERM once and stops them all).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)


ENGINE_HEADER = "X-Kvrouter-Engine"


class RequestIdMiddleware:
    """Echo the client's ``X-Request-Id`` (or a fresh one) on every response.

    :param engine_id: also name the engine that answered (``X-Kvrouter-Engine``), so a
        benchmark can tell which engine served a request whatever router sent it there
        (simulation only: vLLM sends no such header).
    """

    def __init__(self, app: ASGIApp, *, engine_id: str | None = None) -> None:
        self.app = app
        self.engine_id = engine_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["request_id"] = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers.append("X-Request-Id", state["request_id"])
                if self.engine_id is not None:
                    headers.append(ENGINE_HEADER, self.engine_id)
            await send(message)

        await self.app(scope, receive, send_with_id)


class BodyLimitMiddleware:
    """Answer 413 (``error``'s JSON body) to a request whose body exceeds ``max_bytes``.

    The body is read here, bounded, before the app sees it (and replayed to it), so no handler
    can be made to buffer or tokenize more than ``max_bytes``.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int, error: Callable[[str], bytes]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self._error = error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                await self.app(scope, _replay([message], receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    async def _refuse(self, send: Send) -> None:
        content = self._error(f"the request body exceeds {self.max_bytes} bytes")
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": content})


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """``receive`` that first returns ``messages``, then the real ones (e.g. a disconnect)."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
