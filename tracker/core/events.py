"""vLLM / SGLang KV-event wire types and ZeroMQ message framing; pure, no I/O.

The wire contract (see docs/architecture.md and ../shared/docs/vllm-kv-events.md):

* a live message is three ZeroMQ frames ``[topic, seq (8 bytes big-endian), payload]``;
* a replay stream ends with a marker whose sequence is ``0xFF`` x 8;
* the payload is msgpack of an :class:`EventBatch` (its per-era layouts and codec live in
  :mod:`tracker.core.event_codec`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from tracker.framework.errors import DecodeError

ExternalHash = int | bytes
"""A block hash as the engine puts it on the wire: uint64, signed int64, or digest bytes."""

U64_MASK: Final = (1 << 64) - 1
REPLAY_END_SEQ: Final = U64_MASK
"""Sequence value of the end-of-replay marker (``0xFF`` x 8)."""

MEDIUM_GPU: Final = "GPU"
MEDIUM_CPU: Final = "CPU"
MEDIUM_STORAGE: Final = "STORAGE"
LOCALITY_LOCAL: Final = "LOCAL"
LOCALITY_REMOTE: Final = "REMOTE"
LOCALITIES: Final = frozenset({LOCALITY_LOCAL, LOCALITY_REMOTE})
"""vLLM's ``Locality`` values (v0.26+): where an offload tier's store is, seen from the engine."""


class BlockStored(msgspec.Struct, frozen=True):
    """Blocks became full and cached; ``token_ids`` holds their tokens, concatenated."""

    block_hashes: list[ExternalHash]
    parent_block_hash: ExternalHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int] | None] | None = None
    """Per block, the tokens past it that the engine folded into its hash (v0.33+)."""


class BlockRemoved(msgspec.Struct, frozen=True):
    """Cached blocks were evicted (one physical block each; duplicates are possible)."""

    block_hashes: list[ExternalHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True):
    """The engine reset its whole prefix cache."""


class UnknownEvent(msgspec.Struct, frozen=True):
    """An event whose tag this codec does not know; skipped by the index, counted."""

    tag: str


Event = BlockStored | BlockRemoved | AllBlocksCleared | UnknownEvent


class EventBatch(msgspec.Struct, frozen=True):
    """One published engine step: its timestamp, events and data-parallel rank."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


@dataclass(frozen=True, slots=True)
class Message:
    """A live or replayed message: topic, sequence number and still-encoded payload."""

    topic: bytes
    seq: int
    payload: bytes


def encode_message(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The three ZeroMQ frames of a live message."""
    return [topic, seq.to_bytes(8, "big"), payload]


def decode_message(frames: Sequence[bytes]) -> Message:
    """Split a live ``[topic, seq, payload]`` message; the payload is decoded separately."""
    if len(frames) != 3:
        raise DecodeError("bad_frames", f"expected 3 frames, got {len(frames)}")
    topic, seq, payload = frames
    if len(seq) != 8:
        raise DecodeError("bad_frames", f"sequence frame has {len(seq)} bytes")
    return Message(bytes(topic), int.from_bytes(seq, "big"), bytes(payload))


def decode_replay_reply(frames: Sequence[bytes]) -> Message | None:
    """One message from a replay stream, or ``None`` for the end marker.

    Accepts both layouts vLLM has shipped, ``[seq, payload]`` and ``[topic, seq, payload]``,
    optionally behind the empty delimiter frame a DEALER socket receives.
    """
    parts = list(frames)
    if len(parts) == 4 and parts[0] == b"":
        parts = parts[1:]  # DEALER delimiter + new layout
    # Three frames are either [delimiter, seq, payload] (DEALER, old layout) or
    # [topic, seq, payload] (REQ, new layout): both put the sequence in the middle.
    if len(parts) == 2:
        topic, seq, payload = b"", parts[0], parts[1]
    elif len(parts) == 3:
        topic, seq, payload = parts
    else:
        raise DecodeError("bad_replay", f"unexpected {len(frames)}-frame replay reply")
    if len(seq) != 8:
        raise DecodeError("bad_replay", f"sequence frame has {len(seq)} bytes")
    number = int.from_bytes(seq, "big")
    if number == REPLAY_END_SEQ or not payload:
        return None
    return Message(bytes(topic), number, bytes(payload))


def external_hash_u64(value: ExternalHash) -> int:
    """Normalize any wire hash to vLLM's unsigned 64-bit event form.

    Ints (signed or unsigned) are masked; digest bytes keep their last 8 bytes big-endian,
    which is exactly how vLLM derives its int hashes, so int and bytes producers agree.
    """
    if isinstance(value, int):
        return value & U64_MASK
    return int.from_bytes(value[-8:], "big")
