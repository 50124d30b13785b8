"""How many requests per second a fleet of simulated engines can serve for a workload.

:func:`measure_shape` learns what a workload can reuse (its prompts rendered and chained into
blocks); :func:`capacity` solves the engine's steady state with its own latency profile, in
two readings: **ideal**, what a perfect cache-aware router unlocks (the benchmark's load is
relative to it), and **cache-blind**, about what round-robin sustains; :func:`ttft_floors`
gives each request's unavoidable prefill. The model: docs/benchmarks.md, "Capacity".
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass

from bench.workloads import Workload, text, walk
from publishers.config import EngineShape
from publishers.sim.latency import LatencyProfile, load_profile
from tracker.core.blocks import Namespace, block_keys
from tracker.core.tokens import Tokenizer

_COMPUTE_CEILING = 0.9
_KV_HEADROOM = 0.95
_KEPT_STEPS = 20  # the ideal's resident share of the prefixes, tried in 5 % steps


@dataclass(frozen=True, slots=True)
class WorkloadShape:
    """What a workload asks of the engines, per request on average (tokens / blocks)."""

    requests: int
    prompt_tokens: float
    output_tokens: float
    unique_tokens: float
    shared_blocks: int
    private_blocks: float
    longest_request: int = 0  # tokens: the longest prompt with its output

    @property
    def ideal_hit_rate(self) -> float:
        """Share of prompt tokens a router that never loses a prefix could serve from cache."""
        return 1.0 - self.unique_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True, slots=True)
class Capacity:
    """Fleet capacity in requests per simulated second, and what bounds it."""

    ideal_rps: float
    ideal_limit: str
    blind_rps: float
    blind_limit: str
    step_ms: float


def latency_profile(engine: EngineShape) -> LatencyProfile:
    """The latency profile ``engine`` runs (its step floor replaced when it sets one)."""
    return load_profile(engine.profile, floor_ms=engine.floor_ms)


@dataclass(frozen=True, slots=True)
class _Prompt:
    """One request as the engines see it: planned arrival, length, block chain, output."""

    at_s: float
    tokens: int
    chain: list[int]
    outputs: int


def _prompts(tokenizer: Tokenizer, workload: Workload, namespace: Namespace) -> list[_Prompt]:
    """Every request (subagents' too), in the order a closed loop sends each session's:
    histories carry planned answers, else stand-ins of the configured length. Each arrives
    at its session's start plus its planned send (open loop; 0 otherwise)."""
    rng = random.Random("capacity")
    out = []
    for session in workload.conversations:
        for request in walk(session, lambda turn: text(rng, turn.max_tokens)):
            conversation, turn = request.conversation, request.conversation.turns[request.turn]
            if conversation.raw:
                ids = tokenizer.prompt_token_ids(turn.user)
            else:
                ids = tokenizer.chat_token_ids(request.messages, add_generation_prompt=True)
            chain = block_keys(ids, namespace)
            out.append(_Prompt(session.start_s + request.at_s, len(ids), chain, turn.max_tokens))
    return out


def measure_shape(workload: Workload, block_size: int, tokenizer: Tokenizer) -> WorkloadShape:
    """Reuse structure of ``workload`` in ``block_size`` blocks (see the module docstring)."""
    prompts = _prompts(tokenizer, workload, Namespace("capacity", block_size))
    uses: Counter[int] = Counter(key for p in prompts for key in set(p.chain))
    seen: set[int] = set()
    unique = private = 0.0
    for p in prompts:
        new = sum(1 for key in p.chain if key not in seen)
        seen.update(p.chain)
        unique += new * block_size + p.tokens - len(p.chain) * block_size
        own = sum(1 for key in p.chain if uses[key] == 1)
        private += own + math.ceil((p.tokens - len(p.chain) * block_size + p.outputs) / block_size)
    n = max(1, len(prompts))
    return WorkloadShape(
        requests=len(prompts),
        prompt_tokens=sum(p.tokens for p in prompts) / n,
        output_tokens=sum(p.outputs for p in prompts) / n,
        unique_tokens=unique / n,
        shared_blocks=sum(1 for count in uses.values() if count > 1),
        private_blocks=private / n,
        longest_request=max((p.tokens + p.outputs for p in prompts), default=0),
    )


@dataclass(frozen=True, slots=True)
class _Requests:
    """One class of requests: its share of the traffic, new prefill tokens and own blocks."""

    weight: float
    new: float
    blocks: float


def _per_replica(
    engine: EngineShape,
    profile: LatencyProfile,
    *,
    prompt: float,
    output: float,
    resident: float,
    classes: tuple[_Requests, ...],
) -> tuple[float, str, float]:
    """(requests/s one replica sustains, the binding limit, step ms there)."""
    work_ms = floor = blocks = 0.0
    for c in classes:
        context = max(0.0, prompt - c.new)
        decode = output * (prompt + output / 2)  # context tokens read by the decode steps
        work_ms += c.weight * (
            profile.token_ms * (c.new + output)
            + profile.attention_ms * (c.new * (context + c.new / 2) + decode)
            + profile.kv_ms_per_token * decode
        )
        floor += c.weight * profile.floor_ms * profile.prefill_floor_at(context)
        blocks += c.weight * c.blocks

    def state(rate_per_ms: float) -> tuple[str | None, float]:
        load = work_ms * rate_per_ms
        if load >= _COMPUTE_CEILING:
            return "compute", math.inf
        step = max(floor, profile.step_compute_ms / (1.0 - load))
        running = rate_per_ms * output * step
        if running > engine.max_num_seqs:
            return "max_num_seqs", step
        if resident + running * blocks > _KV_HEADROOM * engine.num_blocks:
            return "kv_cache", step
        return None, step

    lo, hi = 0.0, _COMPUTE_CEILING / work_ms if work_ms > 0 else 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if state(mid)[0] is None:
            lo = mid
        else:
            hi = mid
    limit, _ = state(hi)
    return lo * 1000.0, limit or "compute", state(lo)[1]


def capacity(shape: WorkloadShape, engine: EngineShape, replicas: int) -> Capacity:
    """The fleet's ideal and cache-blind capacity for ``shape`` on ``replicas`` engines of
    ``engine``'s size and latency profile (module docstring)."""
    profile = latency_profile(engine)
    prompt, output = shape.prompt_tokens, shape.output_tokens
    whole = math.ceil((prompt + output) / engine.block_size)
    cold = _Requests(1.0, prompt, whole)
    ideal, ideal_limit, step = 0.0, "kv_cache", 0.0
    for kept in (i / _KEPT_STEPS for i in range(_KEPT_STEPS, -1, -1)):
        classes = (_Requests(kept, shape.unique_tokens, shape.private_blocks),) + (
            (_Requests(1.0 - kept, prompt, whole),) if kept < 1 else ()
        )
        rate, limit, at = _per_replica(
            engine,
            profile,
            prompt=prompt,
            output=output,
            resident=kept * shape.shared_blocks / replicas,
            classes=classes,
        )
        if rate > ideal:
            ideal, ideal_limit, step = rate, limit, at
    blind, blind_limit, _ = _per_replica(
        engine, profile, prompt=prompt, output=output, resident=0.0, classes=(cold,)
    )
    return Capacity(ideal * replicas, ideal_limit, blind * replicas, blind_limit, step)


def ttft_floors(workload: Workload, engine: EngineShape, tokenizer: Tokenizer) -> list[float]:
    """Per request, in arrival order, the least TTFT any router could give it (simulated ms).

    The request pays only its unavoidable prefill: the tokens no earlier request of the
    workload had (a block seen before is taken as cached wherever it is needed, and the last
    token is always computed, as vLLM does), in chunks of the engine's
    ``max_num_batched_tokens``, each chunk one engine step of the latency profile with
    nothing else in the batch and no queue. The bound no routing policy can beat, and no
    finite fleet reaches under load.
    """
    size = engine.block_size
    profile = latency_profile(engine)
    max_num_batched_tokens = engine.max_num_batched_tokens
    prompts = _prompts(tokenizer, workload, Namespace("floor", size))
    ordered = sorted(range(len(prompts)), key=lambda i: (prompts[i].at_s, i))
    seen: set[int] = set()
    out = []
    for p in (prompts[i] for i in ordered):
        cached = 0
        for key in p.chain[: max(0, (p.tokens - 1) // size)]:
            if key not in seen:
                break
            cached += size
        seen.update(p.chain)
        out.append(profile.lone_prefill_ms(p.tokens, max_num_batched_tokens, cached))
    return out
