"""HTTP plumbing of the publishers: uvicorn servers owned by a service, request-id and body-size
middleware.

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
from collections.abc import Callable, Iterator

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
    sock = socket.create_server((host.strip("[]"), port), family=family, backlog=2048)
    # proto TCP makes asyncio set TCP_NODELAY on accepted sockets (streamed chunks go out
    # at once instead of waiting for the client's delayed ACK)
    return socket.socket(sock.family, sock.type, socket.IPPROTO_TCP, fileno=sock.detach())


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
