"""Codec tests: hand-built SGLang and other producers' variants, and hash normalization."""

from __future__ import annotations

from typing import Any

import pytest

from tests.tracker.wire import TS, U64, pack
from tracker.core.event_codec import decode_batch
from tracker.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    UnknownEvent,
    external_hash_u64,
)

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
