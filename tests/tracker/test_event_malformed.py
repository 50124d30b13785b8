"""Codec tests: malformed, truncated and arbitrary payloads raise DecodeError, nothing else."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.tracker.wire import GOLDEN, TS, U64, pack
from tracker.core import event_codec as codec
from tracker.core.event_codec import decode_batch
from tracker.core.events import EventBatch
from tracker.framework.errors import DecodeError

# ------------------------------------------------------------------ malformed payloads


def _batch_with(event: Any) -> Any:
    return [TS, [event], 0]


GOOD_STORED = ["BlockStored", [1], None, [1, 2], 2, None, "GPU"]


def _stored_with(position: int, value: Any) -> list[Any]:
    event = list(GOOD_STORED)
    event[position] = value
    return event


MALFORMED = [
    pytest.param(b"", "msgpack", id="empty"),
    pytest.param(b"\xc1", "msgpack", id="never-used-opcode"),
    pytest.param(b"not msgpack at all", "msgpack", id="text"),
    pytest.param(pack([TS, [], 0]) + b"\x00", "msgpack", id="trailing-bytes"),
    pytest.param(pack(5), "bad_batch", id="batch-is-int"),
    pytest.param(pack([TS]), "bad_batch", id="batch-too-short"),
    pytest.param(pack(["1700000000.5", [], 0]), "bad_batch", id="ts-string"),
    pytest.param(pack([True, [], 0]), "bad_batch", id="ts-bool"),
    pytest.param(pack([None, [], 0]), "bad_batch", id="ts-nil"),
    pytest.param(pack([TS, {"a": 1}, 0]), "bad_batch", id="events-map"),
    pytest.param(pack([TS, "events", 0]), "bad_batch", id="events-string"),
    pytest.param(pack([TS, [], "0"]), "bad_batch", id="rank-string"),
    pytest.param(pack([TS, [], False]), "bad_batch", id="rank-bool"),
    pytest.param(pack({"ts": TS}), "bad_batch", id="map-batch-without-events"),
    pytest.param(pack(_batch_with(5)), "bad_event", id="event-int"),
    pytest.param(pack(_batch_with([])), "bad_event", id="event-empty-array"),
    pytest.param(pack(_batch_with([1, [1]])), "bad_event", id="event-int-tag"),
    pytest.param(pack(_batch_with({"block_hashes": [1]})), "bad_event", id="map-event-no-type"),
    pytest.param(pack(_batch_with({"type": 1})), "bad_event", id="map-event-int-type"),
    pytest.param(pack(_batch_with(_stored_with(1, ["1"]))), "bad_hash", id="string-hash"),
    pytest.param(pack(_batch_with(_stored_with(1, [True]))), "bad_hash", id="bool-hash"),
    pytest.param(pack(_batch_with(_stored_with(1, [1.0]))), "bad_hash", id="float-hash"),
    pytest.param(pack(_batch_with(_stored_with(1, [float(1 << 64)]))), "bad_hash", id="float-2^64"),
    pytest.param(pack(_batch_with(_stored_with(1, [None]))), "bad_hash", id="nil-hash"),
    pytest.param(pack(_batch_with(_stored_with(1, [b""]))), "bad_hash", id="empty-bytes-hash"),
    pytest.param(pack(_batch_with(_stored_with(2, "1"))), "bad_hash", id="string-parent"),
    pytest.param(pack(_batch_with(_stored_with(2, False))), "bad_hash", id="bool-parent"),
    pytest.param(pack(_batch_with(_stored_with(1, []))), "bad_event", id="block-hashes-empty"),
    pytest.param(pack(_batch_with(_stored_with(1, 1))), "bad_event", id="block-hashes-int"),
    pytest.param(pack(_batch_with(_stored_with(1, None))), "bad_event", id="block-hashes-nil"),
    pytest.param(pack(_batch_with(_stored_with(3, [1.5, 2]))), "bad_event", id="float-token"),
    pytest.param(pack(_batch_with(_stored_with(3, [1, -1]))), "bad_event", id="negative-token"),
    pytest.param(pack(_batch_with(_stored_with(3, [1 << 32, 1]))), "bad_event", id="token-2^32"),
    pytest.param(pack(_batch_with(_stored_with(3, ["1", "2"]))), "bad_event", id="string-token"),
    pytest.param(pack(_batch_with(_stored_with(3, None))), "bad_event", id="token-ids-nil"),
    pytest.param(pack(_batch_with(_stored_with(4, "2"))), "bad_event", id="block-size-string"),
    pytest.param(pack(_batch_with(_stored_with(4, -2))), "bad_event", id="block-size-negative"),
    pytest.param(pack(_batch_with(_stored_with(4, True))), "bad_event", id="block-size-bool"),
    pytest.param(pack(_batch_with(_stored_with(5, "3"))), "bad_event", id="lora-id-string"),
    pytest.param(pack(_batch_with(_stored_with(6, 1))), "bad_event", id="medium-int"),
    pytest.param(pack(_batch_with([*GOOD_STORED, 7])), "bad_event", id="lora-name-int"),
    pytest.param(pack(_batch_with([*GOOD_STORED, None, "x"])), "bad_event", id="extra-keys-str"),
    pytest.param(pack(_batch_with([*GOOD_STORED, None, None, "0"])), "bad_event", id="group-str"),
    pytest.param(pack(_batch_with(["BlockStored", [1], None, [1, 2]])), "bad_event", id="stored-3"),
    pytest.param(pack(_batch_with(["BlockStored"])), "bad_event", id="stored-no-fields"),
    pytest.param(pack(_batch_with(["BlockRemoved"])), "bad_event", id="removed-no-fields"),
    pytest.param(pack(_batch_with(["BlockRemoved", [], "GPU"])), "bad_event", id="removed-empty"),
    pytest.param(pack(_batch_with(["BlockRemoved", [1], 5])), "bad_event", id="removed-medium-int"),
    pytest.param(
        pack(_batch_with({"type": "BlockStored", "block_hashes": [1], "block_size": 1})),
        "bad_event",
        id="map-stored-without-token-ids",
    ),
    pytest.param(
        pack(_batch_with({"type": "BlockRemoved", "medium": "GPU"})),
        "bad_event",
        id="map-removed-without-hashes",
    ),
]


@pytest.mark.parametrize(("payload", "reason"), MALFORMED)
def test_malformed_payload_raises_decode_error(payload: bytes, reason: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode_batch(payload)
    assert info.value.reason == reason


def test_hash_beyond_64_bits_is_rejected() -> None:
    # msgpack cannot carry such an int (old vLLM dropped the batch instead, doc section 5.5);
    # the range check still guards every value that reaches it.
    for value in (1 << 64, -(1 << 63) - 1):
        with pytest.raises(DecodeError) as info:
            codec._check_hash(value, "block_hashes")
        assert info.value.reason == "bad_hash"
    with pytest.raises(OverflowError):
        pack([1 << 64])


TRUNCATED = [v for v in GOLDEN if v.id and v.id.startswith(("vllm-v0.9.0/", "vllm-v0.24.0/"))]


@pytest.mark.parametrize("vector", TRUNCATED)
def test_every_truncation_of_a_golden_payload_is_a_decode_error(vector: Any) -> None:
    payload = bytes.fromhex(vector["payload_hex"])
    for length in range(len(payload)):
        with pytest.raises(DecodeError) as info:
            decode_batch(payload[:length])
        assert info.value.reason == "msgpack", length


_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), U64),
    st.floats(),
    st.text(max_size=4),
    st.binary(max_size=9),
    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "type"]),
)
_value = st.recursive(
    _leaf,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(
            st.sampled_from(["type", "block_hashes", "token_ids", "block_size", "ts", "events"])
            | st.text(max_size=3),
            inner,
            max_size=4,
        )
    ),
    max_leaves=20,
)
_event = st.one_of(
    st.tuples(
        st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]),
        st.lists(_value, max_size=12),
    ).map(lambda t: [t[0], *t[1]]),
    _value,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_value, st.tuples(_value, st.lists(_event, max_size=3), _value).map(list)))
def test_arbitrary_msgpack_decodes_or_raises_decode_error(value: Any) -> None:
    try:
        batch = decode_batch(pack(value))
    except DecodeError as exc:
        assert exc.reason
    else:
        assert isinstance(batch, EventBatch)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=48))
def test_arbitrary_bytes_decode_or_raise_decode_error(payload: bytes) -> None:
    try:
        decode_batch(payload)
    except DecodeError as exc:
        assert exc.reason
