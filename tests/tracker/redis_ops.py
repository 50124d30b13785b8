"""Shared by the RedisIndex tests: engine-like events, their lookups, every index operation."""

from __future__ import annotations

import asyncio

from tests.factories import LLAMA, batch
from tracker.core.blocks import Namespace, block_keys, session_key
from tracker.core.events import BlockRemoved, BlockStored
from tracker.core.index import ReplicaRecord, Route
from tracker.core.redis_index import RedisIndex
from tracker.core.redis_writes import OPS_PER_CALL

SEQ = list(range(1000, 1016))  # 4 blocks
OTHER = list(range(2000, 2016))


def engine_hashes(tokens: list[int]) -> list[int]:
    """Stand-ins for vLLM's chained block hashes (another chain than the index keys)."""
    return block_keys(tokens, Namespace("engine", LLAMA.block_size))


def engine_hash(tokens: list[int], block: int) -> int:
    return engine_hashes(tokens[: (block + 1) * LLAMA.block_size])[block]


def store(tokens: list[int], blocks: range | None = None) -> BlockStored:
    blocks = blocks if blocks is not None else range(len(tokens) // LLAMA.block_size)
    hashes = engine_hashes(tokens[: blocks.stop * LLAMA.block_size])
    parent = hashes[blocks.start - 1] if blocks.start else None
    return BlockStored(
        hashes[blocks.start : blocks.stop],
        parent,
        tokens[blocks.start * LLAMA.block_size : blocks.stop * LLAMA.block_size],
        LLAMA.block_size,
        medium="GPU",
    )


def offload(tokens: list[int], *blocks: int) -> BlockStored:
    return BlockStored([engine_hash(tokens, b) for b in blocks], None, [], 0, medium="CPU")


def remove(tokens: list[int], *blocks: int, medium: str = "GPU") -> BlockRemoved:
    return BlockRemoved([engine_hash(tokens, b) for b in blocks], medium)


async def matches(index: RedisIndex, tokens: list[int]) -> dict[str, tuple[int, int]]:
    found = await index.lookup(LLAMA, block_keys(tokens, LLAMA))
    return {r: (m.blocks, m.gpu_blocks) for r, m in found.items()}


async def exercise(index: RedisIndex) -> None:
    """Every index operation, including multi-call writes and a restore."""
    big = list(range(4 * (OPS_PER_CALL + 1)))
    await index.apply("r1", LLAMA, batch(store(SEQ), offload(SEQ, 0)), 1)
    await index.apply("r2", LLAMA, batch(store(big)), 1)
    await index.apply("r1", LLAMA, batch(remove(SEQ, 3)), 2)
    assert await matches(index, SEQ) == {"r1": (3, 3)}
    assert (await index.lookup(LLAMA, block_keys(big, LLAMA)))["r2"].blocks == OPS_PER_CALL + 1
    assert await index.last_seq("r1", LLAMA) == 2
    keys, session = block_keys(SEQ, LLAMA), session_key(LLAMA, "agent")
    for replica in ("r1", "r2"):  # a session routed, then moved
        route = Route(replica, keys, 5, [keys[0], session], 5, session=session, session_ttl_s=5)
        await index.route(LLAMA, route)
    survey = await index.survey(LLAMA, keys, session=session_key(LLAMA, "another"))
    assert survey.sessions == {"r2": 1} and set(survey.session) == set()
    await index.register(ReplicaRecord(id="r1", model="llama", block_size=4, ttl_s=0.01))
    assert [r.id for r in await index.replicas()] == ["r1"]
    await asyncio.sleep(0.05)
    assert [r.id for r in await index.reap()] == ["r1"]
    await index.register(ReplicaRecord(id="r2", model="llama", block_size=4))
    await index.deregister("r2")
    await index.clear("r2", LLAMA)
    await index.forget("r1", LLAMA)
    await index.apply("r3", LLAMA, batch(store(OTHER)), 1)
    restored = RedisIndex(index.client)
    assert await restored.block_count("r3", LLAMA) == 4
