"""Segments on every backend: long chains whose lookups skip the segments a replica holds
whole (tracker.core.keys.SEGMENT_BLOCKS), and answer exactly as a block-by-block walk would:
evictions from the middle, tiers, clears, a restarted tracker, chains that part inside one."""

from __future__ import annotations

import asyncio

import redis.asyncio

from tests.factories import LLAMA
from tests.tracker.contract import matches, offload, put, remove, store
from tracker.core import keys as schema
from tracker.core.blocks import block_keys
from tracker.core.events import AllBlocksCleared
from tracker.core.index import BlockIndex, Route
from tracker.core.redis_index import RedisIndex

S = schema.SEGMENT_BLOCKS
LONG = list(range(10_000, 10_000 + 10 * S * LLAMA.block_size))  # ten segments
FORK = [*LONG[: (3 * S + 5) * LLAMA.block_size], *range(90_000, 90_000 + 40 * LLAMA.block_size)]


async def test_a_chain_held_whole_and_in_part(index: BlockIndex) -> None:
    await put(index, "whole", store(LONG))
    await put(index, "part", store(LONG, range(4 * S + 3)))
    await put(index, "aligned", store(LONG, range(2 * S)))
    assert await matches(index, LONG) == {
        "whole": (10 * S, 10 * S),
        "part": (4 * S + 3, 4 * S + 3),
        "aligned": (2 * S, 2 * S),
    }
    # a prompt that goes on past the cached chain, and one that stops inside a segment
    assert await matches(index, [*LONG, *range(5)]) == {
        "whole": (10 * S, 10 * S),
        "part": (4 * S + 3, 4 * S + 3),
        "aligned": (2 * S, 2 * S),
    }
    assert await matches(index, LONG[: (S + 7) * LLAMA.block_size]) == {
        "whole": (S + 7, S + 7),
        "part": (S + 7, S + 7),
        "aligned": (S + 7, S + 7),
    }


async def test_an_eviction_in_the_middle_of_a_segment_ends_the_run_there(
    index: BlockIndex,
) -> None:
    await put(index, "a", store(LONG))
    await put(index, "b", store(LONG))
    await put(index, "a", remove(LONG, 3 * S + 9))  # a later batch than the store
    assert await matches(index, LONG) == {"a": (3 * S + 9, 3 * S + 9), "b": (10 * S, 10 * S)}
    await put(index, "a", store(LONG, range(3 * S + 9, 3 * S + 10)))  # stored again
    assert await matches(index, LONG) == {"a": (10 * S, 10 * S), "b": (10 * S, 10 * S)}
    await put(index, "b", remove(LONG, 0))  # the first block: nothing matches on b
    assert await matches(index, LONG) == {"a": (10 * S, 10 * S)}


async def test_tiers_of_a_segment_held_whole(index: BlockIndex) -> None:
    offloaded = range(S + 2, S + 6)
    await put(index, "a", store(LONG), offload(LONG, *offloaded))
    await put(index, "a", remove(LONG, *offloaded))  # those load from CPU now
    await put(index, "a", offload(LONG, 5 * S, medium="STORAGE"), remove(LONG, 5 * S))
    found = (await index.lookup(LLAMA, block_keys(LONG, LLAMA)))["a"]
    assert (found.blocks, found.gpu_blocks, found.cpu_blocks, found.storage_blocks) == (
        10 * S,
        10 * S - 5,
        4,
        1,
    )
    await put(index, "a", offload(LONG, S + 2), store(LONG, range(S + 2, S + 3)))
    await put(index, "a", remove(LONG, S + 2, medium="CPU"))  # back on GPU alone
    found = (await index.lookup(LLAMA, block_keys(LONG, LLAMA)))["a"]
    assert (found.gpu_blocks, found.cpu_blocks, found.storage_blocks) == (10 * S - 4, 3, 1)


async def test_chains_that_part_inside_a_segment(index: BlockIndex) -> None:
    await put(index, "a", store(LONG))
    await put(index, "b", store(FORK))
    assert await matches(index, LONG) == {"a": (10 * S, 10 * S), "b": (3 * S + 5, 3 * S + 5)}
    assert await matches(index, FORK) == {"a": (3 * S + 5, 3 * S + 5), "b": (3 * S + 45,) * 2}
    # a block both chains share, evicted from b: b's runs of both end there
    await put(index, "b", remove(FORK, 2 * S + 1))
    assert await matches(index, FORK) == {"a": (3 * S + 5, 3 * S + 5), "b": (2 * S + 1,) * 2}


async def test_a_cleared_replica_holds_no_segment(index: BlockIndex) -> None:
    await put(index, "a", store(LONG), AllBlocksCleared(), store(LONG, range(S + 1)))
    assert await matches(index, LONG) == {"a": (S + 1, S + 1)}
    await index.clear("a", LLAMA)
    assert await matches(index, LONG) == {}
    await put(index, "a", store(LONG, range(3 * S)))
    assert await matches(index, LONG) == {"a": (3 * S, 3 * S)}


async def test_a_restarted_tracker_keeps_the_segments_exact(redis_url: str) -> None:
    first = RedisIndex.from_url(redis_url)
    await put(first, "a", store(LONG))
    await first.close()
    second = RedisIndex.from_url(redis_url)  # its ledger is read back from the engine map
    try:
        await put(second, "a", remove(LONG, 6 * S + 1))
        assert await matches(second, LONG) == {"a": (6 * S + 1, 6 * S + 1)}
        await put(second, "a", store(LONG, range(6 * S + 1, 6 * S + 2)))
        assert await matches(second, LONG) == {"a": (10 * S, 10 * S)}
    finally:
        await second.close()


async def test_a_lookup_reads_one_entry_per_segment_held_whole(redis_url: str) -> None:
    index = RedisIndex.from_url(redis_url)
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        await put(index, "a", store(LONG))
        await put(index, "b", store(LONG, range(7 * S + 3)))
        await client.config_resetstat()
        assert await matches(index, LONG) == {"a": (10 * S, 10 * S), "b": (7 * S + 3,) * 2}
        stats = await client.info("commandstats")
        # the first block (whether any segment is worth reading, then the candidates), b's
        # segment walked block by block, one HMGET of the segments
        assert stats["cmdstat_hget"]["calls"] <= 3 + S, stats
        assert stats["cmdstat_hmget"]["calls"] <= 3, stats
        nk = index.writer.keys_for(LLAMA)
        entries = await client.hget(nk.segments, schema.field(block_keys(LONG, LLAMA)[S - 1]))
        assert isinstance(entries, bytes)
        rids = {await index.writer.rid(r, LLAMA): r for r in ("a", "b")}
        assert {rids[rid]: counts for rid, counts in schema.segment_entries(entries)} == {
            "a": (S, 0, 0, 0),
            "b": (S, 0, 0, 0),
        }
    finally:
        await client.aclose()
        await index.close()


# ------------------------------------------------------------------ predictions of segments


async def predicted(index: BlockIndex, tokens: list[int]) -> dict[str, tuple[int, int, int]]:
    found = await index.lookup(LLAMA, block_keys(tokens, LLAMA))
    return {r: (m.blocks, m.gpu_blocks, m.predicted_blocks) for r, m in found.items()}


async def test_a_routed_miss_is_predicted_whole(index: BlockIndex) -> None:
    keys = block_keys(LONG, LLAMA)
    await index.route(LLAMA, Route("a", keys, 0.4, [keys[0]], 5))
    assert await predicted(index, LONG) == {"a": (10 * S, 10 * S, 10 * S)}
    # a prompt that shares four segments and parts at a segment's end
    fork = [*LONG[: 4 * S * LLAMA.block_size], *range(70_000, 70_400)]
    assert await predicted(index, fork) == {"a": (4 * S, 4 * S, 4 * S)}
    await asyncio.sleep(0.6)
    assert await predicted(index, LONG) == {}


async def test_predictions_go_on_where_the_engine_has_prefilled_so_far(
    index: BlockIndex,
) -> None:
    keys = block_keys(LONG, LLAMA)
    placed = 3 * S + 5  # the replica held that much when the request was routed
    await put(index, "a", store(LONG, range(placed)))
    await index.route(LLAMA, Route("a", keys[placed:], 5, [keys[0]], 5, first=placed))
    assert await predicted(index, LONG) == {"a": (10 * S, 10 * S, 10 * S - placed)}
    await put(index, "a", store(LONG, range(placed, 6 * S + 7)))  # a chunk of the prefill
    assert await predicted(index, LONG) == {"a": (10 * S, 10 * S, 4 * S - 7)}
    await put(index, "a", store(LONG, range(6 * S + 7, 10 * S)))  # all of it
    assert await predicted(index, LONG) == {"a": (10 * S, 10 * S, 0)}
    # evicted from the tail: a prediction of its segments never outranks the engine
    await put(index, "a", remove(LONG, *range(10 * S - 1, 6 * S - 1, -1)))
    assert await predicted(index, LONG) == {"a": (6 * S, 6 * S, 0)}


async def test_a_replica_that_stopped_matching_is_not_revived_by_its_segments(
    index: BlockIndex,
) -> None:
    keys = block_keys(LONG, LLAMA)
    await put(index, "a", store(LONG, range(2 * S)))
    await put(index, "b", store(LONG, range(2 * S)))
    await index.route(LLAMA, Route("a", keys[2 * S :], 5, [keys[0]], 5, first=2 * S))
    assert await predicted(index, LONG) == {"a": (10 * S, 10 * S, 8 * S), "b": (2 * S, 2 * S, 0)}
    # b's real blocks go on past a's: predictions extend only the runs still going there
    await put(index, "b", store(LONG, range(2 * S, 5 * S + 1)))
    assert await predicted(index, LONG) == {"a": (2 * S, 2 * S, 0), "b": (5 * S + 1, 5 * S + 1, 0)}


async def test_a_routed_prompt_is_written_a_segment_at_a_time(redis_url: str) -> None:
    index = RedisIndex.from_url(redis_url)
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        keys = block_keys(LONG, LLAMA)
        await put(index, "a", store(LONG, range(5)))
        await client.config_resetstat()
        await index.route(LLAMA, Route("a", keys[5:], 5, [keys[0]], 5, first=5))
        stats = await client.info("commandstats")
        # the blocks before the first whole segment one by one, one HSET of the nine segments
        # after them, one of the home claim
        assert stats["cmdstat_hset"]["calls"] == (S - 5) + 1 + 1, stats
        await client.config_resetstat()
        assert await predicted(index, LONG) == {"a": (10 * S, 10 * S, 10 * S - 5)}
        stats = await client.info("commandstats")
        assert stats["cmdstat_hget"]["calls"] <= 2 * S + 2, stats  # the first segment's blocks
    finally:
        await client.aclose()
        await index.close()


async def test_a_prompt_parting_inside_a_segment_predicted_whole_matches_up_to_it(
    redis_url: str,
) -> None:
    """The shared index's rounding: a prompt that parts from a predicted one inside a segment
    the route predicted whole matches its predictions up to that segment's start (the
    in-process index, block by block, up to where they part); real placements stay exact."""
    index = RedisIndex.from_url(redis_url)
    try:
        keys = block_keys(LONG, LLAMA)
        await index.route(LLAMA, Route("a", keys, 5, [keys[0]], 5))
        fork = [*LONG[: (4 * S + 9) * LLAMA.block_size], *range(70_000, 70_400)]
        assert await predicted(index, fork) == {"a": (4 * S, 4 * S, 4 * S)}
    finally:
        await index.close()
