"""ZeroMQ consumption of many replicas' KV events (zmq.asyncio), one ordered stream each.

Two ways in, usable together:

* connect mode: one SUB socket per replica, connected to the replica's PUB endpoint;
* bind mode (``--bind tcp://*:5557``): one bound SUB socket that publishers connect to; the
  topic names the replica, either ``<id>`` or llm-d style ``kv@<id>@<model>``.

Frames are split here; sequence handling, replay and fencing live in
:class:`tracker.ingest.streams.ReplicaStream`, index writes and their retries in
:class:`tracker.ingest.writes.IndexWriter`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Final

import zmq
import zmq.asyncio

from tracker.core.blocks import Namespace
from tracker.core.events import decode_message
from tracker.core.index import BlockIndex
from tracker.framework.errors import DecodeError
from tracker.framework.lifecycle import cancel_and_wait, finish_or_cancel
from tracker.ingest.config import TrackerSettings
from tracker.ingest.metrics import TrackerMetrics
from tracker.ingest.replay import ReplayClient
from tracker.ingest.streams import ReplicaStream, ReplicaTarget
from tracker.ingest.writes import IndexWriter

logger = logging.getLogger(__name__)

RCVHWM: Final = 100_000
"""Matches vLLM's publisher HWM so a burst is queued rather than dropped."""

MAX_MESSAGE_BYTES: Final = 64 << 20
"""Largest frame the bound SUB socket accepts; ZeroMQ drops the connection of a peer sending
more (an honest one reconnects). One engine step's events are far smaller; the limit bounds
what anyone who can reach ``--bind`` makes the tracker allocate. Sockets that connect out are
not limited: libzmq never reconnects after such a protocol error, so one oversized batch
would silently cut the tracker off from that engine."""


def parse_topic(topic: bytes) -> tuple[str, str | None]:
    """The replica id (and model, llm-d style) a bind-mode topic names."""
    try:
        text = topic.decode("utf-8")
    except UnicodeDecodeError:
        raise DecodeError("bad_topic", "topic is not UTF-8") from None
    model: str | None = None
    if text.startswith("kv@"):
        _, replica, *rest = text.split("@", 2)
        model = rest[0] if rest and rest[0] else None
    else:
        replica = text
    if not replica or len(replica) > 256 or not replica.isprintable():
        raise DecodeError("bad_topic", f"no replica id in topic {text[:64]!r}")
    return replica, model


class Subscriber:
    """Owns the ZeroMQ context, the sockets and one worker task per replica.

    Args:
        settings: the tracker's settings (``bind``, ``topic``, replay and resync options).
        index: where blocks go.
        metrics: the service's metrics.
        on_failure: called when a task crashed (a bug): the service stops with an error.
    """

    def __init__(
        self,
        settings: TrackerSettings,
        index: BlockIndex,
        metrics: TrackerMetrics,
        *,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._on_failure = on_failure
        self.writer = IndexWriter(index, metrics)
        self._context: zmq.asyncio.Context | None = None
        self._replay: ReplayClient | None = None
        self._streams: dict[str, ReplicaStream] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._readers: dict[str, tuple[zmq.asyncio.Socket, asyncio.Task[None]]] = {}
        self._bound: tuple[zmq.asyncio.Socket, asyncio.Task[None]] | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._stopped = False
        self.bound_endpoint: str | None = None
        self.failure: BaseException | None = None

    async def start(self) -> None:
        """Create the context, bind the fan-in socket if configured, start the flusher."""
        self._context = zmq.asyncio.Context()
        self._replay = ReplayClient(
            self._context,
            self._metrics,
            timeout_s=self._settings.replay_timeout_s,
            concurrency=self._settings.max_replays,
        )
        if self._settings.bind:
            socket = self._sub_socket()
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            try:
                socket.bind(self._settings.bind)
            except zmq.ZMQError:
                socket.close(linger=0)
                raise
            self.bound_endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
            self._bound = (socket, self._spawn(self._read_bound(socket), "bind-reader"))
            logger.info("accepting publishers", extra={"endpoint": self.bound_endpoint})
        self._flusher = self._spawn(self.writer.run(), "flusher")

    # ----------------------------------------------------------- replicas

    def track(self, target: ReplicaTarget) -> ReplicaStream:
        """Start consuming ``target`` (or update its replay endpoint / instance).

        Raises ``zmq.ZMQError`` when the events endpoint cannot be connected to.
        """
        current = self._streams.get(target.id)
        if current is not None:
            if (current.target.events, current.namespace) != (target.events, target.namespace):
                raise RuntimeError(f"replica {target.id} is tracked with other endpoints")
            current.target = target
            return current
        if self._context is None or self._replay is None:
            raise RuntimeError("Subscriber.start() was not awaited")
        socket: zmq.asyncio.Socket | None = None
        if target.events is not None:
            socket = self._sub_socket()
            try:
                socket.connect(target.events)
            except zmq.ZMQError:
                socket.close(linger=0)
                raise
        stream = ReplicaStream(
            target,
            writer=self.writer,
            metrics=self._metrics,
            replay=self._replay,
            settings=self._settings,
        )
        self._streams[target.id] = stream
        self._workers[target.id] = self._spawn(stream.run(), f"stream:{target.id}")
        if socket is not None:
            task = self._spawn(self._read_connected(socket, stream), f"reader:{target.id}")
            self._readers[target.id] = (socket, task)
        self._metrics.replicas.set(len(self._streams))
        return stream

    async def untrack(self, replica: str) -> ReplicaTarget | None:
        """Stop consuming ``replica`` (its blocks stay; see :meth:`forget`)."""
        stream = self._streams.pop(replica, None)
        if stream is None:
            return None
        reader = self._readers.pop(replica, None)
        await cancel_and_wait([self._workers.pop(replica)] + ([reader[1]] if reader else []))
        if reader is not None:
            reader[0].close(linger=0)
        self._metrics.forget(replica)
        self._metrics.replicas.set(len(self._streams))
        logger.info("replica untracked", extra={"replica": replica})
        return stream.target

    async def forget(self, replica: str, namespace: Namespace) -> int:
        """Stop consuming ``replica`` and remove its blocks; returns how many it held."""
        await self.untrack(replica)
        held = await self.writer.forget(replica, namespace)
        return held or 0

    def fence(self, replica: str, cause: str, *, catch_up: bool = True) -> bool:
        """Clear ``replica``'s blocks in stream order; ``False`` if it is not tracked."""
        stream = self._streams.get(replica)
        if stream is None:
            return False
        stream.fence(cause, catch_up=catch_up)
        return True

    def get(self, replica: str) -> ReplicaStream | None:
        return self._streams.get(replica)

    def status(self) -> dict[str, dict[str, Any]]:
        return {replica: stream.status() for replica, stream in sorted(self._streams.items())}

    @property
    def index_down(self) -> bool:
        return self.writer.down

    # ----------------------------------------------------------- shutdown

    async def stop(self, timeout_s: float) -> dict[str, int]:
        """Stop intake, let workers apply what is queued (bounded), cancel the rest."""
        if self._stopped:
            return {}
        self._stopped = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        sockets_tasks = list(self._readers.values()) + ([self._bound] if self._bound else [])
        await cancel_and_wait([task for _, task in sockets_tasks])
        for socket, _ in sockets_tasks:
            socket.close(linger=0)
        self._readers.clear()
        self._bound = None
        for stream in self._streams.values():
            stream.finish()
        drained, cancelled = await finish_or_cancel(
            list(self._workers.values()), deadline - loop.time()
        )
        left = await self._final_flush(max(0.0, deadline - loop.time()))
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None
        counts = {
            "replicas": len(self._streams),
            "drained": drained,
            "cancelled": cancelled,
            "pending_writes": left,
        }
        self._streams.clear()
        self._workers.clear()
        self._metrics.replicas.set(0)
        return counts

    async def _final_flush(self, budget_s: float) -> int:
        if self._flusher is not None:
            await cancel_and_wait([self._flusher])
            self._flusher = None
        return await self.writer.flush(budget_s)

    # ----------------------------------------------------------- internals

    def _sub_socket(self) -> zmq.asyncio.Socket:
        assert self._context is not None
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, RCVHWM)
        socket.setsockopt(zmq.SUBSCRIBE, self._settings.topic.encode())
        return socket

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        assert exc is not None
        logger.error("tracker task crashed", exc_info=exc, extra={"task": task.get_name()})
        if self.failure is None:
            self.failure = exc
        if self._on_failure is not None:
            self._on_failure(exc)

    def _malformed(self, replica: str | None, exc: DecodeError) -> None:
        self._metrics.decode_errors.labels(exc.reason).inc()
        logger.warning(
            "skipping malformed message",
            extra={"replica": replica, "reason": exc.reason, "detail": str(exc)},
        )

    async def _read_connected(self, socket: zmq.asyncio.Socket, stream: ReplicaStream) -> None:
        while True:
            frames = await socket.recv_multipart()
            try:
                message = decode_message(frames)
            except DecodeError as exc:
                self._malformed(stream.id, exc)
                continue
            stream.offer(message)

    async def _read_bound(self, socket: zmq.asyncio.Socket) -> None:
        while True:
            frames = await socket.recv_multipart()
            try:
                message = decode_message(frames)
                replica, model = parse_topic(message.topic)
            except DecodeError as exc:
                self._malformed(None, exc)
                continue
            stream = self._streams.get(replica)
            if stream is None:
                namespace = Namespace(model or self._settings.model, self._settings.block_size)
                stream = self.track(ReplicaTarget(replica, namespace))
            elif stream.target.events is not None:
                # Also consumed over its own socket: taking both copies would look like a
                # sequence reset on every message.
                continue
            stream.offer(message)
