"""The subscriber when live events stop: replay polled, idle engines, replicas gone unverified."""

from __future__ import annotations

from typing import Any

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


async def test_a_silent_live_stream_is_noticed_and_polled(
    make_tracker: Any, make_publisher: Any
) -> None:
    """Live events stop reaching the tracker while the engine still publishes (vLLM with a
    non-wildcard endpoint connects its PUB socket): replay polling keeps the index right."""
    tracker = await make_tracker(silence_check_s=0.3)
    pub = await make_publisher()
    stream = await tracker.track("r1", pub)
    await pub.publish(block_a())
    await wait_until(lambda: stream.applier.last == 0, what="live seq 0")
    assert not stream.silent
    await pub.publish(block_b(), live=False)
    await pub.publish(block_c(), live=False)
    await wait_until(lambda: stream.applier.last == 2, what="replay polled")
    assert stream.silent
    assert stream.status()["live_silent"] is True
    assert await held(tracker.index, A_TOKENS + B_TOKENS + C_TOKENS) == {"r1": 4}
    assert tracker.value("kvrouter_tracker_replica_live_silent", replica="r1") == 1
    assert tracker.value("kvrouter_tracker_silent_polls_total", replica="r1") == 1
    assert tracker.value("kvrouter_tracker_gaps_total", replica="r1") == 0
    # while silent, replay is polled every second: the index lags by that much at most
    await pub.publish(root("D"), live=False)
    await wait_until(lambda: stream.applier.last == 3, timeout_s=3.0, what="polled while silent")
    # live events come back
    await pub.publish(root("E"))
    await wait_until(lambda: stream.applier.last == 4, what="live again")
    assert not stream.silent
    assert tracker.value("kvrouter_tracker_replica_live_silent", replica="r1") == 0
    assert await held(tracker.index, ROOTS["D"][0]) == {"r1": 1}


async def test_an_idle_engine_is_not_silent(make_tracker: Any, make_publisher: Any) -> None:
    tracker = await make_tracker(silence_check_s=0.2)
    pub = await make_publisher()
    stream = await tracker.track("r1", pub)
    await pub.publish(block_a())
    await wait_until(lambda: stream.applier.last == 0, what="live seq 0")
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
    await wait_until(lambda: stream.applier.last == 0, what="live seq 0")
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
