"""Redis-backed block index shared by every router and tracker; keys from :mod:`tracker.core.keys`.

:class:`RedisIndex` answers lookups (one ``EVALSHA`` of :data:`tracker.core.lua.LOOKUP` walks
the chain server-side, a segment at a time where it is held whole), takes the routers' writes
and keeps the replica registry; it has a :class:`~tracker.core.redis_writes.RedisWriter` for
the trackers' writes and a :class:`~tracker.core.redis_recovery.RedisRecovery` for the
server's upkeep.
"""

from __future__ import annotations

import logging
import sys
import time
from array import array
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

import msgspec
import redis.asyncio as redis
from redis.exceptions import RedisError

from tracker.core import keys as schema
from tracker.core import lua
from tracker.core.blocks import Namespace
from tracker.core.events import EventBatch
from tracker.core.index import (
    LOAD_TTL_S,
    ApplyResult,
    Home,
    Match,
    ReplicaRecord,
    Residency,
    Route,
    Survey,
)
from tracker.core.redis_client import RedisConnection, open_redis, redis_call
from tracker.core.redis_recovery import RedisMemory, RedisRecovery
from tracker.core.redis_writes import RedisWriter

logger = logging.getLogger(__name__)

_LITTLE_ENDIAN: Final = sys.byteorder == "little"
_record_decoder = msgspec.json.Decoder(ReplicaRecord)


def _ms(seconds: float) -> int:
    """A script's ttl argument: whole milliseconds, at least one."""
    return max(1, int(seconds * 1000))


def load_sums(reply: Sequence[Any]) -> dict[str, tuple[int, int, int]]:
    """A load snapshot's reply (``load_snapshot`` of :mod:`tracker.core.lua`: replica, in
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


def _chain(keys: Sequence[int]) -> bytes:
    """Block keys as one blob of 8-byte big-endian fields (one script argument)."""
    chain = array("Q", keys)
    if _LITTLE_ENDIAN:
        chain.byteswap()
    return chain.tobytes()


class RedisIndex:
    """The shared index. Construct with :meth:`from_url` or around an existing client.

    :param client: the Redis client, shared with its :attr:`writer` and :attr:`recovery`.
    :param connection: what to close with the client (Sentinel clients); by default the
        client alone.
    """

    def __init__(
        self,
        client: redis.Redis,
        connection: RedisConnection | None = None,
        *,
        segment_blocks: int = schema.SEGMENT_BLOCKS,
    ) -> None:
        self.client = client
        self._connection = connection or RedisConnection(client)
        self.segment_blocks = segment_blocks
        """Blocks per segment: the partition's layout (tests use short ones)."""
        self.writer = RedisWriter(client, segment_blocks=segment_blocks)
        """The trackers' writes: ledgers, ``APPLY``, pending changes, replica ids."""
        self.recovery = RedisRecovery(self.writer)
        """The server's upkeep: what it lost written back, partition fences, memory."""
        self._lookup = client.register_script(lua.LOOKUP)
        self._predict = client.register_script(lua.PREDICT)
        self._claim = client.register_script(lua.CLAIM)
        self._route = client.register_script(lua.ROUTE)
        self._heartbeat = client.register_script(lua.HEARTBEAT)
        self._registry = client.register_script(lua.REGISTRY)

    @classmethod
    def from_url(
        cls, url: str, *, timeout_s: float = 2.0, segment_blocks: int = schema.SEGMENT_BLOCKS
    ) -> RedisIndex:
        """Open the index at ``url``: a server, a Sentinel-monitored primary or a Redis
        Cluster (:func:`tracker.core.redis_client.open_redis`)."""
        connection = open_redis(url, timeout_s=timeout_s)
        return cls(connection.client, connection, segment_blocks=segment_blocks)

    # ----------------------------------------------------------- the trackers' writes (writer)

    async def apply(
        self, replica: str, namespace: Namespace, batch: EventBatch, seq: int | None = None
    ) -> ApplyResult:
        return await self.writer.apply(replica, namespace, batch, seq)

    async def clear(self, replica: str, namespace: Namespace) -> int:
        return await self.writer.clear(replica, namespace)

    async def forget(self, replica: str, namespace: Namespace) -> int:
        """Clear a departed replica and release its short id for reuse."""
        return await self.writer.forget(replica, namespace)

    async def last_seq(self, replica: str, namespace: Namespace) -> int | None:
        return await self.writer.last_seq(replica, namespace)

    async def block_count(self, replica: str, namespace: Namespace) -> int:
        return await self.writer.block_count(replica, namespace)

    async def flush(self) -> int:
        """Retry every pending write; returns how many replicas are still pending."""
        return await self.writer.flush()

    # ----------------------------------------------------------- the server's upkeep (recovery)

    async def restore_lost(self) -> int:
        """Write back every tracked replica that Redis lost or holds older; returns how many
        (:meth:`tracker.core.redis_recovery.RedisRecovery.restore_lost`)."""
        return await self.recovery.restore_lost()

    async def claim_partitions(self, fence: int, election: str) -> int:
        """Raise every known partition's fence of ``election`` to ``fence``; returns how many
        (:meth:`tracker.core.redis_recovery.RedisRecovery.claim_partitions`).

        :raises FencedError: if a tracker elected after this one already claimed one.
        """
        return await self.recovery.claim_partitions(fence, election)

    async def memory(self) -> RedisMemory:
        """Redis's eviction policy and memory use.

        :raises IndexUnavailableError: if Redis does not answer.
        """
        return await self.recovery.memory()

    # ----------------------------------------------------------- reads and the routers' writes

    async def lookup(self, namespace: Namespace, keys: Sequence[int]) -> dict[str, Match]:
        return (await self.survey(namespace, keys)).matches

    async def survey(
        self,
        namespace: Namespace,
        keys: Sequence[int],
        *,
        load_except: str | None = None,
        load_ttl_s: float = LOAD_TTL_S,
        session: int | None = None,
    ) -> Survey:
        nk = self.writer.keys_for(namespace)
        # an empty chain still walks nothing and answers the residency
        chain = _chain(keys)
        span = self.segment_blocks
        ends = [chain[i * 8 - 8 : i * 8] for i in range(span, len(keys) + 1, span)]
        home = b"" if session is None else _chain([session])
        if load_except is None:
            args: list[str | bytes | int] = [nk.tag, chain, span, "", 0, home, *ends]
            call = self._lookup(keys=[nk.rname], args=args)
        else:
            ttl_ms = max(1, round(load_ttl_s * 1000))  # as the load board rounds its own
            args = [nk.tag, chain, span, load_except, ttl_ms, home, *ends]
            call = self._lookup(keys=[nk.rname, nk.load], args=args)
        found, stats, homes, others, ahead, claim, lives = await redis_call("lookup", call)
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
        sessions = (
            {claim[0].decode(): Home(len(keys), max(0, int(claim[1])) / 1000)} if claim else {}
        )
        live = {lives[i].decode(): int(lives[i + 1]) for i in range(0, len(lives) - 1, 2)}
        return Survey(matches, residency, claims, load, lookahead, sessions, live)

    async def set_lookahead(self, replica: str, namespace: Namespace, tokens: int) -> None:
        key = self.writer.keys_for(namespace.base()).lookahead
        write = self.client.hset(key, replica, tokens) if tokens else self.client.hdel(key, replica)
        await redis_call("lookahead", write)

    async def claim(
        self, namespace: Namespace, replica: str, anchors: Sequence[int], ttl_s: float
    ) -> None:
        if not anchors:
            return
        nk = self.writer.keys_for(namespace)
        tag = nk.tag
        await self._as_replica(
            "claim",
            namespace,
            replica,
            lambda rid, rname: self._claim(
                keys=rname, args=[tag, rid, _ms(ttl_s), _chain(anchors), replica]
            ),
            self._touched_by_routing(nk, (), anchors, 0.0),
        )

    async def route(self, namespace: Namespace, route: Route) -> None:
        replica, keys, anchors = route.replica, route.keys, route.anchors
        if not anchors:  # predictions alone, or nothing, to write
            await self._predict_from(namespace, replica, keys, route.ttl_s, route.first)
            return
        nk = self.writer.keys_for(namespace)
        tag = nk.tag
        args: list[bytes | int] = [
            _ms(route.ttl_s),
            _chain(keys),
            _ms(route.home_ttl_s),
            _chain(anchors),
            route.first,
            self.segment_blocks,
            b"" if route.session is None else _chain([route.session]),
            _ms(route.session_ttl_s),
        ]
        await self._as_replica(
            "route",
            namespace,
            replica,
            lambda rid, rname: self._route(keys=rname, args=[tag, rid, replica, *args]),
            self._touched_by_routing(nk, keys, anchors, route.ttl_s),
        )

    def route_now(self, namespace: Namespace, route: Route) -> bool:
        return False  # the index is in Redis: every write is a round trip

    def survey_now(
        self, namespace: Namespace, keys: Sequence[int], session: int | None = None
    ) -> Survey | None:
        return None  # the index is in Redis: every read is a round trip

    async def predict(
        self, namespace: Namespace, replica: str, keys: Sequence[int], ttl_s: float
    ) -> None:
        await self._predict_from(namespace, replica, keys, ttl_s, 0)

    async def _predict_from(
        self, namespace: Namespace, replica: str, keys: Sequence[int], ttl_s: float, first: int
    ) -> None:
        """:meth:`predict` of ``keys`` starting at position ``first`` of their chain."""
        if not keys:
            return
        nk = self.writer.keys_for(namespace)
        tag, span = nk.tag, self.segment_blocks
        await self._as_replica(
            "predict",
            namespace,
            replica,
            lambda rid, rname: self._predict(
                keys=rname, args=[tag, rid, _ms(ttl_s), _chain(keys), replica, first, span]
            ),
            self._touched_by_routing(nk, keys, (), ttl_s),
        )

    def _touched_by_routing(
        self, nk: schema.NamespaceKeys, keys: Sequence[int], anchors: Sequence[int], ttl_s: float
    ) -> list[str]:
        """On a cluster, the keys a routing write touches besides the rname hash: prediction
        buckets (and the live marker) of ``keys``, home buckets of ``anchors``, and the slots
        of segment predictions its expiry may fall in (by this host's clock, give or take a
        slot: Redis' own decides)."""
        if not self.writer.cluster:
            return []
        touched = {nk.prediction_bucket(key) for key in keys}
        if keys:
            touched.add(nk.plive)
            slot = (round(time.time() * 1000) + _ms(ttl_s)) // schema.PREDICTION_SLOT_MS
            touched.update(nk.prediction_segments(s) for s in (slot - 1, slot, slot + 1))
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
        rname = [self.writer.keys_for(namespace).rname, *touched]
        for _ in range(2):
            rid = await self.writer.rid(replica, base)
            if int(await redis_call(what, script(rid, rname))) >= 0:
                return
            self.writer.drop_rid(replica, base)

    # ----------------------------------------------------------- the replica registry

    async def register(self, record: ReplicaRecord) -> None:
        await redis_call(
            "heartbeat",
            self._heartbeat(
                keys=[schema.REPLICAS, schema.REPLICAS_SEEN],
                args=[record.id, msgspec.json.encode(record)],
            ),
        )

    async def _registry_call(self, mode: str) -> list[ReplicaRecord]:
        reply = await redis_call(
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
            await redis_call("deregister", pipe.execute())

    async def reap(self) -> list[ReplicaRecord]:
        return await self._registry_call("reap")

    async def ping(self) -> bool:
        try:
            return bool(await self.client.ping())
        except (RedisError, OSError):
            return False

    async def close(self) -> None:
        await self._connection.aclose()
