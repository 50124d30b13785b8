"""The generation routes: a front end that places a request, sends it, relays the answer.

Per request: the body is read and parsed, the decision core places it
(:meth:`~router.decide.decider.Decider.place`), and each attempt is committed to the replica
actually tried before it is sent (:meth:`~router.decide.decider.Decider.commit`). Until the
answer's first byte reaches the client (for a stream: its first chunk, which also gives the
TTFT) a failed connection or a 5xx is retried on the next-best replica; after that, an upstream
failure can only end the stream, with an OpenAI error event and ``[DONE]``. A client that
leaves cancels the upstream request: its connection is closed, which vLLM takes as an abort.
However the answer ends, the attempt is finished once
(:meth:`~router.decide.decider.Decider.finish`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Final

import anyio
from starlette.requests import Request
from starlette.responses import Response

from router.config import RouterSettings
from router.decide.attempt import Attempt
from router.decide.decider import Decider
from router.decide.placement import Placement
from router.decide.request import Endpoint, answer_cached_tokens, parse
from router.errors import NoReplicaError, UpstreamError
from router.fleet.replicas import Replica, ReplicaSet
from router.fleet.upstream import (
    UpstreamClient,
    UpstreamResponse,
    failure_kind,
    passthrough_headers,
)
from router.http.body import PATHS, read_body, upstream_body
from router.http.relay import RelayResponse
from router.http.sse import UsageFilter, error_event
from router.metrics import RouterMetrics
from tracker.framework.http import CLIENT_CLOSED, ClientWatch

logger = logging.getLogger(__name__)

REPLICA_HEADER: Final = "x-kvrouter-replica"
PREDICTED_HEADER: Final = "x-kvrouter-cached-tokens-predicted"
FALLBACK_HEADER: Final = "x-kvrouter-fallback"
DECISION_HEADER: Final = "x-kvrouter-decision-ms"


class _Call:
    """One client request on its way: what was decided and what is sent upstream."""

    def __init__(
        self,
        endpoint: Endpoint,
        placement: Placement,
        body: bytes,
        headers: dict[str, str],
    ) -> None:
        self.endpoint = endpoint
        self.placement = placement
        self.body = body
        self.headers = headers
        self.started = time.monotonic()
        self.done = False


class Proxy:
    """Handles ``/v1/chat/completions`` and ``/v1/completions`` over the decision core."""

    def __init__(
        self,
        settings: RouterSettings,
        *,
        decider: Decider,
        replicas: ReplicaSet,
        upstream: UpstreamClient,
        metrics: RouterMetrics,
    ) -> None:
        self.settings = settings
        self.decider = decider
        self.replicas = replicas
        self.upstream = upstream
        self.metrics = metrics
        self.inflight = 0
        self._own_keys = bool(
            settings.api_key or settings.api_key_file or settings.upstream_api_key
        )

    async def handle(self, request: Request, endpoint: Endpoint) -> Response:
        """Route one generation request (errors raise :class:`~router.errors.RouterError`)."""
        raw = await read_body(request, self.settings.max_body_bytes)
        header = self.settings.session_header
        parsed = parse(raw, endpoint, request.headers.get(header) if header else None)
        placement = await self.decider.place(parsed)
        headers = {
            "content-type": "application/json",
            "x-request-id": request.headers.get("x-request-id") or uuid.uuid4().hex,
        }
        auth = request.headers.get("authorization")
        if auth and not self._own_keys:
            headers["authorization"] = auth  # no key of ours: the replicas judge it
        call = _Call(endpoint, placement, upstream_body(parsed, raw), headers)
        self.inflight += 1
        watch = ClientWatch(request.receive)
        try:
            response = await self._dispatch(call, watch)
        except BaseException:
            watch.close()
            self._close(call)
            raise
        if not isinstance(response, RelayResponse):
            watch.close()  # a relay closes it once the stream is sent
        return response

    def _close(self, call: _Call) -> None:
        """The call is over (counted once): answered, streamed, failed or abandoned."""
        if not call.done:
            call.done = True
            self.inflight -= 1

    def _next(self, call: _Call, tried: list[str]) -> Replica | None:
        if len(tried) > self.settings.retries:
            return None
        healthy = self.replicas.in_rotation(call.placement.order())
        return next((r for r in healthy if r.id not in tried), None)

    async def _dispatch(self, call: _Call, watch: ClientWatch) -> Response:
        tried: list[str] = []
        while (replica := self._next(call, tried)) is not None:
            tried.append(replica.id)
            attempt = self.decider.commit(call.placement, replica.id)
            try:
                answer = await self._start(call, replica, attempt)
            except asyncio.CancelledError:
                if not watch.absorb():
                    self.decider.fail(attempt)
                    raise
                answer = None
            except UpstreamError as exc:
                self.decider.fail(attempt)
                kind = failure_kind(exc)
                self.metrics.upstream_errors.labels(replica.id, kind).inc()
                self.replicas.failed(replica.id, exc.message, now=kind == "connect")
                if kind in ("connect", "transport") and self._next(call, tried) is not None:
                    self.metrics.retries.labels(kind).inc()
                    logger.info(
                        "retrying on the next-best replica",
                        extra={"replica": replica.id, "error": exc.message},
                    )
                    continue
                if kind == "connect":
                    raise NoReplicaError(
                        f"no replica serving `{call.placement.model}` could be reached"
                    ) from exc
                raise
            except BaseException:
                self.decider.fail(attempt)
                raise
            if answer is None:  # the client left before the answer started
                self._count(call, CLIENT_CLOSED, replica.id)
                self._finished(call, attempt, "client_disconnect", None, timed=False)
                return Response(status_code=CLIENT_CLOSED)
            upstream, data = answer
            if upstream.status >= 500:
                self.decider.fail(attempt)
                self.metrics.upstream_errors.labels(replica.id, "status").inc()
                self.replicas.failed(replica.id, f"answered {upstream.status}")
                if self._next(call, tried) is not None:
                    self.metrics.retries.labels("status").inc()
                    continue
            return self._respond(call, attempt, upstream, data, watch)
        raise NoReplicaError("no healthy replica left to try")

    async def _start(
        self, call: _Call, replica: Replica, attempt: Attempt
    ) -> tuple[UpstreamResponse, bytes]:
        """Send the request; wait for a stream's first chunk or a whole other answer."""
        deadline = attempt.dispatched + self.settings.first_byte_timeout_s
        upstream = await self.upstream.open(
            replica.id,
            replica.url,
            PATHS["chat" if call.endpoint == "chat" else "completions"],
            call.body,
            call.headers,
            timeout_s=self.settings.first_byte_timeout_s,
        )
        try:
            if upstream.status >= 300 or not call.placement.request.stream:
                data = await upstream.read(self.settings.read_timeout_s)
                await upstream.aclose()
            else:
                data = await upstream.next_chunk(max(0.001, deadline - time.monotonic()))
                self.decider.first_token(attempt)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
            raise
        return upstream, data

    def _headers(self, call: _Call, attempt: Attempt, upstream: UpstreamResponse) -> dict[str, str]:
        headers = passthrough_headers(upstream.headers)
        headers["x-request-id"] = call.headers["x-request-id"]
        headers[REPLICA_HEADER] = attempt.replica
        headers[PREDICTED_HEADER] = str(attempt.score.matched_tokens)
        headers[DECISION_HEADER] = f"{call.placement.stages.get('total', 0.0) * 1000:.3f}"
        if call.placement.fallback is not None:
            headers[FALLBACK_HEADER] = call.placement.fallback
        return headers

    def _respond(
        self,
        call: _Call,
        attempt: Attempt,
        upstream: UpstreamResponse,
        data: bytes,
        watch: ClientWatch,
    ) -> Response:
        headers = self._headers(call, attempt, upstream)
        self._count(call, upstream.status, attempt.replica)
        if upstream.status >= 300 or not call.placement.request.stream:
            engine = answer_cached_tokens(data) if upstream.status == 200 else None
            self._finished(call, attempt, "ok" if upstream.status < 500 else "error", engine)
            return Response(data, upstream.status, headers)
        usage = UsageFilter(strip_usage=not call.placement.request.include_usage)
        relay = self._relay(call, attempt, upstream, data, usage)

        async def cleanup() -> None:
            await upstream.aclose()
            self._finished(call, attempt, "client_disconnect", None)

        return RelayResponse(relay, cleanup, watch, status_code=upstream.status, headers=headers)

    async def _relay(
        self,
        call: _Call,
        attempt: Attempt,
        upstream: UpstreamResponse,
        first: bytes,
        usage: UsageFilter,
    ) -> AsyncGenerator[bytes, None]:
        outcome = "client_disconnect"
        try:
            data = first
            while data:
                out = usage.feed(data)
                if out:
                    yield out
                data = await upstream.next_chunk(self.settings.read_timeout_s)
            tail = usage.flush()
            if tail:
                yield tail
            outcome = "ok"
        except UpstreamError as exc:
            outcome = "stream_error"
            self.metrics.stream_errors.labels(attempt.replica).inc()
            self.replicas.failed(attempt.replica, exc.message)
            logger.warning(
                "upstream stream broke; ending the client's stream",
                extra={"replica": attempt.replica, "error": exc.message},
            )
            yield error_event(exc)  # whole events only were sent: this one starts cleanly
        finally:
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
            self._finished(call, attempt, outcome, usage.cached_tokens)

    def _count(self, call: _Call, status: int, replica: str) -> None:
        self.metrics.requests.labels(call.endpoint, str(status), replica).inc()

    def _finished(
        self,
        call: _Call,
        attempt: Attempt,
        outcome: str,
        engine: int | None,
        *,
        timed: bool = True,
    ) -> None:
        """The answer ended (counted once): the call is closed, the attempt finished."""
        if call.done:
            return
        self._close(call)
        if timed:
            self.metrics.duration.labels(call.endpoint).observe(time.monotonic() - call.started)
        if outcome == "client_disconnect":
            self.metrics.disconnects.labels(call.endpoint).inc()
        self.decider.finish(attempt, outcome, engine)
