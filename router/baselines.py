"""Baseline routing policies, run inside the real router so every policy pays the same proxy path.

Selected with ``kvrouter router --policy NAME``; the benchmark (``kvrouter bench``) compares
them with kvrouter's own policy (``ttft``). None of them reads the block index:

``round-robin``
    The next healthy replica in id order.
``least-load``
    Fewest requests in flight, summed over every router (the shared load board); ties at
    random.
``seed``
    The design this project started from (``docs/benchmarks.md``): key = SHA-256 of the
    system prompt(s) plus the first ``seed_user_chars`` characters of the first user message;
    each replica remembers the keys it was sent in an LRU map (2,000 keys, 30 min TTL);
    ``score = 100·is_cached - 10·in_flight`` with this router's own in-flight count; best
    score, ties at random.
``sglang``
    SGLang's ``cache_aware`` policy: if the router-local in-flight counts are imbalanced
    (``max - min > balance_abs_threshold`` and ``max > balance_rel_threshold · min``) the
    least-loaded replica; else the replica holding the longest prefix of the request text in
    an approximate per-replica radix tree (:mod:`router.texttree`) built from this router's
    own decisions, if that prefix covers more than ``cache_threshold`` of the text; else the
    least-loaded one. The text is inserted under the chosen replica. Text is what SGLang's
    HTTP router routes on: the messages' text contents joined by spaces (or the prompt).
``oracle``
    Not deployable: reads every engine's real prefix cache and queue at decision time
    (``POST /kvrouter/probe``, which only the simulated engine answers) and picks the lowest
    TTFT the engine itself predicts. The upper bound of the benchmark.
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final

import msgspec

from router.config import RouterSettings
from router.errors import UpstreamError
from router.load import Load, LoadBoard
from router.policy import Decision, Score
from router.replicas import Replica
from router.requests import PromptRequest
from router.texttree import TextTree
from router.upstream import UpstreamClient
from tracker.blocks import Namespace
from tracker.tokens import TokenizationError

logger = logging.getLogger(__name__)

BASELINES: Final = ("round-robin", "least-load", "seed", "sglang", "oracle")
PROBE_PATH: Final = "/kvrouter/probe"
SEED_LRU_SIZE: Final = 2000
SEED_TTL_S: Final = 1800.0
SGLANG_EVICTION_INTERVAL_S: Final = 120.0
SGLANG_MAX_TREE_SIZE: Final = 1 << 26
ORACLE_TIMEOUT_S: Final = 10.0
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


@dataclass(frozen=True, slots=True)
class Choice:
    """One request to place among healthy ``candidates`` (at least one)."""

    request: PromptRequest
    model: str
    namespace: Namespace
    candidates: Sequence[Replica]


@dataclass(frozen=True, slots=True)
class Tools:
    """What baselines may use: load boards, the tokenizer, the replicas' HTTP client.

    :param shared_loads: every router's load per replica (falls back to this router's).
    :param token_ids: the engine's prompt token ids for a request and model.
    """

    load: LoadBoard
    shared_loads: Callable[[Namespace], Awaitable[Mapping[str, Load]]]
    token_ids: Callable[[PromptRequest, str], Awaitable[list[int]]]
    upstream: UpstreamClient


def _score(replica: str, value: float, *, cached: int = 0, ttft_ms: float = 0.0) -> Score:
    return Score(
        replica=replica,
        matched_tokens=cached,
        gpu_cached_tokens=cached,
        offload_cached_tokens=0,
        uncached_tokens=0,
        queue_ms=0.0,
        prefill_ms=0.0,
        expected_ttft_ms=ttft_ms,
        score=value,
    )


def _best(scores: Sequence[Score], rng: random.Random, mode: str, tie: float = 1e-9) -> Decision:
    top = max(s.score for s in scores)
    tied = [s for s in scores if s.score >= top - tie]
    return Decision(rng.choice(tied).replica, tuple(scores), mode)


def _content(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p
        )
    return ""


def request_text(request: PromptRequest) -> str:
    """The text SGLang's HTTP router routes on: message contents joined by spaces."""
    if request.messages is not None:
        return " ".join(_content(m) for m in request.messages if isinstance(m, dict))
    if isinstance(request.prompt, str):
        return request.prompt
    return " ".join(map(str, request.prompt or ()))


def seed_key(request: PromptRequest, user_chars: int) -> str:
    """The seed design's prefix key: system prompt(s) + first characters of the user message."""
    system, user = [], ""
    for message in request.messages or ():
        if not isinstance(message, dict):
            continue
        if message.get("role") in ("system", "developer"):
            system.append(_content(message))
        elif message.get("role") == "user":
            user = _content(message)
            break
    if request.messages is None:
        user = request_text(request)
    text = "\n".join(system) + "\x00" + user[:user_chars]
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Baseline(abc.ABC):
    """A routing strategy with state; :meth:`choose` is called once per request."""

    name: ClassVar[str]

    def __init__(self, settings: RouterSettings, tools: Tools, rng: random.Random) -> None:
        self.settings = settings
        self.tools = tools
        self.rng = rng

    @abc.abstractmethod
    async def choose(self, choice: Choice, stages: dict[str, float]) -> tuple[Decision, int]:
        """The decision and the prompt's token count (0 when not tokenized)."""

    def _local(self, choice: Choice) -> dict[str, int]:
        loads = self.tools.load.local_snapshot(choice.namespace)
        return {r.id: loads[r.id].inflight if r.id in loads else 0 for r in choice.candidates}


class RoundRobin(Baseline):
    name = "round-robin"

    def __init__(self, settings: RouterSettings, tools: Tools, rng: random.Random) -> None:
        super().__init__(settings, tools, rng)
        self._next = 0

    async def choose(self, choice: Choice, stages: dict[str, float]) -> tuple[Decision, int]:
        picked = choice.candidates[self._next % len(choice.candidates)].id
        self._next += 1
        scores = tuple(_score(r.id, float(r.id == picked)) for r in choice.candidates)
        return Decision(picked, scores, self.name), 0


class LeastLoad(Baseline):
    name = "least-load"

    async def choose(self, choice: Choice, stages: dict[str, float]) -> tuple[Decision, int]:
        loads = await self.tools.shared_loads(choice.namespace)
        scores = [
            _score(r.id, -float(loads[r.id].inflight if r.id in loads else 0))
            for r in choice.candidates
        ]
        return _best(scores, self.rng, self.name), 0


class Seed(Baseline):
    name = "seed"

    def __init__(self, settings: RouterSettings, tools: Tools, rng: random.Random) -> None:
        super().__init__(settings, tools, rng)
        self._seen: dict[str, OrderedDict[str, float]] = {}

    async def choose(self, choice: Choice, stages: dict[str, float]) -> tuple[Decision, int]:
        key = seed_key(choice.request, self.settings.seed_user_chars)
        now = time.monotonic()
        inflight = self._local(choice)
        scores = []
        for replica in choice.candidates:
            seen = self._seen.setdefault(replica.id, OrderedDict())
            at = seen.get(key)
            cached = at is not None and now - at <= SEED_TTL_S
            scores.append(_score(replica.id, 100.0 * cached - 10.0 * inflight[replica.id]))
        decision = _best(scores, self.rng, self.name)
        seen = self._seen[decision.replica]
        seen[key] = now
        seen.move_to_end(key)
        while len(seen) > SEED_LRU_SIZE:
            seen.popitem(last=False)
        return decision, 0


class SGLang(Baseline):
    name = "sglang"

    def __init__(self, settings: RouterSettings, tools: Tools, rng: random.Random) -> None:
        super().__init__(settings, tools, rng)
        self.tree = TextTree(SGLANG_MAX_TREE_SIZE)
        self._evicted = time.monotonic()

    async def choose(self, choice: Choice, stages: dict[str, float]) -> tuple[Decision, int]:
        settings = self.settings
        now = time.monotonic()
        if now - self._evicted >= SGLANG_EVICTION_INTERVAL_S:
            self._evicted = now
            self.tree.evict()
        text = request_text(choice.request)
        loads = self._local(choice)
        most, least = max(loads.values()), min(loads.values())
        imbalanced = (
            most - least > settings.sglang_balance_abs_threshold
            and most > settings.sglang_balance_rel_threshold * least
        )
        matched, holder = 0, None
        if not imbalanced:
            found = self.tree.match(text, loads.keys())
            matched, holder = found.chars, found.tenant
        if holder is not None and matched > settings.sglang_cache_threshold * len(text):
            picked = holder
        else:
            fewest = [r for r, n in loads.items() if n == least]
            picked = self.rng.choice(fewest)
        self.tree.insert(text, picked, now)
        scores = tuple(
            _score(r.id, float(r.id == picked), cached=matched if r.id == picked else 0)
            for r in choice.candidates
        )
        return Decision(picked, scores, self.name), 0


class Oracle(Baseline):
    name = "oracle"

    async def choose(self, choice: Choice, stages: dict[str, float]) -> tuple[Decision, int]:
        started = time.perf_counter()
        try:
            ids = await self.tools.token_ids(choice.request, choice.model)
        except TokenizationError:
            ids = []
        tokenized = time.perf_counter()
        stages["tokenize"] = tokenized - started
        body = _encode({"token_ids": ids, "cache_salt": choice.request.cache_salt})
        answers = await asyncio.gather(*(self._probe(r, body) for r in choice.candidates))
        stages["probe"] = time.perf_counter() - tokenized
        scores = [
            _score(
                r.id,
                -float(a["expected_ttft_ms"]),
                cached=int(a["expected_cached_tokens"]),
                ttft_ms=float(a["expected_ttft_ms"]),
            )
            for r, a in zip(choice.candidates, answers, strict=True)
            if a is not None
        ]
        if not scores or not ids:  # nothing to probe or no answer: least load
            inflight = self._local(choice)
            scores = [_score(r, -float(n)) for r, n in inflight.items()]
            return _best(scores, self.rng, self.name), len(ids)
        return _best(scores, self.rng, self.name, tie=self.settings.tie_epsilon_ms), len(ids)

    async def _probe(self, replica: Replica, body: bytes) -> dict[str, Any] | None:
        headers = {"content-type": "application/json"}
        try:
            async with asyncio.timeout(ORACLE_TIMEOUT_S):
                response = await self.tools.upstream.open(
                    replica.id,
                    replica.url,
                    PROBE_PATH,
                    body,
                    headers,
                    timeout_s=ORACLE_TIMEOUT_S,
                )
                try:
                    data = await response.read(ORACLE_TIMEOUT_S)
                finally:
                    await response.aclose()
        except (UpstreamError, TimeoutError) as exc:
            logger.warning("oracle probe failed", extra={"replica": replica.id, "error": str(exc)})
            return None
        try:
            answer = _decode(data) if response.status == 200 else None
        except msgspec.DecodeError:
            answer = None
        return answer if isinstance(answer, dict) and "expected_ttft_ms" in answer else None


_KINDS: Final[dict[str, type[Baseline]]] = {
    kind.name: kind for kind in (RoundRobin, LeastLoad, Seed, SGLang, Oracle)
}


def make_baseline(settings: RouterSettings, tools: Tools, rng: random.Random) -> Baseline | None:
    """The baseline ``settings.policy`` names, or None for kvrouter's own policies."""
    kind = _KINDS.get(settings.policy)
    return None if kind is None else kind(settings, tools, rng)
