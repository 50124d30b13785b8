"""RedisIndex specifics: key layout, claims' expiry, restart restore, rid reuse, memory."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis

from tests.factories import LLAMA, batch
from tests.tracker.redis_ops import OTHER, SEQ, matches, offload, remove, store
from tracker.core import keys as schema
from tracker.core.blocks import Namespace, block_keys
from tracker.core.events import BlockStored
from tracker.core.redis_index import RedisIndex


@pytest.fixture
async def index_factory(redis_url: str) -> AsyncIterator[Callable[..., RedisIndex]]:
    made: list[RedisIndex] = []

    def make(url: str = redis_url, **kwargs: Any) -> RedisIndex:
        made.append(RedisIndex.from_url(url, **kwargs))
        return made[-1]

    yield make
    for index in made:
        await index.close()


# ------------------------------------------------------------------ layout


async def test_bucket_entries_hold_each_replicas_rid_and_tiers(
    index_factory: Any, redis_url: str
) -> None:
    """A block bucket's value is ``rid << 4 | tiers`` per replica (layout v2, the partition's
    key prefix says so), as ``tracker.core.keys.bucket_entries`` reads it; a restored engine map
    keeps every tier's references."""
    index = index_factory()
    await index.apply("r1", LLAMA, batch(store(SEQ), offload(SEQ, 0)), 1)
    await index.apply("r2", LLAMA, batch(store(SEQ)), 1)
    await index.apply("r2", LLAMA, batch(remove(SEQ, 0)), 2)
    nk = schema.NamespaceKeys(LLAMA)
    assert nk.block_prefix.startswith(f"{schema.PARTITION_PREFIX}:{{")
    first = block_keys(SEQ, LLAMA)[0]
    with redis.Redis.from_url(redis_url) as client:
        value = client.hget(nk.block_bucket(first), schema.field(first))
    rids = {await index.writer.rid(r, LLAMA): r for r in ("r1", "r2")}
    assert {rids[rid]: tiers for rid, tiers in schema.bucket_entries(value)} == {"r1": 0b11}
    rid1 = await index.writer.rid("r1", LLAMA)
    with redis.Redis.from_url(redis_url) as client:  # a value of another layout (12 bytes)
        client.hset(nk.engine_bucket(rid1, 7), schema.field(7), bytes(12))
    restarted = index_factory()
    await restarted.apply("r1", LLAMA, batch(remove(SEQ, 0)), 2)  # its ledger restored first
    assert await matches(restarted, SEQ) == {"r1": (4, 3)}  # r2 lost block 0: no run
    assert await restarted.block_count("r1", LLAMA) == 4  # the foreign entry was skipped


async def test_claims_sweep_expired_homes_from_a_bucket_kept_alive(
    index_factory: Any, redis_url: str
) -> None:
    """A bucket written without pause never expires: claims drop its expired records."""
    index = index_factory()
    nk = schema.NamespaceKeys(LLAMA)
    stale = [(9 << 50) | i for i in range(1, 6)]
    await index.claim(LLAMA, "a", stale, ttl_s=0.2)
    bucket = nk.home_bucket(stale[0])
    assert {nk.home_bucket(k) for k in stale} == {bucket}
    await index.claim(LLAMA, "b", [(9 << 50) | 99], ttl_s=5)
    assert await index.client.hlen(bucket) == 6
    await asyncio.sleep(0.3)
    await index.claim(LLAMA, "b", [(9 << 50) | 99], ttl_s=5)
    assert await index.client.hlen(bucket) == 1
    assert await index.client.pttl(bucket) > 1000


# ------------------------------------------------------------------ tracker restart


async def test_restart_restores_ledger_from_engine_map(index_factory: Any) -> None:
    first = index_factory()
    await first.apply("r1", LLAMA, batch(store(SEQ), store(SEQ, range(2))), 7)  # blocks 0-1 twice
    await first.apply("r1", LLAMA, batch(offload(SEQ, 3)), 8)
    await first.apply("r2", LLAMA, batch(store(OTHER)), 3)
    await first.close()

    second = index_factory()
    assert await second.block_count("r1", LLAMA) == 4
    assert await second.last_seq("r1", LLAMA) == 8
    assert await matches(second, SEQ) == {"r1": (4, 4)}
    # Ref counts survived the restart: blocks 0-1 need two removals each.
    await second.apply("r1", LLAMA, batch(remove(SEQ, 0, 3)), 9)
    assert await matches(second, SEQ) == {"r1": (4, 3)}
    await second.apply("r1", LLAMA, batch(remove(SEQ, 0)), 10)
    assert await matches(second, SEQ) == {}
    await second.apply("r1", LLAMA, batch(remove(SEQ, 3, medium="CPU")), 11)
    assert await second.block_count("r1", LLAMA) == 2  # blocks 1 and 2
    # New blocks chain onto restored ones.
    await second.apply("r2", LLAMA, batch(remove(OTHER, 3), store(OTHER, range(3, 4))), 4)
    assert await matches(second, OTHER) == {"r2": (4, 4)}
    third = index_factory()
    assert await third.block_count("r1", LLAMA) == 2
    assert await third.block_count("r2", LLAMA) == 4
    assert await third.last_seq("r1", LLAMA) == 11


async def test_a_reader_counts_the_blocks_another_index_writes(index_factory: Any) -> None:
    """Asked before the tracker wrote anything, a reader (a test, an operator) still sees what
    the tracker writes after: it keeps no copy of a ledger it does not write."""
    tracker, reader = index_factory(), index_factory()
    assert await reader.block_count("r1", LLAMA) == 0
    await tracker.apply("r1", LLAMA, batch(store(SEQ)), 1)
    assert await reader.block_count("r1", LLAMA) == len(SEQ) // LLAMA.block_size


async def test_restart_after_clear_and_forget_restores_nothing(index_factory: Any) -> None:
    first = index_factory()
    await first.apply("r1", LLAMA, batch(store(SEQ)), 1)
    await first.apply("r2", LLAMA, batch(store(SEQ)), 1)
    await first.clear("r1", LLAMA)
    await first.forget("r2", LLAMA)
    second = index_factory()
    assert await second.block_count("r1", LLAMA) == 0
    assert await second.block_count("r2", LLAMA) == 0
    assert await second.last_seq("r1", LLAMA) is None
    assert await matches(second, SEQ) == {}


# ------------------------------------------------------------------ replica ids


async def test_rid_is_reused_after_forget(index_factory: Any, redis_url: str) -> None:
    index = index_factory()
    await index.apply("r1", LLAMA, batch(store(SEQ)), 1)
    await index.apply("r2", LLAMA, batch(store(OTHER)), 1)
    rid1 = await index.writer.rid("r1", LLAMA)
    assert await index.forget("r1", LLAMA) == 4
    assert await matches(index, SEQ) == {}
    assert await index.last_seq("r1", LLAMA) is None
    await index.apply("r3", LLAMA, batch(store(SEQ, range(2))), 1)
    assert await index.writer.rid("r3", LLAMA) == rid1
    assert await matches(index, SEQ) == {"r3": (2, 2)}
    assert await matches(index, OTHER) == {"r2": (4, 4)}
    # The departed replica comes back under a new id, with an empty ledger.
    await index.apply("r1", LLAMA, batch(store(SEQ, range(1))), 5)
    assert await index.writer.rid("r1", LLAMA) not in (rid1, await index.writer.rid("r2", LLAMA))
    assert await matches(index, SEQ) == {"r3": (2, 2), "r1": (1, 1)}
    # A restarted tracker restores exactly what each id holds now.
    restarted = index_factory()
    assert await restarted.block_count("r3", LLAMA) == 2
    assert await restarted.block_count("r1", LLAMA) == 1
    assert await restarted.block_count("r2", LLAMA) == 4


async def test_predictions_never_land_on_the_new_owner_of_a_reused_rid(
    index_factory: Any,
) -> None:
    tracker, router = index_factory(), index_factory()
    await tracker.apply("r1", LLAMA, batch(store(SEQ, range(1))), 1)
    stale = await router.writer.rid("r1", LLAMA)  # the router caches r1's rid
    await tracker.forget("r1", LLAMA)
    await tracker.apply("r2", LLAMA, batch(store(OTHER)), 1)
    assert await tracker.writer.rid("r2", LLAMA) == stale  # r2 now owns r1's old rid
    await router.predict(LLAMA, "r1", block_keys(SEQ, LLAMA), ttl_s=5)
    found = await router.lookup(LLAMA, block_keys(SEQ, LLAMA))
    assert {r: m.predicted_blocks for r, m in found.items()} == {"r1": 4}


async def test_rids_are_per_namespace(index_factory: Any) -> None:
    index = index_factory()
    other = Namespace("mistral", 4)
    assert await index.writer.rid("a", LLAMA) == 1
    assert await index.writer.rid("b", LLAMA) == 2
    assert await index.writer.rid("b", other) == 1
    assert await index.writer.rid("a", LLAMA) == 1
    assert await index_factory().writer.rid("b", LLAMA) == 2


# ------------------------------------------------------------------ memory


async def _used_memory(client: redis.asyncio.Redis) -> int:
    return int((await client.info("memory"))["used_memory"])


async def test_memory_per_block_and_replica(index_factory: Any, redis_url: str) -> None:
    """Sanity bound, not a benchmark: bench/index_bench.py measures the real figure."""
    blocks = 10_000
    tokens = [(i * 7919) % 50_000 for i in range(blocks * LLAMA.block_size)]
    index = index_factory()
    hashes = list(range(1 << 40, (1 << 40) + blocks))
    event = BlockStored(hashes, None, tokens, LLAMA.block_size, medium="GPU")
    await index.apply("warm-up", LLAMA, batch(store(SEQ)), 0)
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        before = await _used_memory(client)
        await index.apply("r0", LLAMA, batch(event), 1)
        first = (await _used_memory(client) - before) / blocks
        for r in range(1, 4):
            await index.apply(f"r{r}", LLAMA, batch(event), 1)
        per_pair = (await _used_memory(client) - before) / (4 * blocks)
    finally:
        await client.aclose()
    found = await index.lookup(LLAMA, block_keys(tokens, LLAMA))
    assert {r: m.blocks for r, m in found.items()} == {f"r{r}": blocks for r in range(4)}
    # A fleet shares its blocks: amortized over 4 replicas a (block, replica) costs < 100 B.
    assert per_pair < 100, per_pair
    # A lone replica with few blocks pays for sparse buckets: ~one Redis hash key per block
    # below ~10^5 blocks per namespace (2**16 buckets), hence the looser bound.
    assert first < 250, first
