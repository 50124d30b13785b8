"""Calls to replicas over one httpx client: open a request, read its body under timeouts, probe.

httpx's own read timeout is off: a non-streamed completion sends its headers only when the
whole answer is ready, so the router bounds "until the answer starts" and "between two
chunks" itself. Every transport failure becomes an :class:`~router.errors.UpstreamError`
(or :class:`~router.errors.UpstreamTimeoutError`) whose ``__cause__`` keeps the httpx error;
:func:`failure_kind` tells the proxy whether a retry elsewhere is safe.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Final, Literal

import httpx

from router.errors import UpstreamError, UpstreamTimeoutError

FailureKind = Literal["connect", "transport", "timeout", "pool"]
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


def failure_kind(exc: UpstreamError) -> FailureKind:
    """What went wrong: ``connect`` and ``transport`` (no answer at all) may be retried."""
    if isinstance(exc, UpstreamTimeoutError):
        return "timeout"
    cause = exc.__cause__
    if isinstance(cause, httpx.PoolTimeout):
        return "pool"
    if isinstance(cause, httpx.ConnectError | httpx.ConnectTimeout):
        return "connect"
    return "transport"


def _mapped(exc: httpx.TransportError, replica: str, what: str) -> UpstreamError:
    detail = str(exc) or type(exc).__name__
    return UpstreamError(f"replica {replica} {what}: {detail}", replica=replica)


def passthrough_headers(headers: httpx.Headers) -> dict[str, str]:
    """The upstream's response headers a client should see (hop-by-hop ones removed)."""
    return {k: v for k, v in headers.items() if k.lower() not in _DROPPED}


class UpstreamResponse:
    """A replica's answer whose status and headers arrived; the body is read chunk by chunk."""

    def __init__(
        self,
        replica: str,
        response: httpx.Response,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.replica = replica
        self.status = response.status_code
        self.headers = response.headers
        self._response = response
        self._chunks: AsyncIterator[bytes] = response.aiter_bytes()
        self._on_close = on_close

    async def next_chunk(self, timeout_s: float) -> bytes:
        """The next piece of the body as it arrived; ``b""`` at its end.

        :raises UpstreamTimeoutError: nothing arrived for ``timeout_s``.
        :raises UpstreamError: the connection broke.
        """
        try:
            async with asyncio.timeout(timeout_s):
                return await anext(self._chunks, b"")
        except TimeoutError:
            raise UpstreamTimeoutError(
                f"replica {self.replica} sent nothing for {timeout_s:g}s", replica=self.replica
            ) from None
        except httpx.TransportError as exc:
            raise _mapped(exc, self.replica, "broke the stream") from exc

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
        """Close the response; mid-body this drops the connection, so the engine aborts."""
        try:
            with contextlib.suppress(httpx.TransportError):
                await self._response.aclose()
        finally:
            on_close, self._on_close = self._on_close, None
            if on_close is not None:
                on_close()


class _Pool:
    """One replica's httpx client and the requests open through it."""

    __slots__ = ("client", "inflight", "url")

    def __init__(self, url: str, client: httpx.AsyncClient) -> None:
        self.url = url
        self.client = client
        self.inflight = 0


class UpstreamClient:
    """A pooled httpx client per replica, sized for many concurrent streams.

    One pool per replica, not one for the fleet: httpcore scans every connection of a pool
    each time a request starts or ends: with 640 streams open, one more request through a
    shared pool cost 2.8 ms instead of 0.8 ms, and in ``kvrouter bench``'s oracle pass (9
    requests per prompt) the scan was a third of the router's CPU. Per replica it scans
    that replica's connections only.

    :param connect_timeout_s: TCP connect (and pool wait, and request upload) timeout.
    :param max_connections: connections to each replica.
    :param api_key: bearer key sent to every replica (vLLM's ``--api-key``), if any.
    """

    def __init__(
        self, *, connect_timeout_s: float, max_connections: int, api_key: str | None = None
    ) -> None:
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = httpx.Timeout(
            connect=connect_timeout_s,
            read=None,
            write=max(10.0, connect_timeout_s),
            pool=max(10.0, connect_timeout_s),
        )
        self._limits = httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=max(64, max_connections // 4),
            keepalive_expiry=30.0,
        )
        self._pools: dict[str, _Pool] = {}
        self._retired: set[_Pool] = set()
        self._closing: set[asyncio.Task[None]] = set()

    def _pool(self, replica: str, url: str) -> _Pool:
        pool = self._pools.get(replica)
        if pool is not None and pool.url == url:
            return pool
        if pool is not None:  # the replica moved: retire the old pool
            self.retire(replica)
        client = httpx.AsyncClient(
            timeout=self._timeout,
            limits=self._limits,
            headers=self._headers,
            follow_redirects=False,
            trust_env=False,
        )
        pool = self._pools[replica] = _Pool(url, client)
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
            task = asyncio.get_running_loop().create_task(pool.client.aclose())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

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
        pool = self._pool(replica, url)
        request = pool.client.build_request(
            "POST", url.rstrip("/") + path, content=content, headers=headers
        )
        pool.inflight += 1
        try:
            async with asyncio.timeout(timeout_s):
                response = await pool.client.send(request, stream=True)
        except TimeoutError:
            self._release(pool)
            raise UpstreamTimeoutError(
                f"replica {replica} did not answer within {timeout_s:g}s", replica=replica
            ) from None
        except httpx.TransportError as exc:
            self._release(pool)
            raise _mapped(exc, replica, "failed") from exc
        except BaseException:
            self._release(pool)
            raise
        return UpstreamResponse(replica, response, on_close=lambda: self._release(pool))

    async def get(self, replica: str, url: str, path: str, *, timeout_s: float) -> tuple[int, str]:
        """``(status, body text)`` of a GET, for health checks and engine metrics."""
        pool = self._pool(replica, url)
        pool.inflight += 1
        try:
            async with asyncio.timeout(timeout_s):
                response = await pool.client.get(url.rstrip("/") + path)
        except TimeoutError:
            raise UpstreamTimeoutError(
                f"replica {replica} did not answer {path} within {timeout_s:g}s", replica=replica
            ) from None
        except httpx.TransportError as exc:
            raise _mapped(exc, replica, f"failed {path}") from exc
        finally:
            self._release(pool)
        return response.status_code, response.text

    async def aclose(self) -> None:
        pools = [*self._pools.values(), *self._retired]
        self._pools.clear()
        self._retired.clear()
        await asyncio.gather(*(p.client.aclose() for p in pools), *self._closing)
