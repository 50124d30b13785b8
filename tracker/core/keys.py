"""The whole Redis key schema, prefixed and versioned; nothing else builds Redis keys.

Every key of one index partition (model + block size) carries the same hash tag
``{<nsid>}``, so multi-key scripts stay in one Redis Cluster slot. Partition keys (``kvr:v3``)
and global keys (``kvr:v1``) carry their own layout version. Each key's type and content, and
why blocks and engine maps are spread over buckets: docs/architecture.md, "Redis key schema".
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

import xxhash

from tracker.core.blocks import Namespace

PREFIX: Final = "kvr:v1"
PARTITION_PREFIX: Final = "kvr:v3"
BLOCK_BUCKET_BITS: Final = 14
ENGINE_BUCKETS: Final = 1024
TIER_BITS: Final = 4
"""Tiers a block may be in (bits of a block-bucket entry, counts of an engine-map value)."""
MAX_ROUTES: Final = 4096
"""Entries a partition's route stream keeps (approximately: ``XADD MAXLEN ~``)."""
MAX_RID: Final = (1 << (16 - TIER_BITS)) - 1
SEGMENT_BLOCKS: Final = 32
"""Blocks of a segment: the aligned runs ``[k·N, (k+1)·N)`` of a chain whose holders a lookup
reads at once (:attr:`NamespaceKeys.segments`): a replica holding every block of one skips
them."""
PREDICTION_SLOT_MS: Final = 2000
"""Width of a slot of segment predictions (``ps:<slot>``, by expiry): each slot's hash
expires with its last possible entry, so no expired segment prediction outlives it long."""
ENGINE_VALUE_BYTES: Final = 8 + 2 * TIER_BITS + 8 + 4
"""An engine-map value: block key, references per tier, the block's parent key and depth."""
SEGMENT_ENTRY_BYTES: Final = 2 + TIER_BITS
"""A segment-bucket entry: rid (2 bytes), then how many of the segment's blocks load from
each tier (one byte each)."""
assert SEGMENT_BLOCKS <= 0xFF, "a segment's counts per tier are one byte"

# the registry's two hashes share a hash tag: its scripts and the deregistration touch both
REPLICAS: Final = f"{PREFIX}:{{replicas}}"
REPLICAS_SEEN: Final = f"{PREFIX}:{{replicas}}:seen"
NAMESPACES: Final = f"{PREFIX}:namespaces"


def tracker_lease(election: str) -> tuple[str, str]:
    """The lease and fencing counter of tracker election ``election`` (one slot)."""
    tag = f"{PREFIX}:{{tracker:{election}}}"
    return f"{tag}:lease", f"{tag}:fence"


def nsid(namespace: Namespace) -> str:
    """Short stable id of an index partition (model + block size, LoRA excluded)."""
    digest = xxhash.xxh3_64_hexdigest(f"{namespace.model}\x00{namespace.block_size}".encode())
    return digest[:12]


class NamespaceKeys:
    """Key names of one index partition."""

    __slots__ = (
        "block_prefix",
        "engine_prefix",
        "home_prefix",
        "load",
        "lookahead",
        "nsid",
        "plive",
        "prediction_prefix",
        "rid",
        "ridfree",
        "ridseq",
        "rname",
        "routes",
        "segments",
        "seq",
        "stats",
        "tag",
    )

    def __init__(self, namespace: Namespace) -> None:
        self.nsid = nsid(namespace)
        self.tag = f"{PARTITION_PREFIX}:{{{self.nsid}}}"
        self.block_prefix = f"{self.tag}:b:"
        self.prediction_prefix = f"{self.tag}:p:"
        self.home_prefix = f"{self.tag}:h:"
        self.segments = f"{self.tag}:s"
        self.engine_prefix = f"{self.tag}:e:"
        self.rid = f"{self.tag}:rid"
        self.rname = f"{self.tag}:rname"
        self.ridseq = f"{self.tag}:ridseq"
        self.ridfree = f"{self.tag}:ridfree"
        self.seq = f"{self.tag}:seq"
        self.load = f"{self.tag}:load"
        self.routes = f"{self.tag}:routes"
        self.stats = f"{self.tag}:stats"
        self.lookahead = f"{self.tag}:lookahead"
        self.plive = f"{self.tag}:plive"

    def fence(self, election: str) -> str:
        """The partition's fence for the trackers of ``election`` (elections over disjoint
        replicas of one model must not fence each other)."""
        return f"{self.tag}:fence:{election}"

    @staticmethod
    def stats_fields(replica: str) -> tuple[str, str]:
        """Fields of ``replica`` in :attr:`stats`: blocks held now, blocks stored ever."""
        return f"n:{replica}", f"s:{replica}"

    def block_bucket(self, key: int) -> str:
        return f"{self.block_prefix}{key >> (64 - BLOCK_BUCKET_BITS):04x}"

    def prediction_bucket(self, key: int) -> str:
        return f"{self.prediction_prefix}{key >> (64 - BLOCK_BUCKET_BITS):04x}"

    def home_bucket(self, key: int) -> str:
        return f"{self.home_prefix}{key >> (64 - BLOCK_BUCKET_BITS):04x}"

    def prediction_segments(self, slot: int) -> str:
        """The segments predicted whole whose predictions expire in slot ``slot``
        (:data:`PREDICTION_SLOT_MS` wide, Redis time)."""
        return f"{self.tag}:ps:{slot}"

    def engine_bucket(self, rid: int, engine_hash: int) -> str:
        bucket = engine_hash % ENGINE_BUCKETS
        return f"{self.engine_prefix}{rid}:{bucket >> 8}{bucket & 0xFF:02x}"

    def engine_buckets(self, rid: int) -> list[str]:
        return [f"{self.engine_prefix}{rid}:{b >> 8}{b & 0xFF:02x}" for b in range(ENGINE_BUCKETS)]


def home_anchors(blocks: int) -> list[int]:
    """Positions of a chain of ``blocks`` whose keys carry its home: 0, 1, 3, 7, ... and the last.

    Doubling positions keep a claim to O(log n) writes and reads however long the prompt,
    while telling the depth two prompts share within a factor of two (the events tell the
    cached part exactly); the last block names the exact prompt (a retry, a resubmission).
    """
    if blocks <= 0:
        return []
    out = []
    position = 1
    while position < blocks:
        out.append(position - 1)
        position *= 2
    out.append(blocks - 1)
    return out


def bucket_entries(value: bytes) -> Iterator[tuple[int, int]]:
    """The ``(rid, tiers)`` entries of a block-bucket value (for operators' tools and tests;
    the scripts in :mod:`tracker.core.lua` read them in Lua)."""
    mask = (1 << TIER_BITS) - 1
    for i in range(0, len(value) - 1, 2):
        word = value[i] << 8 | value[i + 1]
        yield word >> TIER_BITS, word & mask


def segment_entries(value: bytes) -> Iterator[tuple[int, tuple[int, ...]]]:
    """The ``(rid, blocks per tier)`` entries of a segment-bucket value (operators, tests)."""
    for i in range(0, len(value) - SEGMENT_ENTRY_BYTES + 1, SEGMENT_ENTRY_BYTES):
        yield value[i] << 8 | value[i + 1], tuple(value[i + 2 : i + SEGMENT_ENTRY_BYTES])


def field(key: int) -> bytes:
    """A 64-bit block key or engine hash as a hash field."""
    return key.to_bytes(8, "big")
