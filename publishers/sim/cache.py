"""The simulated engine's paged KV cache: vLLM v1's block pool, prefix cache and KV-cache
manager for one full-attention group, the KV events they queue, and an optional CPU tier.

When each event is produced, as vLLM does: docs/architecture.md, "Simulated engine".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, Final

import msgspec

from publishers.sim.block_hashes import TokenSequence, external_hash
from tracker.core.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
)

KV_CACHE_SPEC_KIND: Final = "full_attention"
GROUP_IDX: Final = 0


class CachedBlock(msgspec.Struct, frozen=True):
    """What a prefix-cache entry holds, in the terms a consumer sees in ``BlockStored``."""

    parent_hash: int | None
    token_ids: tuple[int, ...]
    lora_name: str | None
    extra_keys: tuple[Any, ...] | None
    lookahead_token_ids: tuple[int, ...] = ()


class KVBlock:
    """One physical block: reference count and, while cached, its digest and contents."""

    __slots__ = ("block_id", "digest", "entry", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.digest: bytes | None = None
        self.entry: CachedBlock | None = None


class OffloadTier:
    """Blocks kept in host memory after the GPU pool evicted them, least recently used first.

    :param capacity: blocks the tier holds; the oldest is dropped for a new one.
    :param events: the pool's event queue: the tier's events go in the same order as its.
    """

    def __init__(self, capacity: int, events: list[Event]) -> None:
        if capacity <= 0:
            raise ValueError("an offload tier holds at least one block")
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self._events = events

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._blocks

    def keep(self, digest: bytes) -> None:
        """Copy an evicted GPU block here (before the pool announces its removal, so a
        consumer knows the hash when the copy is announced, as the connector stores first)."""
        if digest in self._blocks:
            self._blocks.move_to_end(digest)
            return
        if len(self._blocks) >= self.capacity:
            old, _ = self._blocks.popitem(last=False)
            self._events.append(
                BlockRemoved([external_hash(old)], medium=MEDIUM_CPU, group_idx=GROUP_IDX)
            )
        self._blocks[digest] = None
        self._events.append(
            BlockStored(
                [external_hash(digest)], None, [], 0, medium=MEDIUM_CPU, group_idx=GROUP_IDX
            )
        )

    def loadable(self, digests: Sequence[bytes]) -> int:
        """How many of ``digests``, from the first, the tier holds; those become the most
        recently used."""
        count = 0
        for digest in digests:
            if digest not in self._blocks:
                break
            self._blocks.move_to_end(digest)
            count += 1
        return count

    def clear(self) -> None:
        self._blocks.clear()


class BlockPool:
    """Physical blocks, the LRU free queue and the prefix-cache map; queues KV events.

    :param offload_blocks: size of a CPU tier behind the pool (0: none).
    """

    def __init__(self, num_blocks: int, block_size: int, offload_blocks: int = 0) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Eviction candidates, least recently freed first (vLLM's FreeKVCacheBlockQueue).
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        # digest -> physical copies (block_id -> block), first inserted serves hits
        self._cached: dict[bytes, dict[int, KVBlock]] = {}
        self.events: list[Event] = []
        self.offload = OffloadTier(offload_blocks, self.events) if offload_blocks else None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Distinct block hashes in the prefix-cache map (in use or free)."""
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free, like vLLM)."""
        return 1.0 - len(self._free) / len(self.blocks)

    def lookup(self, digest: bytes) -> KVBlock | None:
        copies = self._cached.get(digest)
        return next(iter(copies.values())) if copies else None

    def take_events(self) -> list[Event]:
        events = list(self.events)
        self.events.clear()  # the offload tier appends to the same list
        return events

    def get_new_blocks(self, count: int) -> list[KVBlock]:
        """Pop ``count`` blocks off the LRU end, evicting their cached hashes."""
        if count > len(self._free):
            raise ValueError(f"cannot allocate {count} blocks, {len(self._free)} free")
        out = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        if block.digest is None:
            return
        copies = self._cached[block.digest]
        del copies[block.block_id]
        if not copies:
            del self._cached[block.digest]
        if self.offload is not None:
            self.offload.keep(block.digest)
        self.events.append(
            BlockRemoved(
                block_hashes=[external_hash(block.digest)], medium=MEDIUM_GPU, group_idx=GROUP_IDX
            )
        )
        block.digest = block.entry = None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVBlock]) -> None:
        """Drop a reference; blocks reaching zero join the queue in the given order."""
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_full_blocks(
        self, seq: TokenSequence, blocks: Sequence[KVBlock], num_cached: int, num_full: int
    ) -> None:
        """Enter ``blocks[num_cached:num_full]`` into the prefix cache; one ``BlockStored``."""
        if num_cached >= num_full:
            return
        size = self.block_size
        parent = external_hash(seq.block_hashes[num_cached - 1]) if num_cached else None
        hashes: list[int] = []
        extras: list[Any] = []
        lookahead: list[list[int] | None] = []
        for i in range(num_cached, num_full):
            block, digest = blocks[i], seq.block_hashes[i]
            extra = seq.extra_keys(i)
            block.digest = digest
            ahead = seq.lookahead_ids(i)
            block.entry = CachedBlock(
                parent_hash=hashes[-1] if hashes else parent,
                token_ids=tuple(seq.token_ids[i * size : (i + 1) * size]),
                lora_name=seq.lora_name,
                extra_keys=extra,
                lookahead_token_ids=tuple(ahead),
            )
            lookahead.append(ahead)
            self._cached.setdefault(digest, {})[block.block_id] = block
            hashes.append(external_hash(digest))
            extras.append(extra)
        self.events.append(
            BlockStored(
                block_hashes=list(hashes),
                parent_block_hash=parent,
                token_ids=seq.token_ids[num_cached * size : num_full * size],
                block_size=size,
                lora_id=seq.lora_id,
                medium=MEDIUM_GPU,
                lora_name=seq.lora_name,
                extra_keys=extras,
                group_idx=GROUP_IDX,
                kv_cache_spec_kind=KV_CACHE_SPEC_KIND,
                lookahead_token_ids=lookahead if seq.lookahead else None,
            )
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every hash if no block is in use; queues ``AllBlocksCleared``."""
        if len(self._free) != len(self.blocks):
            return False
        self._cached.clear()
        for block in self.blocks:
            block.digest = block.entry = None
        if self.offload is not None:
            self.offload.clear()  # AllBlocksCleared empties every tier for a consumer
        self.events.append(AllBlocksCleared())
        return True

    def cached_blocks(self) -> dict[int, CachedBlock]:
        """Every entry of the prefix-cache map, keyed by its event hash."""
        out = {}
        for digest, copies in self._cached.items():
            entry = next(iter(copies.values())).entry
            assert entry is not None
            out[external_hash(digest)] = entry
        return out


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Per-request block tables over a :class:`BlockPool` (vLLM's ``KVCacheManager``)."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_cached: dict[str, int] = {}

    def get_computed_blocks(self, seq: TokenSequence) -> list[KVBlock]:
        """Longest cached prefix of ``seq``; the last token is always recomputed."""
        limit = (seq.num_tokens - 1) // self.block_size
        hits = []
        for digest in seq.block_hashes[:limit]:
            block = self.pool.lookup(digest)
            if block is None:
                break
            hits.append(block)
        return hits

    def offloaded_blocks(self, seq: TokenSequence, hits: int) -> int:
        """Blocks right after ``hits`` GPU hits that the CPU tier can load (the connector's
        external hit: it continues the GPU prefix, and the last token is still computed)."""
        offload = self.pool.offload
        if offload is None:
            return 0
        limit = (seq.num_tokens - 1) // self.block_size
        return offload.loadable(seq.block_hashes[hits:limit])

    def allocate_slots(
        self,
        request_id: str,
        seq: TokenSequence,
        num_new_tokens: int,
        num_computed_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
    ) -> bool:
        """Reserve slots for ``num_new_tokens`` after ``num_computed_tokens`` (hits included).

        Returns False, changing nothing, when the free queue is too short; otherwise takes
        the hits, allocates new blocks (evicting) and caches the blocks this step fills.
        """
        blocks = self._blocks.setdefault(request_id, [])
        wanted = cdiv(num_computed_tokens + num_new_tokens, self.block_size)
        new = wanted - len(blocks) - len(new_computed_blocks)
        evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(new, 0) + evictable > self.pool.num_free:
            if not blocks:
                del self._blocks[request_id]
            return False
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
        self._num_cached.setdefault(request_id, len(blocks))
        if new > 0:
            blocks.extend(self.pool.get_new_blocks(new))
        num_full = min(num_computed_tokens + num_new_tokens, seq.num_tokens) // self.block_size
        num_full = min(num_full, len(seq.block_hashes))  # lookahead: hashed blocks only
        num_cached = self._num_cached[request_id]
        if num_full > num_cached:
            self.pool.cache_full_blocks(seq, blocks, num_cached, num_full)
            self._num_cached[request_id] = num_full
        return True

    def free(self, request_id: str) -> None:
        """Release a finished, aborted or preempted request's blocks, tail first."""
        blocks = self._blocks.pop(request_id, [])
        self._num_cached.pop(request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def num_blocks(self, request_id: str) -> int:
        return len(self._blocks.get(request_id, ()))
