"""The BlockIndex contract, run unchanged against every backend.

Backends: :class:`MemoryIndex`; :class:`RedisIndex` on the session's real redis-server; and
:class:`RedisIndex` on fakeredis, whose Lua support needs the ``lupa`` package.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import xxhash

from tests.factories import LLAMA, batch
from tracker.core.blocks import Namespace, block_keys
from tracker.core.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from tracker.core.index import BlockIndex, Match, ReplicaRecord
from tracker.core.keys import home_anchors
from tracker.core.memory_index import MemoryIndex
from tracker.core.redis_index import RedisIndex

SEQ = list(range(1000, 1016))  # 4 blocks
OTHER = list(range(2000, 2016))


@pytest.fixture(params=["memory", "redis", "fakeredis"])
async def index(request: pytest.FixtureRequest) -> AsyncIterator[BlockIndex]:
    backend: BlockIndex
    if request.param == "memory":
        backend = MemoryIndex()
    elif request.param == "redis":
        backend = RedisIndex.from_url(request.getfixturevalue("redis_url"))
    else:
        pytest.importorskip(
            "lupa", reason="fakeredis runs Lua only with lupa: add fakeredis[lua] to test deps"
        )
        import fakeredis

        backend = RedisIndex(fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer()))
    yield backend
    await backend.close()


# ------------------------------------------------------------------ event helpers


def engine_hash(tokens: list[int], block: int, ns: Namespace = LLAMA) -> int:
    """A stand-in for vLLM's hash of block ``block`` of ``tokens`` (any stable function works)."""
    prefix = b"".join(t.to_bytes(4, "little") for t in tokens[: (block + 1) * ns.block_size])
    return xxhash.xxh3_64_intdigest(prefix, seed=7)


def store(
    tokens: list[int],
    blocks: range | None = None,
    *,
    ns: Namespace = LLAMA,
    lora: str | None = None,
) -> BlockStored:
    """GPU BlockStored of ``blocks`` of ``tokens``, chained to the block before them."""
    bs = ns.block_size
    blocks = blocks if blocks is not None else range(len(tokens) // bs)
    parent = engine_hash(tokens, blocks.start - 1, ns) if blocks.start else None
    return BlockStored(
        [engine_hash(tokens, b, ns) for b in blocks],
        parent,
        tokens[blocks.start * bs : blocks.stop * bs],
        bs,
        medium="GPU",
        lora_name=lora,
    )


def offload(
    tokens: list[int], *blocks: int, medium: str = "CPU", locality: str | None = None
) -> BlockStored:
    """Tokenless offload BlockStored with digest-bytes hashes, as vLLM's offload connector
    sends (a placeholder of its tier: no tokens, block size 0)."""
    digests = [b"\xee" * 24 + engine_hash(tokens, b).to_bytes(8, "big") for b in blocks]
    return BlockStored(digests, None, [], 0, medium=medium, locality=locality)


def remove(
    tokens: list[int], *blocks: int, medium: str = "GPU", locality: str | None = None
) -> BlockRemoved:
    return BlockRemoved([engine_hash(tokens, b) for b in blocks], medium, locality=locality)


async def put(
    index: BlockIndex, replica: str, *events: Event, ns: Namespace = LLAMA, seq: Any = None
) -> Any:
    return await index.apply(replica, ns, batch(*events), seq)


async def matches(
    index: BlockIndex, tokens: list[int], ns: Namespace = LLAMA
) -> dict[str, tuple[int, int]]:
    found = await index.lookup(ns, block_keys(tokens, ns))
    for replica, match in found.items():
        assert isinstance(match, Match) and match.replica == replica
        assert match.offload_blocks == match.blocks - match.gpu_blocks
    return {r: (m.blocks, m.gpu_blocks) for r, m in found.items()}


# ------------------------------------------------------------------ placements and lookups


async def test_empty_index_and_empty_chain(index: BlockIndex) -> None:
    assert await matches(index, SEQ) == {}
    await put(index, "r1", store(SEQ))
    assert await index.lookup(LLAMA, []) == {}


async def test_apply_then_lookup(index: BlockIndex) -> None:
    result = await put(index, "r1", store(SEQ, range(2)), store(SEQ, range(2, 4)), seq=0)
    assert result.stats["stored"] == 4
    assert result.blocks == 4
    assert not result.cleared
    assert await matches(index, SEQ) == {"r1": (4, 4)}
    assert await matches(index, SEQ[:8]) == {"r1": (2, 2)}
    assert await matches(index, [*SEQ, *OTHER]) == {"r1": (4, 4)}
    assert await matches(index, OTHER) == {}
    assert await index.block_count("r1", LLAMA) == 4


async def test_longest_contiguous_prefix_per_replica(index: BlockIndex) -> None:
    await put(index, "holes", store(SEQ), remove(SEQ, 2))  # blocks 0, 1, 3
    await put(index, "middle", store(SEQ, range(2)), remove(SEQ, 0))  # block 1 only
    await put(index, "full", store(SEQ))
    await put(index, "first", store(SEQ, range(1)))
    assert await matches(index, SEQ) == {"holes": (2, 2), "full": (4, 4), "first": (1, 1)}


async def test_walk_stops_at_first_block_no_replica_holds(index: BlockIndex) -> None:
    await put(index, "a", store(SEQ), remove(SEQ, 2))  # 0, 1, 3
    await put(index, "b", store(SEQ), remove(SEQ, 2))  # 0, 1, 3
    await put(index, "c", store(SEQ), remove(SEQ, 0, 1, 2))  # 3 only
    assert await index.block_count("c", LLAMA) == 1
    assert await matches(index, SEQ) == {"a": (2, 2), "b": (2, 2)}
    await put(index, "a", remove(SEQ, 0))
    assert await matches(index, SEQ) == {"b": (2, 2)}
    await put(index, "b", remove(SEQ, 0))
    assert await matches(index, SEQ) == {}


async def test_diverging_sequences_share_their_common_prefix(index: BlockIndex) -> None:
    fork = SEQ[:8] + OTHER[:8]
    await put(index, "r1", store(SEQ))
    await put(index, "r2", store(fork))
    assert await matches(index, SEQ) == {"r1": (4, 4), "r2": (2, 2)}
    assert await matches(index, fork) == {"r1": (2, 2), "r2": (4, 4)}


async def test_gpu_and_offload_tiers(index: BlockIndex) -> None:
    await put(index, "r1", store(SEQ, range(3)), offload(SEQ, 0, 1, 2))
    assert await matches(index, SEQ) == {"r1": (3, 3)}
    await put(index, "r1", remove(SEQ, 1))  # block 1 now only on CPU
    assert await matches(index, SEQ) == {"r1": (3, 2)}
    await put(index, "r1", remove(SEQ, 0, 2))
    assert await matches(index, SEQ) == {"r1": (3, 0)}
    await put(
        index, "r1", BlockRemoved([b"\xee" * 24 + engine_hash(SEQ, 1).to_bytes(8, "big")], "CPU")
    )
    assert await matches(index, SEQ) == {"r1": (1, 0)}
    assert await index.block_count("r1", LLAMA) == 2


async def tiers(index: BlockIndex, tokens: list[int]) -> dict[str, tuple[int, ...]]:
    """Per replica: blocks of its run, then how many of them load from GPU, CPU, storage
    and a remote store (each from the cheapest tier holding it)."""
    found = await index.lookup(LLAMA, block_keys(tokens, LLAMA))
    for m in found.values():
        assert m.gpu_blocks + m.cpu_blocks + m.storage_blocks + m.remote_blocks == m.blocks
    return {
        r: (m.blocks, m.gpu_blocks, m.cpu_blocks, m.storage_blocks, m.remote_blocks)
        for r, m in found.items()
    }


async def test_each_offload_tier_is_its_own_in_lookups(index: BlockIndex) -> None:
    """vLLM >= 0.26 names CPU and STORAGE tiers and a REMOTE locality; a run counts each
    block in the cheapest tier holding it, also where runs of two replicas go in step."""
    for replica in ("r1", "r2"):
        await put(
            index,
            replica,
            store(SEQ),
            offload(SEQ, 0, 1, 2, 3),
            offload(SEQ, 1, 2, 3, medium="STORAGE"),
            offload(SEQ, 2, 3, medium="STORAGE", locality="REMOTE"),
        )
    assert await tiers(index, SEQ) == {"r1": (4, 4, 0, 0, 0), "r2": (4, 4, 0, 0, 0)}
    await put(index, "r1", remove(SEQ, 0, 1, 2, 3))  # the GPU pool evicted them all
    assert await tiers(index, SEQ) == {"r1": (4, 0, 4, 0, 0), "r2": (4, 4, 0, 0, 0)}
    await put(index, "r1", remove(SEQ, 1, 2, 3, medium="CPU"))
    assert (await tiers(index, SEQ))["r1"] == (4, 0, 1, 3, 0)
    await put(index, "r1", remove(SEQ, 2, 3, medium="STORAGE"))
    assert (await tiers(index, SEQ))["r1"] == (4, 0, 1, 1, 2)
    await put(index, "r2", remove(SEQ, 3), remove(SEQ, 3, medium="CPU"))
    assert (await tiers(index, SEQ))["r2"] == (4, 3, 0, 1, 0)
    await put(index, "r1", remove(SEQ, 2, medium="STORAGE", locality="REMOTE"))
    assert (await tiers(index, SEQ))["r1"] == (2, 0, 1, 1, 0)  # the chain breaks at block 2
    assert await index.block_count("r1", LLAMA) == 3


async def test_lora_namespaces_are_isolated(index: BlockIndex) -> None:
    await put(index, "lora-a", store(SEQ, lora="a"))
    await put(index, "base", store(SEQ))
    await put(index, "lora-b", store(SEQ[:8], lora="b"), ns=Namespace("llama", 4, "b"))
    assert await matches(index, SEQ, Namespace("llama", 4, "a")) == {"lora-a": (4, 4)}
    assert await matches(index, SEQ, Namespace("llama", 4, "b")) == {"lora-b": (2, 2)}
    assert await matches(index, SEQ) == {"base": (4, 4)}
    assert await matches(index, SEQ, Namespace("llama", 4, "c")) == {}


async def test_empty_lora_name_is_the_base_namespace(index: BlockIndex) -> None:
    await put(index, "r1", store(SEQ), ns=Namespace("llama", 4, ""))
    assert await matches(index, SEQ) == {"r1": (4, 4)}
    assert await index.block_count("r1", LLAMA) == 4


async def test_namespaces_are_isolated(index: BlockIndex) -> None:
    other_model = Namespace("mistral", 4)
    other_size = Namespace("llama", 8)
    await put(index, "r1", store(SEQ), seq=3)
    await put(index, "r1", store(SEQ, ns=other_model), ns=other_model, seq=9)
    keys = block_keys(SEQ, LLAMA)
    # The same keys in another partition find nothing.
    assert await index.lookup(other_size, keys) == {}
    assert await matches(index, SEQ, other_model) == {"r1": (4, 4)}
    assert await index.last_seq("r1", LLAMA) == 3
    assert await index.last_seq("r1", other_model) == 9
    assert await index.clear("r1", other_model) == 4
    assert await matches(index, SEQ) == {"r1": (4, 4)}
    assert await index.last_seq("r1", LLAMA) == 3
    assert await index.block_count("r1", other_model) == 0


async def test_clear_affects_only_that_replica(index: BlockIndex) -> None:
    await put(index, "r1", store(SEQ), seq=4)
    await put(index, "r2", store(SEQ), seq=8)
    assert await index.clear("r1", LLAMA) == 4
    assert await matches(index, SEQ) == {"r2": (4, 4)}
    assert await index.block_count("r1", LLAMA) == 0
    assert await index.block_count("r2", LLAMA) == 4
    assert await index.last_seq("r1", LLAMA) is None
    assert await index.last_seq("r2", LLAMA) == 8
    assert await index.clear("r1", LLAMA) == 0
    await put(index, "r1", store(SEQ, range(1)), seq=0)
    assert await matches(index, SEQ) == {"r2": (4, 4), "r1": (1, 1)}


async def test_all_blocks_cleared_event(index: BlockIndex) -> None:
    await put(index, "r1", store(SEQ))
    await put(index, "r2", store(SEQ))
    result = await put(index, "r1", AllBlocksCleared(), store(OTHER, range(1)))
    assert result.cleared
    assert result.stats["cleared"] == 1
    assert result.blocks == 1
    assert await matches(index, SEQ) == {"r2": (4, 4)}
    assert await matches(index, OTHER) == {"r1": (1, 1)}


async def test_last_seq(index: BlockIndex) -> None:
    assert await index.last_seq("r1", LLAMA) is None
    await put(index, "r1", store(SEQ, range(1)), seq=5)
    assert await index.last_seq("r1", LLAMA) == 5
    await put(index, "r1", store(SEQ, range(1, 2)))
    assert await index.last_seq("r1", LLAMA) == 5
    await put(index, "r1", store(SEQ, range(2, 3)), seq=0)
    assert await index.last_seq("r1", LLAMA) == 0
    await put(index, "r1", store(SEQ, range(3, 4)), seq=(1 << 64) - 2)
    assert await index.last_seq("r1", LLAMA) == (1 << 64) - 2
    assert await index.last_seq("r2", LLAMA) is None


async def test_replaying_a_batch_twice_is_reference_counted(index: BlockIndex) -> None:
    stored = batch(store(SEQ))
    for _ in range(2):
        result = await index.apply("r1", LLAMA, stored, 1)
        assert result.blocks == 4
    assert await index.block_count("r1", LLAMA) == 4
    removal = batch(remove(SEQ, 0, 1, 2, 3))
    assert (await index.apply("r1", LLAMA, removal, 2)).stats["removed"] == 4
    assert await matches(index, SEQ) == {"r1": (4, 4)}
    await index.apply("r1", LLAMA, removal, 3)
    assert await matches(index, SEQ) == {}
    assert await index.block_count("r1", LLAMA) == 0
    assert (await index.apply("r1", LLAMA, removal, 4)).stats["unknown_remove"] == 4


async def test_orphans_are_reported_not_indexed(index: BlockIndex) -> None:
    result = await put(index, "r1", store(SEQ, range(2, 4)))
    assert result.stats["orphan"] == 2
    assert result.blocks == 0
    assert await matches(index, SEQ) == {}


async def test_block_count_counts_distinct_blocks(index: BlockIndex) -> None:
    assert await index.block_count("nobody", LLAMA) == 0
    await put(index, "r1", store(SEQ), store(SEQ, range(2)), offload(SEQ, 0))
    assert await index.block_count("r1", LLAMA) == 4


# ------------------------------------------------------------------ registry


def record(replica: str, **fields: Any) -> ReplicaRecord:
    return ReplicaRecord(id=replica, model="llama", block_size=4, **fields)


async def test_register_list_and_deregister(index: BlockIndex) -> None:
    assert await index.replicas() == []
    before = time.time()
    await index.register(record("r1", url="http://h1:8000", events="tcp://h1:5557"))
    await index.register(record("r2", instance="boot-1"))
    listed = {r.id: r for r in await index.replicas()}
    assert set(listed) == {"r1", "r2"}
    assert listed["r1"].url == "http://h1:8000"
    assert listed["r1"].events == "tcp://h1:5557"
    assert listed["r2"].instance == "boot-1"
    for entry in listed.values():
        assert before - 1 <= entry.last_seen <= time.time() + 1
    await index.register(record("r1", url="http://h1:9000"))
    listed = {r.id: r for r in await index.replicas()}
    assert listed["r1"].url == "http://h1:9000"
    await index.deregister("r1")
    await index.deregister("never-registered")
    assert [r.id for r in await index.replicas()] == ["r2"]


async def test_reap_removes_only_stale_entries(index: BlockIndex) -> None:
    await index.register(record("short", ttl_s=0.05))
    await index.register(record("long", ttl_s=60))
    assert await index.reap() == []
    await asyncio.sleep(0.15)
    reaped = await index.reap()
    assert [r.id for r in reaped] == ["short"]
    assert [r.id for r in await index.replicas()] == ["long"]
    assert await index.reap() == []
    # A heartbeat brings it back.
    await index.register(record("short", ttl_s=0.05))
    assert {r.id for r in await index.replicas()} == {"short", "long"}


async def test_registry_and_blocks_are_independent(index: BlockIndex) -> None:
    await put(index, "r1", store(SEQ))
    await index.register(record("r1"))
    await index.deregister("r1")
    assert await matches(index, SEQ) == {"r1": (4, 4)}


# ------------------------------------------------------------------ predictions


async def predicted(
    index: BlockIndex, tokens: list[int], ns: Namespace = LLAMA
) -> dict[str, tuple[int, int, int]]:
    found = await index.lookup(ns, block_keys(tokens, ns))
    return {r: (m.blocks, m.gpu_blocks, m.predicted_blocks) for r, m in found.items()}


async def test_predictions_match_a_new_prefix_until_they_expire(index: BlockIndex) -> None:
    await index.predict(LLAMA, "a", block_keys(SEQ, LLAMA), ttl_s=0.4)
    assert await predicted(index, SEQ) == {"a": (4, 4, 4)}
    assert await predicted(index, [*SEQ[:8], *OTHER]) == {"a": (2, 2, 2)}
    await asyncio.sleep(0.6)
    assert await predicted(index, SEQ) == {}


async def test_predictions_extend_real_matches_where_events_end(index: BlockIndex) -> None:
    await put(index, "a", store(SEQ, range(2)))
    await put(index, "b", store(SEQ, range(2)))
    await index.predict(LLAMA, "a", block_keys(SEQ, LLAMA)[2:], ttl_s=5)
    assert await predicted(index, SEQ) == {"a": (4, 4, 2), "b": (2, 2, 0)}


async def test_real_events_supersede_predictions(index: BlockIndex) -> None:
    await index.predict(LLAMA, "a", block_keys(SEQ, LLAMA), ttl_s=5)
    await put(index, "a", store(SEQ))
    assert await predicted(index, SEQ) == {"a": (4, 4, 0)}


async def test_an_eviction_cancels_the_prediction_of_that_block(index: BlockIndex) -> None:
    keys = block_keys(SEQ, LLAMA)
    await index.predict(LLAMA, "a", keys, ttl_s=30)
    await put(index, "a", store(SEQ))
    await put(index, "a", remove(SEQ, 3, 2))  # vLLM evicts a chain's tail first
    # without the cancellation the walk would go on over blocks 2, 3 on their prediction
    assert await predicted(index, SEQ) == {"a": (2, 2, 0)}
    await put(index, "a", remove(SEQ, 1, 0))
    assert await predicted(index, SEQ) == {}


async def test_a_cleared_replica_loses_its_predictions_of_stored_blocks(
    index: BlockIndex,
) -> None:
    keys = block_keys(SEQ, LLAMA)
    await index.predict(LLAMA, "a", keys, ttl_s=30)
    await index.predict(LLAMA, "b", keys, ttl_s=30)
    await put(index, "a", store(SEQ, range(3)))
    await put(index, "a", AllBlocksCleared())
    # block 3 was never stored: its prediction stands (the request may still be running)
    assert await predicted(index, SEQ) == {"b": (4, 4, 4)}
    await put(index, "b", store(SEQ), remove(SEQ, 3))
    assert await predicted(index, SEQ) == {"b": (3, 3, 0)}


async def test_residency_counts_held_and_stored_gpu_blocks(index: BlockIndex) -> None:
    survey = await index.survey(LLAMA, block_keys(SEQ, LLAMA))
    assert survey.residency == {}
    await put(index, "a", store(SEQ), offload(SEQ, 0, 1))
    await put(index, "b", store(SEQ, range(2)))
    await put(index, "a", remove(SEQ, 3, 2), store(OTHER, range(1)))
    survey = await index.survey(LLAMA, block_keys(SEQ, LLAMA))
    assert {r: (m.blocks, m.gpu_blocks) for r, m in survey.matches.items()} == {
        "a": (2, 2),
        "b": (2, 2),
    }
    assert {r: (c.blocks, c.stored) for r, c in survey.residency.items()} == {
        "a": (3, 5),
        "b": (2, 2),
    }
    await put(index, "a", AllBlocksCleared())
    survey = await index.survey(LLAMA, [])
    assert survey.matches == {}
    assert (survey.residency["a"].blocks, survey.residency["a"].stored) == (0, 5)


async def test_lookahead_widths_are_surveyed_per_replica(index: BlockIndex) -> None:
    assert (await index.survey(LLAMA, [])).lookahead == {}
    await index.set_lookahead("a", LLAMA, 2)
    await index.set_lookahead("b", LLAMA, 0)  # no lookahead: nothing to say
    await index.set_lookahead("c", Namespace("other", LLAMA.block_size), 1)
    # an adapter's partition is the base's
    lora = Namespace(LLAMA.model, LLAMA.block_size, "adapter")
    assert (await index.survey(lora, block_keys(SEQ, LLAMA))).lookahead == {"a": 2}
    await index.set_lookahead("a", LLAMA, 0)
    assert (await index.survey(LLAMA, [])).lookahead == {}


async def test_homes_name_the_last_replica_each_anchor_was_routed_to(index: BlockIndex) -> None:
    long = list(range(5000, 5040))  # 10 blocks of 4
    keys = block_keys(long, LLAMA)
    assert home_anchors(len(keys)) == [0, 1, 3, 7, 9]
    await index.claim(LLAMA, "a", [keys[p] for p in home_anchors(len(keys))], ttl_s=0.6)
    # a prompt sharing 5 blocks meets a's anchors 0, 1, 3 (its own 4, 7 were never claimed)
    sibling = block_keys([*long[:20], *OTHER], LLAMA)
    survey = await index.survey(LLAMA, sibling)
    assert {r: h.blocks for r, h in survey.homes.items()} == {"a": 4}
    assert 0 <= survey.homes["a"].age_s < 0.5
    assert survey.matches == {}  # a home says where a prefix went, not what is cached
    # b takes over the shared part; a keeps the depth only it was routed with
    await index.claim(LLAMA, "b", [sibling[p] for p in home_anchors(len(sibling))], ttl_s=5)
    survey = await index.survey(LLAMA, keys)
    assert {r: h.blocks for r, h in survey.homes.items()} == {"b": 4, "a": 10}
    await asyncio.sleep(0.8)
    survey = await index.survey(LLAMA, keys)
    assert {r: h.blocks for r, h in survey.homes.items()} == {"b": 4}


async def test_a_route_predicts_the_chain_and_claims_its_anchors_at_once(
    index: BlockIndex,
) -> None:
    """What a router writes after each request: both records, each with its own expiry."""
    keys = block_keys(SEQ, LLAMA)
    anchors = [keys[p] for p in home_anchors(len(keys))]
    await index.route(LLAMA, "a", keys[1:], ttl_s=0.3, anchors=anchors, home_ttl_s=5)
    await put(index, "a", store(SEQ, range(1)))  # the engine's word on the first block
    survey = await index.survey(LLAMA, keys)
    assert {r: (m.blocks, m.predicted_blocks) for r, m in survey.matches.items()} == {"a": (4, 3)}
    assert {r: h.blocks for r, h in survey.homes.items()} == {"a": 4}
    await asyncio.sleep(0.5)  # the predictions expire, the home stays
    survey = await index.survey(LLAMA, keys)
    assert {r: (m.blocks, m.predicted_blocks) for r, m in survey.matches.items()} == {"a": (1, 0)}
    assert {r: h.blocks for r, h in survey.homes.items()} == {"a": 4}
    # either part alone
    await index.route(LLAMA, "b", [], ttl_s=5, anchors=anchors, home_ttl_s=5)
    await index.route(LLAMA, "c", block_keys(OTHER, LLAMA), ttl_s=5, anchors=[], home_ttl_s=5)
    survey = await index.survey(LLAMA, keys)
    assert {r: h.blocks for r, h in survey.homes.items()} == {"b": 4}
    assert await predicted(index, OTHER) == {"c": (4, 4, 4)}
    assert (await index.survey(LLAMA, block_keys(OTHER, LLAMA))).homes == {}


async def test_an_expired_home_is_not_reported_while_its_bucket_lives_on(
    index: BlockIndex,
) -> None:
    # two anchors in one Redis bucket (same top 14 bits): b's fresh claim keeps the bucket
    # alive; a's record beside it has expired and must not be read as a deeper home
    first, second = (5 << 50) | 1, (5 << 50) | 2
    await index.claim(LLAMA, "a", [first, second], ttl_s=0.3)
    await index.claim(LLAMA, "b", [first], ttl_s=5)
    await asyncio.sleep(0.4)
    survey = await index.survey(LLAMA, [first, second])
    assert {r: h.blocks for r, h in survey.homes.items()} == {"b": 1}


async def test_a_replica_that_stopped_matching_is_not_revived_by_predictions(
    index: BlockIndex,
) -> None:
    await put(index, "a", store(SEQ, range(1)))
    await index.predict(LLAMA, "b", block_keys(SEQ, LLAMA)[1:], ttl_s=5)
    assert await predicted(index, SEQ) == {"a": (1, 1, 0)}


async def test_newer_prediction_of_the_same_replica_replaces_the_older(index: BlockIndex) -> None:
    keys = block_keys(SEQ, LLAMA)
    await index.predict(LLAMA, "a", keys, ttl_s=0.3)
    await index.predict(LLAMA, "a", keys, ttl_s=5)
    await index.predict(LLAMA, "b", keys[:1], ttl_s=5)
    await asyncio.sleep(0.5)
    assert await predicted(index, SEQ) == {"a": (4, 4, 4), "b": (1, 1, 1)}
