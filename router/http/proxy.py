"""The generation routes: place a request, send it upstream, relay the answer, account for it.

Per attempt a load lease is taken (released in a ``finally``), the chosen replica is
predicted to hold the prompt's blocks, and the request is sent. Until the answer's first
byte reaches the client (for a stream: its first chunk, which also gives the TTFT) a failed
connection or a 5xx is retried on the next-best replica; after that, an upstream failure
can only end the stream, with an OpenAI error event and ``[DONE]``. A client that leaves
cancels the upstream request: its connection is closed, which vLLM takes as an abort.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Final

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from router.config import RouterSettings
from router.decide.estimator import SpeedBook
from router.decide.placement import Placement, Placer
from router.decide.policy_types import Score
from router.decide.request import (
    PATHS,
    Endpoint,
    PromptRequest,
    cached_tokens,
    parse,
    read_body,
    upstream_body,
)
from router.errors import NoReplicaError, UpstreamError
from router.fleet.replicas import Replica
from router.fleet.upstream import (
    UpstreamClient,
    UpstreamResponse,
    failure_kind,
    passthrough_headers,
)
from router.http.relay import RelayResponse
from router.http.sse import UsageFilter, error_event
from router.metrics import MismatchDetector, RouterMetrics
from router.shared.load import LoadBoard
from router.shared.state import GuardedIndex
from tracker.core.keys import home_anchors
from tracker.framework.http import CLIENT_CLOSED, ClientWatch

logger = logging.getLogger(__name__)

REPLICA_HEADER: Final = "x-kvrouter-replica"
PREDICTED_HEADER: Final = "x-kvrouter-cached-tokens-predicted"
FALLBACK_HEADER: Final = "x-kvrouter-fallback"
DECISION_HEADER: Final = "x-kvrouter-decision-ms"
_decode = msgspec.json.Decoder().decode


class _Call:
    """One client request on its way: what was decided and what is sent upstream."""

    def __init__(
        self, endpoint: Endpoint, request: PromptRequest, placement: Placement, body: bytes
    ) -> None:
        self.endpoint = endpoint
        self.request = request
        self.placement = placement
        self.body = body
        self.started = time.monotonic()
        self.headers: dict[str, str] = {"content-type": "application/json"}
        self.done = False


class _Attempt:
    """One try on one replica: its load lease, in-flight gauge and first-token bookkeeping."""

    def __init__(self, proxy: Proxy, call: _Call, replica: Replica) -> None:
        self.proxy = proxy
        self.call = call
        self.replica = replica
        self.score: Score = call.placement.score(replica.id)
        placement = call.placement
        work = self.score.uncached_tokens + round(self.score.loading_tokens)
        self.lease = proxy.load.acquire(placement.namespace, replica.id, work)
        proxy.metrics.inflight.labels(replica.id).inc()
        self.dispatched = time.monotonic()
        self._first = False
        self._timer: asyncio.TimerHandle | None = None
        if not call.request.stream:
            # A non-streamed answer shows no first token: stop counting its prefill work
            # once the policy expected it to be done.
            delay = max(0.0, self.score.expected_ttft_ms / 1000)
            self._timer = asyncio.get_running_loop().call_later(delay, self.lease.first_token)
        # blocks the events already place there need no prediction; predicted ones get renewed
        held = placement.matches.get(replica.id)
        start = held.blocks - held.predicted_blocks if held is not None else 0
        keys = placement.keys
        proxy.shared.predict(
            placement.namespace,
            replica.id,
            keys[start:],
            proxy.settings.predict_ttl_s,
            anchors=[keys[p] for p in home_anchors(len(keys))],
            home_ttl_s=proxy.settings.home_ttl_s,
        )

    def first_token(self) -> None:
        if self._first:
            return
        self._first = True
        self.lease.first_token()
        ttft = time.monotonic() - self.dispatched
        self.proxy.metrics.ttft.labels(self.replica.id).observe(ttft)
        self.proxy.speeds.observe(self.call.placement.model, ttft * 1000, self.score.work_tokens)

    def release(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.lease.released:
            self.lease.release()
            self.proxy.metrics.inflight.labels(self.replica.id).dec()


class Proxy:
    """Handles ``/v1/chat/completions`` and ``/v1/completions``."""

    def __init__(
        self,
        settings: RouterSettings,
        *,
        placer: Placer,
        upstream: UpstreamClient,
        load: LoadBoard,
        shared: GuardedIndex,
        speeds: SpeedBook,
        metrics: RouterMetrics,
        detector: MismatchDetector,
    ) -> None:
        self.settings = settings
        self.placer = placer
        self.replicas = placer.replicas
        self.upstream = upstream
        self.load = load
        self.shared = shared
        self.speeds = speeds
        self.metrics = metrics
        self.detector = detector
        self.inflight = 0
        self._own_keys = bool(
            settings.api_key or settings.api_key_file or settings.upstream_api_key
        )

    async def handle(self, request: Request, endpoint: Endpoint) -> Response:
        """Route one generation request (errors raise :class:`~router.errors.RouterError`)."""
        raw = await read_body(request, self.settings.max_body_bytes)
        parsed = parse(raw, endpoint)
        placement = await self.placer.place(parsed)
        call = _Call(endpoint, parsed, placement, upstream_body(parsed, raw))
        call.headers["x-request-id"] = request.headers.get("x-request-id") or uuid.uuid4().hex
        auth = request.headers.get("authorization")
        if auth and not self._own_keys:
            call.headers["authorization"] = auth  # no key of ours: the replicas judge it
        chosen = placement.score(placement.decision.replica)
        self.metrics.prompt_tokens.labels(chosen.replica).inc(placement.prompt_tokens)
        if placement.prompt_tokens:
            self.metrics.predicted_hit_ratio.observe(
                chosen.matched_tokens / placement.prompt_tokens
            )
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
        for replica_id in call.placement.order():
            replica = self.replicas.get(replica_id)
            if replica_id not in tried and replica is not None and replica.healthy:
                return replica
        return None

    async def _dispatch(self, call: _Call, watch: ClientWatch) -> Response:
        tried: list[str] = []
        while (replica := self._next(call, tried)) is not None:
            tried.append(replica.id)
            attempt = _Attempt(self, call, replica)
            try:
                answer = await self._start(call, attempt)
            except asyncio.CancelledError:
                if not watch.absorb():
                    attempt.release()
                    raise
                answer = None
            except UpstreamError as exc:
                attempt.release()
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
                attempt.release()
                raise
            if answer is None:
                attempt.release()
                self._count(call, CLIENT_CLOSED, replica.id)
                self.metrics.disconnects.labels(call.endpoint).inc()
                self._close(call)
                return Response(status_code=CLIENT_CLOSED)
            upstream, data = answer
            if upstream.status >= 500:
                attempt.release()
                self.metrics.upstream_errors.labels(replica.id, "status").inc()
                self.replicas.failed(replica.id, f"answered {upstream.status}")
                if self._next(call, tried) is not None:
                    self.metrics.retries.labels("status").inc()
                    continue
            return self._respond(call, attempt, upstream, data, watch)
        raise NoReplicaError("no healthy replica left to try")

    async def _start(self, call: _Call, attempt: _Attempt) -> tuple[UpstreamResponse, bytes]:
        """Send the request; wait for a stream's first chunk or a whole other answer."""
        replica = attempt.replica
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
            if upstream.status >= 300 or not call.request.stream:
                data = await upstream.read(self.settings.read_timeout_s)
                await upstream.aclose()
            else:
                data = await upstream.next_chunk(max(0.001, deadline - time.monotonic()))
                attempt.first_token()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
            raise
        return upstream, data

    def _headers(
        self, call: _Call, attempt: _Attempt, upstream: UpstreamResponse
    ) -> dict[str, str]:
        headers = passthrough_headers(upstream.headers)
        headers["x-request-id"] = call.headers["x-request-id"]
        headers[REPLICA_HEADER] = attempt.replica.id
        headers[PREDICTED_HEADER] = str(attempt.score.matched_tokens)
        headers[DECISION_HEADER] = f"{call.placement.stages.get('total', 0.0) * 1000:.3f}"
        if call.placement.fallback is not None:
            headers[FALLBACK_HEADER] = call.placement.fallback
        return headers

    def _respond(
        self,
        call: _Call,
        attempt: _Attempt,
        upstream: UpstreamResponse,
        data: bytes,
        watch: ClientWatch,
    ) -> Response:
        headers = self._headers(call, attempt, upstream)
        self._count(call, upstream.status, attempt.replica.id)
        if upstream.status >= 300 or not call.request.stream:
            engine: int | None = None
            if upstream.status == 200 and b'"usage"' in data:
                try:
                    answer = _decode(data)
                except msgspec.DecodeError:
                    answer = None
                if isinstance(answer, dict):
                    engine = cached_tokens(answer.get("usage"))
            self._finished(call, attempt, "ok" if upstream.status < 500 else "error", engine)
            return Response(data, upstream.status, headers)
        usage = UsageFilter(strip_usage=not call.request.include_usage)
        relay = self._relay(call, attempt, upstream, data, usage)

        async def cleanup() -> None:
            await upstream.aclose()
            self._finished(call, attempt, "client_disconnect", None)

        return RelayResponse(relay, cleanup, watch, status_code=upstream.status, headers=headers)

    async def _relay(
        self,
        call: _Call,
        attempt: _Attempt,
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
            self.metrics.stream_errors.labels(attempt.replica.id).inc()
            self.replicas.failed(attempt.replica.id, exc.message)
            logger.warning(
                "upstream stream broke; ending the client's stream",
                extra={"replica": attempt.replica.id, "error": exc.message},
            )
            yield error_event(exc)  # whole events only were sent: this one starts cleanly
        finally:
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
            self._finished(call, attempt, outcome, usage.cached_tokens)

    def _count(self, call: _Call, status: int, replica: str) -> None:
        self.metrics.requests.labels(call.endpoint, str(status), replica).inc()

    def _finished(self, call: _Call, attempt: _Attempt, outcome: str, engine: int | None) -> None:
        if call.done:
            return
        self._close(call)
        attempt.release()
        self.metrics.duration.labels(call.endpoint).observe(time.monotonic() - call.started)
        if outcome == "client_disconnect":
            self.metrics.disconnects.labels(call.endpoint).inc()
        placement = call.placement
        # a prediction to check needs block keys (baseline policies compute none)
        checkable = placement.fallback is None and bool(placement.keys)
        if engine is not None and checkable and call.request.batch == 1:
            size = placement.namespace.block_size
            held = placement.matches.get(attempt.replica.id)
            real = (held.blocks - held.predicted_blocks) * size if held is not None else 0
            predicted = attempt.score.matched_tokens
            self.detector.observe(
                placement.model,
                attempt.replica.id,
                predicted=predicted,
                confirmed=min(real, predicted),
                engine=engine,
                block=size,
            )
        if outcome == "ok":
            self.replicas.succeeded(attempt.replica.id)
