"""HTTP middleware of the simulated engines' servers: request ids.

The servers themselves are :class:`tracker.framework.http.HTTPServer` with
:class:`tracker.framework.http.BodyLimitMiddleware` (several share one process in
``kvrouter replica --count N``; the fleet handles SIGINT/SIGTERM once and stops them all).
"""

from __future__ import annotations

import logging
import uuid

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
