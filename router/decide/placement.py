"""From a request to a routing decision: tokenize, hash, look up, score; timed per stage.

The prompt is tokenized as the engine will (chat template over every message), its block-key
chain computed with the tracker's :func:`~tracker.core.blocks.block_keys` (the keys of a prefix
seen before are reused: :class:`~tracker.core.blocks.ChainCache`), the chain's placements and every
router's load read in one guarded round trip (:mod:`router.shared.state`), and the candidates scored
by :func:`router.decide.policy.decide`. A prompt the router cannot tokenize (a content type it does
not know, a template that rejects the conversation) is routed on load alone: the engine, not
the router, decides whether it is valid.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.baselines.baseline import Baseline, Choice
from router.config import RouterSettings
from router.decide.churn import ChurnBook
from router.decide.estimator import SpeedBook
from router.decide.journal import DecisionJournal
from router.decide.occupancy import OccupancyBook
from router.decide.policy import decide
from router.decide.policy_types import Decision, PolicyConfig, ReplicaState, Score
from router.decide.request import PromptRequest
from router.decide.reuse import ReuseBook
from router.decide.tokenize import TokenizerBook
from router.errors import BadRequestError, ModelNotFoundError, NoReplicaError
from router.fleet.replicas import Replica, ReplicaSet
from router.metrics import RouterMetrics
from router.shared.state import GuardedIndex, SharedView
from tracker.core.blocks import ChainCache, Namespace
from tracker.core.index import Home, Match, Residency
from tracker.framework.errors import TokenizationError

logger = logging.getLogger(__name__)
_NOTHING = Residency(0, 0)


@dataclass(frozen=True, slots=True)
class Placement:
    """A routing decision and everything that went into it.

    :param keys: the prompt's block keys in ``namespace``.
    :param matches: every replica's cached run of ``keys`` (empty on a fallback).
    :param fallback: why the index was not used (``None`` when it was).
    :param stages: seconds spent per stage.
    :param homes: the replicas routers last sent prefixes of the prompt to.
    """

    model: str
    namespace: Namespace
    prompt_tokens: int
    keys: list[int]
    matches: dict[str, Match]
    decision: Decision
    fallback: str | None = None
    stages: dict[str, float] = field(default_factory=dict)
    homes: dict[str, Home] = field(default_factory=dict)

    def order(self) -> list[str]:
        """Candidates best first, the chosen one leading."""
        ranked = sorted(self.decision.scores, key=lambda s: -s.score)
        return [self.decision.replica] + [
            s.replica for s in ranked if s.replica != self.decision.replica
        ]

    def score(self, replica: str) -> Score:
        return next(s for s in self.decision.scores if s.replica == replica)


class Placer:
    """Turns a :class:`PromptRequest` into a :class:`Placement`; never blocks the loop."""

    def __init__(
        self,
        settings: RouterSettings,
        *,
        replicas: ReplicaSet,
        tokenizers: TokenizerBook,
        shared: GuardedIndex,
        speeds: SpeedBook,
        metrics: RouterMetrics,
        rng: random.Random | None = None,
        baseline: Baseline | None = None,
        journal: DecisionJournal | None = None,
    ) -> None:
        self.settings = settings
        self.baseline = baseline
        self.journal = journal
        self.replicas = replicas
        self.tokenizers = tokenizers
        self.shared = shared
        self.speeds = speeds
        self.metrics = metrics
        self.rng = rng or random.Random()
        self.churn = ChurnBook()
        window = settings.reuse_window_s
        self.reuse = ReuseBook(window) if window > 0 else None
        half_life = settings.recent_load_half_life_s
        self.occupancy = OccupancyBook(half_life) if half_life > 0 else None
        self._mixed: set[str] = set()
        self._policies: dict[int, PolicyConfig] = {}
        # per (model, block size): the lookahead tokens the engines hash, as the index said
        self._lookahead: dict[tuple[str, int], int] = {}
        # keys of recent long prompts: a repeated prefix is compared, not hashed again
        self._chains = ChainCache()

    def resolve_model(self, model: str | None) -> tuple[str, str | None]:
        """The model a request is for (the only one served when it names none), and the
        LoRA adapter when it names one: ``(base model, adapter)``."""
        if not len(self.replicas):
            # nothing known yet (e.g. the registry was unreachable since startup): not a 404
            raise NoReplicaError("no replica is known yet")
        if model is None:
            bases = {r.model for r in self.replicas.all()}
            if len(bases) == 1:
                return bases.pop(), None
            raise BadRequestError("Missing required parameter: 'model'.", param="model")
        resolved = self.replicas.resolve(model)
        if resolved is None:
            raise ModelNotFoundError(f"The model `{model}` does not exist.", param="model")
        return resolved

    def _keys(self, ids: list[int], namespace: Namespace, salt: str | None) -> list[int]:
        """The prompt's block keys as the engines hash it: the cache salt on the first block,
        and the lookahead tokens set, or else learned (:meth:`_learn_lookahead`)."""
        extra = [(salt,)] if salt is not None else None
        lookahead = self.settings.lookahead_tokens
        if lookahead is None:
            lookahead = self._lookahead.get((namespace.model, namespace.block_size), 0)
        return self._chains.keys(ids, namespace, extra_keys=extra, lookahead=lookahead)

    def _learn_lookahead(
        self, namespace: Namespace, candidates: Sequence[Replica], view: SharedView
    ) -> None:
        """Remember how many tokens after each block the candidates' engines hash (vLLM
        0.33's lookahead hashing, as the tracker saw in their events) for the next prompt:
        the most common among them. Until a lookup has said so, keys are hashed without
        (such a prompt matches nothing and is routed by load)."""
        size = namespace.block_size
        seen = view.lookahead
        if view.fallback is not None or not (seen or self._lookahead.get((namespace.model, size))):
            return  # no answer, or nothing hashes lookahead tokens now or before: the usual
        widths = Counter(seen.get(r.id, 0) for r in candidates if r.block_size == size)
        width = widths.most_common(1)[0][0] if widths else 0
        if self._lookahead.get((namespace.model, size), 0) != width:
            logger.info(
                "engines hash lookahead tokens",
                extra={"model": namespace.model, "block_size": size, "lookahead_tokens": width},
            )
            self._lookahead[(namespace.model, size)] = width

    def _block_size(self, model: str, candidates: Sequence[Replica]) -> int:
        sizes = Counter(r.block_size for r in candidates)
        if len(sizes) > 1 and model not in self._mixed:
            self._mixed.add(model)
            logger.warning(
                "replicas of one model use different block sizes; only the most common is "
                "matched against the index",
                extra={"model": model, "block_sizes": dict(sizes)},
            )
        return min(sizes, key=lambda size: (-sizes[size], size))

    async def token_ids(self, request: PromptRequest, model: str) -> list[int]:
        """The engine's prompt token ids; :raises TokenizationError: if they cannot be known."""
        if request.token_ids is not None:
            return request.token_ids
        tokenizer = self.tokenizers.for_model(model)
        if request.messages is not None:
            if not tokenizer.tokenizer.has_chat_template:
                raise TokenizationError(f"the tokenizer of {model!r} has no chat template")
            return await tokenizer.chat(
                request.messages,
                add_generation_prompt=request.add_generation_prompt,
                tools=request.tools,
                **request.template_kwargs,
            )
        assert request.prompt is not None
        return await tokenizer.prompt(request.prompt)

    async def place(self, request: PromptRequest, *, dry_run: bool = False) -> Placement:
        """Decide where ``request`` goes.

        :param dry_run: an operator query: a prompt that cannot be tokenized is a 400.
        :raises ModelNotFoundError: no replica serves the model.
        :raises NoReplicaError: none of them is healthy.
        :raises BadRequestError: the prompt is longer than ``max_prompt_tokens``.
        """
        model, lora = self.resolve_model(request.model)
        candidates = self.replicas.candidates(model, lora)
        if not candidates:
            raise NoReplicaError(f"no healthy replica serves the model `{lora or model}`")
        block_size = self._block_size(model, candidates)
        # an adapter's blocks live in the base model's partition, keyed from its own seed
        namespace = Namespace(model, block_size, lora)
        if self.baseline is not None:
            return await self._place_baseline(request, model, namespace, candidates, dry_run)
        stages: dict[str, float] = {}
        started = time.perf_counter()
        fallback: str | None = None
        try:
            ids = await self.token_ids(request, model)
        except TokenizationError as exc:
            if dry_run:
                raise BadRequestError(f"cannot tokenize the prompt: {exc}") from None
            logger.debug("routing on load only", extra={"model": model, "error": str(exc)})
            self.metrics.fallbacks.labels("tokenize").inc()
            ids, fallback = [], "tokenize"
        if len(ids) > self.settings.max_prompt_tokens:
            raise BadRequestError(
                f"the prompt has {len(ids)} tokens, more than the router's limit of "
                f"{self.settings.max_prompt_tokens}",
                param="messages" if request.messages is not None else "prompt",
            )
        tokenized = time.perf_counter()
        stages["tokenize"] = tokenized - started
        keys = self._keys(ids, namespace, request.cache_salt)
        hashed = time.perf_counter()
        stages["hash"] = hashed - tokenized
        view = await self.shared.view(namespace, keys)
        self._learn_lookahead(namespace, candidates, view)
        fallback = fallback or view.fallback
        looked_up = time.perf_counter()
        stages["lookup"] = looked_up - hashed
        states = self._states(model, block_size, candidates, view)
        policy = self._policies.get(block_size)
        if policy is None:
            policy = self._policies[block_size] = self.settings.policy_config(block_size)
        output = request.max_tokens or self.settings.default_output_tokens
        decision = decide(len(ids), states, policy, self.rng, output)
        done = time.perf_counter()
        stages["score"] = done - looked_up
        stages["total"] = done - started
        if not dry_run:
            for stage, seconds in stages.items():
                self.metrics.decision.labels(stage).observe(seconds)
            if self.occupancy is not None:  # the request joins the chosen replica's count
                state = next(s for s in states if s.id == decision.replica)
                self.occupancy.observe(state.id, state.inflight + 1)
            if self.reuse is not None and keys:  # the replica holds the whole chain after it
                self.reuse.record(decision.replica, keys[0], len(keys))
            if self.journal is not None:
                self.journal.record(
                    model=model,
                    prompt_tokens=len(ids),
                    keys=keys,
                    matches=view.matches,
                    states=states,
                    decision=decision,
                    fallback=fallback,
                )
        return Placement(
            model, namespace, len(ids), keys, view.matches, decision, fallback, stages, view.homes
        )

    def _states(
        self, model: str, block_size: int, candidates: Sequence[Replica], view: SharedView
    ) -> list[ReplicaState]:
        """What the policy knows of each candidate: the index's answer, load, engine gauges."""
        now = time.monotonic()
        speed = self.speeds.get(model)  # one estimate per model: see router.decide.estimator
        if view.residency:
            self.churn.observe(view.residency)
        churn = self.churn.relative(r.id for r in candidates)
        states: list[ReplicaState] = []
        for replica in candidates:
            match = view.matches.get(replica.id) if replica.block_size == block_size else None
            load = view.loads.get(replica.id)
            inflight = load.inflight if load else 0
            engine = self.replicas.engine_load(replica, now)
            # every router's requests in flight when the gauges were scraped (the monitor
            # reads the load board then); the rest of what the engine ran is outside traffic
            routed = engine.routed if engine else None
            # the index answered: a replica it has no count of holds nothing
            resident = (
                view.residency.get(replica.id, _NOTHING)
                if view.fallback is None and replica.block_size == block_size
                else None
            )
            states.append(
                ReplicaState(
                    replica.id,
                    matched_blocks=match.blocks if match else 0,
                    matched_gpu_blocks=match.gpu_blocks if match else 0,
                    matched_storage_blocks=match.storage_blocks if match else 0,
                    matched_remote_blocks=match.remote_blocks if match else 0,
                    inflight=inflight,
                    queued_prefill_tokens=load.queued_prefill_tokens if load else 0,
                    engine_waiting=engine.waiting if engine else None,
                    engine_running=engine.running if engine else None,
                    routed_at_scrape=routed,
                    kv_usage=engine.kv_usage if engine else None,
                    speed=speed,
                    cache_blocks=replica.cache_blocks,
                    resident_blocks=resident.blocks if resident is not None else None,
                    churn=churn[replica.id],
                    home_blocks=self._home(view.homes.get(replica.id)),
                    valued_blocks=(
                        self.reuse.valued(replica.id, resident.blocks if resident else None)
                        if self.reuse
                        else None
                    ),
                    recent_inflight=(
                        self.occupancy.observe(replica.id, inflight) if self.occupancy else 0.0
                    ),
                    prefixes=self.reuse.prefixes(replica.id) if self.reuse else 0,
                    prefill_elapsed_ms=(
                        (now - load.prefill_since) * 1000
                        if load is not None and load.prefill_since is not None
                        else 0.0
                    ),
                )
            )
        return states

    def _home(self, home: Home | None) -> float:
        """A home claim's weight in blocks: its depth, fading linearly to 0 over its TTL."""
        ttl = self.settings.home_ttl_s
        if home is None or ttl <= 0:
            return 0.0
        return home.blocks * max(0.0, 1.0 - home.age_s / ttl)

    async def _place_baseline(
        self,
        request: PromptRequest,
        model: str,
        namespace: Namespace,
        candidates: Sequence[Replica],
        dry_run: bool,
    ) -> Placement:
        """A benchmark baseline's decision (:mod:`router.baselines`); the index is not used."""
        assert self.baseline is not None
        stages: dict[str, float] = {}
        started = time.perf_counter()
        choice = Choice(request, model, namespace, candidates)
        decision, prompt_tokens = await self.baseline.choose(choice, stages)
        stages["total"] = time.perf_counter() - started
        if not dry_run:
            for stage, seconds in stages.items():
                self.metrics.decision.labels(stage).observe(seconds)
        return Placement(model, namespace, prompt_tokens, [], {}, decision, None, stages)
