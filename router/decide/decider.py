"""The decision core: a parsed request in, a placement out; each attempt committed and finished.

:meth:`Decider.place` tokenizes the prompt as the engine will, hashes its block-key chain, reads
the chain's placements and every router's load (:mod:`router.shared.state`) and scores the
candidates (:func:`router.decide.policy.decide`); a prompt the router cannot tokenize is placed
on load alone. :meth:`Decider.commit` books an attempt on the replica actually tried (load
lease, prediction and home claim, reuse and occupancy); :meth:`Decider.finish` closes it
(release, engine-reported usage), :meth:`Decider.fail` takes back what never reached the
engine. Front ends (the HTTP proxy, :mod:`router.http.proxy`) call these in that order and
hold no books of their own.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Collection, Sequence

from router.baselines.baseline import Baseline, Choice
from router.config import RouterSettings
from router.decide.attempt import Attempt
from router.decide.churn import ChurnBook
from router.decide.estimator import SpeedBook
from router.decide.journal import DecisionJournal
from router.decide.occupancy import OccupancyBook
from router.decide.placement import Placement
from router.decide.policy import decide
from router.decide.policy_types import PolicyConfig, ReplicaState
from router.decide.request import PromptRequest
from router.decide.returns import ReturnBook
from router.decide.reuse import ReuseBook
from router.decide.tokenize import TokenizerBook
from router.errors import BadRequestError, ModelNotFoundError, NoReplicaError, OverloadedError
from router.fleet.replicas import Replica, ReplicaSet
from router.metrics import MismatchDetector, RouterMetrics
from router.shared.state import SharedState, SharedView
from tracker.core.blocks import ChainCache, Namespace, session_key
from tracker.core.index import Home, Residency, Route
from tracker.core.keys import home_anchors
from tracker.framework.errors import TokenizationError

logger = logging.getLogger(__name__)
_NOTHING = Residency(0, 0)


class Decider:
    """Places requests and keeps the books of each attempt; never blocks the loop.

    :param shared: the index and every router's load, read under a budget; its load board
        is where this router's attempts take their leases.
    :param detector: compares predicted cached tokens with what engines report.
    :param baseline: a benchmark baseline that places instead of kvrouter's policy
        (:mod:`router.baselines`); None: the policy.
    :param journal: where every decision is written, if anywhere.
    """

    def __init__(
        self,
        settings: RouterSettings,
        *,
        replicas: ReplicaSet,
        tokenizers: TokenizerBook,
        shared: SharedState,
        speeds: SpeedBook,
        metrics: RouterMetrics,
        detector: MismatchDetector,
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
        self.detector = detector
        self.rng = rng or random.Random()
        self.churn = ChurnBook()
        window = settings.reuse_window_s
        self.reuse = ReuseBook(window) if window > 0 else None
        half_life = settings.recent_load_half_life_s
        self.occupancy = OccupancyBook(half_life) if half_life > 0 else None
        self.returns = ReturnBook()
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

    async def place(
        self,
        request: PromptRequest,
        *,
        dry_run: bool = False,
        among: Collection[str] | None = None,
    ) -> Placement:
        """Decide where ``request`` goes.

        :param dry_run: an operator query: a prompt that cannot be tokenized is a 400.
        :param among: the replicas the caller allows (a gateway's subset hint); None: all.
        :raises ModelNotFoundError: no replica serves the model.
        :raises NoReplicaError: none of them is healthy (and allowed).
        :raises OverloadedError: every candidate has ``shed_inflight`` requests in flight.
        :raises BadRequestError: the prompt is longer than ``max_prompt_tokens``.
        """
        model, lora = self.resolve_model(request.model)
        candidates = self.replicas.candidates(model, lora)
        if among is not None:
            candidates = [r for r in candidates if r.id in among]
        if not candidates:
            allowed = "" if among is None else " among the endpoints allowed"
            raise NoReplicaError(f"no healthy replica serves the model `{lora or model}`{allowed}")
        block_size = self._block_size(model, candidates)
        # an adapter's blocks live in the base model's partition, keyed from its own seed
        namespace = Namespace(model, block_size, lora)
        if self.baseline is not None:
            return await self._place_baseline(request, model, namespace, candidates, dry_run)
        stages: dict[str, float] = {}
        started = time.perf_counter()
        fallback: str | None = None
        try:
            ids = await self.tokenizers.token_ids(request, model)
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
        session = session_key(namespace, request.session) if request.session else None
        view = await self.shared.view(namespace, keys, session)
        self._learn_lookahead(namespace, candidates, view)
        fallback = fallback or view.fallback
        looked_up = time.perf_counter()
        stages["lookup"] = looked_up - hashed
        states = self._states(model, block_size, candidates, view)
        if not dry_run:
            self._shed(states)
        policy = self._policies.get(block_size)
        if policy is None:
            policy = self._policies[block_size] = self.settings.policy_config(block_size)
        output = request.max_tokens or self.settings.default_output_tokens
        decision = decide(len(ids), states, policy, self.rng, output)
        done = time.perf_counter()
        stages["score"] = done - looked_up
        stages["total"] = done - started
        placement = Placement(
            request,
            model,
            namespace,
            len(ids),
            keys,
            view.matches,
            decision,
            fallback,
            stages,
            view.homes,
            tuple(states),
            session,
        )
        if not dry_run:
            self._observe(placement, view)
        return placement

    def _observe(self, placement: Placement, view: SharedView) -> None:
        """A decision's stage times and session outcome in the metrics, its inputs in the
        journal; the request in the return book (does it continue one that finished?)."""
        for stage, seconds in placement.stages.items():
            self.metrics.decision.labels(stage).observe(seconds)
        for gap in self.returns.arrived(placement.keys):
            self.metrics.return_gap.observe(gap)
        if placement.session is not None:
            outcome = _session_outcome(view, placement.decision.replica)
            self.metrics.sessions.labels(outcome).inc()
        if self.journal is not None:
            self.journal.record(
                model=placement.model,
                prompt_tokens=placement.prompt_tokens,
                keys=placement.keys,
                matches=view.matches,
                states=placement.states,
                decision=placement.decision,
                fallback=placement.fallback,
                session=placement.request.session,
                stages=placement.stages,
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
                    session_home=replica.id in view.session,
                    valued_blocks=(
                        self.reuse.valued(replica.id, resident.blocks if resident else None)
                        if self.reuse
                        else None
                    ),
                    recent_inflight=(
                        self.occupancy.observe(replica.id, inflight) if self.occupancy else 0.0
                    ),
                    returns=self.returns.share,
                    prefixes=self.reuse.prefixes(replica.id) if self.reuse else 0,
                    sessions=view.sessions.get(replica.id, 0),
                    prefill_elapsed_ms=(
                        (now - load.prefill_since) * 1000
                        if load is not None and load.prefill_since is not None
                        else 0.0
                    ),
                )
            )
        return states

    def _shed(self, states: Sequence[ReplicaState]) -> None:
        """Refuse the request when every candidate already has ``shed_inflight`` requests in
        flight from all routers (0: never): a 429 the client may retry, instead of a queue
        that only grows."""
        limit = self.settings.shed_inflight
        if limit > 0 and all(state.inflight >= limit for state in states):
            self.metrics.shed.inc()
            raise OverloadedError(
                f"every replica has {limit} or more requests in flight; retry later"
            )

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
        return Placement(request, model, namespace, prompt_tokens, [], {}, decision, None, stages)

    # ------------------------------------------------------------------ attempts

    def commit(
        self, placement: Placement, replica: str, *, sees_first_token: bool | None = None
    ) -> Attempt:
        """Book a try of ``placement`` on ``replica``, the chosen one or the next-best after
        a failure, just before the request is sent there.

        The replica takes a load lease for the request's prefill work; the index is told it
        will hold the prompt's blocks (the part its events do not place there yet) and is
        now the home of the chain's anchors; the chain joins the replica's reuse book and the
        request its occupancy. A non-streamed answer shows no first token: its prefill is
        taken as done when the policy expected it to be.

        :param sees_first_token: whether the front end will call :meth:`first_token`
            (default: for a stream); if not, the prefill is taken as done when expected.
        """
        score = placement.score(replica)
        namespace, keys = placement.namespace, placement.keys
        lease = self.shared.load.acquire(namespace, replica, round(score.prefill_work))
        self.metrics.inflight.labels(replica).inc()
        attempt = Attempt(placement, replica, score, lease)
        if not (placement.request.stream if sees_first_token is None else sees_first_token):
            delay = max(0.0, score.expected_ttft_ms / 1000)
            attempt.timer = asyncio.get_running_loop().call_later(delay, lease.first_token)
        placed = placement.placed_blocks(replica)
        route = Route(
            replica,
            keys[placed:],
            self.settings.predict_ttl_s,
            [keys[p] for p in home_anchors(len(keys))]
            + ([placement.session] if placement.session is not None else []),
            self.settings.home_ttl_s,
            first=placed,
            session=placement.session,
            session_ttl_s=self.settings.reuse_window_s,
        )
        self.shared.record(namespace, route)
        state = placement.state(replica)
        if self.occupancy is not None and state is not None:
            self.occupancy.observe(replica, state.inflight + 1)  # the request joins its count
        if self.reuse is not None and keys:  # the replica holds the whole chain after it
            root = keys[0] if placement.session is None else placement.session
            attempt.booking = self.reuse.record(replica, root, len(keys))
        return attempt

    def first_token(self, attempt: Attempt) -> None:
        """The attempt's first token reached the router: its prefill is done (idempotent)."""
        if attempt.first_token_at is not None or attempt.done:
            return
        attempt.first_token_at = time.monotonic()
        attempt.lease.first_token()
        ttft = attempt.first_token_at - attempt.dispatched
        self.metrics.ttft.labels(attempt.replica).observe(ttft)
        self.speeds.observe(attempt.placement.model, ttft * 1000, attempt.score.work_tokens)

    def fail(self, attempt: Attempt) -> None:
        """The attempt got no answer (the front end may try the next replica): its lease is
        released and the books that said the chain went there are taken back. What the
        index was told expires with its time to live."""
        if not self._close(attempt):
            return
        if attempt.booking is not None and self.reuse is not None:
            self.reuse.withdraw(attempt.booking)
        state = attempt.placement.state(attempt.replica)
        if self.occupancy is not None and state is not None:
            self.occupancy.observe(attempt.replica, state.inflight)  # the request left

    def finish(self, attempt: Attempt, outcome: str, engine_cached_tokens: int | None) -> None:
        """The attempt's answer ended (idempotent): ``"ok"``, or how it ended otherwise.

        :param engine_cached_tokens: the prompt tokens the engine reported cached (its
            usage), compared with the prediction (:class:`router.metrics.MismatchDetector`).
        """
        if not self._close(attempt):
            return
        placement, replica = attempt.placement, attempt.replica
        predicted = attempt.score.matched_tokens
        self.metrics.prompt_tokens.labels(replica).inc(placement.prompt_tokens)
        if placement.prompt_tokens:
            self.metrics.predicted_hit_ratio.observe(predicted / placement.prompt_tokens)
        # a prediction to check needs block keys (baseline policies compute none)
        checkable = placement.fallback is None and bool(placement.keys)
        if engine_cached_tokens is not None and checkable and placement.request.batch == 1:
            size = placement.namespace.block_size
            real = placement.placed_blocks(replica) * size
            self.detector.observe(
                placement.model,
                replica,
                predicted=predicted,
                confirmed=min(real, predicted),
                engine=engine_cached_tokens,
                block=size,
            )
        if outcome == "ok":
            self.replicas.succeeded(replica)
            self.returns.finished(placement.keys)

    def _close(self, attempt: Attempt) -> bool:
        """Release the attempt's lease once; False if it was already closed."""
        if attempt.done:
            return False
        attempt.done = True
        if attempt.timer is not None:
            attempt.timer.cancel()
            attempt.timer = None
        attempt.lease.release()
        self.metrics.inflight.labels(attempt.replica).dec()
        return True

    def forget(self, replica: str) -> None:
        """A replica left the fleet: what its cache held is worth nothing now (speeds are
        per model and stay)."""
        if self.reuse is not None:
            self.reuse.forget(replica)
        if self.occupancy is not None:
            self.occupancy.forget(replica)


def _session_outcome(view: SharedView, chosen: str) -> str:
    """How a request of a session was placed: its session's first (or expired) claim, at the
    session's home, or moved away from it."""
    if not view.session:
        return "new"
    return "home" if chosen in view.session else "moved"
