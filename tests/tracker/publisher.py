"""A vLLM-compatible KV-event publisher for tests: XPUB live socket + ROUTER replay buffer.

XPUB speaks PUB on the wire and additionally reports subscriptions, which lets a test wait
until the tracker is listening instead of sleeping. The replay side answers DEALER and REQ
clients with either reply layout vLLM has shipped (``old``: ``[seq, payload]``, ``new``:
``[topic, seq, payload]``), from a ring buffer of ``buffer`` batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque

import zmq
import zmq.asyncio

from tests.factories import batch
from tracker.core.event_codec import WireEra, encode_batch
from tracker.core.events import REPLAY_END_SEQ, Event, encode_message

END = REPLAY_END_SEQ.to_bytes(8, "big")


async def _bind(sock: zmq.asyncio.Socket, endpoint: str) -> str:
    """Bind, retrying briefly: a just-closed socket may still hold the port (restart)."""
    for _ in range(100):
        try:
            sock.bind(endpoint)
            return sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE:
                raise
            await asyncio.sleep(0.02)
    raise TimeoutError(f"{endpoint} stays in use")


class EventPublisher:
    """One simulated engine's publisher.

    Args:
        context: the test's zmq.asyncio context.
        endpoint: where the XPUB socket binds (or connects, with ``connect=True``).
        replay: where the ROUTER binds; ``None`` disables replay.
        topic: first frame of every live message.
        layout: replay reply layout, ``"old"`` (v0.9-v0.24) or ``"new"`` (2026-07 main).
        buffer: replay ring buffer size, in batches.
        era: payload encoding.
    """

    def __init__(
        self,
        context: zmq.asyncio.Context,
        endpoint: str,
        *,
        replay: str | None = None,
        topic: bytes = b"",
        layout: str = "new",
        buffer: int = 10_000,
        connect: bool = False,
        era: WireEra = WireEra.V0_24_0,
    ) -> None:
        self.context = context
        self.endpoint = endpoint
        self.replay_endpoint = replay
        self.topic = topic
        self.layout = layout
        self.connect = connect
        self.era = era
        self.seq = 0
        self.ring: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self.drop_replays = 0
        self.replay_requests: list[int] = []
        self.pub: zmq.asyncio.Socket | None = None
        self.router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> EventPublisher:
        self.pub = self.context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        # report every subscription, duplicates too: a tracker that restarts subscribes again
        # while its predecessor's subscription may not be gone yet (the default XPUB would
        # swallow the second one and wait_subscribed would time out)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        if self.connect:
            self.pub.connect(self.endpoint)
        else:
            self.endpoint = await _bind(self.pub, self.endpoint)
        if self.replay_endpoint is not None:
            self.router = self.context.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = await _bind(self.router, self.replay_endpoint)
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())
        return self

    async def wait_subscribed(self, timeout_s: float = 5.0) -> None:
        """Until a subscriber's subscription reached the XPUB socket."""
        assert self.pub is not None
        async with asyncio.timeout(timeout_s):
            while True:
                frame = await self.pub.recv()
                if frame[:1] == b"\x01":
                    return

    async def publish(self, *events: Event, live: bool = True) -> int:
        """Publish one batch; ``live=False`` keeps it only in the replay buffer (a gap)."""
        payload = encode_batch(batch(*events, ts=time.time()), self.era)
        return await self.publish_payload(payload, live=live)

    async def publish_payload(self, payload: bytes, *, live: bool = True) -> int:
        seq = self.seq
        self.seq += 1
        self.ring.append((seq, payload))
        if live:
            await self.send_raw(encode_message(self.topic, seq, payload))
        return seq

    async def send_raw(self, frames: list[bytes]) -> None:
        assert self.pub is not None
        await self.pub.send_multipart(frames)

    async def restart(self) -> None:
        """An engine restart: sockets rebound on the same endpoints, seq and buffer reset."""
        await self.close()
        self.seq = 0
        self.ring.clear()
        await self.start()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for sock in (self.pub, self.router):
            if sock is not None:
                sock.close(linger=0)
        self.pub = self.router = None

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                continue  # vLLM ignores anything else
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            self.replay_requests.append(start)
            if self.drop_replays > 0:
                self.drop_replays -= 1
                continue
            for seq, payload in list(self.ring):
                if seq >= start:
                    await self.router.send_multipart(self._reply(identity, seq, payload))
            await self.router.send_multipart(self._end(identity))

    def _reply(self, identity: bytes, seq: int, payload: bytes) -> list[bytes]:
        if self.layout == "old":
            return [identity, b"", seq.to_bytes(8, "big"), payload]
        return [identity, b"", self.topic, seq.to_bytes(8, "big"), payload]

    def _end(self, identity: bytes) -> list[bytes]:
        if self.layout == "old":
            return [identity, b"", END, b""]
        return [identity, b"", b"", END, b""]
