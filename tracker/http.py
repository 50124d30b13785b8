"""HTTP serving shared by every kvrouter process: a listening socket and an embedded uvicorn.

The tracker (/metrics, /health), the router and the simulated engines all serve a Starlette
app from a socket they bind themselves (so a bad address fails at start-up with a clear
error, and port 0 works), and all own their process's signal handling.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
from collections.abc import Iterator
from typing import Literal

import uvicorn
from starlette.types import ASGIApp

from tracker.errors import ConfigError

logger = logging.getLogger(__name__)
_LATE_SWEEPS = 3


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
