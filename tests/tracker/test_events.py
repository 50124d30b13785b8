"""Codec tests: golden vLLM payloads decoded and re-encoded byte for byte, and their eras."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.conftest import VECTORS
from tests.tracker.wire import GOLDEN, GOLDEN_FILES
from tracker.core import event_codec as codec
from tracker.core.event_codec import WireEra, decode_batch, encode_batch, wire_era
from tracker.core.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch

# ------------------------------------------------------------------ golden vectors

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
