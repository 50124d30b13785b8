"""vLLM's KV-event publisher, reproduced: live batches on a ZeroMQ PUB socket and replays on a
ROUTER, framed as a chosen vLLM release frames them (``docs/vllm-kv-events.md`` §2; summed up
in docs/architecture.md, "Simulated engine"); and vLLM's endpoint rules (the port offset per
data-parallel rank, bind or connect).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections import deque
from typing import Final, Literal

import msgspec
import zmq

from tracker.core.blocks import own_extra_keys
from tracker.core.event_codec import NEWEST_ERA, WireEra, encode_batch
from tracker.core.events import REPLAY_END_SEQ, BlockStored, Event, EventBatch

logger = logging.getLogger(__name__)

END_SEQ: Final = REPLAY_END_SEQ.to_bytes(8, "big")
_POLL_MS: Final = 100


def endpoint_for_rank(endpoint: str, rank: int) -> str:
    """vLLM's per-DP-rank endpoint: tcp port + rank, ``inproc`` name + ``_dp{rank}``."""
    if rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if "tcp" in endpoint:
        base, _, port = endpoint.rpartition(":")
        if port.isdigit():
            return f"{base}:{int(port) + rank}"
        return endpoint  # a wildcard port ("*") gets a fresh port per rank anyway
    raise ValueError(f"cannot offset {endpoint!r} for data-parallel rank {rank}")


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and local-transport endpoints, connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def as_emitted(batch: EventBatch, era: WireEra) -> EventBatch:
    """``batch`` (built the v0.26+ way) as an engine of ``era`` fills it in.

    Before v0.26 a block's ``extra_keys`` held no LoRA name (its hash did; the name travels in
    ``lora_name``): drop the leading name for older eras, so both forms reach the tracker.
    """
    if era.at_least(WireEra.V0_26_0):
        return batch
    return EventBatch(batch.ts, [_pre_v26(e) for e in batch.events], batch.data_parallel_rank)


def _pre_v26(event: Event) -> Event:
    if not isinstance(event, BlockStored) or event.lora_name is None or not event.extra_keys:
        return event
    extra = own_extra_keys(event.lora_name, event.extra_keys)
    if extra is not None and all(e is None for e in extra):
        extra = None
    return msgspec.structs.replace(event, extra_keys=extra)


class ZmqEventPublisher:
    """Publish engine-step event batches exactly as a chosen vLLM release does.

    The sockets are bound (or connected) in the constructor, so address errors surface there,
    and then owned by a daemon thread that encodes, sends and answers replays;
    :meth:`publish` only enqueues, so the engine's event loop never blocks on ZeroMQ.

    Args:
        endpoint: PUB address (bound or connected, see :func:`binds`).
        replay_endpoint: ROUTER address (always bound); ``None`` disables replay.
        topic: first frame of every live message.
        era: wire format to encode (:class:`tracker.core.event_codec.WireEra`).
        replay_layout: ``"legacy"`` (vLLM <= 0.24.x, 0.25.1) or ``"topic"`` (with a topic
            frame: vLLM main from 2026-07, every release from v0.26).
        buffer_steps: how many published batches replay can serve (vLLM's default; the
            buffer costs about 1.5 kB per batch, and an engine publishes a batch per step).
        data_parallel_rank: stamped into each batch; rank > 0 offsets the endpoints like vLLM.
        hwm: high-water mark of the PUB socket.
        context: ZeroMQ context to use; by default a private one, terminated by :meth:`close`.
        bind: bind (``True``) or connect (``False``) the PUB socket; ``None``: vLLM's rule,
            :func:`binds`.

    Attributes ``endpoint`` and ``replay_endpoint`` hold the addresses actually in use (rank
    offset applied, wildcard ports resolved).
    """

    def __init__(  # noqa: PLR0917 - vLLM's KVEventsConfig order, all positional
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        topic: bytes = b"",
        era: WireEra = NEWEST_ERA,
        replay_layout: Literal["legacy", "topic"] = "topic",
        buffer_steps: int = 10_000,
        data_parallel_rank: int = 0,
        hwm: int = 100_000,
        *,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        bind: bool | None = None,
    ) -> None:
        if replay_layout not in ("legacy", "topic"):
            raise ValueError(f"replay_layout must be 'legacy' or 'topic', got {replay_layout!r}")
        if buffer_steps <= 0:
            raise ValueError("buffer_steps must be positive")
        self.topic = topic
        self.era = era
        self.replay_layout = replay_layout
        self.data_parallel_rank = data_parallel_rank
        self.encode_errors = 0
        self._owns_context = context is None
        self._context = context if context is not None else zmq.Context()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.SimpleQueue[EventBatch] = queue.SimpleQueue()
        self._seq = 0
        self._published = 0
        self._published_lock = threading.Lock()
        self._drop_live = 0
        self._lose = 0
        self._closed = False
        self._pub = self._context.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        self._bell_out, self._bell_in = socket.socketpair()
        try:
            self._pub.set_hwm(hwm)
            target = endpoint_for_rank(endpoint, data_parallel_rank)
            if binds(target) if bind is None else bind:
                self._pub.bind(target)
            else:
                self._pub.connect(target)
            self.endpoint = self._last_endpoint(self._pub, target)
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                # A replay is sent in one go; never drop part of it at the default HWM.
                self._replay.setsockopt(zmq.SNDHWM, 0)
                target = endpoint_for_rank(replay_endpoint, data_parallel_rank)
                self._replay.bind(target)
                self.replay_endpoint = self._last_endpoint(self._replay, target)
        except (zmq.ZMQError, ValueError):
            self._close_sockets()
            raise
        self._bell_out.setblocking(False)
        self._thread = threading.Thread(target=self._serve, name="zmq-publisher", daemon=True)
        self._thread.start()

    @staticmethod
    def _last_endpoint(sock: zmq.Socket[bytes], fallback: str) -> str:
        last = sock.getsockopt(zmq.LAST_ENDPOINT)
        return last.decode() if isinstance(last, bytes) and last else fallback

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def next_seq(self) -> int:
        """Batches the thread has sent so far, i.e. the sequence number of the next one."""
        return self._seq

    @property
    def published(self) -> int:
        """Batches handed to :meth:`publish` so far. Each takes the next sequence number
        when the thread sends it, so ``published - 1`` is the last batch's, sent or still
        queued: what a consumer that has everything the engine emitted has applied."""
        return self._published

    def publish(self, events: list[Event]) -> None:
        """Queue one batch (stamped now); thread-safe and non-blocking."""
        if self._closed:
            raise RuntimeError("publisher is closed")
        with self._published_lock:
            self._published += 1
            self._queue.put(EventBatch(time.time(), list(events), self.data_parallel_rank))
        self._ring()

    def drop_live(self, batches: int = 1) -> None:
        """Fault injection: keep the next ``batches`` batches for replay but never send them live.

        This is what a subscriber sees when ZeroMQ drops messages past the high-water mark or
        a network path loses them: a sequence gap that replay can repair.
        """
        self._drop_live += batches

    def lose(self, batches: int = 1) -> None:
        """Fault injection: the next ``batches`` batches are neither sent nor kept for replay.

        The replay buffer is emptied as they pass, as a bounded buffer overflows while its
        consumer is away: a subscriber sees a sequence gap that replay cannot repair.
        """
        self._lose += batches

    def close(self) -> None:
        """Send what is queued, stop the thread and close the sockets (linger 0)."""
        if self._closed:
            return
        self._closed = True
        self._ring()
        self._thread.join()
        self._close_sockets()

    def _ring(self) -> None:
        # A full bell means it is already ringing: the thread drains the whole queue anyway.
        with contextlib.suppress(BlockingIOError, InterruptedError):
            self._bell_out.send(b"\x00")

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._bell_out.close()
        self._bell_in.close()
        if self._owns_context:
            self._context.term()

    # ------------------------------------------------------------ publisher thread

    def _serve(self) -> None:
        poller = zmq.Poller()
        bell = self._bell_in.fileno()
        poller.register(bell, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(_POLL_MS))
            if self._replay is not None and self._replay in ready:
                self._answer_replays(self._replay)
            if bell in ready:
                self._bell_in.recv(4096)
            self._drain()
            if self._closed:
                self._drain()
                return

    def _drain(self) -> None:
        while True:
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                return
            self._send(batch)

    def _send(self, batch: EventBatch) -> None:
        seq, self._seq = self._seq, self._seq + 1
        try:
            payload = encode_batch(as_emitted(batch, self.era), self.era)
        except (msgspec.EncodeError, OverflowError, TypeError, ValueError):
            # vLLM consumes the sequence number too: consumers see an unreplayable gap.
            self.encode_errors += 1
            logger.exception("dropping an event batch that cannot be encoded", extra={"seq": seq})
            return
        if self._lose > 0:
            self._lose -= 1
            self._buffer.clear()
            return
        self._buffer.append((seq, payload))
        if self._drop_live > 0:
            self._drop_live -= 1
            return
        self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], copy=False)

    def _answer_replays(self, router: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                logger.warning("ignoring a malformed replay request", extra={"frames": len(frames)})
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            topic_frame = [self.topic] if self.replay_layout == "topic" else []
            for seq, payload in self._buffer:
                if seq >= start:
                    router.send_multipart(
                        [identity, b"", *topic_frame, seq.to_bytes(8, "big"), payload], copy=False
                    )
            end_topic = [b""] if self.replay_layout == "topic" else []
            router.send_multipart([identity, b"", *end_topic, END_SEQ, b""])
