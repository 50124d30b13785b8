"""A second home for a prefix whose only home runs short of KV memory, copied off the path.

A prefix group that shares an engine with others keeps little KV memory for its running
requests, and a burst of the group there waits while the other engines idle. The policy
moves a request off such a home only when the request's own wait there costs more than a
cold prefill elsewhere, and then that request pays the prefill: each move is one slow answer
(and ties the group's tail to how the moment's gauges read). Here the copy is made by the
router instead: when a request hits a prefix held by one replica whose KV usage is at
``kv_usage`` or more, and another replica is idle with room in its cache for the prefix
beside the prefixes routed requests keep using there, the router sends that replica the
prefix's tokens as a one-token completion in the background. No client waits for it; the
next requests of the group find two homes and go to the less loaded one.

A copy takes KV memory the fleet's own bursts need, so it is made only while the fleet keeps
``headroom`` times what its requests in flight take beside the prefixes in use (their mean
count, which a router watches for ``watch_s`` before it copies anything), and only to an
idle replica whose cache holds it beside the prefixes reused there. Where the caches cannot
hold a second copy, or the fleet is loaded, or no replica is idle, nothing is copied and the
policy's choices are unchanged.

:func:`plan_copy` decides (pure); :class:`Replicator` sends and counts. The copy goes through
the shared load board like a routed request (its prefill is queued work there) and is
announced as a prediction on its blocks, so every router sees the second home at once and
none copies the prefix again. docs/architecture.md ("Second homes") has the numbers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from uuid import uuid4

import msgspec

from router.breaker import GuardedIndex
from router.errors import UpstreamError
from router.load import LoadBoard
from router.metrics import RouterMetrics
from router.occupancy import OccupancyBook
from router.policy import ReplicaState
from router.replicas import ReplicaSet
from router.upstream import UpstreamClient
from tracker.blocks import Namespace

logger = logging.getLogger(__name__)

COMPLETIONS = "/v1/completions"


@dataclass(frozen=True, slots=True)
class CopyConfig:
    """When a prefix gets a second home (module docstring).

    :param kv_usage: the home's KV usage (0..1) from which its single-homed prefixes are
        copied (above 1: never).
    :param min_blocks: shorter prefixes are not worth a copy.
    :param idle_inflight: a destination has at most this many requests in flight...
    :param idle_kv_usage: ...and at most this KV usage...
    :param fill: ...and its reused prefixes plus the copy take at most this share of its
        cache (1: they fit; a copy that does not fit beside them would evict one).
    :param interval_s: a prefix is copied at most once per this many seconds per router.
    :param headroom: after the copy, the fleet's KV memory beside the prefixes in use holds
        this many times what its requests in flight take, on average (halving its weight
        every ``watch_s / 2``): a copy takes room the fleet's bursts need.
    :param watch_s: a router copies nothing until it has watched the fleet's load this long.
    """

    kv_usage: float = 0.85
    min_blocks: int = 32
    idle_inflight: int = 1
    idle_kv_usage: float = 0.5
    fill: float = 1.0
    interval_s: float = 30.0
    headroom: float = 3.0
    watch_s: float = 20.0


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """Copy the first ``blocks`` blocks of the prompt to ``replica``."""

    replica: str
    blocks: int


def plan_copy(
    states: Sequence[ReplicaState],
    chosen: str,
    config: CopyConfig,
    *,
    fleet_inflight: float = 0.0,
    request_blocks: int = 0,
) -> CopyPlan | None:
    """Where to copy the prefix a request routed to ``chosen`` hit, or None.

    Only a hit on the one replica holding the prefix, at a home whose KV usage has reached
    ``config.kv_usage``, is copied; to the idle replica with the most room for it, while
    the fleet keeps ``config.headroom`` times the KV its ``fleet_inflight`` requests (of
    ``request_blocks`` blocks beyond their prefix each) take.
    """
    home = next((s for s in states if s.id == chosen), None)
    if home is None or home.kv_usage is None or home.kv_usage < config.kv_usage:
        return None
    blocks = home.matched_gpu_blocks
    if blocks < config.min_blocks:
        return None
    if any(s.matched_blocks * 2 >= blocks for s in states if s.id != chosen):
        return None  # it has a second home already (or one on its way)
    room: list[tuple[int, int, str]] = []
    for s in states:
        if s.id == chosen or s.cache_blocks is None or s.valued_blocks is None:
            continue
        if s.kv_usage is None or s.kv_usage > config.idle_kv_usage:
            continue
        if s.inflight > config.idle_inflight or (s.engine_waiting or 0) > 0:
            continue
        if s.valued_blocks + blocks > config.fill * s.cache_blocks:
            continue
        room.append((s.valued_blocks, s.inflight, s.id))
    if not room:
        return None
    free = 0
    for s in states:
        if s.cache_blocks is None or s.valued_blocks is None:
            return None
        free += max(0, s.cache_blocks - s.valued_blocks)
    if free - blocks < config.headroom * fleet_inflight * request_blocks:
        return None
    return CopyPlan(min(room)[2], blocks)


class Replicator:
    """Sends the copies :func:`plan_copy` plans, in the background, one per prefix at a time."""

    def __init__(
        self,
        config: CopyConfig,
        *,
        replicas: ReplicaSet,
        upstream: UpstreamClient,
        load: LoadBoard,
        shared: GuardedIndex,
        metrics: RouterMetrics,
        predict_ttl_s: float,
        timeout_s: float,
    ) -> None:
        self.config = config
        self.replicas = replicas
        self.upstream = upstream
        self.load = load
        self.shared = shared
        self.metrics = metrics
        self.predict_ttl_s = predict_ttl_s
        self.timeout_s = timeout_s
        self._last: dict[tuple[Namespace, int], float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._fleet = OccupancyBook(max(config.watch_s, 1e-3) / 2)
        self._since: float | None = None

    def plan(
        self, states: Sequence[ReplicaState], chosen: str, request_blocks: int
    ) -> CopyPlan | None:
        """:func:`plan_copy` with the fleet's requests in flight lately (observed now).

        Nothing is copied until this router has watched the fleet for ``watch_s`` (two
        half-lives of the mean): before that the mean is not the load yet. At 50 % load a
        copy made 8 s into a run, on the mean or the highest count seen so far, left a
        two-prefix engine with three prefixes, and TTFT p95 was 260 ms against 160.
        """
        now = time.monotonic()
        fleet = self._fleet.observe("fleet", sum(s.inflight for s in states))
        if self._since is None:
            self._since = now
        if now - self._since < self.config.watch_s:
            return None
        return plan_copy(
            states, chosen, self.config, fleet_inflight=fleet, request_blocks=request_blocks
        )

    def copy(
        self,
        plan: CopyPlan,
        namespace: Namespace,
        ids: list[int],
        keys: list[int],
        cache_salt: str | None,
    ) -> bool:
        """Start copying ``plan``'s prefix of ``ids`` (False: copied lately, or unknown)."""
        replica = self.replicas.get(plan.replica)
        if replica is None or not replica.healthy or not keys:
            return False
        now = time.monotonic()
        last = self._last.get((namespace, keys[0]))
        if last is not None and now - last < self.config.interval_s:
            return False
        self._last[(namespace, keys[0])] = now
        if len(self._last) > 4096:  # forget the stale
            horizon = now - self.config.interval_s
            self._last = {k: t for k, t in self._last.items() if t >= horizon}
        tokens = ids[: plan.blocks * namespace.block_size]
        body: dict[str, object] = {
            "model": namespace.lora_name or namespace.model,
            "prompt": tokens,
            "max_tokens": 1,
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        # every router sees the second home (and copies no more) before the engine says so
        self.shared.predict(namespace, plan.replica, keys[: plan.blocks], self.predict_ttl_s)
        task = asyncio.create_task(
            self._send(namespace, plan.replica, replica.url, msgspec.json.encode(body), len(tokens))
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _send(
        self, namespace: Namespace, replica: str, url: str, body: bytes, tokens: int
    ) -> None:
        lease = self.load.acquire(namespace, replica, tokens)
        headers = {
            "content-type": "application/json",
            "x-request-id": f"kvrouter-copy-{uuid4().hex}",
        }
        outcome = "ok"
        try:
            upstream = await self.upstream.open(
                replica,
                url,
                COMPLETIONS,
                body,
                headers,
                timeout_s=self.timeout_s,
            )
            try:
                await upstream.read(self.timeout_s)
            finally:
                await upstream.aclose()
            if upstream.status >= 300:
                outcome = "status"
                logger.warning(
                    "prefix copy refused",
                    extra={"replica": replica, "status": upstream.status, "tokens": tokens},
                )
        except UpstreamError as exc:
            outcome = "error"
            logger.info("prefix copy failed", extra={"replica": replica, "error": exc.message})
        finally:
            lease.release()
            self.metrics.prefix_copies.labels(replica, outcome).inc()

    async def stop(self) -> None:
        """Cancel the copies under way (they are only hints)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
