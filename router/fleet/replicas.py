"""The replicas a router may send requests to: configured and registered ones, with their health.

A replica is in rotation while healthy. It leaves after ``unhealthy_after`` failures in a row
(failed health checks, or requests that got no answer) or at once when its connection is
refused, and comes back with its next successful health check. Registered replicas come and
go with the registry: one missing from it is dropped once it has been missing for its
record's ``ttl_s`` (a Redis that restarted empty is refilled by the next heartbeats, which
must not empty the router in between); an unreachable registry changes nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from tracker.core.blocks import Namespace
from tracker.core.index import RECORD_TTL_S, ReplicaRecord
from tracker.core.replicas import ReplicaSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What a replica's own ``/metrics`` said, and when (``time.monotonic()``)."""

    running: int | None
    waiting: int | None
    kv_usage: float | None
    at: float
    cache_blocks: int | None = None
    # of its running and waiting requests, those taken as the routers' (None: unknown): all
    # but outside traffic seen in this scrape and the one before (router.fleet.health)
    routed: int | None = None
    unrouted: int = 0  # its requests no router counted at this scrape alone


@dataclass(slots=True)
class Replica:
    """One upstream replica and what the router knows about it."""

    id: str
    url: str
    model: str
    block_size: int
    static: bool
    instance: str = ""
    healthy: bool = True
    failures: int = 0
    last_error: str = ""
    changed_at: float = field(default_factory=time.monotonic)
    engine: EngineLoad | None = None
    ttl_s: float = RECORD_TTL_S
    missing_since: float | None = None
    cache_blocks: int | None = None  # KV-cache size, from the engine's cache_config_info
    adapters: frozenset[str] = frozenset()  # LoRA adapters it serves, from its /v1/models

    @property
    def namespace(self) -> Namespace:
        return Namespace(self.model, self.block_size)


class ReplicaSet:
    """Every known replica by id; the health state machine; candidates per model.

    :param specs: replicas given with ``--replica`` (always known, whatever the registry says).
    :param model: / :param block_size: defaults for specs that do not name their own.
    :param unhealthy_after: failures in a row that take a replica out of rotation.
    :param engine_stale_s: engine metrics older than this are ignored.
    """

    def __init__(
        self,
        specs: Iterable[ReplicaSpec],
        *,
        model: str,
        block_size: int,
        unhealthy_after: int,
        engine_stale_s: float,
    ) -> None:
        self.unhealthy_after = unhealthy_after
        self.engine_stale_s = engine_stale_s
        self._specs = {spec.id: spec for spec in specs}
        self._replicas: dict[str, Replica] = {}
        for spec in self._specs.values():
            assert spec.url is not None  # RouterSettings requires it
            self._replicas[spec.id] = Replica(
                spec.id, spec.url, spec.model or model, spec.block_size or block_size, True
            )

    def __len__(self) -> int:
        return len(self._replicas)

    def get(self, replica: str) -> Replica | None:
        return self._replicas.get(replica)

    def all(self) -> list[Replica]:
        return sorted(self._replicas.values(), key=lambda r: r.id)

    def models(self) -> list[str]:
        """Every model and LoRA adapter some replica serves."""
        names = {r.model for r in self._replicas.values()}
        for replica in self._replicas.values():
            names |= replica.adapters
        return sorted(names)

    def serves(self, model: str) -> bool:
        return self.resolve(model) is not None

    def resolve(self, name: str) -> tuple[str, str | None] | None:
        """``(model, None)`` for a model, ``(base model, name)`` for a LoRA adapter (vLLM
        serves each under its own name); None when no replica serves ``name``."""
        replicas = self._replicas.values()
        if any(r.model == name for r in replicas):
            return name, None
        base = next((r.model for r in replicas if name in r.adapters), None)
        return None if base is None else (base, name)

    def candidates(self, model: str, lora: str | None = None) -> list[Replica]:
        """Healthy replicas serving ``model`` (with the adapter ``lora``), in id order."""
        return [
            r
            for r in self.all()
            if r.model == model and r.healthy and (lora is None or lora in r.adapters)
        ]

    def in_rotation(self, ids: Iterable[str]) -> Iterator[Replica]:
        """The replicas of ``ids`` that are known and healthy, in that order."""
        for replica_id in ids:
            replica = self._replicas.get(replica_id)
            if replica is not None and replica.healthy:
                yield replica

    def engine_load(self, replica: Replica, now: float | None = None) -> EngineLoad | None:
        """The replica's engine metrics if fresh enough to use."""
        engine = replica.engine
        if engine is None:
            return None
        now = time.monotonic() if now is None else now
        return engine if now - engine.at <= self.engine_stale_s else None

    # ------------------------------------------------------------------ registry

    def reconcile(
        self, records: Iterable[ReplicaRecord], now: float | None = None
    ) -> tuple[list[str], list[str]]:
        """Adopt the registry's view; returns ``(added, removed)`` replica ids.

        A configured replica takes its block size (unless its spec gives one) and instance
        from its record; registered replicas without a URL cannot be routed to.
        """
        now = time.monotonic() if now is None else now
        added: list[str] = []
        seen: set[str] = set()
        for record in records:
            seen.add(record.id)
            current = self._replicas.get(record.id)
            if current is not None:
                current.missing_since = None
                current.ttl_s = record.ttl_s
            spec = self._specs.get(record.id)
            if spec is not None and current is not None:
                if spec.block_size is None:
                    current.block_size = record.block_size
                self._restarted(current, record.instance)
                continue
            if record.url is None or record.block_size <= 0:
                continue
            if current is None:
                self._replicas[record.id] = Replica(
                    record.id,
                    record.url,
                    record.model,
                    record.block_size,
                    False,
                    record.instance,
                    ttl_s=record.ttl_s,
                )
                added.append(record.id)
                logger.info(
                    "replica discovered",
                    extra={"replica": record.id, "url": record.url, "model": record.model},
                )
                continue
            current.url, current.model, current.block_size = (
                record.url,
                record.model,
                record.block_size,
            )
            self._restarted(current, record.instance)
        removed = []
        for rid, replica in self._replicas.items():
            if replica.static or rid in seen:
                continue
            if replica.missing_since is None:
                replica.missing_since = now
            if now - replica.missing_since >= replica.ttl_s:
                removed.append(rid)
        for rid in removed:
            del self._replicas[rid]
            logger.info("replica left the registry", extra={"replica": rid})
        return added, removed

    def _restarted(self, replica: Replica, instance: str) -> None:
        if replica.instance and instance and instance != replica.instance:
            logger.info("replica restarted", extra={"replica": replica.id})
            replica.engine = None
        replica.instance = instance or replica.instance

    # ------------------------------------------------------------------ health

    def succeeded(self, replica_id: str) -> bool:
        """A health check or request went well; returns True if the replica came back."""
        replica = self._replicas.get(replica_id)
        if replica is None:
            return False
        replica.failures = 0
        if replica.healthy:
            return False
        replica.healthy = True
        replica.last_error = ""
        replica.changed_at = time.monotonic()
        logger.info("replica healthy again", extra={"replica": replica_id})
        return True

    def failed(self, replica_id: str, error: str, *, now: bool = False) -> bool:
        """A health check or request failed; returns True if the replica just left rotation.

        :param now: take it out at once (its connection was refused: nothing listens).
        """
        replica = self._replicas.get(replica_id)
        if replica is None:
            return False
        replica.failures += 1
        replica.last_error = error
        if not replica.healthy or (not now and replica.failures < self.unhealthy_after):
            return False
        replica.healthy = False
        replica.changed_at = time.monotonic()
        replica.engine = None
        logger.warning(
            "replica out of rotation",
            extra={"replica": replica_id, "failures": replica.failures, "error": error},
        )
        return True
