"""The BlockIndex contract, run unchanged against every backend: placements and lookups.

Backends (the ``index`` fixture in tests/tracker/conftest.py): :class:`MemoryIndex`;
:class:`RedisIndex` on the session's real redis-server; and :class:`RedisIndex` on fakeredis,
whose Lua support needs the ``lupa`` package. The registry and the predictions parts of the
contract are in test_index_registry.py and test_index_predictions.py.
"""

from __future__ import annotations

from tests.factories import LLAMA, batch
from tests.tracker.contract import OTHER, SEQ, engine_hash, matches, offload, put, remove, store
from tracker.core.blocks import Namespace, block_keys
from tracker.core.events import AllBlocksCleared, BlockRemoved
from tracker.core.index import BlockIndex

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
