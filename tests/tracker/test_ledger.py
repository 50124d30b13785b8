"""Ledger tests: ref counts, orphans, offload tiers, skipped groups, clears, persistence."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest

from tests import factories
from tests.factories import TINY, removed
from tracker.core.blocks import Namespace, block_keys, own_extra_keys
from tracker.core.events import AllBlocksCleared, Event, UnknownEvent
from tracker.core.keys import ENGINE_VALUE_BYTES
from tracker.core.ledger import EngineBlock, ReplicaLedger, Tier, tier_of

TOKENS = [10, 11, 20, 21, 30, 31, 40, 41]
KEYS = block_keys(TOKENS, TINY)
GPU, OFF = int(Tier.GPU), int(Tier.CPU)
STORAGE, REMOTE = int(Tier.STORAGE), int(Tier.REMOTE)


# two-token blocks, stored without a medium as vLLM before 0.9 sent them (the GPU tier)
stored = partial(factories.stored, block_size=TINY.block_size, medium=None)


def ledger_with(*events: Event) -> ReplicaLedger:
    ledger = ReplicaLedger("r1", TINY)
    ledger.apply(events)
    return ledger


def held(ledger: ReplicaLedger) -> dict[int, int]:
    return dict(ledger.placements())


def test_store_chain_maps_engine_hashes_to_chained_keys() -> None:
    ledger = ReplicaLedger("r1", TINY)
    changes = ledger.apply([stored(TOKENS[:4], [1, 2]), stored(TOKENS[4:6], [3], parent=2)])
    assert changes.placements == {KEYS[0]: GPU, KEYS[1]: GPU, KEYS[2]: GPU}
    assert changes.stats == {"stored": 3}
    assert {h: b.key for h, b in ledger.engine.items()} == {1: KEYS[0], 2: KEYS[1], 3: KEYS[2]}
    assert set(changes.engine) == {1, 2, 3}
    assert not changes.cleared
    assert len(ledger) == 3


def test_duplicate_stores_are_reference_counted() -> None:
    ledger = ledger_with(stored(TOKENS[:2], [1]), stored(TOKENS[:2], [1]))
    assert ledger.engine[1].gpu == 2
    changes = ledger.apply([removed(1)])
    assert changes.placements == {KEYS[0]: GPU}
    assert ledger.tiers(KEYS[0]) == GPU
    changes = ledger.apply([removed(1)])
    assert changes.placements == {KEYS[0]: 0}
    assert changes.engine == {1: None}
    assert ledger.tiers(KEYS[0]) == 0
    assert len(ledger) == 0
    assert ledger.apply([removed(1)]).stats == {"unknown_remove": 1}


def test_signed_and_unsigned_forms_of_a_hash_are_the_same_block() -> None:
    ledger = ledger_with(stored(TOKENS[:2], [-5]), stored(TOKENS[2:4], [7], parent=(1 << 64) - 5))
    assert held(ledger) == {KEYS[0]: GPU, KEYS[1]: GPU}
    ledger.apply([removed((1 << 64) - 5), removed(7)])
    assert held(ledger) == {}


def test_orphan_is_counted_and_not_indexed_and_its_children_are_orphans() -> None:
    ledger = ReplicaLedger("r1", TINY)
    changes = ledger.apply([stored(TOKENS[2:6], [5, 6], parent=99)])
    assert changes.stats == {"orphan": 2}
    assert changes.placements == {}
    assert len(ledger) == 0
    child = ledger.apply([stored(TOKENS[6:8], [7], parent=6)])
    assert child.stats == {"orphan": 1}
    assert held(ledger) == {}
    assert ledger.apply([removed(6)]).stats == {"removed_orphan": 1}
    assert ledger.apply([removed(6)]).stats == {"unknown_remove": 1}
    assert ledger.apply([removed(7, 5)]).stats == {"removed_orphan": 2}


def test_orphan_stored_twice_needs_two_removes() -> None:
    ledger = ledger_with(stored(TOKENS[2:4], [5], parent=99), stored(TOKENS[2:4], [5], parent=99))
    assert ledger.apply([removed(5)]).stats == {"removed_orphan": 1}
    assert ledger.apply([removed(5)]).stats == {"removed_orphan": 1}
    assert ledger.apply([removed(5)]).stats == {"unknown_remove": 1}


def test_orphan_later_stored_with_known_parent_is_indexed() -> None:
    ledger = ledger_with(stored(TOKENS[2:4], [2], parent=1))
    assert held(ledger) == {}
    ledger.apply([stored(TOKENS[:2], [1]), stored(TOKENS[2:4], [2], parent=1)])
    assert held(ledger) == {KEYS[0]: GPU, KEYS[1]: GPU}
    assert not ledger.orphans
    assert ledger.apply([removed(2)]).stats == {"removed": 1}


def test_tokenless_cpu_store_adds_offload_tier_to_known_gpu_block() -> None:
    digest = bytes(range(24)) + (1234).to_bytes(8, "big")  # last 8 bytes == the GPU int hash
    ledger = ledger_with(stored(TOKENS[:2], [1234]))
    changes = ledger.apply([stored([], [digest], block_size=0, medium="CPU")])
    assert changes.placements == {KEYS[0]: GPU | OFF}
    assert changes.stats == {"stored": 1}
    assert ledger.engine[1234].cpu == 1
    # GPU eviction leaves the CPU copy; the CPU removal (bytes again) forgets the block.
    assert ledger.apply([removed(1234)]).placements == {KEYS[0]: OFF}
    changes = ledger.apply([removed(digest, medium="CPU")])
    assert changes.placements == {KEYS[0]: 0}
    assert changes.engine == {1234: None}


def test_tokenless_store_of_unknown_hash_is_counted_and_ignored() -> None:
    ledger = ReplicaLedger("r1", TINY)
    changes = ledger.apply([stored([], [b"\x01" * 32, 77], block_size=16, medium="CPU")])
    assert changes.stats == {"tokenless_unknown": 2}
    assert changes.placements == {}


def test_remove_from_a_tier_the_block_is_not_in_is_unbalanced() -> None:
    ledger = ledger_with(stored(TOKENS[:2], [1]))
    assert ledger.apply([removed(1, medium="CPU")]).stats == {"unbalanced_remove": 1}
    assert held(ledger) == {KEYS[0]: GPU}


@pytest.mark.parametrize(
    ("fields", "indexed"),
    [
        pytest.param({}, True, id="no-group"),
        pytest.param({"group_idx": 0}, True, id="group-0"),
        pytest.param({"group_idx": 1}, False, id="group-1"),
        pytest.param({"group_idx": 1, "kv_cache_spec_kind": "full_attention"}, True, id="full-g1"),
        pytest.param({"group_idx": 0, "kv_cache_spec_kind": "mla_attention"}, True, id="mla"),
        pytest.param({"group_idx": 0, "kv_cache_spec_kind": "sliding_window"}, False, id="swa"),
        pytest.param({"kv_cache_spec_kind": "mamba"}, False, id="mamba"),
        pytest.param(
            {"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 4096},
            False,
            id="swa-with-window",
        ),
    ],
)
def test_only_full_attention_groups_are_indexed(fields: dict[str, Any], indexed: bool) -> None:
    changes = ReplicaLedger("r1", TINY).apply([stored(TOKENS[:2], [1], **fields)])
    if indexed:
        assert changes.placements == {KEYS[0]: GPU}
    else:
        assert changes.placements == {}
        assert changes.stats == {"skipped_group": 1}


def test_removal_of_another_group_is_skipped() -> None:
    ledger = ledger_with(stored(TOKENS[:2], [1]), stored(TOKENS[:2], [1], group_idx=1))
    assert ledger.apply([removed(1, group_idx=1)]).stats == {"skipped_group": 1}
    assert held(ledger) == {KEYS[0]: GPU}


def test_block_size_and_token_count_mismatches_are_counted() -> None:
    ledger = ReplicaLedger("r1", TINY)
    assert ledger.apply([stored(TOKENS[:4], [1], block_size=4)]).stats == {"block_size_mismatch": 1}
    assert ledger.apply([stored(TOKENS[:3], [1, 2])]).stats == {"token_count_mismatch": 2}
    assert len(ledger) == 0


def test_all_blocks_cleared_in_the_middle_of_a_batch() -> None:
    ledger = ledger_with(stored(TOKENS[:2], [1]))
    changes = ledger.apply(
        [stored(TOKENS[2:4], [2], parent=1), AllBlocksCleared(), stored(TOKENS[4:6], [9])]
    )
    assert changes.cleared
    assert changes.stats == {"stored": 2, "cleared": 1}
    key9 = block_keys(TOKENS[4:6], TINY)[0]
    assert changes.placements == {KEYS[0]: 0, KEYS[1]: 0, key9: GPU}
    assert changes.engine[1] is None and changes.engine[2] is None
    assert changes.engine[9] == EngineBlock(key9, gpu=1)
    assert held(ledger) == {key9: GPU}
    # The pre-clear hashes are gone: their parent link no longer resolves.
    assert ledger.apply([stored(TOKENS[4:6], [3], parent=2)]).stats == {"orphan": 1}


def test_clear_forgets_orphans_too() -> None:
    ledger = ledger_with(stored(TOKENS[2:4], [5], parent=99))
    changes = ledger.clear()
    assert changes.cleared and changes.placements == {}
    assert ledger.apply([removed(5)]).stats == {"unknown_remove": 1}


def test_hash_reused_for_other_tokens_replaces_the_block() -> None:
    ledger = ledger_with(stored(TOKENS[:2], [1]))
    other = block_keys([7, 7], TINY)[0]
    changes = ledger.apply([stored([7, 7], [1])])
    assert changes.stats == {"hash_conflict": 1, "stored": 1}
    assert changes.placements == {KEYS[0]: 0, other: GPU}
    assert held(ledger) == {other: GPU}


def test_lora_and_extra_keys_feed_the_block_key() -> None:
    ledger = ledger_with(
        stored(TOKENS[:2], [1], lora_name="adapter"),
        stored(TOKENS[:2], [2], extra_keys=[["salt"]]),
    )
    lora_key = block_keys(TOKENS[:2], Namespace("m", 2, "adapter"))[0]
    salted_key = block_keys(TOKENS[:2], TINY, extra_keys=[("salt",)])[0]
    assert held(ledger) == {lora_key: GPU, salted_key: GPU}
    assert ledger.namespace == TINY


def test_lora_keys_are_the_same_before_and_after_v0_26() -> None:
    # v0.26+ puts the LoRA name first in every block's extra keys; v0.17-v0.25 did not.
    # Both must give the keys a router computes from the adapter's namespace and the salt.
    router = block_keys(TOKENS[:4], Namespace("m", 2, "ad"), extra_keys=[("salt",)])
    old = ledger_with(stored(TOKENS[:4], [1, 2], lora_name="ad", extra_keys=[["salt"], None]))
    new = ledger_with(
        stored(TOKENS[:4], [1, 2], lora_name="ad", extra_keys=[["ad", "salt"], ["ad"]])
    )
    assert held(old) == held(new) == dict.fromkeys(router, GPU)
    # without a salt, v0.26 lists the name alone on every block
    plain = ledger_with(stored(TOKENS[:4], [1, 2], lora_name="ad", extra_keys=[["ad"], ["ad"]]))
    assert held(plain) == dict.fromkeys(block_keys(TOKENS[:4], Namespace("m", 2, "ad")), GPU)


@pytest.mark.parametrize(
    ("lora", "extra", "own"),
    [
        (None, None, None),
        (None, [["s"]], [["s"]]),
        ("ad", None, None),
        ("ad", [["ad", "s"], ["ad"]], [("s",), None]),
        ("ad", [["s"], None], [["s"], None]),  # pre-v0.26: left alone
        ("ad", [["ad"], ["mm", 0]], [["ad"], ["mm", 0]]),  # not every block names it
    ],
)
def test_own_extra_keys(lora: str | None, extra: Any, own: Any) -> None:
    assert own_extra_keys(lora, extra) == own


def test_ledger_namespace_is_the_base_partition() -> None:
    assert ReplicaLedger("r1", Namespace("m", 2, "adapter")).namespace == TINY


def test_unknown_events_are_counted() -> None:
    assert ReplicaLedger("r1", TINY).apply([UnknownEvent("X")]).stats == {"unknown_event": 1}


@pytest.mark.parametrize(
    ("medium", "tier"),
    [
        (None, Tier.GPU),
        ("GPU", Tier.GPU),
        ("gpu", Tier.GPU),
        ("CPU", Tier.CPU),
        ("cpu", Tier.CPU),
        ("CPU_PINNED", Tier.CPU),
        ("STORAGE", Tier.STORAGE),
        ("FS", Tier.STORAGE),  # a medium vLLM does not name: the slowest local tier
    ],
)
def test_tier_of_medium(medium: str | None, tier: Tier) -> None:
    assert tier_of(medium) is tier
    assert tier_of(medium, "LOCAL") is tier
    assert tier_of(medium, "REMOTE") is Tier.REMOTE


def test_every_tier_is_counted_apart_and_a_block_loads_from_its_cheapest() -> None:
    """vLLM's offloading connector stores a GPU block's copy in each of its tiers (tokenless
    events naming the medium, ``locality`` and the tier's ``ownership``) and removes each
    copy alone; the block stays placed while any tier holds it."""
    ledger = ledger_with(stored(TOKENS[:2], [1]))
    tiers: dict[str, Any] = {"medium": "STORAGE", "locality": "LOCAL", "ownership": "tier-2"}
    remote: dict[str, Any] = {"medium": "STORAGE", "locality": "REMOTE", "ownership": "tier-3"}
    ledger.apply(
        [
            stored([], [1], block_size=0, medium="CPU", locality="LOCAL"),
            stored([], [1], block_size=0, **tiers),
            stored([], [1], block_size=0, **remote),
        ]
    )
    assert held(ledger) == {KEYS[0]: GPU | OFF | STORAGE | REMOTE}
    assert ledger.engine[1] == EngineBlock(KEYS[0], gpu=1, cpu=1, storage=1, remote=1)
    steps = [
        (removed(1), OFF | STORAGE | REMOTE),
        (removed(1, medium="CPU", locality="LOCAL"), STORAGE | REMOTE),
        (removed(1, **remote), STORAGE),
        (removed(1, medium="STORAGE", locality="LOCAL"), 0),
    ]
    for event, left in steps:
        assert ledger.apply([event]).placements == {KEYS[0]: left}
    assert not ledger.engine


def test_a_medium_or_locality_vllm_does_not_name_is_counted_and_placed_as_storage() -> None:
    ledger = ledger_with(stored(TOKENS[:2], [1]))
    changes = ledger.apply([stored([], [1], block_size=0, medium="NVME")])
    assert changes.stats == {"unknown_medium": 1, "stored": 1}
    assert held(ledger) == {KEYS[0]: GPU | STORAGE}
    changes = ledger.apply([removed(1, medium="CPU", locality="MARS")])
    assert changes.stats == {"unknown_medium": 1, "unbalanced_remove": 1}


def test_load_round_trip_from_engine_blocks() -> None:
    ledger = ledger_with(
        stored(TOKENS[:4], [1, 2]),
        stored(TOKENS[:2], [1]),
        stored([], [(2).to_bytes(8, "big")], medium="CPU"),
    )
    persisted = [(h, EngineBlock.unpack(b.pack())) for h, b in ledger.engine.items()]
    restored = ReplicaLedger("r1", TINY)
    restored.load(persisted)
    assert held(restored) == held(ledger) == {KEYS[0]: GPU, KEYS[1]: GPU | OFF}
    assert restored.refs == ledger.refs
    # Ref counts survived: block 1 needs two removals, block 2 keeps its CPU copy.
    restored.apply([removed(1), removed(2)])
    assert held(restored) == {KEYS[0]: GPU, KEYS[1]: OFF}
    restored.apply([removed(1)])
    assert held(restored) == {KEYS[1]: OFF}
    # Descendants of restored blocks chain correctly.
    restored.apply([stored(TOKENS[4:6], [3], parent=2)])
    assert restored.tiers(KEYS[2]) == GPU


def test_load_replaces_previous_state() -> None:
    ledger = ledger_with(stored(TOKENS[:2], [1]), stored(TOKENS[2:4], [5], parent=99))
    ledger.load([(2, EngineBlock(KEYS[1], gpu=1))])
    assert held(ledger) == {KEYS[1]: GPU}
    assert not ledger.orphans


@pytest.mark.parametrize(
    "block",
    [
        EngineBlock(0),
        EngineBlock((1 << 64) - 1, 3, 0xFFFF, 7, 0xFFFE),
        EngineBlock(12345, 1, 2, 3, 4),
    ],
)
def test_engine_block_pack_round_trip(block: EngineBlock) -> None:
    packed = block.pack()
    assert len(packed) == ENGINE_VALUE_BYTES
    assert EngineBlock.unpack(packed) == block


def test_engine_block_pack_clamps_huge_ref_counts() -> None:
    assert EngineBlock.unpack(EngineBlock(1, 70000, 0).pack()) == EngineBlock(1, 0xFFFF, 0)


def test_engine_block_of_another_layout_is_refused() -> None:
    with pytest.raises(ValueError, match=f"{ENGINE_VALUE_BYTES} bytes, not 12"):
        EngineBlock.unpack(bytes(12))


def test_lookahead_tokens_feed_the_block_keys_as_the_router_computes_them() -> None:
    """vLLM 0.33 hashes the tokens after each block into it; the ledger's keys are the ones
    a router hashing with ``lookahead`` computes for a prompt that goes on the same way."""
    prompt = [*TOKENS, 50, 51]
    lookahead = [TOKENS[2:3], TOKENS[4:5], TOKENS[6:7], [50]]  # one token after each block
    ledger = ReplicaLedger("r1", TINY)
    changes = ledger.apply([stored(TOKENS, [1, 2, 3, 4], lookahead_token_ids=lookahead)])
    assert changes.stats["stored"] == 4
    assert set(held(ledger)) == set(block_keys(prompt, TINY, lookahead=1))
    assert not set(held(ledger)) & set(KEYS)  # not the keys of blocks hashed without it


def test_inconsistent_lookahead_is_counted_and_not_indexed() -> None:
    # block 0's lookahead must be block 1's first token: 20, not 99
    wrong = [[99], [30]]
    ledger = ReplicaLedger("r1", TINY)
    changes = ledger.apply([stored(TOKENS[:4], [1, 2], lookahead_token_ids=wrong)])
    assert changes.stats["lookahead_mismatch"] == 2 and not held(ledger)
    short = ledger.apply([stored(TOKENS[:4], [1, 2], lookahead_token_ids=[[20]])])
    assert short.stats["lookahead_mismatch"] == 2 and not held(ledger)
