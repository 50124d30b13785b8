"""Replay requests to a publisher's ROUTER socket over DEALER (vLLM's replay protocol, §2.5).

A request is ``[b"", start_seq (8 bytes BE)]``; the publisher answers one message per
buffered batch with ``seq >= start_seq`` in order, then an end marker. Both reply layouts
vLLM has shipped are accepted (:func:`tracker.core.events.decode_replay_reply`). DEALER, not REQ:
a REQ socket would keep only the first reply.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Final

import zmq
import zmq.asyncio

from tracker.core.events import Message, decode_replay_reply
from tracker.framework.errors import DecodeError
from tracker.ingest.metrics import TrackerMetrics

logger = logging.getLogger(__name__)

MAX_REPLAY_MESSAGES: Final = 1_000_000
"""Safety cap: vLLM buffers 10,000 batches by default; a stream this long is not a replay."""


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What a replay returned, in seq order.

    ``outcome``: ``ok`` (everything asked for came back), ``overrun`` (the publisher's
    buffer no longer holds the start of the range), ``timeout`` or ``error``.
    """

    outcome: str
    messages: list[Message] = field(default_factory=list)

    @property
    def received(self) -> bool:
        return self.outcome in ("ok", "overrun")

    @property
    def complete(self) -> bool:
        return self.outcome == "ok"


class ReplayClient:
    """Issues replay requests, at most ``concurrency`` at a time.

    Args:
        context: the subscriber's ZeroMQ context (one DEALER socket per request).
        metrics: where malformed replies are counted.
        timeout_s: give up when the publisher stays silent this long (per reply, so a long
            buffer that keeps streaming is not cut off).
        concurrency: replays allowed in flight at once across all replicas.
    """

    def __init__(
        self,
        context: zmq.asyncio.Context,
        metrics: TrackerMetrics,
        *,
        timeout_s: float,
        concurrency: int,
    ) -> None:
        self._context = context
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._slots = asyncio.Semaphore(max(1, concurrency))

    async def fetch(
        self, replica: str, endpoint: str, start: int, until: int | None = None
    ) -> ReplayResult:
        """Every batch ``endpoint`` still buffers from ``start`` on; counted by outcome.

        The result is complete when it starts at ``start`` and reaches ``until`` (if given).
        """
        result = await self._request(replica, endpoint, start)
        if result.received:
            messages = sorted(result.messages, key=lambda m: m.seq)
            complete = not messages or messages[0].seq == start
            if until is not None and until >= start:
                complete = complete and bool(messages) and messages[-1].seq >= until
            result = ReplayResult("ok" if complete else "overrun", messages)
            self._metrics.messages.labels("replay").inc(len(messages))
            logger.info(
                "replayed",
                extra={
                    "replica": replica,
                    "start_seq": start,
                    "batches": len(messages),
                    "first": messages[0].seq if messages else None,
                    "complete": complete,
                },
            )
        self._metrics.replays.labels(result.outcome).inc()
        return result

    async def _request(self, replica: str, endpoint: str, start: int) -> ReplayResult:
        async with self._slots:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            try:
                socket.connect(endpoint)
                return await self._exchange(socket, replica, start)
            except TimeoutError:
                logger.warning(
                    "replay timed out",
                    extra={"replica": replica, "endpoint": endpoint, "start_seq": start},
                )
                return ReplayResult("timeout")
            except zmq.ZMQError as exc:
                logger.warning(
                    "replay failed",
                    extra={"replica": replica, "endpoint": endpoint, "error": str(exc)},
                )
                return ReplayResult("error")
            finally:
                socket.close(linger=0)

    async def _exchange(self, socket: zmq.asyncio.Socket, replica: str, start: int) -> ReplayResult:
        async with asyncio.timeout(self._timeout_s):
            await socket.send_multipart([b"", start.to_bytes(8, "big")])
        messages: list[Message] = []
        while len(messages) < MAX_REPLAY_MESSAGES:
            async with asyncio.timeout(self._timeout_s):
                frames = await socket.recv_multipart()
            try:
                message = decode_replay_reply(frames)
            except DecodeError as exc:
                self._metrics.decode_errors.labels(exc.reason).inc()
                logger.warning(
                    "skipping malformed replay reply",
                    extra={"replica": replica, "reason": exc.reason, "detail": str(exc)},
                )
                continue
            if message is None:
                return ReplayResult("ok", messages)
            messages.append(message)
        logger.warning("replay exceeded its size cap", extra={"replica": replica})
        return ReplayResult("error")
