"""Fuzz the tracker's event intake: nothing but DecodeError escapes, junk never touches the index.

Two paths, both the real code:

* decode + apply (100,000+ messages): ``decode_message`` -> ``decode_batch`` ->
  ``MemoryIndex.apply``, as a replica stream does, for every truncation of every golden
  payload plus a seeded mix of random bytes, mutated golden and valid payloads, wrong types,
  unknown tags, huge and deeply nested structures, out-of-range hashes and mis-framed messages;
* the subscriber (5,000 messages, a sample of the same mix): a real ZeroMQ PUB socket ->
  ``Subscriber`` -> ``RedisIndex`` on the real redis-server, rejections counted by
  ``kvrouter_tracker_decode_errors_total``.

In both, the index must equal a reference index built by applying only the batches the
decoder accepted, and every rejected message must be counted exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from typing import Any

import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from tests.conftest import VECTORS
from tests.security.frames import BLOCK_SIZE, FrameSource, load_golden
from tracker.core.blocks import Namespace
from tracker.core.event_codec import decode_batch
from tracker.core.events import EventBatch, decode_message
from tracker.core.memory_index import MemoryIndex
from tracker.core.redis_index import RedisIndex
from tracker.framework.errors import DecodeError
from tracker.ingest.config import TrackerSettings
from tracker.ingest.metrics import TrackerMetrics
from tracker.ingest.streams import ReplicaTarget
from tracker.ingest.subscriber import Subscriber

NS = Namespace("fuzz", BLOCK_SIZE)  # the golden payloads' block size, not a shared shape
SEED = int(os.environ.get("KVROUTER_FUZZ_SEED", "20240611"))
DECODE_MESSAGES = 100_000
SOCKET_MESSAGES = 5_000


def snapshot(index: MemoryIndex) -> tuple[Any, ...]:
    """Everything a MemoryIndex holds: placements, each replica's ledger, the checkpoints."""
    blocks = {
        ns: {key: dict(holders) for key, holders in table.items()}
        for ns, table in index._blocks.items()
        if table
    }
    ledgers = {
        owner: (
            {h: (b.key, *b.counts()) for h, b in ledger.engine.items()},
            {key: tuple(refs) for key, refs in ledger.refs.items()},
            dict(ledger.orphans),
        )
        for owner, ledger in index._ledgers.items()
        if ledger.engine or ledger.orphans
    }
    return blocks, ledgers, dict(index._seq)


class Intake:
    """The decode + apply path of a replica stream, with its verdicts kept for the check."""

    def __init__(self) -> None:
        self.index = MemoryIndex()
        self.accepted: list[tuple[str, int, EventBatch]] = []
        self.rejected: Counter[str] = Counter()  # by DecodeError reason
        self.kinds: dict[str, Counter[str]] = {}
        self.most_blocks = 0

    async def offer(self, kind: str, frames: list[bytes]) -> None:
        verdicts = self.kinds.setdefault(kind, Counter())
        try:
            message = decode_message(frames)
            batch = decode_batch(message.payload)
        except DecodeError as exc:
            self.rejected[exc.reason] += 1
            verdicts["rejected"] += 1
            return
        replica = message.topic.decode()
        result = await self.index.apply(replica, NS, batch, message.seq)
        self.accepted.append((replica, message.seq, batch))
        verdicts["accepted"] += 1
        self.most_blocks = max(self.most_blocks, result.blocks)


async def reference_of(accepted: list[tuple[str, int, EventBatch]]) -> MemoryIndex:
    reference = MemoryIndex()
    for replica, seq, batch in accepted:
        await reference.apply(replica, NS, batch, seq)
    return reference


async def test_100k_messages_through_decode_and_apply() -> None:
    source = FrameSource(load_golden(VECTORS), SEED, replicas=3)
    intake = Intake()
    started = time.perf_counter()
    total = 0
    for kind, frames in source.exhaustive():
        await intake.offer(kind, frames)
        total += 1
    for kind, frames in source.messages(DECODE_MESSAGES):
        await intake.offer(kind, frames)
        total += 1
    elapsed = time.perf_counter() - started

    rejected = sum(intake.rejected.values())
    assert rejected + len(intake.accepted) == total >= DECODE_MESSAGES
    # not vacuous: every kind reached the decoder, junk was refused, valid batches built an index
    for kind in ("random_bytes", "truncated", "mutated", "wrong_types", "huge", "deep", "hashes"):
        assert intake.kinds[kind]["rejected"] > 0, kind
    for kind in ("mutated", "wrong_types", "unknown_tags", "golden", "valid"):
        assert intake.kinds[kind]["accepted"] > 0, kind
    assert intake.kinds["bad_frames"]["accepted"] == 0
    assert {"msgpack", "bad_batch", "bad_event", "bad_hash", "bad_frames"} <= intake.rejected.keys()
    assert intake.most_blocks > 10
    reference = await reference_of(intake.accepted)
    assert snapshot(intake.index) == snapshot(reference), f"seed {SEED}"
    print(f"\n{total} messages, {rejected} rejected {dict(intake.rejected)}, {elapsed:.1f} s")


# ------------------------------------------------------------------------ subscriber path


async def _wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def _errors(registry: CollectorRegistry) -> Counter[str]:
    out: Counter[str] = Counter()
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == "kvrouter_tracker_decode_errors_total":
                out[sample.labels["reason"]] += int(sample.value)
    return out


async def _assert_same_index(redis_url: str, reference: MemoryIndex, replicas: list[str]) -> None:
    """The placements and engine maps in Redis (read by a fresh index) equal the reference's."""
    fresh = RedisIndex.from_url(redis_url)
    try:
        table = reference._blocks.get(NS, {})
        for replica in replicas:
            expected = reference._ledgers.get((replica, NS))
            restored = await fresh.writer.ledger(replica, NS)  # rebuilt from Redis' engine map
            engine = {h: (b.key, *b.counts()) for h, b in restored.engine.items()}
            wanted = expected.engine if expected is not None else {}
            assert engine == {h: (b.key, *b.counts()) for h, b in wanted.items()}, replica
            assert await fresh.block_count(replica, NS) == await reference.block_count(replica, NS)
            assert await fresh.last_seq(replica, NS) == await reference.last_seq(replica, NS)
        for key, holders in table.items():
            found = await fresh.lookup(NS, [key])
            assert {r: (m.blocks, m.gpu_blocks) for r, m in found.items()} == {
                r: (1, tiers & 1) for r, tiers in holders.items()
            }
    finally:
        await fresh.close()


async def test_5k_messages_through_the_subscriber_into_redis(
    redis_url: str, caplog: pytest.LogCaptureFixture, zctx: zmq.asyncio.Context
) -> None:
    caplog.set_level(logging.ERROR, logger="tracker")  # one warning per junk message otherwise
    source = FrameSource(load_golden(VECTORS), SEED + 1, replicas=1)
    messages = list(source.messages(SOCKET_MESSAGES))
    replica = source.replicas[0].decode()

    pub = zctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 0)  # never drop: every message must reach the tracker
    pub.bind("tcp://127.0.0.1:*")
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    index = RedisIndex.from_url(redis_url)
    registry = CollectorRegistry()
    settings = TrackerSettings(model=NS.model, block_size=BLOCK_SIZE, http_port=0)
    subscriber = Subscriber(settings, index, TrackerMetrics(registry))
    await subscriber.start()
    try:
        stream = subscriber.track(ReplicaTarget(replica, NS, endpoint, None))
        async with asyncio.timeout(5):
            while (await pub.recv())[:1] != b"\x01":  # the tracker's subscription arrived
                pass
        await _wait(lambda: stream.primed, 5, "stream primed")
        started = time.perf_counter()
        for _, frames in messages:
            await pub.send_multipart(frames)
        last = source.seqs[source.replicas[0]] - 1
        await _wait(
            lambda: stream.applier.last == last and stream.queue.empty(), 30, "last message"
        )
        elapsed = time.perf_counter() - started
        assert subscriber.failure is None
    finally:
        await subscriber.stop(5.0)
        await index.close()
        pub.close(linger=0)

    intake = Intake()  # the verdicts of the same decoder, message by message
    for kind, frames in messages:
        await intake.offer(kind, frames)
    assert _errors(registry) == intake.rejected
    assert sum(intake.rejected.values()) + len(intake.accepted) == SOCKET_MESSAGES
    assert len(intake.accepted) > SOCKET_MESSAGES // 10
    reference = await reference_of(intake.accepted)
    assert snapshot(intake.index) == snapshot(reference)
    await _assert_same_index(redis_url, reference, [replica])
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    print(f"\n{SOCKET_MESSAGES} messages over ZeroMQ into Redis in {elapsed:.1f} s")


async def test_oversized_frames_on_the_bound_socket_are_refused(
    monkeypatch: pytest.MonkeyPatch, zctx: zmq.asyncio.Context
) -> None:
    """Bind mode: a frame over MAX_MESSAGE_BYTES is never decoded; its sender reconnects."""
    import tracker.ingest.subscriber

    monkeypatch.setattr(tracker.ingest.subscriber, "MAX_MESSAGE_BYTES", 1 << 20)
    source = FrameSource(load_golden(VECTORS), SEED + 2)
    registry = CollectorRegistry()
    settings = TrackerSettings(
        model=NS.model, block_size=BLOCK_SIZE, http_port=0, bind="tcp://127.0.0.1:*"
    )
    subscriber = Subscriber(settings, MemoryIndex(), TrackerMetrics(registry))
    await subscriber.start()
    pub = zctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        assert subscriber.bound_endpoint is not None
        pub.connect(subscriber.bound_endpoint)
        replica = source.replicas[0].decode()

        async def until_applied(seq: int) -> None:
            deadline = time.monotonic() + 10
            while (stream := subscriber.get(replica)) is None or (stream.applier.last or -1) < seq:
                assert time.monotonic() < deadline, "no batch got through"
                await pub.send_multipart(source.frame(source.valid()))
                await asyncio.sleep(0.05)

        await until_applied(0)  # connected and subscribed
        giant = source.frame(b"\x93" + b"\xc0" * (2 << 20))
        await pub.send_multipart(giant)
        await until_applied(int.from_bytes(giant[1], "big") + 1)  # reconnected, flowing again
        assert _errors(registry) == Counter()  # the giant frame never reached the decoder
        assert subscriber.failure is None
    finally:
        pub.close(linger=0)
        await subscriber.stop(5.0)
