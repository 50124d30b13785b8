"""The whole Redis key schema, prefixed and versioned; nothing else builds Redis keys.

Every key of one index partition (model + block size) carries the same hash tag
``{<nsid>}``, so multi-key scripts stay in one Redis Cluster slot. Partition keys carry
their own layout version (``Q`` = ``kvr:v2``: a block's tiers took 4 bits in v2, 2 in v1),
global keys theirs (``P`` = ``kvr:v1``), so a tracker or router of another layout finds an
empty partition (load-only routing) instead of misreading one, while the replicas'
registrations, which did not change, stay readable to both. Layout (``T`` = ``{nsid}``):

==============================  =====  ===================================================
key                             type   content
==============================  =====  ===================================================
``Q:T:b:<bucket hex4>``         HASH   field: block key (8 bytes BE) -> value: 2 bytes per
                                       replica holding it, ``rid << 4 | tiers`` (bits: GPU,
                                       CPU, storage, remote; ``tracker.core.ledger.Tier``)
``Q:T:e:<rid>:<bucket>``       HASH   a replica's engine map: field: engine hash (8 bytes
                                       BE) -> value: block key (8 B) + references per tier
                                       (GPU, CPU, storage, remote: 2 B each)
``Q:T:p:<bucket hex4>``         HASH   predictions (router): block key -> 8 bytes per
                                       replica: rid (2 B) + expiry, Redis time ms (6 B)
``Q:T:h:<bucket hex4>``         HASH   homes (router): anchor block key -> rid (2 B) + the
                                       time it was routed there + its expiry, Redis time
                                       ms (6 B each)
``Q:T:rid``                     HASH   replica id -> short numeric rid (1..4095)
``Q:T:rname``                   HASH   rid -> replica id
``Q:T:ridseq``                  STRING last rid allocated
``Q:T:ridfree``                 SET    rids released by departed replicas, reused first
``Q:T:seq``                     HASH   replica id -> last applied event sequence number
``Q:T:load``                    HASH   shared router load: ``replica NUL router id`` ->
                                       ``<dddd`` in flight, queued tokens, expiry ms,
                                       oldest prefilling request's send time ms;
                                       ``NUL router id``: a reader's presence (zeros)
``Q:T:routes``                  STREAM what routers with their own index routed
                                       (``--local-index``): ``r`` router id, ``p``
                                       replica, ``k`` predicted block keys and ``a`` home
                                       anchors (``<Q`` each), ``t`` / ``h`` their
                                       lifetimes in ms; capped at ``MAX_ROUTES`` entries
``Q:T:stats``                   HASH   per replica, from its events: ``n:<replica>`` ->
                                       GPU blocks held now, ``s:<replica>`` -> GPU blocks
                                       stored ever (the router derives cache churn)
``Q:T:lookahead``               HASH   replica id -> tokens after each block its engine
                                       folds into the block's hash (vLLM 0.33; absent: 0)
``Q:T:plive``                   STRING set while any prediction may be live (expires
                                       with the longest); spares the tracker's writes
                                       the prediction check when there are none
``Q:T:fence:<election>``        STRING highest fencing number of a tracker of election
                                       ``N`` that wrote the partition; APPLY refuses
                                       lower ones of that election
``P:namespaces``                HASH   nsid -> JSON {model, block_size}
``P:{tracker:N}:lease``         STRING the tracker lease of election ``N``: ``<fencing
                                       number> <tracker id>``, expiring unless renewed
``P:{tracker:N}:fence``         STRING last fencing number handed out in election ``N``
``P:{replicas}``                HASH   replica id -> JSON registry record
``P:{replicas}:seen``           HASH   replica id -> last heartbeat (Redis server time, ms)
==============================  =====  ===================================================

The two registry hashes share the hash tag ``{replicas}``: the registry scripts and the
deregistration transaction touch both.

Buckets keep each Redis hash small enough for the compact listpack encoding, which is what
keeps memory per (block, replica) low: blocks are spread over ``2**BLOCK_BUCKET_BITS``
buckets by their key's top bits, engine hashes over ``ENGINE_BUCKETS`` buckets per replica.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

import xxhash

from tracker.core.blocks import Namespace

PREFIX: Final = "kvr:v1"
PARTITION_PREFIX: Final = "kvr:v2"
BLOCK_BUCKET_BITS: Final = 14
ENGINE_BUCKETS: Final = 1024
TIER_BITS: Final = 4
"""Tiers a block may be in (bits of a block-bucket entry, counts of an engine-map value)."""
MAX_ROUTES: Final = 4096
"""Entries a partition's route stream keeps (approximately: ``XADD MAXLEN ~``)."""
MAX_RID: Final = (1 << (16 - TIER_BITS)) - 1
ENGINE_VALUE_BYTES: Final = 8 + 2 * TIER_BITS

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


def field(key: int) -> bytes:
    """A 64-bit block key or engine hash as a hash field."""
    return key.to_bytes(8, "big")
