"""Codec tests: golden vLLM payloads byte for byte, SGLang variants, malformed input, frames."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import VECTORS
from tracker.core import event_codec as codec
from tracker.core.event_codec import NEWEST_ERA, WireEra, decode_batch, encode_batch, wire_era
from tracker.core.events import (
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    Message,
    UnknownEvent,
    decode_message,
    decode_replay_reply,
    encode_message,
    external_hash_u64,
)
from tracker.framework.errors import DecodeError

U64 = (1 << 64) - 1
END = b"\xff" * 8
SEQ7 = (7).to_bytes(8, "big")
TS = 1700000000.5
pack = msgspec.msgpack.encode

# ------------------------------------------------------------------ golden vectors

GOLDEN_FILES = sorted(VECTORS.glob("vllm-v*.jsonl"))


def _golden() -> list[Any]:
    params = []
    for path in GOLDEN_FILES:
        for line in path.read_text().splitlines():
            if line.strip():
                vector = json.loads(line)
                params.append(pytest.param(vector, id=f"{path.stem}/{vector['name']}"))
    return params


GOLDEN = _golden()
EVENT_TYPES = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved}


def test_golden_vectors_are_present() -> None:
    releases = {p.stem for p in GOLDEN_FILES}
    assert {"vllm-v0.9.0", "vllm-v0.9.1", "vllm-v0.10.2", "vllm-v0.24.0"} <= releases
    assert {"vllm-v0.25.1", "vllm-v0.32.0", "vllm-v0.33.0"} <= releases
    assert len(GOLDEN) >= 85


def _to_json(value: Any) -> Any:
    """A decoded field value in the vectors' JSON notation (bytes as {"hex": ...})."""
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, list | tuple):
        return [_to_json(v) for v in value]
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"hex"}:
        return bytes.fromhex(value["hex"])
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def _event_from_json(raw: dict[str, Any]) -> Event:
    fields = {k: _from_json(v) for k, v in raw.items() if k != "type"}
    if raw["type"] == "AllBlocksCleared":
        return AllBlocksCleared()
    return EVENT_TYPES[raw["type"]](**fields)


@pytest.mark.parametrize("vector", GOLDEN)
def test_golden_decode_matches_listed_batch(vector: dict[str, Any]) -> None:
    batch = decode_batch(bytes.fromhex(vector["payload_hex"]))
    expected = vector["batch"]
    assert batch.ts == expected["ts"]
    assert batch.data_parallel_rank == expected["data_parallel_rank"]
    assert len(batch.events) == len(expected["events"])
    for event, listed in zip(batch.events, expected["events"], strict=True):
        assert type(event).__name__ == listed["type"]
        for name, value in listed.items():
            if name != "type":
                assert _to_json(getattr(event, name)) == value, name
        # Fields this release does not have stay at their default.
        for name in msgspec.structs.fields(event):
            if name.name not in listed:
                assert getattr(event, name.name) is None, name.name


@pytest.mark.parametrize("vector", GOLDEN)
def test_golden_reencode_is_byte_identical(vector: dict[str, Any]) -> None:
    payload = bytes.fromhex(vector["payload_hex"])
    era = WireEra.for_release(vector["tag"])
    assert encode_batch(decode_batch(payload), era) == payload
    # Also from the listed meaning alone, so the encoder does not just echo the decoder.
    listed = vector["batch"]
    batch = EventBatch(
        listed["ts"],
        [_event_from_json(e) for e in listed["events"]],
        listed["data_parallel_rank"],
    )
    assert encode_batch(batch, era) == payload


@pytest.mark.parametrize(
    ("release", "era"),
    [
        ("v0.9.0", WireEra.V0_9_0),
        ("0.9.2", WireEra.V0_9_1),
        ("v0.10.1", WireEra.V0_9_1),
        ("v0.11.0", WireEra.V0_10_2),
        ("v0.13.9", WireEra.V0_10_2),
        ("v0.19.1", WireEra.V0_17_0),
        ("v0.23.0", WireEra.V0_22_0),
        ("v0.25.1", WireEra.V0_24_0),
        ("v0.26.0", WireEra.V0_26_0),
        ("v0.32.0", WireEra.V0_26_0),
        ("v0.33.0", WireEra.V0_33_0),
        ("v0.40.1", WireEra.V0_33_0),
        ("v0.8.5", WireEra.V0_9_0),
    ],
)
def test_era_for_release(release: str, era: WireEra) -> None:
    assert WireEra.for_release(release) is era


def test_era_for_bad_release() -> None:
    with pytest.raises(ValueError, match="release tag"):
        WireEra.for_release("latest")


# ------------------------------------------------------------------ hand-built variants


def _stored(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [1, 2],
        "block_size": 2,
    }
    return {"type": "BlockStored", **base, **fields}


VARIANTS = [
    pytest.param(
        [TS, [["BlockStored", [-5, -(1 << 63)], None, [1, 2, 3, 4], 2, None]], 1],
        EventBatch(TS, [BlockStored([-5, -(1 << 63)], None, [1, 2, 3, 4], 2)], 1),
        id="sglang-5-field-signed-hashes-attn-dp-rank",
    ),
    pytest.param(
        [TS, [["BlockStored", [-7], -5, [9, 9], 2, None, "CPU_PINNED"]], 0],
        EventBatch(TS, [BlockStored([-7], -5, [9, 9], 2, medium="CPU_PINNED")], 0),
        id="sglang-6-field-cpu-pinned",
    ),
    pytest.param(
        [TS, [["BlockStored", [-7], None, [9, 9], 2, None, "GPU", {"cache_salt": "s"}]], 0],
        EventBatch(TS, [BlockStored([-7], None, [9, 9], 2, medium="GPU")], 0),
        id="sglang-0.5.18-metadata-map-where-lora-name-is",
    ),
    pytest.param(
        [TS, [["BlockRemoved", [-7, -5], "CPU_PINNED"]], 3],
        EventBatch(TS, [BlockRemoved([-7, -5], "CPU_PINNED")], 3),
        id="sglang-batched-remove",
    ),
    pytest.param(
        [TS, [["BlockStored", [b"\x01" * 32, b"\x02" * 16], None, [], 0, None, "CPU"]], 0],
        EventBatch(TS, [BlockStored([b"\x01" * 32, b"\x02" * 16], None, [], 0, medium="CPU")], 0),
        id="cpu-offload-bytes-hashes-no-tokens",
    ),
    pytest.param(
        [TS, [["BlockStored", [3], None, [1], 1, None], ["AllBlocksCleared"]]],
        EventBatch(TS, [BlockStored([3], None, [1], 1), AllBlocksCleared()], None),
        id="v0.9.0-batch-without-rank",
    ),
    pytest.param(
        {"ts": TS, "events": [_stored(), {"type": "BlockRemoved", "block_hashes": [1]}]},
        EventBatch(TS, [BlockStored([1], None, [1, 2], 2), BlockRemoved([1])], None),
        id="fully-map-encoded-batch-without-rank",
    ),
    pytest.param(
        {"events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 2, "ts": 3},
        EventBatch(3.0, [AllBlocksCleared()], 2),
        id="fully-map-encoded-batch-int-ts",
    ),
    pytest.param(
        [TS, [["BlockStored", [1], None, [1], 1, None, "GPU", None, None, 0, None, None, "x"]], 0],
        EventBatch(TS, [BlockStored([1], None, [1], 1, medium="GPU", group_idx=0)], 0),
        id="future-array-fields-ignored",
    ),
    pytest.param(
        [TS, [_stored(future_field=1, medium="GPU")], 0, "future batch item"],
        EventBatch(TS, [BlockStored([1], None, [1, 2], 2, medium="GPU")], 0),
        id="future-map-keys-and-batch-items-ignored",
    ),
    pytest.param(
        [TS, [["BlockMoved", 1, 2], {"type": "Teleported", "x": 1}, ["AllBlocksCleared", 5]], 0],
        EventBatch(
            TS, [UnknownEvent("BlockMoved"), UnknownEvent("Teleported"), AllBlocksCleared()], 0
        ),
        id="unknown-tags-are-events-not-errors",
    ),
    pytest.param(
        [TS, [["BlockStored", [U64], U64, [(1 << 32) - 1], 1, None]], 0],
        EventBatch(TS, [BlockStored([U64], U64, [(1 << 32) - 1], 1)], 0),
        id="largest-hash-and-token",
    ),
    pytest.param([TS, [], 0], EventBatch(TS, [], 0), id="empty-batch"),
]


@pytest.mark.parametrize(("wire", "expected"), VARIANTS)
def test_decode_variants(wire: Any, expected: EventBatch) -> None:
    assert decode_batch(pack(wire)) == expected


@pytest.mark.parametrize(
    ("value", "u64"),
    [
        (5, 5),
        (-1, U64),
        (-(1 << 63), 1 << 63),
        (U64, U64),
        (b"\xaa" * 24 + (12345).to_bytes(8, "big"), 12345),
        (bytes(range(32)), int.from_bytes(bytes(range(24, 32)), "big")),
    ],
)
def test_external_hash_u64(value: int | bytes, u64: int) -> None:
    assert external_hash_u64(value) == u64


def test_bytes_digest_and_int_hash_agree() -> None:
    """vLLM's int event hash is the digest's last 8 bytes, so both producers normalize alike."""
    digest = bytes.fromhex("d830de3d" * 7 + "276afc9c")
    assert external_hash_u64(digest) == int.from_bytes(digest, "big") & U64


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


# ------------------------------------------------------------------ frames


def test_live_message_round_trip() -> None:
    frames = encode_message(b"kv-events", 258, b"payload")
    assert frames == [b"kv-events", b"\x00" * 6 + b"\x01\x02", b"payload"]
    assert decode_message(frames) == Message(b"kv-events", 258, b"payload")
    assert decode_message([memoryview(b""), SEQ7, bytearray(b"p")]) == Message(b"", 7, b"p")


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param([SEQ7, b"p"], id="2-frames"),
        pytest.param([b"", b"t", SEQ7, b"p"], id="4-frames"),
        pytest.param([], id="no-frames"),
        pytest.param([b"t", b"\x00" * 7, b"p"], id="seq-7-bytes"),
        pytest.param([b"t", b"\x00" * 9, b"p"], id="seq-9-bytes"),
    ],
)
def test_bad_live_frames(frames: list[bytes]) -> None:
    with pytest.raises(DecodeError) as info:
        decode_message(frames)
    assert info.value.reason == "bad_frames"


@pytest.mark.parametrize(
    ("frames", "expected"),
    [
        pytest.param([SEQ7, b"p"], Message(b"", 7, b"p"), id="old-layout-req"),
        pytest.param([b"", SEQ7, b"p"], Message(b"", 7, b"p"), id="old-layout-dealer"),
        pytest.param([b"kv", SEQ7, b"p"], Message(b"kv", 7, b"p"), id="new-layout-req"),
        pytest.param([b"", b"kv", SEQ7, b"p"], Message(b"kv", 7, b"p"), id="new-layout-dealer"),
        pytest.param([b"", b"", SEQ7, b"p"], Message(b"", 7, b"p"), id="new-dealer-empty-topic"),
        pytest.param([END, b""], None, id="end-old-req"),
        pytest.param([b"", END, b""], None, id="end-old-dealer-or-new-req"),
        pytest.param([b"", b"", END, b""], None, id="end-new-dealer"),
        pytest.param([b"kv", END, b""], None, id="end-new-req-with-topic"),
        pytest.param([SEQ7, b""], None, id="end-empty-payload"),
    ],
)
def test_replay_replies(frames: list[bytes], expected: Message | None) -> None:
    assert decode_replay_reply(frames) == expected
    assert int.from_bytes(END, "big") == REPLAY_END_SEQ


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param([b"p"], id="1-frame"),
        pytest.param([b"", b"", b"", SEQ7, b"p"], id="5-frames"),
        pytest.param([b"x", b"kv", SEQ7, b"p"], id="4-frames-without-delimiter"),
        pytest.param([b"\x00" * 7, b"p"], id="seq-7-bytes"),
        pytest.param([b"", b"kv", b"\x00" * 9, b"p"], id="dealer-seq-9-bytes"),
    ],
)
def test_bad_replay_replies(frames: list[bytes]) -> None:
    with pytest.raises(DecodeError) as info:
        decode_replay_reply(frames)
    assert info.value.reason == "bad_replay"


def test_golden_directory_is_the_shared_one() -> None:
    assert Path(VECTORS).is_dir()


@pytest.mark.parametrize("vector", GOLDEN)
def test_wire_era_is_a_lower_bound_of_the_release(vector: dict[str, Any]) -> None:
    era = wire_era(bytes.fromhex(vector["payload_hex"]))
    assert era is not None
    assert codec._ERA_ORDER[era] <= codec._ERA_ORDER[WireEra.for_release(vector["tag"])]


@pytest.mark.parametrize(
    ("release", "name", "era"),
    [
        ("v0.9.0", "stored_two_blocks_root", WireEra.V0_9_0),
        ("v0.22.0", "stored_two_blocks_root", WireEra.V0_22_0),
        ("v0.25.1", "removed_one", WireEra.V0_24_0),
        ("v0.32.0", "stored_locality_session", WireEra.V0_26_0),
        ("v0.32.0", "removed_remote", WireEra.V0_26_0),
        ("v0.33.0", "stored_lookahead", WireEra.V0_33_0),
    ],
)
def test_wire_era_recognises_each_eras_fields(release: str, name: str, era: WireEra) -> None:
    vector = next(
        v.values[0] for v in GOLDEN if v.values[0]["tag"] == release and v.values[0]["name"] == name
    )
    assert wire_era(bytes.fromhex(vector["payload_hex"])) is era


@pytest.mark.parametrize("payload", [b"", b"\xc1", msgspec.msgpack.encode({"ts": 1})])
def test_wire_era_of_garbage_is_none(payload: bytes) -> None:
    assert wire_era(payload) is None


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
