"""HTTP plumbing of the publishers: uvicorn servers owned by a service, request-id middleware.

Several servers share one process and event loop (``kvrouter replica --count N``), so the
owning service handles SIGINT/SIGTERM once and stops every server itself. Binding the socket
here turns "port in use" into an exception instead of uvicorn's ``sys.exit``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import uuid
from collections.abc import Iterator

import uvicorn
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # the owning service installs the process's signal handlers
        yield


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free port); raises OSError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host.strip("[]"), port), family=family, backlog=2048)


class HTTPServer:
    """One uvicorn server for ``app`` on a pre-bound socket; :meth:`start` / :meth:`stop`.

    :param shutdown_timeout_s: how long :meth:`stop` lets in-flight requests finish before
        uvicorn cancels them.
    """

    def __init__(
        self, app: ASGIApp, sock: socket.socket, *, shutdown_timeout_s: float = 5.0
    ) -> None:
        self.sock = sock
        config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=max(1, math.ceil(shutdown_timeout_s)),
        )
        self._server = _Server(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    async def start(self) -> None:
        """Serve in a background task; returns once the socket accepts connections."""
        self._task = asyncio.get_running_loop().create_task(
            self._server.serve(sockets=[self.sock]), name=f"http:{self.port}"
        )
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("HTTP server exited during startup")
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        """Stop accepting, drain in-flight requests (bounded), close the socket."""
        self._server.should_exit = True
        task, self._task = self._task, None
        if task is not None:
            await task
        self.sock.close()


class RequestIdMiddleware:
    """Echo the client's ``X-Request-Id`` (or a fresh one) on every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["request_id"] = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append("X-Request-Id", state["request_id"])
            await send(message)

        await self.app(scope, receive, send_with_id)
