"""HTTP shared by every kvrouter process: serving, and the plumbing of its request handlers.

Serving: the tracker (/metrics, /health), the router and the simulated engines all serve a
Starlette app from a socket they bind themselves (so a bad address fails at start-up with a
clear error, and port 0 works), and all own their process's signal handling.

Handlers: the router and the simulated engines read JSON bodies the same way (declared as
JSON or not declared, bounded in size), watch for clients that hang up, answer every error in
their own OpenAI shape and serve ``/metrics``; each passes in what differs (its error shape,
its status codes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Final, Literal

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tracker.framework.errors import ConfigError

logger = logging.getLogger(__name__)
_LATE_SWEEPS = 3

Handler = Callable[[Request], Awaitable[Response]]
CLIENT_CLOSED: Final = 499  # nginx's status for a request whose client left before the answer


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the owning service decides when to stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, that also closes connections accepted while it began.

        uvicorn asks the connections it knows to close once, right after it stops listening.
        A connection the loop had accepted but not yet handed to its protocol joins after
        that: it was never asked, so it kept serving (a stopped app) on keep-alive and held
        the drain until the graceful timeout. Asking again while the drain runs closes it.
        """
        drain = asyncio.ensure_future(super().shutdown(sockets))
        try:
            while not drain.done():
                await asyncio.wait([drain], timeout=0.05)
                for connection in list(self.server_state.connections):
                    connection.shutdown()
        except BaseException:
            drain.cancel()  # stop() gave up waiting: the drain goes with us
            raise
        drain.result()
        # Past the graceful timeout a stopped server serves none. Accepts already under way
        # when listening stopped hand their connections over a few loop iterations later.
        for _ in range(_LATE_SWEEPS):
            for connection in list(self.server_state.connections):
                connection.transport.close()
            await asyncio.sleep(0.01)


def bind(host: str, port: int, *, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free port).

    :raises ConfigError: the address cannot be listened on (in use, not local, bad name).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host.strip("[]"), port), family=family, backlog=backlog)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    # asyncio disables Nagle (TCP_NODELAY) only on accepted sockets whose proto says TCP, and
    # create_server leaves it 0: without this, small SSE chunks on a kept-alive connection
    # wait for the client's delayed ACK (up to 40 ms on Linux).
    return socket.socket(sock.family, sock.type, socket.IPPROTO_TCP, fileno=sock.detach())


class HTTPServer:
    """One uvicorn server for ``app`` on a pre-bound socket: :meth:`start`, :meth:`stop`.

    :param shutdown_timeout_s: how long :meth:`stop` lets in-flight requests finish before
        uvicorn cancels them.
    :param lifespan: ``"on"`` runs the app's startup and shutdown handlers.
    """

    def __init__(
        self,
        app: ASGIApp,
        sock: socket.socket,
        *,
        shutdown_timeout_s: float = 5.0,
        lifespan: Literal["on", "off"] = "off",
        name: str = "http",
    ) -> None:
        self.sock = sock
        self.name = name
        self.shutdown_timeout_s = shutdown_timeout_s
        config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan=lifespan,
            ws="none",
            timeout_graceful_shutdown=max(1, math.ceil(shutdown_timeout_s)),
        )
        self._server = _Server(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    @property
    def task(self) -> asyncio.Task[None]:
        """The serving task (done when the server exits); only after :meth:`start`."""
        assert self._task is not None, "not started"
        return self._task

    async def start(self) -> None:
        """Serve in a background task; returns once the socket accepts connections.

        :raises ConfigError: the server (or the app's startup) failed before it served.
        """
        self._task = asyncio.get_running_loop().create_task(self._serve(), name=self.name)
        while not self._server.started:
            if self._task.done():
                self.sock.close()
                self._task.result()
                raise ConfigError(f"{self.name} failed to start (see the log above)")
            await asyncio.sleep(0.005)

    async def _serve(self) -> None:
        try:
            await self._server.serve(sockets=[self.sock])
        except SystemExit:
            # uvicorn exits the process when the app's startup fails; a task must not (the
            # loop would die with it): :meth:`start` reports it instead
            logger.error("http server exited", extra={"server": self.name})

    def force_exit(self) -> None:
        """Stop waiting for in-flight requests (a second stop request)."""
        self._server.force_exit = True

    async def stop(self) -> None:
        """Stop accepting, drain in-flight requests (bounded), close the socket."""
        self._server.should_exit = True
        task, self._task = self._task, None
        if task is not None:
            try:
                async with asyncio.timeout(self.shutdown_timeout_s + 1.0):
                    await asyncio.shield(task)
            except TimeoutError:
                logger.warning("http server did not stop in time", extra={"server": self.name})
                task.cancel()
                await asyncio.wait([task])
            except Exception:
                logger.exception("http server failed", extra={"server": self.name})
        self.sock.close()


# ---------------------------------------------------------------------------- request bodies


def content_type_refusal(content_type: str | None) -> str | None:
    """Why a body declared as ``content_type`` is not read as JSON; None if it is.

    JSON is ``application/json`` or ``application/*+json`` (parameters aside); an undeclared
    body is read as JSON too, as vLLM's (FastAPI) server reads it.
    """
    if content_type is None:
        return None
    media = content_type.partition(";")[0].strip().lower()
    suffixed = media.startswith("application/") and media.endswith("+json")
    if media == "application/json" or suffixed:
        return None
    return f"Unsupported content type {content_type[:100]!r}: send application/json."


def body_limit_message(max_bytes: int) -> str:
    """What a refused body is told when it is over ``max_bytes``."""
    return f"the request body exceeds {max_bytes} bytes"


async def read_limited(request: Request, max_bytes: int) -> bytes | None:
    """The whole request body, or None once it is declared or read past ``max_bytes``.

    A body over the limit is left unread from there on.

    :raises ClientDisconnect: the client left before it sent the whole body.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        return None
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            return None
        parts.append(chunk)
    return b"".join(parts)


class BodyLimitMiddleware:
    """Answer 413 (``error``'s JSON body) to a request whose body exceeds ``max_bytes``.

    The body is read here, bounded, before the app sees it (and replayed to it), so no handler
    can be made to buffer or tokenize more than ``max_bytes``. The refusal closes the
    connection, since the rest of the body is never read.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int, error: Callable[[str], bytes]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self._error = error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await read_limited(Request(scope, receive), self.max_bytes)
        except ClientDisconnect:  # the client left: let the app see it
            await self.app(scope, _replay({"type": "http.disconnect"}, receive), send)
            return
        if body is None:
            content = self._error(body_limit_message(self.max_bytes))
            headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
            await send({"type": "http.response.start", "status": 413, "headers": headers})
            await send({"type": "http.response.body", "body": content})
            return
        whole: Message = {"type": "http.request", "body": body, "more_body": False}
        await self.app(scope, _replay(whole, receive), send)


def _replay(message: Message, receive: Receive) -> Receive:
    """``receive`` that first returns ``message``, then the real ones (e.g. a disconnect)."""
    pending = [message]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


# ---------------------------------------------------------------------------- disconnects


class ClientWatch:
    """Watches one request's client from dispatch until its answer is sent; if the client
    leaves first, cancels the request's own task (once).

    One watcher task per request, and the request's work runs in its own task: a task and a
    watcher around the wait for the first chunk, then Starlette's task group around the
    relay, cost a lone request 0.35 ms between the engine's first chunk and its relay
    (docs/benchmarks.md). Where the request awaits, :meth:`absorb` tells this watch's
    cancellation from any other (a server shutting down), which must go on. Start it once
    the body is read: it takes every message the client sends from then on.
    """

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None, "a request runs in a task"
        self.task = task
        self.gone = False
        self._closed = False
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        if not self._closed:
            self.task.cancel()

    def absorb(self) -> bool:
        """After a :class:`asyncio.CancelledError`: whether it was only this watch's (the
        client left; the request goes on to account for it), else it must propagate."""
        if not self.gone or self._closed:
            return False
        self._closed = True
        return self.task.uncancel() == 0

    def close(self) -> None:
        """The answer is sent (or failed): stop watching; idempotent."""
        self._closed = True
        if not self._watcher.done():
            self._watcher.cancel()


# ---------------------------------------------------------------------------- answers


def answer_errors(
    handler: Handler,
    answer: Callable[[Exception], Response],
    *,
    expected: tuple[type[Exception], ...],
    log: logging.Logger,
) -> Handler:
    """``handler``, with every exception it raises answered by ``answer``.

    ``expected`` exceptions are the server's own refusals, answered as they are; any other is
    a bug, logged (``"request failed"``, with its traceback, on ``log``) before ``answer``
    turns it into an answer that tells the client no internals.
    """

    async def answered(request: Request) -> Response:
        try:
            return await handler(request)
        except expected as exc:
            return answer(exc)
        except Exception as exc:
            log.exception("request failed", extra={"path": request.url.path})
            return answer(exc)

    return answered


HTTPErrorAnswer = Callable[[str, int, Mapping[str, str] | None], Response]


def http_error_handler(
    answer: HTTPErrorAnswer,
) -> Callable[[Request, Exception], Awaitable[Response]]:
    """A Starlette handler for its own :class:`HTTPException` (an unknown path, a wrong
    method): ``answer(detail, status, headers)`` gives the response in the server's shape."""

    async def handle(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return answer(exc.detail, exc.status_code, exc.headers)

    return handle


def metrics_endpoint(
    registry: CollectorRegistry,
    *,
    exposition: Callable[[CollectorRegistry], bytes] = generate_latest,
) -> Handler:
    """``GET /metrics``: ``exposition(registry)`` in Prometheus' text format."""

    async def metrics(request: Request) -> Response:
        return Response(exposition(registry), media_type=CONTENT_TYPE_LATEST)

    return metrics
