"""Redis-backed block index shared by every router and tracker; layout in :mod:`tracker.core.keys`.

Writes: each batch becomes one ``EVALSHA`` of :data:`tracker.core.lua.APPLY` (idempotent
placements, engine-map updates and the sequence checkpoint, atomically). Reads: one
``EVALSHA`` of :data:`tracker.core.lua.LOOKUP` walks the chain server-side and stops at the first
block no replica holds, so a lookup is one round trip whatever the chain length.

A tracker owns the :class:`~tracker.core.ledger.ReplicaLedger` of the replicas it consumes; the
ledger is rebuilt from the persisted engine map after a restart. When Redis is unreachable
the ledger keeps absorbing events and their effect is kept as pending changes, flushed (they
are idempotent) as soon as Redis answers again.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from array import array
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import redis.asyncio as redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from tracker.core import keys as schema
from tracker.core import lua, lua_lease, lua_router
from tracker.core.blocks import Namespace
from tracker.core.events import EventBatch
from tracker.core.index import (
    LOAD_TTL_S,
    ApplyResult,
    Home,
    Match,
    ReplicaRecord,
    Residency,
    Survey,
)
from tracker.core.ledger import EngineBlock, LedgerChanges, ReplicaLedger
from tracker.core.redis_client import RedisConnection, open_redis, redis_call
from tracker.framework.errors import FencedError, IndexUnavailableError

logger = logging.getLogger(__name__)

OPS_PER_CALL: Final = 8192
_TIERS: Final = [bytes((t,)) for t in range(1 << schema.TIER_BITS)]
_DELETE: Final = b"\x00" * (1 + schema.ENGINE_VALUE_BYTES)
_LITTLE_ENDIAN: Final = sys.byteorder == "little"
_record_decoder = msgspec.json.Decoder(ReplicaRecord)

EVICTING_POLICIES: Final = frozenset({"allkeys-lru", "allkeys-lfu", "allkeys-random"})
"""``maxmemory-policy`` values under which Redis evicts keys without a TTL: the index's."""


@dataclass(frozen=True, slots=True)
class RedisMemory:
    """Redis's memory as ``INFO memory`` reports it (which managed Redis allows where it
    disables ``CONFIG``).

    :param policy: ``maxmemory-policy``; only :data:`EVICTING_POLICIES` evict index keys
        (the ``volatile-*`` ones evict only keys with a TTL: routers' leases and load).
    :param used_bytes: ``used_memory``: the index, when Redis is dedicated to kvrouter.
    :param max_bytes: ``maxmemory`` (0: no limit).
    """

    policy: str
    used_bytes: int
    max_bytes: int

    @property
    def evicts_index(self) -> bool:
        """Whether Redis, once at ``maxmemory``, would evict index keys."""
        return self.policy in EVICTING_POLICIES


def _ms(seconds: float) -> int:
    """A script's ttl argument: whole milliseconds, at least one."""
    return max(1, int(seconds * 1000))


def load_sums(reply: Sequence[Any]) -> dict[str, tuple[int, int, int]]:
    """A load snapshot's reply (``tracker.core.lua_router`` ``load_snapshot``: replica, in
    flight, queued tokens, age ms of the oldest still prefilling, ...) per replica; replica ""
    is another router's presence."""
    return {
        (raw.decode() if isinstance(raw, bytes) else str(raw)): (
            int(reply[i + 1]),
            int(reply[i + 2]),
            int(reply[i + 3]),
        )
        for i in range(0, len(reply) - 3, 4)
        if (raw := reply[i]) is not None
    }


def _touched_by_apply(
    nk: schema.NamespaceKeys,
    rid: int,
    placements: Sequence[tuple[int, int]],
    engine: Sequence[tuple[int, EngineBlock | None]],
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
    return sorted(touched)


def _chain(keys: Sequence[int]) -> bytes:
    """Block keys as one blob of 8-byte big-endian fields (one script argument)."""
    chain = array("Q", keys)
    if _LITTLE_ENDIAN:
        chain.byteswap()
    return chain.tobytes()


class _Pending:
    """Changes a ledger made that Redis has not acknowledged yet."""

    __slots__ = ("changes", "seq")

    def __init__(self) -> None:
        self.changes = LedgerChanges()
        self.seq: str = ""

    def merge(self, changes: LedgerChanges, seq: str) -> None:
        self.changes.placements.update(changes.placements)
        self.changes.engine.update(changes.engine)
        if seq:
            self.seq = seq

    def __bool__(self) -> bool:
        return bool(self.changes.placements or self.changes.engine or self.seq)


class RedisIndex:
    """The shared index. Construct with :meth:`from_url` or around an existing client."""

    def __init__(self, client: redis.Redis, connection: RedisConnection | None = None) -> None:
        self.client = client
        # on a cluster every key a writing script touches is declared (_touched_by_*)
        self._cluster = isinstance(client, RedisCluster)
        self._connection = connection or RedisConnection(client)
        self._server: str | None = None  # run_id of the server the ledgers were last written to
        self._raise_fence = client.register_script(lua_lease.FENCE_RAISE)
        self.fence = 0  # fencing number of the elected tracker writing through this (0: none)
        self.election = ""  # ... and its election
        self._apply = client.register_script(lua.APPLY)
        self._lookup = client.register_script(lua.LOOKUP)
        self._predict = client.register_script(lua_router.PREDICT)
        self._claim = client.register_script(lua_router.CLAIM)
        self._route = client.register_script(lua_router.ROUTE)
        self._rid_script = client.register_script(lua.RID)
        self._release_rid = client.register_script(lua.RELEASE_RID)
        self._heartbeat = client.register_script(lua.HEARTBEAT)
        self._registry = client.register_script(lua.REGISTRY)
        self._keys: dict[Namespace, schema.NamespaceKeys] = {}
        self._rids: dict[tuple[str, Namespace], int] = {}
        self._ledgers: dict[tuple[str, Namespace], ReplicaLedger] = {}
        self._pending: dict[tuple[str, Namespace], _Pending] = {}
        self._locks: dict[tuple[str, Namespace], asyncio.Lock] = {}
        self._seqs: dict[tuple[str, Namespace], str] = {}  # last checkpoint sent, per replica

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 2.0) -> RedisIndex:
        """Open the index at ``url``: a server, a Sentinel-monitored primary or a Redis
        Cluster (:func:`tracker.core.redis_client.open_redis`)."""
        connection = open_redis(url, timeout_s=timeout_s)
        return cls(connection.client, connection)

    def keys_for(self, namespace: Namespace) -> schema.NamespaceKeys:
        base = namespace.base()
        nk = self._keys.get(base)
        if nk is None:
            nk = self._keys[base] = schema.NamespaceKeys(base)
        return nk

    _call = staticmethod(redis_call)

    async def rid(self, replica: str, namespace: Namespace) -> int:
        """The replica's short numeric id in ``namespace``, allocated on first use."""
        base = namespace.base()
        rid = self._rids.get((replica, base))
        if rid is None:
            nk = self.keys_for(base)
            rid, created = await self._call(
                "rid",
                self._rid_script(
                    keys=[nk.rid, nk.rname, nk.ridseq, nk.ridfree],
                    args=[replica, schema.MAX_RID],
                ),
            )
            rid = int(rid)
            if created:
                # A new id has no persisted engine map: nothing to restore.
                self._ledgers.setdefault((replica, base), ReplicaLedger(replica, base))
            await self._call(
                "namespace",
                self.client.hset(
                    schema.NAMESPACES,
                    nk.nsid,
                    msgspec.json.encode({"model": base.model, "block_size": base.block_size}),
                ),
            )
            self._rids[(replica, base)] = rid
        return rid

    async def _ledger(self, replica: str, namespace: Namespace) -> ReplicaLedger:
        base = namespace.base()
        ledger = self._ledgers.get((replica, base))
        if ledger is not None:
            return ledger
        rid = await self.rid(replica, base)
        ledger = self._ledgers.get((replica, base))
        if ledger is not None:  # freshly allocated id
            return ledger
        entries = await self._engine_map(rid, base)
        ledger = ReplicaLedger(replica, base)
        ledger.load(entries)
        self._ledgers[(replica, base)] = ledger
        if entries:
            logger.info(
                "replica ledger restored from redis",
                extra={"replica": replica, "engine_blocks": len(entries)},
            )
        return ledger

    async def _engine_map(self, rid: int, namespace: Namespace) -> list[tuple[int, EngineBlock]]:
        """The engine map Redis holds for replica id ``rid``."""
        buckets = self.keys_for(namespace).engine_buckets(rid)
        entries: list[tuple[int, EngineBlock]] = []
        skipped = 0
        for start in range(0, len(buckets), 128):
            async with self.client.pipeline(transaction=False) as pipe:
                for bucket in buckets[start : start + 128]:
                    pipe.hgetall(bucket)
                mappings = await self._call("load", pipe.execute())
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
        calls = max(1, -(-max(len(placements), len(engine)) // OPS_PER_CALL))
        batches: list[list[Any]] = []
        declared: list[list[str]] = []
        for call in range(calls):
            window = slice(call * OPS_PER_CALL, (call + 1) * OPS_PER_CALL)
            touched = (
                _touched_by_apply(nk, rid, placements[window], engine[window])
                if self._cluster
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
                ]
            )
        if len(batches) == 1:
            return [await self._call("apply", self._apply(keys=declared[0], args=batches[0]))]
        async with self.client.pipeline(transaction=True) as pipe:
            for call_keys, args in zip(declared, batches, strict=True):
                await self._apply(keys=call_keys, args=args, client=pipe)
            return list(await self._call("apply", pipe.execute()))

    async def _resync(
        self, replica: str, namespace: Namespace, pending: _Pending, statuses: list[Any]
    ) -> None:
        # Redis lost this replica's id mapping, hence (no persistence, failover) its data: the
        # ledger is the authority, so its whole state is written again under a valid id.
        if any(int(s) == lua.APPLY_RID_TAKEN for s in statuses):
            self._rids.pop((replica, namespace), None)
        ledger = self._ledgers[(replica, namespace)]
        newer = self._pending.get((replica, namespace))
        snapshot = _Pending()
        snapshot.merge(
            LedgerChanges(dict(ledger.placements()), dict(ledger.engine)),
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

    async def restore_lost(self) -> int:
        """Write back the state of every tracked replica that Redis lost or holds older.

        The tracker calls this periodically, with no other write of this index in flight.

        * A different server answers (its ``run_id`` changed: a restart, with or without
          persistence, or a Sentinel failover to a replica that had not received the last
          writes): it may hold any older state of every replica. Each one's engine map is
          read back and the difference from its ledger written (:meth:`_reconcile`).
        * Otherwise, an id Redis lost (no persistence) is written back whole: a replica that
          keeps publishing would be with its next batch (APPLY reports the lost id), but an
          idle one would stay out of the index and, found nowhere, get no requests that would
          make it publish again. One pipelined HGET per replica.

        Returns how many replicas were written back.
        """
        server = await self.server_id()
        if self._server is not None and server != self._server:
            logger.warning(
                "a different redis server answers (restart or failover): "
                "reconciling every replica with its ledger",
                extra={"run_id": server, "replicas": len(self._ledgers)},
            )
            written = 0
            for replica, namespace in list(self._ledgers):
                written += await self._reconcile(replica, namespace)
            self._server = server
            return written
        self._server = server
        tracked = list(self._ledgers)
        if not tracked:
            return 0
        async with self.client.pipeline(transaction=False) as pipe:
            for replica, namespace in tracked:
                pipe.hget(self.keys_for(namespace).rid, replica)
            found = await self._call("verify", pipe.execute())
        lost = [key for key, rid in zip(tracked, found, strict=True) if rid is None]
        for key in lost:
            if key in self._ledgers and key not in self._pending:  # else a flush is due anyway
                # an empty write restores the id; APPLY says so and the state follows
                await self._commit(*key, LedgerChanges(), self._seqs.get(key, ""))
        return len(lost)

    async def claim_partitions(self, fence: int, election: str) -> int:
        """Raise every known partition's fence of ``election`` to ``fence`` (a tracker that
        just won the election, before it reads any ledger back): from then on the index
        refuses the writes of any tracker of that election elected before it. Returns how
        many partitions it claimed.

        :raises FencedError: if a tracker elected after this one already claimed one.
        """
        self.fence, self.election = fence, election
        nsids = await self._call("namespaces", self.client.hgetall(schema.NAMESPACES))
        for raw in nsids.values():
            meta = msgspec.json.decode(raw)
            namespace = Namespace(str(meta["model"]), int(meta["block_size"]))
            newest = int(
                await self._call(
                    "fence",
                    self._raise_fence(
                        keys=[self.keys_for(namespace).fence(election)], args=[fence]
                    ),
                )
            )
            if newest > fence:
                raise FencedError(f"a tracker elected after this one (fence {fence}) owns it")
        return len(nsids)

    async def server_id(self) -> str:
        """The answering server's ``run_id`` (new with every server process); of a cluster,
        its masters' (a failover of any one of them changes it).

        :raises IndexUnavailableError: if Redis does not answer.
        """
        return ",".join(str(info.get("run_id", "")) for info in await self._infos("server"))

    async def _reconcile(self, replica: str, namespace: Namespace) -> int:
        """Make Redis hold exactly what the replica's ledger says; 1 if anything differed.

        Every APPLY writes a replica's engine map and its placements in one script, so a
        server holding an older state holds an older state of both: the placements it lists
        follow from the engine map it holds, and the difference between the two engine maps
        is all that must be written (placements Redis holds that the ledger does not are
        removed, as in a clear).
        """
        key = (replica, namespace)
        ledger = self._ledgers[key]
        theirs = ReplicaLedger(replica, namespace)
        rid = self._rids.get(key)
        if rid is not None:
            theirs.load(await self._engine_map(rid, namespace))
        changes = LedgerChanges()
        held = dict(theirs.placements())
        for block, tiers in ledger.placements():
            if held.pop(block, 0) != tiers:
                changes.placements[block] = tiers
        changes.placements.update(dict.fromkeys(held, 0))
        for engine_hash, entry in ledger.engine.items():
            stale = theirs.engine.pop(engine_hash, None)
            if stale is None or stale.pack() != entry.pack():
                changes.engine[engine_hash] = entry
        changes.engine.update(dict.fromkeys(theirs.engine))
        if not (changes.placements or changes.engine):
            return 0
        logger.warning(
            "replica state in redis differs from its ledger, rewriting the difference",
            extra={
                "replica": replica,
                "placements": len(changes.placements),
                "engine_blocks": len(changes.engine),
            },
        )
        await self._commit(replica, namespace, changes, self._seqs.get(key, ""))
        return 1

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
        ledger = await self._ledger(replica, base)
        changes = ledger.apply(batch.events)
        result = ApplyResult(changes.stats, changes.cleared, len(ledger))
        await self._commit(replica, base, changes, "" if seq is None else str(seq))
        return result

    async def clear(self, replica: str, namespace: Namespace) -> int:
        base = namespace.base()
        ledger = await self._ledger(replica, base)
        held = len(ledger)
        await self._commit(replica, base, ledger.clear(), "-")
        return held

    async def forget(self, replica: str, namespace: Namespace) -> int:
        """Clear a departed replica and release its short id for reuse."""
        held = await self.clear(replica, namespace)
        base = namespace.base()
        nk = self.keys_for(base)
        await self._call(
            "release",
            self._release_rid(keys=[nk.rid, nk.rname, nk.ridfree], args=[replica]),
        )
        await self._call("stats", self.client.hdel(nk.stats, *nk.stats_fields(replica)))
        await self._call("lookahead", self.client.hdel(nk.lookahead, replica))
        self._rids.pop((replica, base), None)
        self._ledgers.pop((replica, base), None)
        self._seqs.pop((replica, base), None)
        return held

    async def last_seq(self, replica: str, namespace: Namespace) -> int | None:
        base = namespace.base()
        pending = self._pending.get((replica, base))
        if pending is not None and pending.seq:
            return None if pending.seq == "-" else int(pending.seq)
        value = await self._call("seq", self.client.hget(self.keys_for(base).seq, replica))
        return None if value is None else int(value)

    async def lookup(self, namespace: Namespace, keys: Sequence[int]) -> dict[str, Match]:
        return (await self.survey(namespace, keys)).matches

    async def survey(
        self,
        namespace: Namespace,
        keys: Sequence[int],
        *,
        load_except: str | None = None,
        load_ttl_s: float = LOAD_TTL_S,
    ) -> Survey:
        nk = self.keys_for(namespace)
        # an empty chain still walks nothing and answers the residency
        if load_except is None:
            call = self._lookup(keys=[nk.rname], args=[nk.tag, _chain(keys)])
        else:
            ttl_ms = max(1, round(load_ttl_s * 1000))  # as the load board rounds its own
            args: list[str | bytes | int] = [nk.tag, _chain(keys), load_except, ttl_ms]
            call = self._lookup(keys=[nk.rname, nk.load], args=args)
        found, stats, homes, others, ahead = await self._call("lookup", call)
        matches: dict[str, Match] = {}
        for i in range(0, len(found), 7):  # name, blocks, GPU, CPU, storage, remote, predicted
            name = found[i].decode()
            blocks, gpu, cpu, storage, remote, predicted = map(int, found[i + 1 : i + 7])
            matches[name] = Match(name, blocks, gpu, predicted, cpu, storage, remote)
        counts: dict[str, list[int]] = {}
        for i in range(0, len(stats) - 1, 2):
            kind, _, name = stats[i].decode().partition(":")
            slot = 0 if kind == "n" else 1
            counts.setdefault(name, [0, 0])[slot] = int(stats[i + 1])
        claims = {
            homes[i].decode(): Home(int(homes[i + 1]), max(0, int(homes[i + 2])) / 1000)
            for i in range(0, len(homes) - 2, 3)
        }
        residency = {r: Residency(max(0, n), s) for r, (n, s) in counts.items()}
        load = load_sums(others) if load_except is not None else None
        lookahead = {ahead[i].decode(): int(ahead[i + 1]) for i in range(0, len(ahead) - 1, 2)}
        return Survey(matches, residency, claims, load, lookahead)

    async def set_lookahead(self, replica: str, namespace: Namespace, tokens: int) -> None:
        key = self.keys_for(namespace.base()).lookahead
        write = self.client.hset(key, replica, tokens) if tokens else self.client.hdel(key, replica)
        await self._call("lookahead", write)

    async def claim(
        self, namespace: Namespace, replica: str, anchors: Sequence[int], ttl_s: float
    ) -> None:
        if not anchors:
            return
        nk = self.keys_for(namespace)
        tag = nk.tag
        await self._as_replica(
            "claim",
            namespace,
            replica,
            lambda rid, rname: self._claim(
                keys=rname, args=[tag, rid, _ms(ttl_s), _chain(anchors), replica]
            ),
            self._touched_by_routing(nk, (), anchors),
        )

    async def route(
        self,
        namespace: Namespace,
        replica: str,
        keys: Sequence[int],
        *,
        ttl_s: float,
        anchors: Sequence[int],
        home_ttl_s: float,
    ) -> None:
        if not keys or not anchors:  # one of the two, or nothing, to write
            await self.predict(namespace, replica, keys, ttl_s)
            await self.claim(namespace, replica, anchors, home_ttl_s)
            return
        nk = self.keys_for(namespace)
        tag = nk.tag
        args: list[bytes | int] = [_ms(ttl_s), _chain(keys), _ms(home_ttl_s), _chain(anchors)]
        await self._as_replica(
            "route",
            namespace,
            replica,
            lambda rid, rname: self._route(keys=rname, args=[tag, rid, replica, *args]),
            self._touched_by_routing(nk, keys, anchors),
        )

    async def predict(
        self, namespace: Namespace, replica: str, keys: Sequence[int], ttl_s: float
    ) -> None:
        if not keys:
            return
        nk = self.keys_for(namespace)
        tag = nk.tag
        await self._as_replica(
            "predict",
            namespace,
            replica,
            lambda rid, rname: self._predict(
                keys=rname, args=[tag, rid, _ms(ttl_s), _chain(keys), replica]
            ),
            self._touched_by_routing(nk, keys, ()),
        )

    def _touched_by_routing(
        self, nk: schema.NamespaceKeys, keys: Sequence[int], anchors: Sequence[int]
    ) -> list[str]:
        """On a cluster, the keys a routing write touches besides the rname hash: prediction
        buckets (and the live marker) of ``keys``, home buckets of ``anchors``."""
        if not self._cluster:
            return []
        touched = {nk.prediction_bucket(key) for key in keys}
        if keys:
            touched.add(nk.plive)
        touched.update(nk.home_bucket(key) for key in anchors)
        return sorted(touched)

    async def _as_replica(
        self,
        what: str,
        namespace: Namespace,
        replica: str,
        script: Callable[[int, list[str]], Awaitable[Any]],
        touched: list[str],
    ) -> None:
        """Run a router's write ``script(rid, [rname hash, *touched])`` under the replica's
        rid; the script answers -1, writing nothing, when the rid no longer names that replica
        (Redis lost data, or the rid was released and reused): then allocate (or look up) the
        current one and try once more."""
        base = namespace.base()
        rname = [self.keys_for(namespace).rname, *touched]
        for _ in range(2):
            rid = await self.rid(replica, base)
            if int(await self._call(what, script(rid, rname))) >= 0:
                return
            self._rids.pop((replica, base), None)

    async def block_count(self, replica: str, namespace: Namespace) -> int:
        return len(await self._ledger(replica, namespace))

    async def register(self, record: ReplicaRecord) -> None:
        await self._call(
            "heartbeat",
            self._heartbeat(
                keys=[schema.REPLICAS, schema.REPLICAS_SEEN],
                args=[record.id, msgspec.json.encode(record)],
            ),
        )

    async def _registry_call(self, mode: str) -> list[ReplicaRecord]:
        reply = await self._call(
            "registry", self._registry(keys=[schema.REPLICAS, schema.REPLICAS_SEEN], args=[mode])
        )
        records = []
        for i in range(1, len(reply), 3):
            try:
                record = _record_decoder.decode(reply[i + 2])
            except msgspec.DecodeError:
                logger.warning("ignoring malformed registry entry", extra={"replica": reply[i]})
                continue
            records.append(msgspec.structs.replace(record, last_seen=int(reply[i + 1]) / 1000))
        return records

    async def replicas(self) -> list[ReplicaRecord]:
        return await self._registry_call("list")

    async def deregister(self, replica: str) -> None:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hdel(schema.REPLICAS, replica)
            pipe.hdel(schema.REPLICAS_SEEN, replica)
            await self._call("deregister", pipe.execute())

    async def reap(self) -> list[ReplicaRecord]:
        return await self._registry_call("reap")

    async def memory(self) -> RedisMemory:
        """Redis's eviction policy and memory use.

        :raises IndexUnavailableError: if Redis does not answer.
        """
        infos = await self._infos("memory")
        # a cluster: the sum over its masters, and the worst policy any of them has
        policies = [str(info.get("maxmemory_policy", "noeviction")) for info in infos]
        evicting = [p for p in policies if p in EVICTING_POLICIES]
        return RedisMemory(
            policy=(evicting or policies)[0],
            used_bytes=sum(int(info.get("used_memory", 0)) for info in infos),
            max_bytes=sum(int(info.get("maxmemory", 0)) for info in infos),
        )

    async def _infos(self, section: str) -> list[dict[str, Any]]:
        """``INFO section`` of the server, or of every master of a cluster."""
        if isinstance(self.client, RedisCluster):
            nodes = await self._call(
                f"info {section}", self.client.info(section, target_nodes=RedisCluster.PRIMARIES)
            )
            return [nodes[name] for name in sorted(nodes)]
        return [await self._call(f"info {section}", self.client.info(section))]

    async def ping(self) -> bool:
        try:
            return bool(await self.client.ping())
        except (RedisError, OSError):
            return False

    async def close(self) -> None:
        await self._connection.aclose()
