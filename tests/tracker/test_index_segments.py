"""Segments on every backend: long chains whose lookups skip the segments a replica holds
whole (tracker.core.keys.SEGMENT_BLOCKS), and answer exactly as a block-by-block walk would:
evictions from the middle, tiers, clears, a restarted tracker, chains that part inside one."""

from __future__ import annotations

import redis.asyncio

from tests.factories import LLAMA
from tests.tracker.contract import matches, offload, put, remove, store
from tracker.core import keys as schema
from tracker.core.blocks import block_keys
from tracker.core.events import AllBlocksCleared
from tracker.core.index import BlockIndex
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
        # the first block (the candidates), b's segment walked block by block, one HMGET
        assert stats["cmdstat_hget"]["calls"] <= 1 + S + 1, stats
        assert stats["cmdstat_hmget"]["calls"] <= 3, stats
        nk = index.writer.keys_for(LLAMA)
        entries = await client.hget(nk.segments, schema.field(block_keys(LONG, LLAMA)[S - 1]))
        rids = {await index.writer.rid(r, LLAMA): r for r in ("a", "b")}
        assert {rids[rid]: counts for rid, counts in schema.segment_entries(entries)} == {
            "a": (S, 0, 0, 0),
            "b": (S, 0, 0, 0),
        }
    finally:
        await client.aclose()
        await index.close()
