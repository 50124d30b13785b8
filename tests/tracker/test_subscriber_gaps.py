"""The subscriber's recovery of lost batches: gaps replayed or cleared, seq resets, orphans."""

from __future__ import annotations

from typing import Any

import pytest

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


@pytest.mark.parametrize("layout", ["new", "old"])
async def test_gap_is_replayed(make_tracker: Any, make_publisher: Any, layout: str) -> None:
    tracker = await make_tracker()
    pub = await make_publisher(layout=layout)
    stream = await tracker.track("r1", pub)
    await pub.publish(block_a())
    await pub.publish(block_b(), live=False)  # lost on the live stream, still buffered
    await pub.publish(block_c())
    await wait_until(lambda: stream.applier.last == 2, what="seq 2 applied")

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
    await wait_until(lambda: stream.applier.last == 0)
    await pub.publish(root("D"), live=False)  # falls out of the 2-batch buffer
    await pub.publish(root("E"), live=False)
    await pub.publish(root("F"))
    await wait_until(lambda: stream.applier.last == 3, what="seq 3 applied")

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
    await wait_until(lambda: stream.applier.last == 2)

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
    await wait_until(lambda: stream.applier.last == 1)
    assert await held(tracker.index, A_TOKENS + B_TOKENS) == {"r1": 3}

    await pub.restart()  # the engine restarts: seq starts over, other blocks
    await pub.wait_subscribed()
    if replay:  # its first batch is missed live; the tracker replays it from the new engine
        await pub.publish(root("D"), live=False)
    await pub.publish(root("E"))
    await wait_until(
        lambda: (
            tracker.value("kvrouter_tracker_resets_total", cause="seq_reset") == 1
            and stream.applier.last == pub.seq - 1
        )
    )

    assert await held(tracker.index, A_TOKENS) == {}
    assert await held(tracker.index, ROOTS["D"][0]) == ({"r1": 1} if replay else {})
    assert await held(tracker.index, ROOTS["E"][0]) == {"r1": 1}
    assert tracker.value("kvrouter_tracker_resets_total", cause="seq_reset") == 1
    assert tracker.value("kvrouter_tracker_replica_blocks", replica="r1") == (2 if replay else 1)


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
    await wait_until(lambda: stream.applier.last == 2)

    assert await held(tracker.index, A_TOKENS + B_TOKENS + C_TOKENS) == {"r1": 4}
    assert pub.replay_requests == [0, 1, 0]
    assert tracker.value("kvrouter_tracker_replays_total", outcome="timeout") == 1
    assert tracker.value("kvrouter_tracker_resets_total", cause="unrecoverable_gap") == 1
    assert tracker.value("kvrouter_tracker_orphan_blocks_total") == 1
    assert not stream.applier.resync_blocked
