"""The subscriber against real ZeroMQ publishers on loopback (and a real redis-server)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from tests.factories import SMALL, removed, stored
from tests.procs import RedisServer
from tests.tracker.publisher import EventPublisher
from tracker.core.blocks import Namespace, block_keys
from tracker.core.event_codec import WireEra
from tracker.core.events import AllBlocksCleared, encode_message
from tracker.core.index import BlockIndex
from tracker.core.memory_index import MemoryIndex
from tracker.core.redis_index import RedisIndex
from tracker.framework.errors import DecodeError
from tracker.ingest.config import TrackerSettings
from tracker.ingest.metrics import TrackerMetrics
from tracker.ingest.streams import ReplicaStream
from tracker.ingest.subscriber import Subscriber, parse_topic
from tracker.ingest.targets import ReplicaTarget

ANY = "tcp://127.0.0.1:*"

# A chain: A = two blocks, B extends A, C extends B; D, E, F are unrelated roots.
A_TOKENS, A_HASHES = list(range(1, 9)), [101, 102]
B_TOKENS, B_HASH = list(range(9, 13)), 103
C_TOKENS, C_HASH = list(range(13, 17)), 104
ROOTS = {name: ([n * 100 + i for i in range(4)], 1000 + n) for n, name in enumerate("DEFG", 1)}


def block_a() -> Any:
    return stored(A_TOKENS, A_HASHES)


def block_b() -> Any:
    return stored(B_TOKENS, [B_HASH], parent=A_HASHES[-1])


def block_c() -> Any:
    return stored(C_TOKENS, [C_HASH], parent=B_HASH)


def root(name: str) -> Any:
    tokens, h = ROOTS[name]
    return stored(tokens, [h])


def settings(**overrides: Any) -> TrackerSettings:
    values: dict[str, Any] = {
        "model": SMALL.model,
        "block_size": SMALL.block_size,
        "http_port": 0,
        "replay_timeout_s": 0.5,
        "resync_cooldown_s": 0.2,
    }
    values.update(overrides)
    return TrackerSettings(**values)


async def wait_until(predicate: Callable[[], Any], timeout_s: float = 5.0, what: str = "") -> None:
    """Poll ``predicate`` (plain or awaitable result) until truthy; fail after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        await asyncio.sleep(0.01)


async def held(
    index: BlockIndex, tokens: list[int], namespace: Namespace = SMALL
) -> dict[str, int]:
    matches = await index.lookup(namespace, block_keys(tokens, namespace))
    return {replica: match.blocks for replica, match in matches.items()}


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


class Tracker:
    """A subscriber with its index and metrics, as a test drives it."""

    def __init__(self, index: BlockIndex, config: TrackerSettings) -> None:
        self.index = index
        self.registry = CollectorRegistry()
        self.metrics = TrackerMetrics(self.registry)
        self.subscriber = Subscriber(config, index, self.metrics)

    async def track(self, replica: str, publisher: EventPublisher) -> ReplicaStream:
        stream = self.subscriber.track(
            ReplicaTarget(replica, SMALL, publisher.endpoint, publisher.replay_endpoint)
        )
        await wait_until(lambda: stream.primed, what="stream primed")
        await publisher.wait_subscribed()
        return stream

    def value(self, name: str, **labels: str) -> float:
        return sample(self.registry, name, **labels)


TrackerFactory = Callable[..., Awaitable[Tracker]]


@pytest.fixture
async def make_tracker() -> AsyncIterator[TrackerFactory]:
    started: list[Tracker] = []

    async def make(index: BlockIndex | None = None, **overrides: Any) -> Tracker:
        tracker = Tracker(index or MemoryIndex(), settings(**overrides))
        await tracker.subscriber.start()
        started.append(tracker)
        return tracker

    yield make
    for tracker in started:
        await tracker.subscriber.stop(2.0)
        assert tracker.subscriber.failure is None


@pytest.fixture
async def make_publisher(zctx: zmq.asyncio.Context) -> AsyncIterator[Callable[..., Any]]:
    started: list[EventPublisher] = []

    async def make(*, replay: bool = True, **kwargs: Any) -> EventPublisher:
        endpoint = kwargs.pop("endpoint", ANY)
        publisher = EventPublisher(zctx, endpoint, replay=ANY if replay else None, **kwargs)
        started.append(await publisher.start())
        return publisher

    yield make
    for publisher in started:
        await publisher.close()


async def test_in_order_batches_are_applied(make_tracker: Any, make_publisher: Any) -> None:
    tracker = await make_tracker()
    pub = await make_publisher(replay=False)
    stream = await tracker.track("r1", pub)
    await pub.publish(block_a())
    await pub.publish(block_b(), root("D"))
    await pub.publish(removed(B_HASH))
    await pub.publish(block_c())  # parent B was removed: an orphan
    await pub.publish(AllBlocksCleared(), root("E"))
    await wait_until(lambda: stream.last == 4, what="seq 4 applied")

    assert await held(tracker.index, A_TOKENS) == {}
    assert await held(tracker.index, ROOTS["E"][0]) == {"r1": 1}
    assert await tracker.index.last_seq("r1", SMALL) == 4
    assert tracker.value("kvrouter_tracker_events_total", type="BlockStored") == 5
    assert tracker.value("kvrouter_tracker_events_total", type="BlockRemoved") == 1
    assert tracker.value("kvrouter_tracker_events_total", type="AllBlocksCleared") == 1
    assert tracker.value("kvrouter_tracker_blocks_stored_total") == 6
    assert tracker.value("kvrouter_tracker_replica_last_seq", replica="r1") == 4
    assert tracker.value("kvrouter_tracker_replica_blocks", replica="r1") == 1
    assert tracker.value("kvrouter_tracker_ledger_stats_total", stat="cleared") == 1
    assert tracker.value("kvrouter_tracker_orphan_blocks_total") == 1
    assert tracker.value("kvrouter_tracker_apply_seconds_count") == 5
    assert tracker.value("kvrouter_tracker_gaps_total", replica="r1") == 0
    # no replay endpoint: the orphan cannot be resynced, nothing is cleared
    assert tracker.value("kvrouter_tracker_resets_total", cause="orphan_resync") == 0


async def test_lookahead_hashing_is_indexed_and_shown(
    make_tracker: Any, make_publisher: Any
) -> None:
    """vLLM 0.33 folds the tokens after each block into its hash: the index keys the blocks
    as a router hashing 2 lookahead tokens does, and /health and the index say 2."""
    tracker = await make_tracker()
    pub = await make_publisher(replay=False, era=WireEra.V0_33_0)
    stream = await tracker.track("r1", pub)
    assert stream.status()["lookahead_tokens"] == 0
    event = msgspec.structs.replace(
        stored(A_TOKENS, A_HASHES), lookahead_token_ids=[A_TOKENS[4:6], [50, 51]]
    )
    await pub.publish(event)
    await wait_until(lambda: stream.last == 0, what="seq 0 applied")
    prompt = [*A_TOKENS, 50, 51]
    matches = await tracker.index.lookup(SMALL, block_keys(prompt, SMALL, lookahead=2))
    assert {r: m.blocks for r, m in matches.items()} == {"r1": 2}
    assert await held(tracker.index, A_TOKENS) == {}  # keys without lookahead: nothing
    assert stream.status()["lookahead_tokens"] == 2
    # the routers learn it from the index (router.placement)
    assert (await tracker.index.survey(SMALL, [])).lookahead == {"r1": 2}


async def test_a_silent_live_stream_is_noticed_and_polled(
    make_tracker: Any, make_publisher: Any
) -> None:
    """Live events stop reaching the tracker while the engine still publishes (vLLM with a
    non-wildcard endpoint connects its PUB socket): replay polling keeps the index right."""
    tracker = await make_tracker(silence_check_s=0.3)
    pub = await make_publisher()
    stream = await tracker.track("r1", pub)
    await pub.publish(block_a())
    await wait_until(lambda: stream.last == 0, what="live seq 0")
    assert not stream.silent
    await pub.publish(block_b(), live=False)
    await pub.publish(block_c(), live=False)
    await wait_until(lambda: stream.last == 2, what="replay polled")
    assert stream.silent
    assert stream.status()["live_silent"] is True
    assert await held(tracker.index, A_TOKENS + B_TOKENS + C_TOKENS) == {"r1": 4}
    assert tracker.value("kvrouter_tracker_replica_live_silent", replica="r1") == 1
    assert tracker.value("kvrouter_tracker_silent_polls_total", replica="r1") == 1
    assert tracker.value("kvrouter_tracker_gaps_total", replica="r1") == 0
    # while silent, replay is polled every second: the index lags by that much at most
    await pub.publish(root("D"), live=False)
    await wait_until(lambda: stream.last == 3, timeout_s=3.0, what="polled while silent")
    # live events come back
    await pub.publish(root("E"))
    await wait_until(lambda: stream.last == 4, what="live again")
    assert not stream.silent
    assert tracker.value("kvrouter_tracker_replica_live_silent", replica="r1") == 0
    assert await held(tracker.index, ROOTS["D"][0]) == {"r1": 1}


async def test_an_idle_engine_is_not_silent(make_tracker: Any, make_publisher: Any) -> None:
    tracker = await make_tracker(silence_check_s=0.2)
    pub = await make_publisher()
    stream = await tracker.track("r1", pub)
    await pub.publish(block_a())
    await wait_until(lambda: stream.last == 0, what="live seq 0")
    polls = len(pub.replay_requests)
    await wait_until(lambda: len(pub.replay_requests) >= polls + 2, what="two idle polls")
    assert pub.replay_requests[-1] == 1  # it asks for what follows the last applied batch
    assert not stream.silent
    assert tracker.value("kvrouter_tracker_silent_polls_total", replica="r1") == 0


async def test_a_replica_nothing_answers_for_loses_its_placements_until_it_answers(
    make_tracker: Any, make_publisher: Any
) -> None:
    """Its registry entry lives (heartbeats), but its event sockets are dead: neither live
    events nor replay answers. After ``unverified_after_s`` nothing vouches for its cache."""
    tracker = await make_tracker(silence_check_s=0.1, unverified_after_s=0.6)
    pub = await make_publisher()
    stream = await tracker.track("r1", pub)
    await pub.publish(block_a())
    await wait_until(lambda: stream.last == 0, what="live seq 0")
    # an idle engine that answers its replay keeps its placements however long it is quiet
    await wait_until(lambda: len(pub.replay_requests) >= 6, what="idle polls")
    assert await held(tracker.index, A_TOKENS) == {"r1": 2} and not stream.unverified
    pub.drop_replays = 10**6  # the event sockets die: nothing answers any more
    await wait_until(lambda: stream.unverified, timeout_s=3.0, what="unverifiable")
    assert await held(tracker.index, A_TOKENS) == {}
    assert stream.status()["unverified"] is True
    assert tracker.value("kvrouter_tracker_resets_total", cause="unverifiable") == 1
    pub.drop_replays = 0  # it answers again: the replay from 0 brings its blocks back
    await wait_until(lambda: not stream.unverified, timeout_s=3.0, what="answers again")
    await wait_until(lambda: held(tracker.index, A_TOKENS), what="re-indexed by replay")
    assert await held(tracker.index, A_TOKENS) == {"r1": 2}
    assert tracker.value("kvrouter_tracker_resets_total", cause="unverifiable") == 1


@pytest.mark.parametrize("layout", ["new", "old"])
async def test_gap_is_replayed(make_tracker: Any, make_publisher: Any, layout: str) -> None:
    tracker = await make_tracker()
    pub = await make_publisher(layout=layout)
    stream = await tracker.track("r1", pub)
    await pub.publish(block_a())
    await pub.publish(block_b(), live=False)  # lost on the live stream, still buffered
    await pub.publish(block_c())
    await wait_until(lambda: stream.last == 2, what="seq 2 applied")

    assert await held(tracker.index, A_TOKENS + B_TOKENS + C_TOKENS) == {"r1": 4}
    assert pub.replay_requests == [0, 1]  # catch-up at start, then the gap
    assert tracker.value("kvrouter_tracker_gaps_total", replica="r1") == 1
    assert tracker.value("kvrouter_tracker_gap_batches_total") == 1
    assert tracker.value("kvrouter_tracker_replays_total", outcome="ok") == 2
    assert tracker.value("kvrouter_tracker_messages_total", source="replay") == 2
    assert tracker.value("kvrouter_tracker_orphan_blocks_total") == 0
    for cause in ("seq_reset", "unrecoverable_gap", "orphan_resync"):
        assert tracker.value("kvrouter_tracker_resets_total", cause=cause) == 0


async def test_gap_beyond_the_replay_buffer_clears(make_tracker: Any, make_publisher: Any) -> None:
    tracker = await make_tracker()
    pub = await make_publisher(buffer=2)
    stream = await tracker.track("r1", pub)
    await pub.publish(block_a())
    await wait_until(lambda: stream.last == 0)
    await pub.publish(root("D"), live=False)  # falls out of the 2-batch buffer
    await pub.publish(root("E"), live=False)
    await pub.publish(root("F"))
    await wait_until(lambda: stream.last == 3, what="seq 3 applied")

    assert await held(tracker.index, A_TOKENS) == {}  # cleared: state before the gap is unknown
    assert await held(tracker.index, ROOTS["D"][0]) == {}
    assert await held(tracker.index, ROOTS["E"][0]) == {"r1": 1}
    assert await held(tracker.index, ROOTS["F"][0]) == {"r1": 1}
    assert tracker.value("kvrouter_tracker_replays_total", outcome="overrun") == 1
    assert tracker.value("kvrouter_tracker_resets_total", cause="unrecoverable_gap") == 1


async def test_gap_without_replay_endpoint_clears(make_tracker: Any, make_publisher: Any) -> None:
    tracker = await make_tracker()
    pub = await make_publisher(replay=False)
    stream = await tracker.track("r1", pub)
    await pub.publish(block_a())
    await pub.publish(root("D"), live=False)
    await pub.publish(root("E"))
    await wait_until(lambda: stream.last == 2)

    assert await held(tracker.index, A_TOKENS) == {}
    assert await held(tracker.index, ROOTS["E"][0]) == {"r1": 1}
    assert tracker.value("kvrouter_tracker_replays_total", outcome="no_endpoint") == 1
    assert tracker.value("kvrouter_tracker_resets_total", cause="unrecoverable_gap") == 1


@pytest.mark.parametrize("replay", [True, False])
async def test_sequence_reset_fences_old_blocks(
    make_tracker: Any, make_publisher: Any, replay: bool
) -> None:
    tracker = await make_tracker()
    pub = await make_publisher(replay=replay)
    stream = await tracker.track("r1", pub)
    await pub.publish(block_a())
    await pub.publish(block_b())
    await wait_until(lambda: stream.last == 1)
    assert await held(tracker.index, A_TOKENS + B_TOKENS) == {"r1": 3}

    await pub.restart()  # the engine restarts: seq starts over, other blocks
    await pub.wait_subscribed()
    if replay:  # its first batch is missed live; the tracker replays it from the new engine
        await pub.publish(root("D"), live=False)
    await pub.publish(root("E"))
    await wait_until(
        lambda: (
            tracker.value("kvrouter_tracker_resets_total", cause="seq_reset") == 1
            and stream.last == pub.seq - 1
        )
    )

    assert await held(tracker.index, A_TOKENS) == {}
    assert await held(tracker.index, ROOTS["D"][0]) == ({"r1": 1} if replay else {})
    assert await held(tracker.index, ROOTS["E"][0]) == {"r1": 1}
    assert tracker.value("kvrouter_tracker_resets_total", cause="seq_reset") == 1
    assert tracker.value("kvrouter_tracker_replica_blocks", replica="r1") == (2 if replay else 1)


async def test_malformed_input_is_counted_and_skipped(
    make_tracker: Any, make_publisher: Any
) -> None:
    tracker = await make_tracker()
    pub = await make_publisher(replay=False)
    stream = await tracker.track("r1", pub)
    await pub.publish(block_a())
    await pub.send_raw([b"", b"\x00\x01", b"payload"])  # 2-byte sequence frame
    await pub.send_raw([b"", b"two frames"])
    await pub.publish_payload(b"\xc1")  # never valid msgpack
    await pub.publish_payload(msgspec.msgpack.encode([1.0]))  # not an EventBatch
    await pub.publish_payload(msgspec.msgpack.encode([1.0, [["BlockStored", [1]]], 0]))
    await pub.publish(root("D"))
    await wait_until(lambda: stream.last == 4, what="seq 4 applied")

    assert await held(tracker.index, A_TOKENS) == {"r1": 2}
    assert await held(tracker.index, ROOTS["D"][0]) == {"r1": 1}
    assert await tracker.index.last_seq("r1", SMALL) == 4
    errors = {
        reason: tracker.value("kvrouter_tracker_decode_errors_total", reason=reason)
        for reason in ("bad_frames", "msgpack", "bad_batch", "bad_event")
    }
    assert errors == {"bad_frames": 2, "msgpack": 1, "bad_batch": 1, "bad_event": 1}
    assert tracker.value("kvrouter_tracker_gaps_total", replica="r1") == 0
    assert tracker.value("kvrouter_tracker_events_total", type="BlockStored") == 2


async def test_orphans_trigger_a_resync(make_tracker: Any, make_publisher: Any) -> None:
    tracker = await make_tracker()
    pub = await make_publisher()
    stream = await tracker.track("r1", pub)
    pub.drop_replays = 1  # the gap's replay goes unanswered: the tracker must clear
    await pub.publish(block_a())
    await pub.publish(block_b(), live=False)
    await pub.publish(block_c())  # its parent B is unknown after the clear: orphan
    await wait_until(
        lambda: tracker.value("kvrouter_tracker_resets_total", cause="orphan_resync") == 1
    )
    await wait_until(lambda: stream.last == 2)

    assert await held(tracker.index, A_TOKENS + B_TOKENS + C_TOKENS) == {"r1": 4}
    assert pub.replay_requests == [0, 1, 0]
    assert tracker.value("kvrouter_tracker_replays_total", outcome="timeout") == 1
    assert tracker.value("kvrouter_tracker_resets_total", cause="unrecoverable_gap") == 1
    assert tracker.value("kvrouter_tracker_orphan_blocks_total") == 1
    assert not stream.resync_blocked


async def test_bind_mode_accepts_connecting_publishers(
    make_tracker: Any, make_publisher: Any
) -> None:
    tracker = await make_tracker(bind="tcp://127.0.0.1:*")
    endpoint = tracker.subscriber.bound_endpoint
    assert endpoint is not None
    first = await make_publisher(replay=False, endpoint=endpoint, connect=True, topic=b"r1")
    second = await make_publisher(
        replay=False, endpoint=endpoint, connect=True, topic=b"kv@r2@other"
    )
    await first.wait_subscribed()
    await second.wait_subscribed()
    await first.publish(block_a())
    await second.publish(block_a())
    await second.publish(root("D"))
    await wait_until(lambda: len(tracker.subscriber.status()) == 2)
    r1, r2 = tracker.subscriber.get("r1"), tracker.subscriber.get("r2")
    assert r1 is not None and r2 is not None
    await wait_until(lambda: r1.last == 0 and r2.last == 1)

    assert await held(tracker.index, A_TOKENS) == {"r1": 2}
    assert await held(tracker.index, A_TOKENS, Namespace("other", 4)) == {"r2": 2}
    assert r2.status()["mode"] == "bind" and r2.namespace == Namespace("other", 4)


async def test_bind_mode_rejects_unusable_topics(make_tracker: Any, make_publisher: Any) -> None:
    tracker = await make_tracker(bind="tcp://127.0.0.1:*")
    pub = await make_publisher(
        replay=False, endpoint=tracker.subscriber.bound_endpoint, connect=True, topic=b""
    )
    await pub.wait_subscribed()
    await pub.send_raw(encode_message(b"", 0, b"x"))
    await pub.send_raw(encode_message(b"\xff\xfe", 0, b"x"))
    await wait_until(
        lambda: tracker.value("kvrouter_tracker_decode_errors_total", reason="bad_topic") == 2
    )
    assert tracker.subscriber.status() == {}


@pytest.mark.parametrize(
    ("topic", "expected"),
    [
        (b"r1", ("r1", None)),
        (b"kv@pod-1@Qwen/Qwen3-8B", ("pod-1", "Qwen/Qwen3-8B")),
        (b"kv@10.0.0.1:8000@", ("10.0.0.1:8000", None)),
        (b"kv@pod-2", ("pod-2", None)),
    ],
)
def test_parse_topic(topic: bytes, expected: tuple[str, str | None]) -> None:
    assert parse_topic(topic) == expected


@pytest.mark.parametrize("topic", [b"", b"kv@", b"kv@@m", b"\xff", b"a\nb"])
def test_parse_topic_rejects(topic: bytes) -> None:
    with pytest.raises(DecodeError) as info:
        parse_topic(topic)
    assert info.value.reason == "bad_topic"


async def test_restarted_tracker_catches_up_from_redis_checkpoint(
    make_tracker: Any, make_publisher: Any, redis_url: str
) -> None:
    pub = await make_publisher()
    first_index = RedisIndex.from_url(redis_url)
    try:
        first = await make_tracker(first_index)
        stream = await first.track("r1", pub)
        await pub.publish(block_a())
        await pub.publish(block_b())
        await wait_until(lambda: stream.last == 1)
        await first.subscriber.stop(2.0)
    finally:
        await first_index.close()

    await pub.publish(block_c())  # nobody listens
    await pub.publish(root("D"))

    index = RedisIndex.from_url(redis_url)
    try:
        assert await index.last_seq("r1", SMALL) == 1
        second = await make_tracker(index)
        stream = await second.track("r1", pub)  # catches up without any live message
        assert stream.last == 3
        assert await held(index, A_TOKENS + B_TOKENS + C_TOKENS) == {"r1": 4}
        assert await held(index, ROOTS["D"][0]) == {"r1": 1}
        assert pub.replay_requests[-1] == 2
        assert second.value("kvrouter_tracker_orphan_blocks_total") == 0
        assert second.value("kvrouter_tracker_resets_total", cause="seq_reset") == 0

        await pub.publish(root("E"))  # and the live stream continues from there
        await wait_until(lambda: stream.last == 4)
        assert await index.last_seq("r1", SMALL) == 4
    finally:
        await second.subscriber.stop(2.0)
        await index.close()


async def test_redis_outage_keeps_events_pending(
    make_tracker: Any, make_publisher: Any, tmp_path: Any
) -> None:
    server = RedisServer("--appendonly", "yes", "--appendfsync", "always").start()
    index = RedisIndex.from_url(server.url, timeout_s=0.5)
    try:
        tracker = await make_tracker(index)
        pub = await make_publisher(replay=False)
        stream = await tracker.track("r1", pub)
        await pub.publish(block_a())
        await wait_until(lambda: stream.last == 0)

        server.stop()
        await pub.publish(block_b())
        await pub.publish(root("D"))
        await wait_until(lambda: stream.last == 2, what="stream keeps going")
        assert tracker.value("kvrouter_tracker_index_write_failures_total", op="apply") >= 1
        assert tracker.subscriber.index_down

        server.start()  # same port, data reloaded from the append-only file
        await wait_until(lambda: not tracker.subscriber.index_down, what="pending flushed")
        assert await held(index, A_TOKENS + B_TOKENS) == {"r1": 3}
        assert await held(index, ROOTS["D"][0]) == {"r1": 1}
        assert await index.last_seq("r1", SMALL) == 2
    finally:
        await tracker.subscriber.stop(2.0)
        await index.close()
        server.close()
