"""The shared index's upkeep: what Redis lost written back, partition fences, its memory.

A tracker notices a different server answering (a restart, a failover) and writes back, from
its ledgers, whatever Redis lost or holds older; an elected tracker claims the partitions it
writes; the tracker service watches Redis's memory and eviction policy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Final

import msgspec
from redis.asyncio.cluster import RedisCluster

from tracker.core import keys as schema
from tracker.core import lua
from tracker.core.blocks import Namespace
from tracker.core.ledger import LedgerChanges
from tracker.core.redis_client import redis_call
from tracker.core.redis_writes import RedisWriter
from tracker.framework.errors import FencedError

logger = logging.getLogger(__name__)

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


class RedisRecovery:
    """The upkeep of the server the index lives on: what it lost written back from the
    writer's ledgers, the election's partition fences, and its memory.

    :class:`tracker.core.redis_index.RedisIndex` builds one around its writer.

    :param writer: the index's writer (its client, key names, ledgers and fence).
    """

    def __init__(self, writer: RedisWriter) -> None:
        self.writer = writer
        self.client = writer.client
        self._server: str | None = None  # run_id of the server the ledgers were last written to
        self._raise_fence = writer.client.register_script(lua.FENCE_RAISE)

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
                extra={"run_id": server, "replicas": len(self.writer.ledgers)},
            )
            written = 0
            for replica, namespace in list(self.writer.ledgers):
                written += await self._reconcile(replica, namespace)
            self._server = server
            return written
        self._server = server
        tracked = list(self.writer.ledgers)
        if not tracked:
            return 0
        async with self.client.pipeline(transaction=False) as pipe:
            for replica, namespace in tracked:
                pipe.hget(self.writer.keys_for(namespace).rid, replica)
            found = await redis_call("verify", pipe.execute())
        lost = [key for key, rid in zip(tracked, found, strict=True) if rid is None]
        for key in lost:
            if key in self.writer.ledgers and not self.writer.has_pending(*key):
                # (else a flush is due anyway) an empty write restores the id; APPLY says so
                # and the state follows
                await self.writer.rewrite(*key, LedgerChanges())
        return len(lost)

    async def claim_partitions(self, fence: int, election: str) -> int:
        """Raise every known partition's fence of ``election`` to ``fence`` (a tracker that
        just won the election, before it reads any ledger back): from then on the index
        refuses the writes of any tracker of that election elected before it. Returns how
        many partitions it claimed.

        :raises FencedError: if a tracker elected after this one already claimed one.
        """
        self.writer.fence, self.writer.election = fence, election
        nsids = await redis_call("namespaces", self.client.hgetall(schema.NAMESPACES))
        for raw in nsids.values():
            meta = msgspec.json.decode(raw)
            namespace = Namespace(str(meta["model"]), int(meta["block_size"]))
            newest = int(
                await redis_call(
                    "fence",
                    self._raise_fence(
                        keys=[self.writer.keys_for(namespace).fence(election)], args=[fence]
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
        ledger = self.writer.ledgers[(replica, namespace)]
        theirs = self.writer.new_ledger(replica, namespace)
        rid = self.writer.known_rid(replica, namespace)
        if rid is not None:
            theirs.load(await self.writer.engine_map(rid, namespace))
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
        for key, segment in ledger.segments.items():
            if theirs.segments.pop(key, None) != segment:
                changes.segments[key] = segment
        changes.segments.update(dict.fromkeys(theirs.segments))
        if not (changes.placements or changes.engine or changes.segments):
            return 0
        logger.warning(
            "replica state in redis differs from its ledger, rewriting the difference",
            extra={
                "replica": replica,
                "placements": len(changes.placements),
                "engine_blocks": len(changes.engine),
            },
        )
        await self.writer.rewrite(replica, namespace, changes)
        return 1

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
            nodes = await redis_call(
                f"info {section}", self.client.info(section, target_nodes=RedisCluster.PRIMARIES)
            )
            return [nodes[name] for name in sorted(nodes)]
        return [await redis_call(f"info {section}", self.client.info(section))]
