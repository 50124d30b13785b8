"""Per-replica interpretation of KV events: engine hash -> block key mapping and ref counts.

A :class:`ReplicaLedger` turns one replica's event stream into idempotent placements
``(block key, tiers)`` (``tiers == 0`` means the replica no longer holds the block), changes
to its engine map, and its *segments*: for each aligned run of ``SEGMENT_BLOCKS`` blocks of a
chain that the replica holds whole, how many of them load from each tier, keyed by the run's
last block (lookups skip such a run in one read). Both index backends share it, so they
agree by construction; they differ only in where placements are stored.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Final, TypeAlias

from tracker.core.blocks import Namespace, block_keys, own_extra_keys
from tracker.core.events import (
    LOCALITIES,
    LOCALITY_REMOTE,
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    external_hash_u64,
)
from tracker.core.keys import ENGINE_VALUE_BYTES, SEGMENT_BLOCKS, TIER_BITS

logger = logging.getLogger(__name__)

_FULL_ATTENTION_KINDS: Final = frozenset({"full_attention", "mla_attention", "sink_full_attention"})


class Tier(enum.IntFlag):
    """Where a replica holds a block, cheapest to reuse first: its GPU pool, the CPU memory
    of its host, local storage, or a store reached over the network (vLLM's ``medium`` and
    ``locality``). A block may be in several at once; its lowest bit is where it loads from."""

    GPU = 1
    CPU = 2
    STORAGE = 4
    REMOTE = 8


TIERS: Final = (Tier.GPU, Tier.CPU, Tier.STORAGE, Tier.REMOTE)
"""Every tier, in the order of the bits (and of :class:`EngineBlock`'s counts)."""
assert len(TIERS) == TIER_BITS, "the Redis layout has a bit per tier"
_TIER_SLOT: Final = {tier: i for i, tier in enumerate(TIERS)}
KNOWN_MEDIUMS: Final = frozenset({MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE})
_BEST: Final = tuple(-1 if not t else (t & -t).bit_length() - 1 for t in range(1 << TIER_BITS))
"""Per tier mask: the slot of its cheapest tier (where a lookup counts the block), -1: none."""

Segment: TypeAlias = tuple[int, int, int, int]
"""A segment held whole: how many of its blocks load from each tier, in :data:`TIERS` order."""


def tier_of(medium: str | None, locality: str | None = None) -> Tier:
    """The tier of a block event's ``medium`` and ``locality``.

    vLLM leaves ``medium`` unset before v0.10.2 and says ``"GPU"`` for its own pool, ``"CPU"``
    and (v0.26+) ``"STORAGE"`` for its offload tiers, whose ``locality`` may be ``"REMOTE"``
    (a store other hosts share, e.g. a network file system). A medium this release does not
    know counts as storage: the slowest local tier, so a hit there is never overrated.
    """
    if locality is not None and locality.upper() == LOCALITY_REMOTE:
        return Tier.REMOTE
    if medium is None:
        return Tier.GPU
    name = medium.upper()
    if name == MEDIUM_GPU:
        return Tier.GPU
    if name.startswith(MEDIUM_CPU):  # "CPU", and "CPU_PINNED" of early connectors
        return Tier.CPU
    return Tier.STORAGE


def _known(event: BlockStored | BlockRemoved) -> bool:
    """Whether the event's medium and locality are ones vLLM documents (else it is counted)."""
    medium = event.medium.upper() if event.medium is not None else MEDIUM_GPU
    known = medium in KNOWN_MEDIUMS or medium.startswith(MEDIUM_CPU)
    return known and (event.locality is None or event.locality.upper() in LOCALITIES)


@dataclass(slots=True)
class EngineBlock:
    """One engine hash of a replica: the block key it maps to and its references per tier."""

    key: int
    gpu: int = 0
    cpu: int = 0
    storage: int = 0
    remote: int = 0
    parent: int = field(default=0, compare=False)
    """The key of the block before this one in its chain (0 at depth 0)."""
    depth: int = field(default=0, compare=False)
    """The block's position in its chain (0: the first block)."""

    def counts(self) -> tuple[int, int, int, int]:
        """References per tier, in :data:`TIERS` order."""
        return self.gpu, self.cpu, self.storage, self.remote

    def add(self, tier: Tier, delta: int) -> None:
        if tier is Tier.GPU:
            self.gpu += delta
        elif tier is Tier.CPU:
            self.cpu += delta
        elif tier is Tier.STORAGE:
            self.storage += delta
        else:
            self.remote += delta

    def count(self, tier: Tier) -> int:
        if tier is Tier.GPU:
            return self.gpu
        if tier is Tier.CPU:
            return self.cpu
        return self.storage if tier is Tier.STORAGE else self.remote

    def held(self) -> bool:
        return self.gpu > 0 or self.cpu > 0 or self.storage > 0 or self.remote > 0

    def pack(self) -> bytes:
        """Block key (8 bytes), references per tier (2 bytes each, saturating), the parent's
        key (8 bytes) and the depth (4 bytes): what a restarted tracker rebuilds from."""
        out = self.key.to_bytes(8, "big")
        for count in self.counts():
            out += min(count, 0xFFFF).to_bytes(2, "big")
        return out + self.parent.to_bytes(8, "big") + self.depth.to_bytes(4, "big")

    @classmethod
    def unpack(cls, value: bytes) -> EngineBlock:
        if len(value) != ENGINE_VALUE_BYTES:
            raise ValueError(f"an engine map value is {ENGINE_VALUE_BYTES} bytes, not {len(value)}")
        end = 8 + 2 * TIER_BITS
        counts = (int.from_bytes(value[i : i + 2], "big") for i in range(8, end, 2))
        block = cls(int.from_bytes(value[:8], "big"), *counts)
        block.parent = int.from_bytes(value[end : end + 8], "big")
        block.depth = int.from_bytes(value[end + 8 :], "big")
        return block


def tiers_of(refs: list[int]) -> int:
    """Bitmask of the tiers whose reference count is positive (plain int: per block event)."""
    return (refs[0] > 0) | (refs[1] > 0) << 1 | (refs[2] > 0) << 2 | (refs[3] > 0) << 3


@dataclass(slots=True)
class LedgerChanges:
    """The effect of one batch: final tiers per touched key, engine map upserts/deletes."""

    placements: dict[int, int] = field(default_factory=dict)
    engine: dict[int, EngineBlock | None] = field(default_factory=dict)
    segments: dict[int, Segment | None] = field(default_factory=dict)
    """Per segment (its last block's key): its counts per tier held whole now, None: not."""
    ends: set[int] = field(default_factory=set)
    """Segments' last blocks the batch stored or removed (or moved to another tier): the
    engine's word on them ends the routers' predictions of their segments on this replica."""
    stats: Counter[str] = field(default_factory=Counter)
    cleared: bool = False


def _with_lookahead(event: BlockStored, blocks: int) -> tuple[list[int], int | None]:
    """The tokens the event's block keys cover and how many follow each block: its own
    tokens, plus the last block's lookahead tokens when vLLM hashed them (every block's
    lookahead is the next one's first tokens, checked). ``None``: inconsistent lookahead."""
    lists = event.lookahead_token_ids
    if lists is None:
        return event.token_ids, 0
    if len(lists) != blocks or any(ids is None for ids in lists):
        return event.token_ids, None
    size, width = event.block_size, len(lists[0] or ())
    tokens = event.token_ids
    for i, ids in enumerate(lists):
        if len(ids or ()) != width:
            return tokens, None
        following = tokens[(i + 1) * size : (i + 1) * size + width]
        if i + 1 < blocks and list(ids or ())[: len(following)] != following:
            return tokens, None
    last = list(lists[-1] or ())
    # a lookahead longer than a block reaches past the next one: the last list has it all
    return [*tokens, *last], width


class ReplicaLedger:
    """What one replica holds, derived only from its events.

    Args:
        replica_id: the replica's stable id.
        namespace: the index partition (model and block size) the replica serves.
        segment_blocks: blocks per segment (the index's layout; tests use short ones).
    """

    def __init__(
        self, replica_id: str, namespace: Namespace, *, segment_blocks: int = SEGMENT_BLOCKS
    ) -> None:
        self.replica_id = replica_id
        self.namespace = namespace.base()
        self.segment_blocks = segment_blocks
        self.engine: dict[int, EngineBlock] = {}
        self.refs: dict[int, list[int]] = {}
        self.orphans: Counter[int] = Counter()
        # refs[key] is [GPU, CPU, storage, remote references, parent key, depth]; per key, its
        # held children (a segment's blocks and the segment ends a change of one of them
        # touches are found through these)
        self.child: dict[int, int] = {}  # a key's first held child (plain ints: no GC load)
        self.children: dict[int, set[int]] = {}  # ... and its others, when it has several
        self.segments: dict[int, Segment] = {}
        """Every segment the replica holds whole now, by its last block's key."""
        self._dirty: set[int] = set()
        self._ends: set[int] = set()

    def __len__(self) -> int:
        return len(self.refs)

    def tiers(self, key: int) -> int:
        """Bitmask of :class:`Tier` values (plain int: this runs once per block event)."""
        refs = self.refs.get(key)
        return 0 if refs is None else tiers_of(refs)

    def placements(self) -> Iterator[tuple[int, int]]:
        """Every block the replica holds, with its tiers."""
        for key in self.refs:
            yield key, self.tiers(key)

    def load(self, entries: Iterable[tuple[int, EngineBlock]]) -> None:
        """Rebuild from a persisted engine map (tracker restart), segments included (the
        index holds them as the engine map says: both are written by the same call)."""
        self._forget()
        for engine_hash, block in entries:
            self.engine[engine_hash] = block
            refs = self.refs.get(block.key)
            if refs is None:
                refs = self.refs[block.key] = [0, 0, 0, 0, block.parent, block.depth]
                self._link(block.key, block.parent, block.depth)
            for slot, count in enumerate(block.counts()):
                refs[slot] += count
        span = self.segment_blocks
        for key, refs in self.refs.items():
            if refs[5] % span == span - 1:
                segment = self._segment(key)
                if segment is not None:
                    self.segments[key] = segment

    def apply(self, events: Iterable[Event]) -> LedgerChanges:
        """Apply one batch's events in order and return what changed."""
        changes = LedgerChanges()
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(event, changes)
            elif isinstance(event, BlockRemoved):
                self._removed(event, changes)
            elif isinstance(event, AllBlocksCleared):
                self.clear(changes)
                changes.stats["cleared"] += 1
            else:
                changes.stats["unknown_event"] += 1
        self._settle(changes)
        return changes

    def clear(self, changes: LedgerChanges | None = None) -> LedgerChanges:
        """Forget everything; the returned changes remove every placement."""
        changes = changes if changes is not None else LedgerChanges()
        for key in self.refs:
            changes.placements[key] = 0
        for engine_hash in self.engine:
            changes.engine[engine_hash] = None
        for key in self.segments:
            changes.segments[key] = None
        changes.cleared = True
        self._forget()
        return changes

    def _forget(self) -> None:
        self.engine.clear()
        self.refs.clear()
        self.orphans.clear()
        self.child.clear()
        self.children.clear()
        self.segments.clear()
        self._dirty.clear()
        self._ends.clear()

    def segment_changes(self) -> dict[int, Segment | None]:
        """Every segment held whole, as changes (a replica's state written again whole)."""
        return {key: segment for key, segment in self.segments.items()}

    # ------------------------------------------------------------------ segments

    def _link(self, key: int, parent: int, depth: int) -> None:
        """``key`` (at ``depth``) is held: a child of ``parent``."""
        if depth:
            first = self.child.get(parent)
            if first is None:
                self.child[parent] = key
            elif first != key:
                self.children.setdefault(parent, set()).add(key)

    def _unlink(self, key: int, parent: int, depth: int) -> None:
        """``key`` is no longer held."""
        if not depth:
            return
        more = self.children.get(parent)
        if self.child.get(parent) == key:
            if more:
                self.child[parent] = more.pop()
            else:
                del self.child[parent]
        elif more:
            more.discard(key)
        if more is not None and not more:
            del self.children[parent]

    def _children_of(self, key: int) -> tuple[int, ...]:
        first = self.child.get(key)
        if first is None:
            return ()
        more = self.children.get(key)
        return (first, *more) if more else (first,)

    def _touched(self, key: int) -> None:
        """``key`` (held, linked) changed where a lookup counts it: the segment ends it is in
        are due for :meth:`_settle` (the held ones: a segment not held whole has no entry)."""
        span = self.segment_blocks
        below = span - 1 - self.refs[key][5] % span  # levels down to its segment's end
        if not below:
            self._dirty.add(key)
            self._ends.add(key)
            return
        level: Iterable[int] = self._children_of(key)
        if not level:  # the usual: a chain stored in order, its blocks' children later
            return
        for _ in range(below - 1):
            level = [child for k in level for child in self._children_of(k)]
            if not level:
                return
        self._dirty.update(level)

    def _segment(self, last: int) -> Segment | None:
        """The counts per tier of the segment ending with ``last``, if held whole."""
        counts = [0, 0, 0, 0]
        key, span = last, self.segment_blocks
        for _ in range(span):
            refs = self.refs.get(key)
            if refs is None:
                return None
            counts[_BEST[tiers_of(refs)]] += 1
            key, depth = refs[4], refs[5]
            if depth % span == 0:
                break
        return counts[0], counts[1], counts[2], counts[3]

    def _settle(self, changes: LedgerChanges) -> None:
        """Write the segments whose blocks changed into ``changes``."""
        for last in self._dirty:
            segment = self._segment(last)
            if segment != self.segments.get(last):
                if segment is None:
                    del self.segments[last]
                else:
                    self.segments[last] = segment
                changes.segments[last] = segment
        self._dirty.clear()
        changes.ends |= self._ends
        self._ends.clear()

    def _indexed_group(self, group_idx: int | None, kind: str | None) -> bool:
        # Hybrid models announce every block once per KV-cache group with the same hash; only
        # the full-attention group describes a reusable prefix (llm-d-router#2362).
        if kind is not None:
            return kind in _FULL_ATTENTION_KINDS
        return group_idx in (None, 0)

    def _touch(
        self,
        key: int,
        slot: int,
        delta: int,
        changes: LedgerChanges,
        *,
        parent: int = 0,
        depth: int = -1,
    ) -> None:
        """``delta`` references to ``key`` in the tier of index ``slot`` (:data:`TIERS`);
        ``parent`` and ``depth`` place a key the replica did not hold yet."""
        refs = self.refs.get(key)
        if refs is None:  # a new key (this runs once per block event: the usual case inline)
            assert depth >= 0, "only a stored block brings a key the ledger lacks"
            refs = self.refs[key] = [0, 0, 0, 0, parent, depth]
            refs[slot] = delta
            self._link(key, parent, depth)
            span = self.segment_blocks
            if depth % span == span - 1 or key in self.child:
                self._touched(key)
            changes.placements[key] = 1 << slot
            return
        before = (refs[0] > 0) | (refs[1] > 0) << 1 | (refs[2] > 0) << 2 | (refs[3] > 0) << 3
        refs[slot] += delta
        # tiers_of(refs), inline
        mask = (refs[0] > 0) | (refs[1] > 0) << 1 | (refs[2] > 0) << 2 | (refs[3] > 0) << 3
        if _BEST[mask] != _BEST[before]:
            self._touched(key)
        if not mask:
            del self.refs[key]
            self._unlink(key, refs[4], refs[5])
        changes.placements[key] = mask

    def _stored(self, event: BlockStored, changes: LedgerChanges) -> None:
        hashes = [external_hash_u64(h) for h in event.block_hashes]
        if not self._indexed_group(event.group_idx, event.kv_cache_spec_kind):
            changes.stats["skipped_group"] += len(hashes)
            return
        if not _known(event):
            changes.stats["unknown_medium"] += len(hashes)
        tier = tier_of(event.medium, event.locality)
        slot = _TIER_SLOT[tier]
        if not event.token_ids:
            self._stored_tokenless(hashes, tier, slot, changes)
            return
        if event.block_size != self.namespace.block_size:
            changes.stats["block_size_mismatch"] += len(hashes)
            return
        if len(event.token_ids) != len(hashes) * event.block_size:
            changes.stats["token_count_mismatch"] += len(hashes)
            return
        parent_key: int | None = None
        depth = 0
        if event.parent_block_hash is not None:
            parent = self.engine.get(external_hash_u64(event.parent_block_hash))
            if parent is None:
                # Missed events (late join, unrecoverable gap): the chain key cannot be
                # derived. Remember the hashes so descendants and removals are recognised,
                # and let the subscriber resync this replica.
                for h in hashes:
                    self.orphans[h] += 1
                changes.stats["orphan"] += len(hashes)
                return
            parent_key, depth = parent.key, parent.depth + 1
        namespace = Namespace(self.namespace.model, self.namespace.block_size, event.lora_name)
        extra = own_extra_keys(event.lora_name, event.extra_keys)
        tokens, lookahead = _with_lookahead(event, len(hashes))
        if lookahead is None:
            changes.stats["lookahead_mismatch"] += len(hashes)
            return
        keys = block_keys(
            tokens, namespace, parent=parent_key, extra_keys=extra, lookahead=lookahead
        )
        previous = parent_key or 0
        for engine_hash, key in zip(hashes, keys, strict=True):
            block = self.engine.get(engine_hash)
            if block is None or block.key != key:
                if block is not None:
                    changes.stats["hash_conflict"] += 1
                    self._drop(engine_hash, block, changes)
                block = self.engine[engine_hash] = EngineBlock(key, 0, 0, 0, 0, previous, depth)
            block.add(tier, 1)
            self.orphans.pop(engine_hash, None)
            self._touch(key, slot, 1, changes, parent=previous, depth=depth)
            changes.engine[engine_hash] = block
            previous, depth = key, depth + 1
        changes.stats["stored"] += len(hashes)

    def _stored_tokenless(
        self, hashes: list[int], tier: Tier, slot: int, changes: LedgerChanges
    ) -> None:
        # Offload connectors announce copies of blocks the GPU pool already described.
        for engine_hash in hashes:
            block = self.engine.get(engine_hash)
            if block is None:
                changes.stats["tokenless_unknown"] += 1
                continue
            block.add(tier, 1)
            self._touch(block.key, slot, 1, changes)
            changes.engine[engine_hash] = block
            changes.stats["stored"] += 1

    def _drop(self, engine_hash: int, block: EngineBlock, changes: LedgerChanges) -> None:
        for slot, count in enumerate(block.counts()):
            if count:
                self._touch(block.key, slot, -count, changes)
        del self.engine[engine_hash]
        changes.engine[engine_hash] = None

    def _removed(self, event: BlockRemoved, changes: LedgerChanges) -> None:
        if not self._indexed_group(event.group_idx, None):
            changes.stats["skipped_group"] += len(event.block_hashes)
            return
        if not _known(event):
            changes.stats["unknown_medium"] += len(event.block_hashes)
        tier = tier_of(event.medium, event.locality)
        slot = _TIER_SLOT[tier]
        for raw in event.block_hashes:
            engine_hash = external_hash_u64(raw)
            block = self.engine.get(engine_hash)
            if block is None:
                if self.orphans[engine_hash] > 0:
                    self.orphans[engine_hash] -= 1
                    if not self.orphans[engine_hash]:
                        del self.orphans[engine_hash]
                    changes.stats["removed_orphan"] += 1
                else:
                    self.orphans.pop(engine_hash, None)
                    changes.stats["unknown_remove"] += 1
                continue
            if block.count(tier) <= 0:
                changes.stats["unbalanced_remove"] += 1
                continue
            block.add(tier, -1)
            self._touch(block.key, slot, -1, changes)
            if not block.held():
                del self.engine[engine_hash]
                changes.engine[engine_hash] = None
            else:
                changes.engine[engine_hash] = block
            changes.stats["removed"] += 1
