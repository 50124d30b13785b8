"""The block index's interface and the types every backend answers with.

The index answers "which replica holds the longest contiguous prefix of this key chain?"
and keeps the replica registry. :class:`tracker.core.memory_index.MemoryIndex` serves a
single process; :class:`tracker.core.redis_index.RedisIndex` is shared by any number of
routers and trackers. Both pass the same contract tests
(``tests/tracker/test_index_contract.py``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import msgspec

from tracker.core.blocks import Namespace
from tracker.core.events import EventBatch

RECORD_TTL_S: Final = 15.0
"""How long a registry entry outlives its last heartbeat unless its publisher says otherwise
(``kvrouter replica --ttl-s``, ``kvrouter attach --ttl-s``)."""

LOAD_TTL_S: Final = 5.0
"""How long a router's shared load, and its presence, outlive their last write unless told
otherwise (``kvrouter router --lease-ttl-s``, :mod:`router.shared.redis_load`)."""


class Match(msgspec.Struct, frozen=True):
    """A replica's longest contiguous run of held blocks from the start of a chain.

    Each block of the run counts in the cheapest tier the replica holds it in: ``gpu_blocks``
    + ``cpu_blocks`` + ``storage_blocks`` + ``remote_blocks`` == ``blocks``
    (:class:`tracker.core.ledger.Tier`). ``predicted_blocks`` of the run are only predicted (the
    router sent a request with these blocks there and the engine's events have not confirmed
    them yet); they count as GPU.
    """

    replica: str
    blocks: int
    gpu_blocks: int
    predicted_blocks: int = 0
    cpu_blocks: int = 0
    storage_blocks: int = 0
    remote_blocks: int = 0

    @property
    def offload_blocks(self) -> int:
        """Blocks of the run held only in an offload tier (CPU, storage or remote)."""
        return self.blocks - self.gpu_blocks


def describe_match(match: Match, block_size: int) -> dict[str, Any]:
    """A match as ``/index`` and ``kvrouter lookup`` show it: the run, its blocks per tier,
    and ``tier``: the one tier holding the whole run, or ``"mixed"``."""
    per_tier = {
        "gpu": match.gpu_blocks,
        "cpu": match.cpu_blocks,
        "storage": match.storage_blocks,
        "remote": match.remote_blocks,
    }
    whole = [name for name, blocks in per_tier.items() if blocks == match.blocks]
    return {
        "matched_blocks": match.blocks,
        "matched_tokens": match.blocks * block_size,
        **{f"{name}_blocks": blocks for name, blocks in per_tier.items()},
        "offload_blocks": match.offload_blocks,
        "tier": whole[0] if whole else "mixed",
    }


class Residency(msgspec.Struct, frozen=True):
    """A replica's GPU prefix cache as its events tell it: blocks held now, stored ever.

    ``stored`` only grows (until the index is rebuilt): its rate is the cache's churn, how
    fast new blocks push old ones out once the cache is full.
    """

    blocks: int
    stored: int


class Home(msgspec.Struct, frozen=True):
    """A replica routers last sent a prefix of the chain to: how deep, and how long ago."""

    blocks: int
    age_s: float


class Survey(msgspec.Struct, frozen=True):
    """One lookup's answer: every replica's cached run of the chain, its residency, and the
    homes routers recorded for the chain's prefixes (:meth:`BlockIndex.claim`)."""

    matches: dict[str, Match]
    residency: dict[str, Residency]
    homes: dict[str, Home] = msgspec.field(default_factory=dict)
    load: dict[str, tuple[int, int, int]] | None = None
    """Per replica, the other routers' requests in flight, queued prefill tokens and how long
    ago (ms) the oldest of those still prefilling was sent, when
    asked for (``load_except``) and the index holds the routers' shared load (Redis); key
    "" (zeros) when another router is present, whether or not it has load."""
    lookahead: dict[str, int] = msgspec.field(default_factory=dict)
    """Per replica whose engine hashes lookahead tokens (vLLM 0.33), how many: the routers
    hash prompts the same way (:func:`tracker.core.blocks.block_keys`)."""
    session: dict[str, Home] = msgspec.field(default_factory=dict)
    """The replica the asked session (:func:`tracker.core.blocks.session_key`) was last routed
    to, if its claim is live: its home covers the whole chain asked for."""
    sessions: dict[str, int] = msgspec.field(default_factory=dict)
    """Asked with a session: per replica, how many other sessions were routed there within
    their window (:attr:`Route.session_ttl_s`) and not routed elsewhere since: the turns that
    will come back to it. Replicas with none are left out."""


@dataclass(frozen=True, slots=True)
class Route:
    """What a router records of a request it routes to ``replica``.

    :param keys: block keys the replica is predicted to hold within ``ttl_s``
        (:meth:`BlockIndex.predict`).
    :param anchors: the chain's keys at :func:`tracker.core.keys.home_anchors` positions, whose
        home the replica is for ``home_ttl_s`` (:meth:`BlockIndex.claim`), and the request's
        :func:`~tracker.core.blocks.session_key` if it names a session.
    :param age_s: the route was made this long ago (another router's, read later): its
        lifetimes count from then.
    :param first: the position of ``keys[0]`` in the prompt's chain: where the segments a
        shared index predicts whole begin (a wrong one only costs those predictions).
    :param session: the request's session key, if it names one: the session lives on the
        replica for ``session_ttl_s`` (:attr:`Survey.sessions`), and on no other since.
    """

    replica: str
    keys: Sequence[int] = ()
    ttl_s: float = 0.0
    anchors: Sequence[int] = ()
    home_ttl_s: float = 0.0
    age_s: float = 0.0
    first: int = 0
    session: int | None = None
    session_ttl_s: float = 0.0


class ReplicaRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A registry entry: how to reach a replica and what it serves.

    ``instance`` changes whenever the engine process restarts, which fences its old blocks.
    ``last_seen`` (unix seconds) is filled in by the index when the record is read.
    """

    id: str
    model: str
    block_size: int
    url: str | None = None
    events: str | None = None
    replay: str | None = None
    instance: str = ""
    ttl_s: float = RECORD_TTL_S
    last_seen: float = 0.0

    @property
    def namespace(self) -> Namespace:
        return Namespace(self.model, self.block_size)


class ApplyResult(msgspec.Struct):
    """What applying one batch did, for metrics and resync decisions."""

    stats: Counter[str]
    cleared: bool
    blocks: int


class BlockIndex(Protocol):
    """Storage of block placements and the replica registry."""

    async def apply(
        self, replica: str, namespace: Namespace, batch: EventBatch, seq: int | None = None
    ) -> ApplyResult:
        """Apply one batch of ``replica``'s events; record ``seq`` as its last applied."""

    async def clear(self, replica: str, namespace: Namespace) -> int:
        """Forget every block of ``replica``; returns how many it held."""

    async def last_seq(self, replica: str, namespace: Namespace) -> int | None:
        """The last sequence number applied for ``replica``, if any."""

    async def lookup(self, namespace: Namespace, keys: Sequence[int]) -> dict[str, Match]:
        """Per replica, the longest contiguous prefix of ``keys`` it holds (absent if none)."""

    async def survey(
        self,
        namespace: Namespace,
        keys: Sequence[int],
        *,
        load_except: str | None = None,
        load_ttl_s: float = LOAD_TTL_S,
        session: int | None = None,
    ) -> Survey:
        """:meth:`lookup` and every replica's :class:`Residency`, in one round trip; with
        ``load_except`` (a router's id), the other routers' shared load too where the index
        holds it (:attr:`Survey.load`; None where it does not), and that router's presence,
        kept ``load_ttl_s`` (:mod:`router.shared.redis_load`); with ``session`` (a
        :func:`~tracker.core.blocks.session_key`, claimed like an anchor by :meth:`route`),
        the session's home (:attr:`Survey.session`)."""

    async def predict(
        self, namespace: Namespace, replica: str, keys: Sequence[int], ttl_s: float
    ) -> None:
        """Record that ``replica`` will hold ``keys`` within ``ttl_s`` (predict-on-route).

        Lookups extend a match with unexpired predictions where real placements end; real
        events supersede them.
        """

    async def claim(
        self, namespace: Namespace, replica: str, anchors: Sequence[int], ttl_s: float
    ) -> None:
        """Record ``replica`` as the home of the anchor keys of a chain just routed there.

        ``anchors`` are the keys at :func:`tracker.core.keys.home_anchors` positions. A claim
        outlives eviction (it says where a prefix was sent, not what is cached) and expires
        ``ttl_s`` after the last request that renewed it.
        """

    async def route(self, namespace: Namespace, route: Route) -> None:
        """:meth:`predict` ``route.keys`` and :meth:`claim` ``route.anchors`` together (one
        round trip where the backend is remote): what a router records of each request."""

    def route_now(self, namespace: Namespace, route: Route) -> bool:
        """Record ``route`` without a turn of the event loop where the index is in this
        process (the next decision reads it); False where it is not: :meth:`route` it."""

    def survey_now(
        self, namespace: Namespace, keys: Sequence[int], session: int | None = None
    ) -> Survey | None:
        """:meth:`survey` without suspending where the index is in this process (nothing
        to wait for, nothing that fails); None where it must be asked."""

    async def set_lookahead(self, replica: str, namespace: Namespace, tokens: int) -> None:
        """Record how many tokens after each block ``replica``'s engine folds into its hash
        (0: none), as its events show; :attr:`Survey.lookahead` returns it."""

    async def block_count(self, replica: str, namespace: Namespace) -> int:
        """How many distinct blocks ``replica`` holds."""

    async def register(self, record: ReplicaRecord) -> None:
        """Insert or refresh a registry entry (also a heartbeat)."""

    async def replicas(self) -> list[ReplicaRecord]:
        """Every registered replica, with ``last_seen`` filled in."""

    async def deregister(self, replica: str) -> None:
        """Remove a registry entry (its blocks are cleared separately)."""

    async def reap(self) -> list[ReplicaRecord]:
        """Remove and return entries whose heartbeat is older than their ``ttl_s``."""

    async def close(self) -> None:
        """Release connections."""
