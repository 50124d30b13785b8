"""Shared by the BlockIndex contract tests: engine-like events over token runs, and lookups."""

from __future__ import annotations

from typing import Any

import xxhash

from tests.factories import LLAMA, batch
from tracker.core.blocks import Namespace, block_keys
from tracker.core.events import BlockRemoved, BlockStored, Event
from tracker.core.index import BlockIndex, Match

SEQ = list(range(1000, 1016))  # 4 blocks
OTHER = list(range(2000, 2016))


def engine_hash(tokens: list[int], block: int, ns: Namespace = LLAMA) -> int:
    """A stand-in for vLLM's hash of block ``block`` of ``tokens`` (any stable function works)."""
    prefix = b"".join(t.to_bytes(4, "little") for t in tokens[: (block + 1) * ns.block_size])
    return xxhash.xxh3_64_intdigest(prefix, seed=7)


def store(
    tokens: list[int],
    blocks: range | None = None,
    *,
    ns: Namespace = LLAMA,
    lora: str | None = None,
) -> BlockStored:
    """GPU BlockStored of ``blocks`` of ``tokens``, chained to the block before them."""
    bs = ns.block_size
    blocks = blocks if blocks is not None else range(len(tokens) // bs)
    parent = engine_hash(tokens, blocks.start - 1, ns) if blocks.start else None
    return BlockStored(
        [engine_hash(tokens, b, ns) for b in blocks],
        parent,
        tokens[blocks.start * bs : blocks.stop * bs],
        bs,
        medium="GPU",
        lora_name=lora,
    )


def offload(
    tokens: list[int], *blocks: int, medium: str = "CPU", locality: str | None = None
) -> BlockStored:
    """Tokenless offload BlockStored with digest-bytes hashes, as vLLM's offload connector
    sends (a placeholder of its tier: no tokens, block size 0)."""
    digests = [b"\xee" * 24 + engine_hash(tokens, b).to_bytes(8, "big") for b in blocks]
    return BlockStored(digests, None, [], 0, medium=medium, locality=locality)


def remove(
    tokens: list[int], *blocks: int, medium: str = "GPU", locality: str | None = None
) -> BlockRemoved:
    return BlockRemoved([engine_hash(tokens, b) for b in blocks], medium, locality=locality)


async def put(
    index: BlockIndex, replica: str, *events: Event, ns: Namespace = LLAMA, seq: Any = None
) -> Any:
    return await index.apply(replica, ns, batch(*events), seq)


async def matches(
    index: BlockIndex, tokens: list[int], ns: Namespace = LLAMA
) -> dict[str, tuple[int, int]]:
    found = await index.lookup(ns, block_keys(tokens, ns))
    for replica, match in found.items():
        assert isinstance(match, Match) and match.replica == replica
        assert match.offload_blocks == match.blocks - match.gpu_blocks
    return {r: (m.blocks, m.gpu_blocks) for r, m in found.items()}
