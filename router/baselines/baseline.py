"""What every benchmark baseline shares: the request to place, the tools, the base class.

A baseline is a routing strategy with state, run inside the real router instead of
kvrouter's score (:mod:`router.baselines`). None reads the block index; each sees the
request, the healthy candidates, and what :class:`Tools` offers. Its decision carries one
:class:`~router.decide.policy_types.Score` per candidate whose ``score`` is the baseline's
own number (higher wins), so ``/index``, the decision headers and the journal show it.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from router.decide.policy_types import Decision, Score
from router.decide.request import PromptRequest
from router.fleet.replicas import Replica
from router.fleet.upstream import UpstreamClient
from router.shared.load import Load, LoadBoard
from tracker.core.blocks import Namespace


class BaselineSettings(Protocol):
    """The router settings baselines read (:class:`router.config.RouterSettings` has them)."""

    @property
    def policy(self) -> str: ...
    @property
    def seed_user_chars(self) -> int: ...
    @property
    def sglang_cache_threshold(self) -> float: ...
    @property
    def sglang_balance_abs_threshold(self) -> int: ...
    @property
    def sglang_balance_rel_threshold(self) -> float: ...
    @property
    def tie_epsilon_ms(self) -> float: ...


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


def baseline_score(replica: str, value: float, *, cached: int = 0, ttft_ms: float = 0.0) -> Score:
    """A candidate's score row: the baseline's ``value``, and what it knows of the cache."""
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


def best(scores: Sequence[Score], rng: random.Random, mode: str, tie: float = 1e-9) -> Decision:
    """The highest score; those within ``tie`` of it are chosen between at random."""
    top = max(s.score for s in scores)
    tied = [s for s in scores if s.score >= top - tie]
    return Decision(rng.choice(tied).replica, tuple(scores), mode)


def message_text(message: Mapping[str, Any]) -> str:
    """A chat message's text: its string content, or its text parts joined by spaces."""
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
        return " ".join(message_text(m) for m in request.messages if isinstance(m, dict))
    if isinstance(request.prompt, str):
        return request.prompt
    return " ".join(map(str, request.prompt or ()))


class Baseline(abc.ABC):
    """A routing strategy with state; :meth:`choose` is called once per request.

    :param name: the ``--policy`` name (:data:`router.baselines.REGISTRY`), also the
        decision's mode.
    """

    name: ClassVar[str]

    def __init__(self, settings: BaselineSettings, tools: Tools, rng: random.Random) -> None:
        self.settings = settings
        self.tools = tools
        self.rng = rng

    @abc.abstractmethod
    async def choose(self, choice: Choice, stages: dict[str, float]) -> tuple[Decision, int]:
        """The decision and the prompt's token count (0 when not tokenized)."""

    def _local(self, choice: Choice) -> dict[str, int]:
        """This router's own requests in flight on each candidate."""
        loads = self.tools.load.local_snapshot(choice.namespace)
        return {r.id: loads[r.id].inflight if r.id in loads else 0 for r in choice.candidates}
