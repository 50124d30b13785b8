"""The paged KV cache: vLLM's hash chain, LRU eviction, reference counts and its events."""

from __future__ import annotations

from collections.abc import Sequence

from publishers.sim.block_hashes import TokenSequence, external_hash, none_hash
from publishers.sim.cache import BlockPool, KVCacheManager
from tracker.core.blocks import Namespace, block_keys
from tracker.core.events import AllBlocksCleared, BlockRemoved, BlockStored

B = 4  # block size of most tests here
ROOT = none_hash("0")


def seq(tokens: list[int], **kwargs: object) -> TokenSequence:
    return TokenSequence(tokens, block_size=B, root=ROOT, **kwargs)  # type: ignore[arg-type]


def setup(num_blocks: int) -> tuple[BlockPool, KVCacheManager]:
    pool = BlockPool(num_blocks, B)
    return pool, KVCacheManager(pool)


def admit(kv: KVCacheManager, rid: str, s: TokenSequence) -> int:
    """Schedule the whole prompt like the scheduler's waiting loop; returns hit tokens."""
    hits = kv.get_computed_blocks(s)
    computed = len(hits) * B
    assert kv.allocate_slots(rid, s, s.num_tokens - computed, computed, hits)
    return computed


def stored(events: Sequence[object]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


def removed(events: Sequence[object]) -> list[int]:
    return [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]  # type: ignore[misc]


def test_hash_chain_matches_vllm_sha256_vectors() -> None:
    # docs/vllm-kv-events.md §5.6, PYTHONHASHSEED="0", block size 16, tokens 0..31
    assert ROOT.hex() == "1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c"
    s = TokenSequence(list(range(32)), block_size=16, root=ROOT)
    assert [external_hash(d) for d in s.block_hashes] == [
        7982712666671721126,
        12675106281628537544,
    ]
    ours = block_keys(list(range(32)), Namespace("default", 16))
    assert not set(ours) & {external_hash(d) for d in s.block_hashes}


def test_extra_keys_lora_everywhere_salt_on_first_block() -> None:
    plain = seq(list(range(8)))
    salted = seq(list(range(8)), cache_salt="s")
    lora = seq(list(range(8)), lora_name="ad", cache_salt="s")
    assert [plain.extra_keys(i) for i in range(2)] == [None, None]
    assert [salted.extra_keys(i) for i in range(2)] == [("s",), None]
    assert [lora.extra_keys(i) for i in range(2)] == [("ad", "s"), ("ad",)]
    assert plain.block_hashes[0] != salted.block_hashes[0]
    # the salt changes block 0 and, through the chain, every later block
    assert plain.block_hashes[1] != salted.block_hashes[1]


def test_stored_event_for_prompt_blocks_and_prefix_hits() -> None:
    pool, kv = setup(16)
    a = seq(list(range(10)))  # 2 full blocks + 2 tokens
    assert admit(kv, "a", a) == 0
    [event] = stored(pool.take_events())
    assert event.block_hashes == [external_hash(d) for d in a.block_hashes]
    assert event.parent_block_hash is None
    assert event.token_ids == list(range(8))
    assert event.block_size == B
    assert event.medium == "GPU"
    assert event.extra_keys == [None, None]
    # same prefix, diverging after 2 blocks: reuses both, stores its own third block
    b = seq([*range(8), 50, 51, 52, 53, 54])
    assert admit(kv, "b", b) == 8
    [event] = stored(pool.take_events())
    assert event.parent_block_hash == external_hash(a.block_hashes[1])
    assert event.token_ids == [50, 51, 52, 53]


def test_last_token_is_never_a_hit() -> None:
    _, kv = setup(16)
    a = seq(list(range(8)))  # exactly 2 blocks
    admit(kv, "a", a)
    again = seq(list(range(8)))
    assert len(kv.get_computed_blocks(again)) == 1  # capped at 7 tokens -> 1 block
    assert len(kv.get_computed_blocks(seq(list(range(9))))) == 2


def test_duplicate_physical_copy_is_stored_twice() -> None:
    pool, kv = setup(16)
    a, b = seq(list(range(8))), seq(list(range(8)))
    admit(kv, "a", a)
    assert admit(kv, "b", b) == 4  # recomputes its last block into a second copy
    events = stored(pool.take_events())
    last = external_hash(a.block_hashes[1])
    assert [last in e.block_hashes for e in events] == [True, True]
    # evicting one copy leaves the hash cached
    kv.free("a")
    pool.get_new_blocks(pool.num_free)
    assert removed(pool.take_events()) == [last]  # a's copy of block 1 (block 0 is shared)
    assert last in pool.cached_blocks()


def test_lru_evicts_leaves_first_and_emits_removed() -> None:
    pool, kv = setup(6)
    a = seq(list(range(16)))  # 4 blocks
    admit(kv, "a", a)
    kv.free("a")
    pool.take_events()
    # 2 never-used blocks go first, then a's blocks from the tail of its chain
    pool.get_new_blocks(3)
    assert removed(pool.take_events()) == [external_hash(a.block_hashes[3])]
    pool.get_new_blocks(2)
    assert removed(pool.take_events()) == [external_hash(d) for d in a.block_hashes[2:0:-1]]
    assert set(pool.cached_blocks()) == {external_hash(a.block_hashes[0])}


def test_reference_counts_protect_blocks_in_use() -> None:
    pool, kv = setup(8)
    a, b = seq(list(range(9))), seq(list(range(9)))
    admit(kv, "a", a)
    admit(kv, "b", b)  # shares a's two full blocks
    kv.free("a")
    assert pool.num_free == 8 - 3  # b holds the two shared blocks and its own partial one
    pool.get_new_blocks(pool.num_free)
    assert removed(pool.take_events()) == []  # no free block had a hash
    assert set(pool.cached_blocks()) == {external_hash(d) for d in a.block_hashes}


def test_allocation_failure_changes_nothing() -> None:
    pool, kv = setup(4)
    s = seq(list(range(20)))  # needs 5 blocks
    assert not kv.allocate_slots("x", s, 20, 0)
    assert pool.num_free == 4
    assert pool.take_events() == []
    assert kv.num_blocks("x") == 0


def test_decode_fills_blocks_with_generated_tokens() -> None:
    pool, kv = setup(8)
    s = seq([1, 2, 3])
    assert kv.allocate_slots("r", s, 3, 0)  # prefill: no full block yet
    assert stored(pool.take_events()) == []
    for token in (4, 5, 6, 7, 8):  # each sampled token is computed by the next decode step
        s.extend([token])
        assert kv.allocate_slots("r", s, 1, s.num_tokens - 1)
    events = stored(pool.take_events())
    assert [e.token_ids for e in events] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert events[1].parent_block_hash == events[0].block_hashes[0]
    assert kv.num_blocks("r") == 2


def test_reset_prefix_cache_only_when_idle() -> None:
    pool, kv = setup(8)
    admit(kv, "a", seq(list(range(8))))
    pool.take_events()
    assert not pool.reset_prefix_cache()
    assert pool.take_events() == []
    kv.free("a")
    assert pool.reset_prefix_cache()
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.cached_blocks() == {}
    pool.get_new_blocks(8)
    assert removed(pool.take_events()) == []  # cleared blocks carry no hash any more


def test_an_evicted_block_moves_to_the_cpu_tier_and_loads_back() -> None:
    """The connector's events, in the order a consumer needs: the CPU copy is announced
    before the GPU pool's removal (the tracker still knows the hash), and a prompt whose GPU
    prefix ends where the CPU tier goes on loads those blocks, which the GPU pool caches."""
    pool = BlockPool(6, B, offload_blocks=3)
    kv = KVCacheManager(pool)
    a = seq(list(range(16)))  # 4 blocks
    admit(kv, "a", a)
    kv.free("a")
    pool.take_events()
    taken = pool.get_new_blocks(4)  # 2 never-used blocks, then a's last two
    events = pool.take_events()
    cpu = [e for e in events if isinstance(e, BlockStored | BlockRemoved) and e.medium == "CPU"]
    assert [(type(e).__name__, e.block_hashes) for e in events] == [
        ("BlockStored", [external_hash(a.block_hashes[3])]),
        ("BlockRemoved", [external_hash(a.block_hashes[3])]),
        ("BlockStored", [external_hash(a.block_hashes[2])]),
        ("BlockRemoved", [external_hash(a.block_hashes[2])]),
    ]
    assert [isinstance(e, BlockStored) for e in cpu] == [True, True]
    assert all(e.token_ids == [] and e.block_size == 0 for e in stored(cpu))
    pool.free_blocks(taken)
    b = seq([*range(16), 99])
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 2
    assert kv.offloaded_blocks(b, len(hits)) == 2  # blocks 2 and 3 load from the CPU tier
    computed = (len(hits) + 2) * B
    assert kv.allocate_slots("b", b, b.num_tokens - computed, computed, hits)
    gpu = stored(pool.take_events())
    assert [e.block_hashes for e in gpu if e.medium == "GPU"] == [
        [external_hash(d) for d in a.block_hashes[2:4]]
    ]


def test_the_cpu_tier_drops_its_least_recently_used_block() -> None:
    pool = BlockPool(2, B, offload_blocks=2)
    kv = KVCacheManager(pool)
    for rid, first in (("a", 0), ("b", 100), ("c", 200)):
        admit(kv, rid, seq(list(range(first, first + 8))))
        kv.free(rid)
    assert pool.offload is not None and len(pool.offload) == 2
    dropped = [e for e in pool.take_events() if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    first_a = seq(list(range(8))).block_hashes
    assert [e.block_hashes for e in dropped] == [
        [external_hash(first_a[1])],
        [external_hash(first_a[0])],
    ]
    assert pool.reset_prefix_cache() and len(pool.offload) == 0
