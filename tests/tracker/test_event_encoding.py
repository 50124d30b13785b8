"""Codec tests: encoding per wire era, the trip back through decoding, each era's layout."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tracker.wire import TS, U64
from tracker.core import event_codec as codec
from tracker.core.event_codec import NEWEST_ERA, WireEra, decode_batch, encode_batch
from tracker.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    UnknownEvent,
)

# ------------------------------------------------------------------ encode/decode round trip

_hash = st.one_of(st.integers(-(1 << 63), U64), st.binary(min_size=1, max_size=32))
_opt_str = st.none() | st.text(max_size=6)
_opt_int = st.none() | st.integers(0, 1000)
_stored_events = st.builds(
    BlockStored,
    block_hashes=st.lists(_hash, min_size=1, max_size=4),
    parent_block_hash=st.none() | _hash,
    token_ids=st.lists(st.integers(0, (1 << 32) - 1), max_size=8),
    block_size=st.integers(0, 64),
    lora_id=_opt_int,
    medium=_opt_str,
    lora_name=_opt_str,
    extra_keys=st.none()
    | st.lists(st.none() | st.lists(st.text(max_size=3), max_size=2), max_size=3),
    group_idx=_opt_int,
    kv_cache_spec_kind=_opt_str,
    kv_cache_spec_sliding_window=_opt_int,
    locality=_opt_str,
    ownership=_opt_str,
    session_id=_opt_str,
    lookahead_token_ids=st.none()
    | st.lists(st.none() | st.lists(st.integers(0, (1 << 32) - 1), max_size=3), max_size=3),
)
_removed_events = st.builds(
    BlockRemoved,
    block_hashes=st.lists(_hash, min_size=1, max_size=4),
    medium=_opt_str,
    group_idx=_opt_int,
    locality=_opt_str,
    ownership=_opt_str,
)
_batches = st.builds(
    EventBatch,
    ts=st.floats(allow_nan=False),
    events=st.lists(_stored_events | _removed_events | st.just(AllBlocksCleared()), max_size=4),
    data_parallel_rank=st.none() | st.integers(0, 64),
)


def _project(batch: EventBatch, era: WireEra) -> EventBatch:
    """What survives a trip through ``era``: its fields only; no rank before v0.9.1."""

    def keep(event: Event) -> Event:
        if isinstance(event, AllBlocksCleared):
            return event
        names = codec._STORED_FIELDS if isinstance(event, BlockStored) else codec._REMOVED_FIELDS
        allowed = set(codec._fields_for(names, era))
        dropped = {n: None for n, _ in names if n not in allowed}
        return msgspec.structs.replace(event, **dropped)

    rank = batch.data_parallel_rank if era.has_rank else None
    return EventBatch(batch.ts, [keep(e) for e in batch.events], rank)


@settings(max_examples=200, deadline=None)
@given(_batches, st.sampled_from(list(WireEra)))
def test_encode_then_decode_keeps_the_eras_fields(batch: EventBatch, era: WireEra) -> None:
    payload = encode_batch(batch, era)
    assert decode_batch(payload) == _project(batch, era)
    assert encode_batch(decode_batch(payload), era) == payload


def test_map_era_omits_default_fields_array_era_keeps_them() -> None:
    batch = EventBatch(TS, [BlockStored([1], None, [1], 1, medium="GPU")], 0)
    assert msgspec.msgpack.decode(encode_batch(batch, WireEra.V0_24_0))[1][0] == {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [1],
        "block_size": 1,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    assert msgspec.msgpack.decode(encode_batch(batch, WireEra.V0_22_0))[1][0] == [
        "BlockStored",
        [1],
        None,
        [1],
        1,
        None,
        "GPU",
        None,
        None,
        None,
        None,
        None,
    ]


def test_encoding_an_unknown_event_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        encode_batch(EventBatch(TS, [UnknownEvent("X")], 0), WireEra.V0_24_0)


def test_newest_era_encodes_the_new_fields_only_when_set() -> None:
    plain = EventBatch(TS, [BlockStored([1], None, [1], 1, medium="GPU")], 0)
    assert encode_batch(plain, WireEra.V0_26_0) == encode_batch(plain, WireEra.V0_24_0)
    # v0.33's BlockStored has 16 fields with its tag: msgspec keeps a map16 header
    newest = encode_batch(plain, NEWEST_ERA)
    assert newest[11:14] == b"\xde\x00\x08"
    assert decode_batch(newest) == plain
    tiered = BlockRemoved([1], medium="STORAGE", locality="REMOTE", ownership="tier-2")
    wire = msgspec.msgpack.decode(encode_batch(EventBatch(TS, [tiered], 0), NEWEST_ERA))
    assert wire[1][0] == {
        "type": "BlockRemoved",
        "block_hashes": [1],
        "medium": "STORAGE",
        "locality": "REMOTE",
        "ownership": "tier-2",
    }
