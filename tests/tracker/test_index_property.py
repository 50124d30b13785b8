"""Property: any event stream gives the lookups of a tiny reference model, on every backend.

The model is a dict ``replica -> {token prefix: [gpu copies, offload copies]}``: a replica
holds a block while it has a copy in any tier, a store whose parent block the replica does not
hold is an orphan (ignored), and a lookup matches, per replica, the longest run of held
blocks from the start of the chain.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import redis
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.factories import TINY, batch
from tracker.core.blocks import block_keys
from tracker.core.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from tracker.core.index import BlockIndex
from tracker.core.memory_index import MemoryIndex
from tracker.core.redis_index import RedisIndex

REPLICAS = ("r0", "r1", "r2")
Prefix = tuple[tuple[int, int], ...]  # a chain of blocks, each two token ids


def engine_hash(prefix: Prefix) -> int:
    return xxhash.xxh3_64_intdigest(repr(prefix).encode())


def flat(prefix: Prefix) -> list[int]:
    return [t for block in prefix for t in block]


# ------------------------------------------------------------------ operations

# Three chains over two distinct blocks: eight prefixes, so stores, offloads and removals of
# the same blocks meet often, and chains share and diverge.
_A, _B = (0, 0), (1, 1)
POOL: tuple[Prefix, ...] = ((_A, _B, _A), (_A, _A, _B), (_B, _B, _A))
# Longer chains for short segments (of 2 and 3 blocks): several segments per chain, chains
# that part inside a segment, removals from the middle of a segment held whole.
LONG_POOL: tuple[Prefix, ...] = (
    (_A, _B, _A, _A, _B, _A, _B),
    (_A, _B, _A, _B, _B, _A, _A),
    (_B, _A, _A, _B, _A, _B, _B),
)


def _prefixes(pool: tuple[Prefix, ...]) -> st.SearchStrategy[Prefix]:
    return st.tuples(st.sampled_from(pool), st.integers(1, len(pool[0]))).map(
        lambda t: t[0][: t[1]]
    )


@dataclass(frozen=True)
class Store:
    sequence: Prefix
    start: int
    count: int


# A tier as the model names it -> vLLM's (medium, locality) for it.
WIRE: dict[str, tuple[str, str | None]] = {
    "GPU": ("GPU", None),
    "CPU": ("CPU", "LOCAL"),
    "STORAGE": ("STORAGE", None),
    "REMOTE": ("STORAGE", "REMOTE"),
}
SLOTS = list(WIRE)


@dataclass(frozen=True)
class Offload:
    prefix: Prefix
    tier: str = "CPU"


@dataclass(frozen=True)
class Remove:
    prefix: Prefix
    medium: str  # a key of WIRE


@dataclass(frozen=True)
class Cleared:
    pass


@dataclass(frozen=True)
class Step:
    """One replica's batch; ``clear_first`` calls ``index.clear()`` (the resync path) before."""

    replica: str
    ops: list[Any]
    clear_first: bool = False


@st.composite
def _store(draw: st.DrawFn, pool: tuple[Prefix, ...]) -> Store:
    sequence = draw(st.sampled_from(pool))
    starts = st.integers(0, len(sequence) - 1)
    if pool is LONG_POOL:  # mostly whole chains: segments held whole, then holes in them
        starts = st.just(0) | starts
    start = draw(starts)
    return Store(sequence, start, draw(st.integers(1, len(sequence) - start)))


_KINDS = ["store"] * 3 + ["offload"] * 2 + ["remove"] * 3 + ["cleared"]


@st.composite
def _scenarios(draw: st.DrawFn, pool: tuple[Prefix, ...] = POOL) -> list[Step]:
    """Batches over a few replicas; offloads and removals mostly hit blocks stored before."""
    touched: dict[str, list[Prefix]] = {r: [] for r in REPLICAS}
    steps = []
    for _ in range(draw(st.integers(1, 30))):
        replica = draw(st.sampled_from(REPLICAS))
        ops: list[Any] = []
        for _ in range(draw(st.integers(1, 3))):
            kind = draw(st.sampled_from(_KINDS))
            if kind == "store":
                store = draw(_store(pool))
                ops.append(store)
                touched[replica] += [
                    store.sequence[: b + 1] for b in range(store.start + store.count)
                ]
            elif kind == "cleared":
                ops.append(Cleared())
            else:
                known = touched[replica]
                from_known = bool(known) and draw(st.booleans())
                prefix = draw(st.sampled_from(known) if from_known else _prefixes(pool))
                if kind == "offload":
                    ops.append(Offload(prefix, draw(st.sampled_from(SLOTS[1:]))))
                else:
                    ops.append(Remove(prefix, draw(st.sampled_from(["GPU", *SLOTS]))))
        steps.append(Step(replica, ops, draw(st.integers(0, 9)) == 0))
    return steps


def to_event(op: Any) -> Event:
    if isinstance(op, Store):
        blocks = range(op.start, op.start + op.count)
        parent = engine_hash(op.sequence[: op.start]) if op.start else None
        return BlockStored(
            [engine_hash(op.sequence[: b + 1]) for b in blocks],
            parent,
            flat(op.sequence[op.start : op.start + op.count]),
            TINY.block_size,
            medium="GPU",
        )
    if isinstance(op, Offload):
        digest = b"\x5a" * 8 + engine_hash(op.prefix).to_bytes(8, "big")
        medium, locality = WIRE[op.tier]
        return BlockStored([digest], None, [], 0, medium=medium, locality=locality)
    if isinstance(op, Remove):
        medium, locality = WIRE[op.medium]
        return BlockRemoved([engine_hash(op.prefix)], medium, locality=locality)
    return AllBlocksCleared()


# ------------------------------------------------------------------ the reference model


@dataclass
class Model:
    held: dict[str, dict[Prefix, list[int]]] = field(
        default_factory=lambda: {r: {} for r in REPLICAS}
    )

    def apply(self, replica: str, op: Any) -> None:
        copies = self.held[replica]
        if isinstance(op, Store):
            if op.start and op.sequence[: op.start] not in copies:
                return  # orphan: the parent is unknown, nothing is indexed
            for b in range(op.start, op.start + op.count):
                copies.setdefault(op.sequence[: b + 1], [0, 0, 0, 0])[0] += 1
        elif isinstance(op, Offload):
            if op.prefix in copies:
                copies[op.prefix][SLOTS.index(op.tier)] += 1
        elif isinstance(op, Remove):
            tier = SLOTS.index(op.medium)
            counts = copies.get(op.prefix)
            if counts is not None and counts[tier] > 0:
                counts[tier] -= 1
                if counts == [0, 0, 0, 0]:
                    del copies[op.prefix]
        else:
            copies.clear()

    def lookup(self, sequence: Prefix) -> dict[str, tuple[int, ...]]:
        """Per replica: its run, then its blocks by the cheapest tier holding each."""
        out = {}
        for replica, copies in self.held.items():
            run, best = 0, [0, 0, 0, 0]
            while run < len(sequence) and sequence[: run + 1] in copies:
                counts = copies[sequence[: run + 1]]
                best[next(i for i, n in enumerate(counts) if n > 0)] += 1
                run += 1
            if run:
                out[replica] = (run, *best)
        return out


# ------------------------------------------------------------------ the property


async def check(
    index: BlockIndex,
    steps: list[Step],
    restart: Callable[[BlockIndex], Awaitable[BlockIndex]] | None = None,
) -> None:
    """Apply ``steps``, then compare every lookup with the model's; ``restart`` replaces the
    index half-way (a tracker restarting over the same Redis: ledgers read back)."""
    model = Model()
    queries: set[Prefix] = {((0, 0), (0, 0), (0, 0), (0, 0)), ((1, 1), (2, 2)), *LONG_POOL}
    for seq, step in enumerate(steps):
        if restart is not None and seq == len(steps) // 2:
            index = await restart(index)
        if step.clear_first:
            model.apply(step.replica, Cleared())
            await index.clear(step.replica, TINY)
        for op in step.ops:
            model.apply(step.replica, op)
            if isinstance(op, Store):
                queries.add(op.sequence)
        events = [to_event(op) for op in step.ops]
        await index.apply(step.replica, TINY, batch(*events), seq)
    for sequence in sorted(queries):
        found = await index.lookup(TINY, block_keys(flat(sequence), TINY))
        got = {
            r: (m.blocks, m.gpu_blocks, m.cpu_blocks, m.storage_blocks, m.remote_blocks)
            for r, m in found.items()
        }
        assert got == model.lookup(sequence), sequence
    for replica in REPLICAS:
        assert await index.block_count(replica, TINY) == len(model.held[replica])
    if restart is not None:
        await index.close()


# Segments of a few blocks put boundaries inside the long pool's chains, so lookups skip
# segments held whole and walk the others (tracker.core.keys.SEGMENT_BLOCKS).
@settings(max_examples=300, deadline=None)
@given(_scenarios(LONG_POOL), st.sampled_from([1, 2, 3]))
def test_memory_index_with_short_segments_matches_model(steps: list[Step], span: int) -> None:
    asyncio.run(check(MemoryIndex(segment_blocks=span), steps))


async def _check_redis_restarting(url: str, steps: list[Step], span: int) -> None:
    async def restart(index: BlockIndex) -> BlockIndex:
        await index.close()
        return RedisIndex.from_url(url, segment_blocks=span)

    await check(RedisIndex.from_url(url, segment_blocks=span), steps, restart)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(steps=_scenarios(LONG_POOL), span=st.sampled_from([2, 3]))
def test_redis_index_with_short_segments_and_a_restart_matches_model(
    redis_url: str, steps: list[Step], span: int
) -> None:
    with redis.Redis.from_url(redis_url) as client:
        client.flushall()
    asyncio.run(_check_redis_restarting(redis_url, steps, span))


@settings(max_examples=300, deadline=None)
@given(_scenarios())
def test_memory_index_matches_model(steps: list[Step]) -> None:
    asyncio.run(check(MemoryIndex(), steps))


async def _check_redis(url: str, steps: list[Step]) -> None:
    index = RedisIndex.from_url(url)
    try:
        await check(index, steps)
    finally:
        await index.close()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(steps=_scenarios())
def test_redis_index_matches_model(redis_url: str, steps: list[Step]) -> None:
    with redis.Redis.from_url(redis_url) as client:
        client.flushall()
    asyncio.run(_check_redis(redis_url, steps))


def test_model_sanity() -> None:
    """The model itself: orphans ignored, duplicates counted, tiers tracked."""
    model = Model()
    seq: Prefix = ((0, 0), (1, 1))
    model.apply("r0", Store(seq, 1, 1))
    assert model.lookup(seq) == {}
    model.apply("r0", Store(seq, 0, 2))
    model.apply("r0", Store(seq, 0, 1))
    model.apply("r0", Remove(seq[:1], "GPU"))
    assert model.lookup(seq) == {"r0": (2, 2, 0, 0, 0)}
    model.apply("r0", Offload(seq[:1]))
    model.apply("r0", Offload(seq[:1], "REMOTE"))
    model.apply("r0", Remove(seq[:1], "GPU"))
    assert model.lookup(seq) == {"r0": (2, 1, 1, 0, 0)}
    model.apply("r0", Remove(seq[1:], "CPU"))
    assert model.lookup(seq) == {"r0": (2, 1, 1, 0, 0)}
    model.apply("r0", Remove(seq[:1], "CPU"))
    assert model.lookup(seq) == {"r0": (2, 1, 0, 0, 1)}


async def test_hand_picked_scenario() -> None:
    seq: Prefix = ((0, 0), (1, 1), (2, 0))
    steps = [
        Step("r0", [Store(seq, 0, 3), Remove(seq[:2], "GPU")]),
        Step("r1", [Store(seq, 0, 1)]),
        Step("r1", [Offload(seq[:1]), Remove(seq[:1], "GPU")]),
        Step("r1", [Offload(seq[:1], "STORAGE"), Remove(seq[:1], "CPU")]),
        Step("r2", [Store(seq, 1, 2)]),
        Step("r0", [Store(seq, 0, 1)], clear_first=True),
        Step("r2", [Store(seq, 0, 3), Cleared(), Store(seq, 0, 2)]),
    ]
    await check(MemoryIndex(), steps)
