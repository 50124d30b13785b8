"""The shared index's write path: each replica's ledger, its changes written with APPLY.

Each batch becomes one ``EVALSHA`` of :data:`tracker.core.lua.APPLY` (idempotent
placements, engine-map updates and the sequence checkpoint, atomically), or, past
:data:`OPS_PER_CALL` changes, several in a row with the checkpoint in the last. A tracker owns the
:class:`~tracker.core.ledger.ReplicaLedger` of the replicas it consumes, rebuilt from the
persisted engine map after a restart; while Redis is unreachable the changes stay pending,
flushed as soon as it answers again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, Final

import msgspec
import redis.asyncio as redis
from redis.asyncio.cluster import RedisCluster

from tracker.core import keys as schema
from tracker.core import lua
from tracker.core.blocks import Namespace
from tracker.core.events import EventBatch
from tracker.core.index import ApplyResult
from tracker.core.ledger import EngineBlock, LedgerChanges, ReplicaLedger, Segment
from tracker.core.redis_client import redis_call
from tracker.framework.errors import FencedError, IndexUnavailableError

logger = logging.getLogger(__name__)

# Redis runs one script at a time and nothing else meanwhile: an APPLY of 8,192 changes (an
# engine's 100k-token prefill) held every router's lookup for up to 31 ms, one of 1,024 for
# 12 ms (~12 µs a block on the benchmark host: Mooncake trace, SLOWLOG), one of 256 for ~3.
OPS_PER_CALL: Final = 256
_TIERS: Final = [bytes((t,)) for t in range(1 << schema.TIER_BITS)]
_DELETE: Final = b"\x00" * (1 + schema.ENGINE_VALUE_BYTES)
_NOT_WHOLE: Final = b"\x00" * schema.TIER_BITS


def _segment_op(key: int, segment: Segment | None) -> bytes:
    """One entry of ``APPLY``'s segments argument: the last block's key, blocks per tier."""
    return key.to_bytes(8, "big") + (_NOT_WHOLE if segment is None else bytes(segment))


def _touched_by_apply(
    nk: schema.NamespaceKeys,
    rid: int,
    placements: Sequence[tuple[int, int]],
    engine: Sequence[tuple[int, EngineBlock | None]],
    segments: Sequence[tuple[int, Segment | None]],
) -> list[str]:
    """Every key an ``APPLY`` call may touch besides the six it names, for a cluster.

    Declared, they make a slot migration refuse the whole call (``TRYAGAIN``, ``ASK``) while
    any of them is elsewhere. Undeclared, a call that Redis sent on to the importing master
    (all six named keys moved, the buckets not yet) ran there against empty buckets: a
    removal found nothing to remove and the source's bucket, moved later, brought the block
    back (tests/tracker/test_redis_cluster.py); and a call that stopped halfway on a
    moved key left its held-blocks count short.
    """
    touched = {nk.stats, nk.plive}
    for key, _ in placements:
        touched.add(nk.block_bucket(key))
        touched.add(nk.prediction_bucket(key))
    touched.update(nk.engine_bucket(rid, engine_hash) for engine_hash, _ in engine)
    if segments:
        touched.add(nk.segments)
    return sorted(touched)


class _Pending:
    """Changes a ledger made that Redis has not acknowledged yet."""

    __slots__ = ("changes", "seq")

    def __init__(self) -> None:
        self.changes = LedgerChanges()
        self.seq: str = ""

    def merge(self, changes: LedgerChanges, seq: str) -> None:
        self.changes.placements.update(changes.placements)
        self.changes.engine.update(changes.engine)
        self.changes.segments.update(changes.segments)
        self.changes.ends |= changes.ends
        if seq:
            self.seq = seq

    def __bool__(self) -> bool:
        changes = self.changes
        return bool(changes.placements or changes.engine or changes.segments or self.seq)


class RedisWriter:
    """The trackers' side of the shared index: each replica's ledger, the writes that keep
    Redis holding what it says, and the replicas' short ids (rids) every write names.

    :class:`tracker.core.redis_index.RedisIndex` builds one around its client.

    :param client: the index's Redis client.
    """

    def __init__(self, client: redis.Redis, *, segment_blocks: int = schema.SEGMENT_BLOCKS) -> None:
        self.client = client
        self.segment_blocks = segment_blocks
        # on a cluster every key a writing script touches is declared (_touched_by_*)
        self.cluster = isinstance(client, RedisCluster)
        self.fence = 0  # fencing number of the elected tracker writing through this (0: none)
        self.election = ""  # ... and its election
        self._apply = client.register_script(lua.APPLY)
        self._rid_script = client.register_script(lua.RID)
        self._release_rid = client.register_script(lua.RELEASE_RID)
        self._keys: dict[Namespace, schema.NamespaceKeys] = {}
        self._rids: dict[tuple[str, Namespace], int] = {}
        self.ledgers: dict[tuple[str, Namespace], ReplicaLedger] = {}
        """The ledger of every replica written through this, by (replica, base namespace)."""
        self._pending: dict[tuple[str, Namespace], _Pending] = {}
        self._locks: dict[tuple[str, Namespace], asyncio.Lock] = {}
        self._seqs: dict[tuple[str, Namespace], str] = {}  # last checkpoint sent, per replica

    def keys_for(self, namespace: Namespace) -> schema.NamespaceKeys:
        """The key names of ``namespace``'s partition."""
        base = namespace.base()
        nk = self._keys.get(base)
        if nk is None:
            nk = self._keys[base] = schema.NamespaceKeys(base)
        return nk

    async def rid(self, replica: str, namespace: Namespace) -> int:
        """The replica's short numeric id in ``namespace``, allocated on first use."""
        base = namespace.base()
        rid = self._rids.get((replica, base))
        if rid is None:
            nk = self.keys_for(base)
            rid, created = await redis_call(
                "rid",
                self._rid_script(
                    keys=[nk.rid, nk.rname, nk.ridseq, nk.ridfree],
                    args=[replica, schema.MAX_RID],
                ),
            )
            rid = int(rid)
            if created:
                # A new id has no persisted engine map: nothing to restore.
                self.ledgers.setdefault((replica, base), self.new_ledger(replica, base))
            await redis_call(
                "namespace",
                self.client.hset(
                    schema.NAMESPACES,
                    nk.nsid,
                    msgspec.json.encode({"model": base.model, "block_size": base.block_size}),
                ),
            )
            self._rids[(replica, base)] = rid
        return rid

    def known_rid(self, replica: str, namespace: Namespace) -> int | None:
        """The replica's rid, if this writer knows it (allocates nothing)."""
        return self._rids.get((replica, namespace.base()))

    def drop_rid(self, replica: str, namespace: Namespace) -> None:
        """Forget the replica's rid: Redis lost it, or it names another replica now; the next
        :meth:`rid` looks it up (or allocates it) again."""
        self._rids.pop((replica, namespace.base()), None)

    def new_ledger(self, replica: str, namespace: Namespace) -> ReplicaLedger:
        """An empty ledger of the replica, of this index's segment layout."""
        return ReplicaLedger(replica, namespace.base(), segment_blocks=self.segment_blocks)

    async def ledger(self, replica: str, namespace: Namespace) -> ReplicaLedger:
        """The replica's ledger, rebuilt from the engine map Redis holds on first use."""
        base = namespace.base()
        ledger = self.ledgers.get((replica, base))
        if ledger is not None:
            return ledger
        rid = await self.rid(replica, base)
        ledger = self.ledgers.get((replica, base))
        if ledger is not None:  # freshly allocated id
            return ledger
        entries = await self.engine_map(rid, base)
        ledger = self.new_ledger(replica, base)
        ledger.load(entries)
        self.ledgers[(replica, base)] = ledger
        if entries:
            logger.info(
                "replica ledger restored from redis",
                extra={"replica": replica, "engine_blocks": len(entries)},
            )
        return ledger

    async def engine_map(self, rid: int, namespace: Namespace) -> list[tuple[int, EngineBlock]]:
        """The engine map Redis holds for replica id ``rid``."""
        buckets = self.keys_for(namespace).engine_buckets(rid)
        entries: list[tuple[int, EngineBlock]] = []
        skipped = 0
        for start in range(0, len(buckets), 128):
            async with self.client.pipeline(transaction=False) as pipe:
                for bucket in buckets[start : start + 128]:
                    pipe.hgetall(bucket)
                mappings = await redis_call("load", pipe.execute())
            for mapping in mappings:
                for f, v in mapping.items():
                    if len(v) == schema.ENGINE_VALUE_BYTES:
                        entries.append((int.from_bytes(f, "big"), EngineBlock.unpack(v)))
                    else:  # not this layout's: a foreign writer; the replay will tell the rest
                        skipped += 1
        if skipped:
            logger.warning(
                "engine map entries of another layout skipped",
                extra={"rid": rid, "skipped": skipped, "bytes": schema.ENGINE_VALUE_BYTES},
            )
        return entries

    async def _flush(self, replica: str, namespace: Namespace, *, resync: bool = True) -> None:
        # One flush per replica at a time: a newer state must never be overtaken on the wire
        # by an older one still in flight.
        lock = self._locks.setdefault((replica, namespace), asyncio.Lock())
        async with lock:
            pending = self._pending.pop((replica, namespace), None)
            if not pending:
                return
            try:
                statuses = await self._write(replica, namespace, pending)
            except BaseException:
                newer = self._pending.get((replica, namespace))
                if newer is not None:
                    pending.merge(newer.changes, newer.seq)
                self._pending[(replica, namespace)] = pending
                raise
        if any(int(s) == lua.APPLY_FENCED for s in statuses):
            # another tracker owns the partition now: this one's changes are not its to write
            raise FencedError(
                f"a tracker elected after this one (fence {self.fence}) writes "
                f"{namespace.model!r}/{namespace.block_size} now"
            )
        if resync and any(int(s) != lua.APPLY_OK for s in statuses):
            await self._resync(replica, namespace, pending, statuses)

    async def _write(self, replica: str, namespace: Namespace, pending: _Pending) -> list[Any]:
        rid = await self.rid(replica, namespace)
        nk = self.keys_for(namespace)
        keys = [nk.seq, nk.rid, nk.rname, nk.ridseq, nk.ridfree, nk.fence(self.election)]
        placements = list(pending.changes.placements.items())
        engine = list(pending.changes.engine.items())
        segments = list(pending.changes.segments.items())
        ends = list(pending.changes.ends)
        most = max(len(placements), len(engine), len(segments), len(ends))
        calls = max(1, -(-most // OPS_PER_CALL))
        batches: list[list[Any]] = []
        declared: list[list[str]] = []
        for call in range(calls):
            window = slice(call * OPS_PER_CALL, (call + 1) * OPS_PER_CALL)
            touched = (
                _touched_by_apply(nk, rid, placements[window], engine[window], segments[window])
                if self.cluster
                else []
            )
            declared.append(keys + touched)
            batches.append(
                [
                    replica,
                    pending.seq if call == calls - 1 else "",
                    rid,
                    nk.tag,
                    b"".join(k.to_bytes(8, "big") + _TIERS[t] for k, t in placements[window]),
                    b"".join(
                        h.to_bytes(8, "big") + (_DELETE if b is None else b"\x01" + b.pack())
                        for h, b in engine[window]
                    ),
                    self.fence,
                    b"".join(_segment_op(k, segment) for k, segment in segments[window]),
                    b"".join(k.to_bytes(8, "big") for k in ends[window]),
                ]
            )
        # One call at a time, so that the routers' lookups run between them (neither a
        # transaction nor one pipeline lets them). Readers may see part of a batch meanwhile,
        # as they see a prefill's batches one after another; the sequence checkpoint comes
        # with the last call, so a failure halfway replays the whole batch (APPLY is
        # idempotent).
        statuses = []
        for call_keys, args in zip(declared, batches, strict=True):
            statuses.append(await redis_call("apply", self._apply(keys=call_keys, args=args)))
        return statuses

    async def _resync(
        self, replica: str, namespace: Namespace, pending: _Pending, statuses: list[Any]
    ) -> None:
        # Redis lost this replica's id mapping, hence (no persistence, failover) its data: the
        # ledger is the authority, so its whole state is written again under a valid id.
        if any(int(s) == lua.APPLY_RID_TAKEN for s in statuses):
            self.drop_rid(replica, namespace)
        ledger = self.ledgers[(replica, namespace)]
        newer = self._pending.get((replica, namespace))
        snapshot = _Pending()
        snapshot.merge(
            LedgerChanges(dict(ledger.placements()), dict(ledger.engine), ledger.segment_changes()),
            newer.seq if newer is not None and newer.seq else pending.seq,
        )
        logger.warning(
            "replica state missing from redis, rewriting it",
            extra={"replica": replica, "blocks": len(ledger)},
        )
        self._pending[(replica, namespace)] = snapshot
        await self._flush(replica, namespace, resync=False)

    async def _commit(
        self, replica: str, namespace: Namespace, changes: LedgerChanges, seq: str
    ) -> None:
        pending = self._pending.setdefault((replica, namespace), _Pending())
        pending.merge(changes, seq)
        if seq:
            self._seqs[(replica, namespace)] = seq
        await self._flush(replica, namespace)

    def has_pending(self, replica: str, namespace: Namespace) -> bool:
        """Whether changes of the replica wait for Redis (a flush is due)."""
        return (replica, namespace.base()) in self._pending

    async def rewrite(self, replica: str, namespace: Namespace, changes: LedgerChanges) -> None:
        """Write ``changes`` of the replica (what Redis lost or holds older than its ledger),
        checkpointed at the last sequence number written for it."""
        base = namespace.base()
        await self._commit(replica, base, changes, self._seqs.get((replica, base), ""))

    async def flush(self) -> int:
        """Retry every pending write; returns how many replicas are still pending."""
        for replica, namespace in list(self._pending):
            try:
                await self._flush(replica, namespace)
            except IndexUnavailableError:
                break
        return len(self._pending)

    async def apply(
        self, replica: str, namespace: Namespace, batch: EventBatch, seq: int | None = None
    ) -> ApplyResult:
        base = namespace.base()
        ledger = await self.ledger(replica, base)
        changes = ledger.apply(batch.events)
        result = ApplyResult(changes.stats, changes.cleared, len(ledger))
        await self._commit(replica, base, changes, "" if seq is None else str(seq))
        return result

    async def clear(self, replica: str, namespace: Namespace) -> int:
        base = namespace.base()
        ledger = await self.ledger(replica, base)
        held = len(ledger)
        await self._commit(replica, base, ledger.clear(), "-")
        return held

    async def forget(self, replica: str, namespace: Namespace) -> int:
        """Clear a departed replica and release its short id for reuse."""
        held = await self.clear(replica, namespace)
        base = namespace.base()
        nk = self.keys_for(base)
        await redis_call(
            "release",
            self._release_rid(keys=[nk.rid, nk.rname, nk.ridfree], args=[replica]),
        )
        await redis_call("stats", self.client.hdel(nk.stats, *nk.stats_fields(replica)))
        await redis_call("lookahead", self.client.hdel(nk.lookahead, replica))
        self.drop_rid(replica, base)
        self.ledgers.pop((replica, base), None)
        self._seqs.pop((replica, base), None)
        return held

    async def last_seq(self, replica: str, namespace: Namespace) -> int | None:
        base = namespace.base()
        pending = self._pending.get((replica, base))
        if pending is not None and pending.seq:
            return None if pending.seq == "-" else int(pending.seq)
        value = await redis_call("seq", self.client.hget(self.keys_for(base).seq, replica))
        return None if value is None else int(value)

    async def block_count(self, replica: str, namespace: Namespace) -> int:
        """How many distinct blocks ``replica`` holds: from the ledger this writer keeps, or
        else as Redis holds it now, not cached (another writer keeps that ledger: a copy
        cached here would stay empty while it fills)."""
        base = namespace.base()
        ledger = self.ledgers.get((replica, base))
        if ledger is not None:
            return len(ledger)
        rid = self.known_rid(replica, base)
        if rid is None:  # look it up, allocating nothing (nor an empty ledger with it)
            found = await redis_call("rid", self.client.hget(self.keys_for(base).rid, replica))
            if found is None:
                return 0
            rid = int(found)
        ledger = self.new_ledger(replica, base)
        ledger.load(await self.engine_map(rid, base))
        return len(ledger)
