"""The in-process block index, :class:`MemoryIndex`, and the chain walk it looks up with.

The default for a single router process without Redis (and the embedded tracker's index);
it keeps the :class:`~tracker.core.index.BlockIndex` contract
(``tests/tracker/test_index_contract.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import ClassVar, Final, TypeAlias

import msgspec

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
from tracker.core.keys import SEGMENT_BLOCKS, TIER_BITS, home_anchors
from tracker.core.ledger import LedgerChanges, ReplicaLedger, Segment

_PREDICTION_SWEEP = 10_000

Segments: TypeAlias = dict[int, dict[str, Segment]]
"""Per segment (its last block's key), the replicas holding it whole and their counts."""


def _best_slot(tiers: int) -> int:
    """Which count of a run a block in ``tiers`` adds to: its cheapest tier's (GPU first)."""
    return (tiers & -tiers).bit_length() - 1


_BEST_SLOT: Final = tuple(_best_slot(t) for t in range(1 << TIER_BITS))


def _match(replica: str, blocks: int, counts: list[int] | None, predicted: int) -> Match:
    gpu, cpu, storage, remote = counts or (0, 0, 0, 0)
    return Match(replica, blocks, gpu, predicted, cpu, storage, remote)


def walk(
    keys: Sequence[int],
    holders_of: dict[int, dict[str, int]],
    predicted_of: Callable[[int], Iterable[str]] | None = None,
    segments: Segments | None = None,
    segment_blocks: int = SEGMENT_BLOCKS,
) -> dict[str, Match]:
    """Longest contiguous match per replica; stops at the first block no candidate holds.

    At each segment boundary (every ``segment_blocks`` blocks), when every replica still
    matching holds the whole segment (``segments``: per segment's last key, its holders' counts
    per tier), they all skip it at once. Otherwise blocks are walked: consecutive blocks held
    by the same replicas (the common case: a shared prefix) compare equal as dicts, so a run
    costs one C-level comparison per block instead of a loop. Where real placements end,
    ``predicted_of(key)`` (replicas predicted to hold ``key``) extends the replicas still
    matching, or any replica if nothing matched. Each block of a run counts in the cheapest
    tier the replica holds it in.
    """
    lengths: dict[str, int] = {}
    tiers: dict[str, list[int]] = {}
    advanced: list[tuple[str, int]] = []
    previous: dict[str, int] | None = None
    depth = pending = 0
    span, n, i = segment_blocks, len(keys), 0
    while i < n:
        boundary = i % span == 0 and i + span <= n
        whole = segments.get(keys[i + span - 1]) if segments and boundary else None
        if whole is not None:
            for replica, slot in advanced:
                lengths[replica] += pending
                tiers[replica][slot] += pending
            depth, pending = depth + pending, 0
            if not depth:  # the candidates: the first block's holders
                lengths = dict.fromkeys(holders_of.get(keys[0]) or (), 0)
                tiers = {replica: [0, 0, 0, 0] for replica in lengths}
            if _skip(whole, lengths, tiers, depth, span):
                depth += span
                i += span
                advanced, previous = [], None
                continue
        holders = holders_of.get(keys[i])
        if not holders:
            break
        i += 1
        if holders == previous:
            pending += 1
            continue
        for replica, slot in advanced:
            lengths[replica] += pending
            tiers[replica][slot] += pending
        depth += pending
        if depth == 0:
            lengths = dict.fromkeys(holders, 0)
            tiers = {replica: [0, 0, 0, 0] for replica in holders}
        advanced = [(r, _BEST_SLOT[t]) for r, t in holders.items() if lengths.get(r, -1) == depth]
        if not advanced:
            pending = 0
            break
        previous, pending = holders, 1
    for replica, slot in advanced:
        lengths[replica] += pending
        tiers[replica][slot] += pending
    predicted: dict[str, int] = {}
    if predicted_of is not None:
        _extend(
            keys,
            depth + pending,
            holders_of=holders_of,
            predicted_of=predicted_of,
            lengths=lengths,
            tiers=tiers,
            predicted=predicted,
        )
    return {r: _match(r, n, tiers.get(r), predicted.get(r, 0)) for r, n in lengths.items() if n}


def _skip(
    whole: dict[str, Segment],
    lengths: dict[str, int],
    tiers: dict[str, list[int]],
    depth: int,
    span: int,
) -> bool:
    """Move every replica still matching (its run ``depth`` long) over a segment if each of
    them holds it ``whole``; False, moving none, if any does not (or none matches)."""
    matching = [r for r, length in lengths.items() if length == depth]
    if not matching or any(r not in whole for r in matching):
        return False
    for replica in matching:
        lengths[replica] += span
        counts = tiers[replica]
        for slot, count in enumerate(whole[replica]):
            counts[slot] += count
    return True


def _extend(
    keys: Sequence[int],
    depth: int,
    *,
    holders_of: dict[int, dict[str, int]],
    predicted_of: Callable[[int], Iterable[str]],
    lengths: dict[str, int],
    tiers: dict[str, list[int]],
    predicted: dict[str, int],
) -> None:
    """Phase 2 of :func:`walk`: block by block, real placements or unexpired predictions
    (which count as GPU: the engine is computing those blocks)."""
    for key in keys[depth:]:
        moved = False
        for replica, held in (holders_of.get(key) or {}).items():
            if lengths.get(replica, 0 if depth == 0 else -1) == depth:
                lengths[replica] = depth + 1
                tiers.setdefault(replica, [0, 0, 0, 0])[_BEST_SLOT[held]] += 1
                moved = True
        for replica in predicted_of(key):
            if lengths.get(replica, 0 if depth == 0 else -1) == depth:
                lengths[replica] = depth + 1
                tiers.setdefault(replica, [0, 0, 0, 0])[0] += 1
                predicted[replica] = predicted.get(replica, 0) + 1
                moved = True
        if not moved:
            return
        depth += 1


class MemoryIndex:
    """In-process index: the default for a single router process without Redis."""

    synchronous: ClassVar[bool] = True
    """Its reads never suspend nor fail: a router in the same process reads it at once
    (:meth:`survey_now`), without a time budget or a circuit breaker."""

    def __init__(self, *, segment_blocks: int = SEGMENT_BLOCKS) -> None:
        self.segment_blocks = segment_blocks
        """Blocks per segment (tests use short ones to meet many boundaries)."""
        self._blocks: dict[Namespace, dict[int, dict[str, int]]] = {}
        self._segments: dict[Namespace, Segments] = {}
        self._ledgers: dict[tuple[str, Namespace], ReplicaLedger] = {}
        self._seq: dict[tuple[str, Namespace], int] = {}
        self._registry: dict[str, ReplicaRecord] = {}
        self._seen: dict[str, float] = {}
        self._predictions: dict[Namespace, dict[int, dict[str, float]]] = {}
        self._residency: dict[Namespace, dict[str, list[int]]] = {}
        self._lookahead: dict[Namespace, dict[str, int]] = {}
        self._homes: dict[Namespace, dict[int, tuple[str, float, float]]] = {}
        # partition -> replica -> session key -> (routed at, lives until), monotonic
        self._sessions: dict[Namespace, dict[str, dict[int, tuple[float, float]]]] = {}
        self._sweep_at = 0.0

    def _ledger(self, replica: str, namespace: Namespace) -> ReplicaLedger:
        base = namespace.base()
        ledger = self._ledgers.get((replica, base))
        if ledger is None:
            ledger = ReplicaLedger(replica, base, segment_blocks=self.segment_blocks)
            self._ledgers[(replica, base)] = ledger
        return ledger

    def _store(self, replica: str, namespace: Namespace, changes: LedgerChanges) -> None:
        base = namespace.base()
        table = self._blocks.setdefault(base, {})
        predictions = self._predictions.get(base)
        counts = self._residency.setdefault(base, {}).setdefault(replica, [0, 0])
        for key, tiers in changes.placements.items():
            holders = table.get(key)
            old = holders.get(replica, 0) if holders is not None else 0
            if tiers:
                if holders is None:
                    holders = table[key] = {}
                holders[replica] = tiers
            elif holders is not None:
                holders.pop(replica, None)
                if not holders:
                    del table[key]
            gained = (tiers & 1) - (old & 1)
            counts[0] += gained
            counts[1] += max(0, gained)
            # the engine's word on a block ends this replica's prediction of it
            entry = predictions.get(key) if predictions else None
            if entry:
                entry.pop(replica, None)
        segments = self._segments.setdefault(base, {})
        for key, segment in changes.segments.items():
            whole = segments.get(key)
            if segment is not None:
                if whole is None:
                    whole = segments[key] = {}
                whole[replica] = segment
            elif whole is not None:
                whole.pop(replica, None)
                if not whole:
                    del segments[key]

    async def apply(
        self, replica: str, namespace: Namespace, batch: EventBatch, seq: int | None = None
    ) -> ApplyResult:
        ledger = self._ledger(replica, namespace)
        changes = ledger.apply(batch.events)
        self._store(replica, namespace, changes)
        if seq is not None:
            self._seq[(replica, namespace.base())] = seq
        return ApplyResult(changes.stats, changes.cleared, len(ledger))

    async def clear(self, replica: str, namespace: Namespace) -> int:
        ledger = self._ledger(replica, namespace)
        held = len(ledger)
        self._store(replica, namespace, ledger.clear())
        self._seq.pop((replica, namespace.base()), None)
        return held

    async def last_seq(self, replica: str, namespace: Namespace) -> int | None:
        return self._seq.get((replica, namespace.base()))

    async def lookup(self, namespace: Namespace, keys: Sequence[int]) -> dict[str, Match]:
        return self.lookup_now(namespace, keys)

    def lookup_now(self, namespace: Namespace, keys: Sequence[int]) -> dict[str, Match]:
        """:meth:`lookup` without suspending (a router in the same process)."""
        predictions = self._predictions.get(namespace.base())
        now = time.monotonic()

        def predicted_of(key: int) -> list[str]:
            entry = predictions.get(key) if predictions else None
            return [r for r, expiry in entry.items() if expiry > now] if entry else []

        base = namespace.base()
        return walk(
            keys,
            self._blocks.get(base, {}),
            predicted_of,
            self._segments.get(base),
            self.segment_blocks,
        )

    async def survey(
        self,
        namespace: Namespace,
        keys: Sequence[int],
        *,
        load_except: str | None = None,
        load_ttl_s: float = LOAD_TTL_S,
        session: int | None = None,
    ) -> Survey:
        return self._survey(namespace, keys, await self.lookup(namespace, keys), session)

    def survey_now(
        self, namespace: Namespace, keys: Sequence[int], session: int | None = None
    ) -> Survey | None:
        if not self.synchronous:
            return None
        return self._survey(namespace, keys, self.lookup_now(namespace, keys), session)

    def _survey(
        self,
        namespace: Namespace,
        keys: Sequence[int],
        matches: dict[str, Match],
        session: int | None,
    ) -> Survey:
        counts = self._residency.get(namespace.base(), {})
        residency = {r: Residency(n, s) for r, (n, s) in counts.items()}
        return Survey(
            matches,
            residency,
            self._walk_homes(namespace, keys),
            lookahead=dict(self._lookahead.get(namespace.base(), {})),
            session=self._session_home(namespace, session, len(keys)),
            sessions=self._live_sessions(namespace, session),
        )

    async def set_lookahead(self, replica: str, namespace: Namespace, tokens: int) -> None:
        widths = self._lookahead.setdefault(namespace.base(), {})
        if tokens:
            widths[replica] = tokens
        else:
            widths.pop(replica, None)

    def _walk_homes(self, namespace: Namespace, keys: Sequence[int]) -> dict[str, Home]:
        table = self._homes.get(namespace.base(), {})
        now = time.monotonic()
        homes: dict[str, Home] = {}
        for position in home_anchors(len(keys)):
            entry = table.get(keys[position])
            if entry is None or entry[2] <= now:
                break
            replica, at, _ = entry
            homes[replica] = Home(position + 1, now - at)
        return homes

    def _session_home(
        self, namespace: Namespace, session: int | None, blocks: int
    ) -> dict[str, Home]:
        if session is None:
            return {}
        entry = self._homes.get(namespace.base(), {}).get(session)
        now = time.monotonic()
        if entry is None or entry[2] <= now:
            return {}
        return {entry[0]: Home(blocks, now - entry[1])}

    def _live_sessions(self, namespace: Namespace, session: int | None) -> dict[str, int]:
        if session is None:
            return {}
        now = time.monotonic()
        counts: dict[str, int] = {}
        for replica, live in self._sessions.get(namespace.base(), {}).items():
            count = sum(1 for s, (_, expiry) in live.items() if expiry > now and s != session)
            if count:
                counts[replica] = count
        return counts

    async def claim(
        self, namespace: Namespace, replica: str, anchors: Sequence[int], ttl_s: float
    ) -> None:
        self.record_route(namespace, Route(replica, anchors=anchors, home_ttl_s=ttl_s))

    async def route(self, namespace: Namespace, route: Route) -> None:
        self.record_route(namespace, route)

    def route_now(self, namespace: Namespace, route: Route) -> bool:
        if not self.synchronous:
            return False
        self.record_route(namespace, route)
        return True

    async def predict(
        self, namespace: Namespace, replica: str, keys: Sequence[int], ttl_s: float
    ) -> None:
        self.record_route(namespace, Route(replica, keys, ttl_s))

    def record_route(self, namespace: Namespace, route: Route) -> None:
        """:meth:`route` at once, without a turn of the event loop: a router in the same
        process records a request before the next decision can read the index. A route made
        ``route.age_s`` ago (another router's) keeps a home claimed since."""
        replica, keys, ttl_s = route.replica, route.keys, route.ttl_s
        anchors, home_ttl_s, age_s = route.anchors, route.home_ttl_s, route.age_s
        now = time.monotonic()
        since = now - age_s
        table = self._predictions.setdefault(namespace.base(), {})
        expiry = since + ttl_s
        for key in keys if expiry > now else ():
            entry = table.get(key)
            if entry is None:
                table[key] = {replica: expiry}
            else:
                for r in [r for r, e in entry.items() if e <= now]:
                    del entry[r]
                entry[replica] = expiry
        homes = self._homes.setdefault(namespace.base(), {})
        for key in anchors:
            claim = homes.get(key)
            if claim is None or claim[1] <= since:
                homes[key] = (replica, since, since + home_ttl_s)
        if route.session is not None and since + route.session_ttl_s > now:
            self._live(namespace, replica, route.session, since, since + route.session_ttl_s)
        if max(len(table), len(homes)) > _PREDICTION_SWEEP and self._sweep_at <= now:
            self._sweep_predictions(now)

    def _live(
        self, namespace: Namespace, replica: str, session: int, since: float, expiry: float
    ) -> None:
        """``session`` was routed to ``replica`` at ``since``: it lives there until ``expiry``
        and no longer where it was routed before (unless it was routed there later)."""
        replicas = self._sessions.setdefault(namespace.base(), {})
        for other, live in replicas.items():
            entry = live.get(session)
            if entry is not None and other != replica and entry[0] <= since:
                del live[session]
        mine = replicas.setdefault(replica, {})
        entry = mine.get(session)
        if entry is None or entry[0] <= since:
            mine[session] = (since, expiry)

    def _sweep_predictions(self, now: float) -> None:
        """Drop expired predictions, home claims and live sessions (bounded memory: at most
        one sweep per second)."""
        self._sweep_at = now + 1.0
        for table in self._predictions.values():
            for key in [k for k, e in table.items() if max(e.values(), default=0.0) <= now]:
                del table[key]
        for homes in self._homes.values():
            for key in [k for k, (_, _, expiry) in homes.items() if expiry <= now]:
                del homes[key]
        # a live session is also a home claim, so the homes' size bounds the sessions'
        for replicas in self._sessions.values():
            for live in replicas.values():
                for key in [k for k, (_, expiry) in live.items() if expiry <= now]:
                    del live[key]

    async def block_count(self, replica: str, namespace: Namespace) -> int:
        return len(self._ledger(replica, namespace))

    async def register(self, record: ReplicaRecord) -> None:
        self._registry[record.id] = record
        self._seen[record.id] = time.time()

    async def replicas(self) -> list[ReplicaRecord]:
        return [
            msgspec.structs.replace(record, last_seen=self._seen.get(record.id, 0.0))
            for record in self._registry.values()
        ]

    async def deregister(self, replica: str) -> None:
        self._registry.pop(replica, None)
        self._seen.pop(replica, None)

    async def reap(self) -> list[ReplicaRecord]:
        now = time.time()
        stale = [r for r in await self.replicas() if now - r.last_seen > r.ttl_s]
        for record in stale:
            await self.deregister(record.id)
        return stale

    async def close(self) -> None:
        return None
