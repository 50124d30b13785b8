"""Calls to replicas over aiohttp: open a request, read its body under timeouts, probe.

The router bounds "until the answer starts" and "between two chunks" itself. Every transport
failure becomes an :class:`~router.errors.UpstreamError` whose ``__cause__`` keeps aiohttp's
error; :func:`failure_kind` tells a front end whether a retry elsewhere is safe. (aiohttp, not
httpx: docs/architecture.md, "Router", dispatch.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from functools import partial
from typing import Final, Literal

import aiohttp

from router.errors import UpstreamError, UpstreamTimeoutError

FailureKind = Literal["connect", "transport", "timeout", "pool"]
# below the engines' own idle timeout (uvicorn's and vLLM's 5 s): a connection the engine
# closes just as the router reuses it would fail the request
KEEPALIVE_EXPIRY_S: Final = 4.0
# hop-by-hop headers, what the body's re-framing changes, and what uvicorn sets itself
_DROPPED: Final = frozenset(
    {
        "connection",
        "date",
        "server",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "content-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-authenticate",
        "proxy-connection",
    }
)


class PoolTimeoutError(TimeoutError):
    """Every connection to the replica stayed busy past the pool timeout."""


def failure_kind(exc: UpstreamError) -> FailureKind:
    """What went wrong: ``connect`` and ``transport`` (no answer at all) may be retried."""
    if isinstance(exc, UpstreamTimeoutError):
        return "timeout"
    cause = exc.__cause__
    if isinstance(cause, PoolTimeoutError):
        return "pool"
    if isinstance(cause, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
        return "connect"
    return "transport"


def _mapped(exc: BaseException, replica: str, what: str) -> UpstreamError:
    detail = str(exc) or type(exc).__name__
    return UpstreamError(f"replica {replica} {what}: {detail}", replica=replica)


def passthrough_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The upstream's response headers a client should see (hop-by-hop ones removed), with
    lower-case names (HTTP/2's form, and what the router's own headers use)."""
    return {name: v for k, v in headers.items() if (name := k.lower()) not in _DROPPED}


class _Pool:
    """One replica's aiohttp session and the requests open through it."""

    __slots__ = ("inflight", "session", "url")

    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        self.url = url
        self.session = session
        self.inflight = 0


class UpstreamResponse:
    """A replica's answer whose status and headers arrived; the body is read chunk by chunk.

    Each wait for a chunk has a timeout, kept by one timer per response that is moved only
    when it fires (a wait that outlives it closes the response, which ends the read): a
    relayed chunk costs a clock read, where ``asyncio.timeout`` around each read arms and
    cancels a timer, 3-8 µs of the event loop's time under uvloop (docs/benchmarks.md).
    """

    def __init__(
        self,
        replica: str,
        response: aiohttp.ClientResponse,
        release: Callable[[], None] | None = None,
    ) -> None:
        self.replica = replica
        self.status = response.status
        self.headers: Mapping[str, str] = response.headers
        self._response = response
        self._release = release
        self._done = False
        self._loop = asyncio.get_running_loop()
        self._waiting_since: float | None = None  # loop time the current read began
        self._timeout_s = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timed_out = False

    async def next_chunk(self, timeout_s: float) -> bytes:
        """The next piece of the body as it arrived; ``b""`` at its end.

        :raises UpstreamTimeoutError: nothing arrived for ``timeout_s``.
        :raises UpstreamError: the connection broke.
        """
        since = self._waiting_since = self._loop.time()
        self._timeout_s = timeout_s
        if self._timer is None or self._timer.when() > since + timeout_s:
            self._arm(since + timeout_s)
        try:
            chunk = await self._response.content.readany()
        except aiohttp.ClientError as exc:
            if self._timed_out:
                raise self._timeout() from None
            raise _mapped(exc, self.replica, "broke the stream") from exc
        finally:
            self._waiting_since = None
        if self._timed_out:
            raise self._timeout()
        if not chunk:
            self._done = True
            self._disarm()
        return chunk

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(when, self._check)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        """The timer fired: close the response if the read in progress has waited its whole
        timeout, else wait again until it would have."""
        self._timer = None
        since, now = self._waiting_since, self._loop.time()
        if since is None:  # between reads (the client is being written to): not waiting
            self._arm(now + self._timeout_s)
        elif now - since >= self._timeout_s:
            self._timed_out = True
            self._response.close()  # the pending read raises; the engine aborts the request
        else:
            self._arm(since + self._timeout_s)

    def _timeout(self) -> UpstreamTimeoutError:
        return UpstreamTimeoutError(
            f"replica {self.replica} sent nothing for {self._timeout_s:g}s", replica=self.replica
        )

    async def read(self, timeout_s: float, limit: int = 1 << 30) -> bytes:
        """The rest of the body (each chunk within ``timeout_s``), at most ``limit`` bytes."""
        parts: list[bytes] = []
        size = 0
        while chunk := await self.next_chunk(timeout_s):
            parts.append(chunk)
            size += len(chunk)
            if size > limit:
                raise UpstreamError(
                    f"replica {self.replica} answered more than {limit} bytes", replica=self.replica
                )
        return b"".join(parts)

    async def aclose(self) -> None:
        """Close the response: a finished body gives its connection back to the pool;
        mid-body this drops the connection, so the engine aborts the request."""
        self._disarm()
        try:
            if self._done:
                self._response.release()
            else:
                self._response.close()
        finally:
            release, self._release = self._release, None
            if release is not None:
                release()


class UpstreamClient:
    """A pooled aiohttp session per replica, sized for many concurrent streams.

    One pool per replica, not one for the fleet: a replica that stops answering fills its
    own pool, not the others' (its requests wait or time out while the rest flow), and a
    replica that leaves the fleet takes its connections with it (:meth:`retire`).

    :param connect_timeout_s: TCP connect timeout (waiting for a free connection of the pool
        may take up to ``max(10, connect_timeout_s)``).
    :param max_connections: connections to each replica.
    :param api_key: bearer key sent to every replica (vLLM's ``--api-key``), if any.
    """

    def __init__(
        self, *, connect_timeout_s: float, max_connections: int, api_key: str | None = None
    ) -> None:
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._connect_timeout_s = connect_timeout_s
        self._pool_timeout_s = max(10.0, connect_timeout_s)
        self._max_connections = max_connections
        self._pools: dict[str, _Pool] = {}
        self._retired: set[_Pool] = set()
        self._closing: set[asyncio.Task[None]] = set()

    def _pool(self, replica: str, url: str) -> _Pool:
        pool = self._pools.get(replica)
        if pool is not None and pool.url == url:
            return pool
        if pool is not None:  # the replica moved: retire the old pool
            self.retire(replica)
        connector = aiohttp.TCPConnector(
            limit=self._max_connections,
            limit_per_host=0,
            keepalive_timeout=KEEPALIVE_EXPIRY_S,
        )
        session = aiohttp.ClientSession(
            connector=connector,
            headers=self._headers,
            timeout=aiohttp.ClientTimeout(
                total=None, connect=self._pool_timeout_s, sock_connect=self._connect_timeout_s
            ),
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,
        )
        pool = self._pools[replica] = _Pool(url, session)
        return pool

    def retire(self, replica: str) -> None:
        """Close ``replica``'s pool (it left the fleet) once its open requests are done."""
        pool = self._pools.pop(replica, None)
        if pool is not None:
            self._retired.add(pool)
            self._release(pool, 0)

    def _release(self, pool: _Pool, done: int = 1) -> None:
        pool.inflight -= done
        if pool in self._retired and pool.inflight == 0:
            self._retired.discard(pool)
            task = asyncio.get_running_loop().create_task(pool.session.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _acquire(self, replica: str, url: str) -> tuple[_Pool, bool]:
        """The replica's pool with one more request counted, and whether that request has to
        wait for a connection (every one is busy)."""
        pool = self._pool(replica, url)
        queued = pool.inflight >= self._max_connections
        pool.inflight += 1
        return pool, queued

    def _cause(self, exc: aiohttp.ClientError, queued: bool) -> BaseException:
        """What failed: aiohttp's error, or the pool's for a connect timeout of a request
        that had to wait for a busy pool."""
        if queued and isinstance(exc, aiohttp.ConnectionTimeoutError):
            return PoolTimeoutError(f"no free connection within {self._pool_timeout_s:g}s")
        return exc

    async def open(
        self,
        replica: str,
        url: str,
        path: str,
        content: bytes,
        headers: Mapping[str, str],
        *,
        timeout_s: float,
    ) -> UpstreamResponse:
        """POST ``content`` to ``url + path`` and wait (at most ``timeout_s``) for the headers.

        Cancelling the caller closes the request, which the replica sees as a disconnect.
        """
        pool, queued = self._acquire(replica, url)
        try:
            async with asyncio.timeout(timeout_s):
                response = await pool.session.post(
                    url.rstrip("/") + path, data=content, headers=headers, allow_redirects=False
                )
        except aiohttp.ClientError as exc:  # first: aiohttp's connect timeouts are TimeoutErrors
            self._release(pool)
            cause = self._cause(exc, queued)
            raise _mapped(cause, replica, "failed") from cause
        except TimeoutError:
            self._release(pool)
            raise UpstreamTimeoutError(
                f"replica {replica} did not answer within {timeout_s:g}s", replica=replica
            ) from None
        except BaseException:
            self._release(pool)
            raise
        return UpstreamResponse(replica, response, partial(self._release, pool))

    async def get(self, replica: str, url: str, path: str, *, timeout_s: float) -> tuple[int, str]:
        """``(status, body text)`` of a GET, for health checks and engine metrics."""
        pool, queued = self._acquire(replica, url)
        try:
            async with asyncio.timeout(timeout_s):
                async with pool.session.get(url.rstrip("/") + path) as response:
                    return response.status, await response.text(errors="replace")
        except aiohttp.ClientError as exc:
            cause = self._cause(exc, queued)
            raise _mapped(cause, replica, f"failed {path}") from cause
        except TimeoutError:
            raise UpstreamTimeoutError(
                f"replica {replica} did not answer {path} within {timeout_s:g}s", replica=replica
            ) from None
        finally:
            self._release(pool)

    async def aclose(self) -> None:
        pools = [*self._pools.values(), *self._retired]
        self._pools.clear()
        self._retired.clear()
        await asyncio.gather(*(p.session.close() for p in pools), *self._closing)
