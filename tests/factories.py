"""Typed builders of test values: the namespaces tests share, KV events and event batches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from tracker.core.blocks import Namespace
from tracker.core.events import BlockRemoved, BlockStored, Event, EventBatch, ExternalHash

# One namespace per shape. A test that pins the model name or the block size (golden keys,
# a command line's --model, engines serving a model) uses the one whose values it states.

SIM: Final = Namespace("sim", 16)
"""What the router tests' simulated engines serve: ``--model sim``, vLLM's default block size."""

LLAMA: Final = Namespace("llama", 4)
"""Four-token blocks of ``llama``: block keys, index contract and ``kvrouter lookup`` tests."""

SMALL: Final = Namespace("m", 4)
"""Four-token blocks of ``m``: what the tracker tests' engines publish and trackers expect."""

TINY: Final = Namespace("m", 2)
"""Two-token blocks of ``m``: ledger and property tests, where every block is written out."""

LOAD: Final = Namespace("llama", 16)
"""Sixteen-token blocks of ``llama``: the load board tests' partition (its adapters' too)."""

LOAD_OTHER: Final = Namespace("qwen", 16)
"""Another model's partition beside ``LOAD``: the load board tests keep partitions apart."""

TS: Final = 1700000000.0
"""The timestamp of built batches (the index ignores it)."""


def stored(
    tokens: Sequence[int],
    hashes: Sequence[ExternalHash],
    parent: ExternalHash | None = None,
    *,
    block_size: int = 4,
    medium: str | None = "GPU",
    **fields: Any,
) -> BlockStored:
    """A ``BlockStored`` of ``hashes``, whose blocks hold ``tokens``, chained to ``parent``.

    Args:
        tokens: the blocks' tokens, concatenated (empty for a tokenless offload store).
        hashes: the engine's block hashes, one per block.
        parent: the hash of the block before the first one; ``None`` for a root.
        block_size: tokens per block, as the engine reports it.
        medium: where the blocks live; ``None`` as engines before vLLM 0.9 sent (GPU).
        fields: any other ``BlockStored`` field (``lora_name``, ``group_idx``, ...).
    """
    return BlockStored(list(hashes), parent, list(tokens), block_size, medium=medium, **fields)


def removed(*hashes: ExternalHash, medium: str | None = "GPU", **fields: Any) -> BlockRemoved:
    """A ``BlockRemoved`` of ``hashes`` from ``medium``; ``fields`` as ``BlockRemoved`` has."""
    return BlockRemoved(list(hashes), medium, **fields)


def batch(*events: Event, ts: float = TS) -> EventBatch:
    """One engine step's ``events`` as an ``EventBatch`` (data-parallel rank 0)."""
    return EventBatch(ts, list(events), 0)
