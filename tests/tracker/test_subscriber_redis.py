"""The subscriber on a real redis-server: catch-up from its checkpoint, writes kept in outages."""

from __future__ import annotations

from typing import Any

from tests.factories import SMALL
from tests.procs import RedisServer
from tests.tracker.tracking import (
    A_TOKENS,
    B_TOKENS,
    C_TOKENS,
    ROOTS,
    block_a,
    block_b,
    block_c,
    held,
    root,
    wait_until,
)
from tracker.core.redis_index import RedisIndex


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
        await wait_until(lambda: stream.applier.last == 1)
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
        assert stream.applier.last == 3
        assert await held(index, A_TOKENS + B_TOKENS + C_TOKENS) == {"r1": 4}
        assert await held(index, ROOTS["D"][0]) == {"r1": 1}
        assert pub.replay_requests[-1] == 2
        assert second.value("kvrouter_tracker_orphan_blocks_total") == 0
        assert second.value("kvrouter_tracker_resets_total", cause="seq_reset") == 0

        await pub.publish(root("E"))  # and the live stream continues from there
        await wait_until(lambda: stream.applier.last == 4)
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
        await wait_until(lambda: stream.applier.last == 0)

        server.stop()
        await pub.publish(block_b())
        await pub.publish(root("D"))
        await wait_until(lambda: stream.applier.last == 2, what="stream keeps going")
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
