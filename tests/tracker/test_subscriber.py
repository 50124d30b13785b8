"""The subscriber against real ZeroMQ publishers on loopback: batches, bad input, bind mode."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from tests.factories import SMALL, removed, stored
from tests.tracker.tracking import (
    A_HASHES,
    A_TOKENS,
    B_HASH,
    ROOTS,
    block_a,
    block_b,
    block_c,
    held,
    root,
    wait_until,
)
from tracker.core.blocks import Namespace, block_keys
from tracker.core.event_codec import WireEra
from tracker.core.events import AllBlocksCleared, encode_message
from tracker.framework.errors import DecodeError
from tracker.ingest.subscriber import parse_topic


async def test_in_order_batches_are_applied(make_tracker: Any, make_publisher: Any) -> None:
    tracker = await make_tracker()
    pub = await make_publisher(replay=False)
    stream = await tracker.track("r1", pub)
    await pub.publish(block_a())
    await pub.publish(block_b(), root("D"))
    await pub.publish(removed(B_HASH))
    await pub.publish(block_c())  # parent B was removed: an orphan
    await pub.publish(AllBlocksCleared(), root("E"))
    await wait_until(lambda: stream.applier.last == 4, what="seq 4 applied")

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
    await wait_until(lambda: stream.applier.last == 0, what="seq 0 applied")
    prompt = [*A_TOKENS, 50, 51]
    matches = await tracker.index.lookup(SMALL, block_keys(prompt, SMALL, lookahead=2))
    assert {r: m.blocks for r, m in matches.items()} == {"r1": 2}
    assert await held(tracker.index, A_TOKENS) == {}  # keys without lookahead: nothing
    assert stream.status()["lookahead_tokens"] == 2
    # the routers learn it from the index (router.decide.placement)
    assert (await tracker.index.survey(SMALL, [])).lookahead == {"r1": 2}


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
    await wait_until(lambda: stream.applier.last == 4, what="seq 4 applied")

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
    await wait_until(lambda: r1.applier.last == 0 and r2.applier.last == 1)

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
