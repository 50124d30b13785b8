"""What a simulated engine would do with a prompt right now, changing nothing: the answer of
``POST /kvrouter/probe`` (simulation only, not part of vLLM), which the benchmark's oracle
policy reads.

Its fields and how each is estimated: docs/benchmarks.md, "The probe".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from publishers.config import EngineShape
from publishers.sim.block_hashes import TokenSequence
from publishers.sim.cache import KVCacheManager
from publishers.sim.latency import LatencyProfile

_MAX_STEPS = 10_000  # bounds the step loop for absurd queues


class EngineProbe(msgspec.Struct, frozen=True):
    """The probe's answer (the JSON body of ``POST /kvrouter/probe``); times in simulated,
    unscaled milliseconds."""

    prompt_tokens: int
    cached_tokens: int
    expected_cached_tokens: int
    num_running: int
    num_waiting: int
    queued_prefill_tokens: int
    free_blocks: int
    cached_blocks: int
    num_blocks: int
    expected_ttft_ms: float
    step_left_ms: float


@dataclass(frozen=True, slots=True)
class QueuedWork:
    """One request the engine holds: its sequence and how far it got.

    :param prompt_tokens: tokens to compute before the first output (the whole sequence for
        a preempted request, which recomputes its outputs too).
    :param computed: tokens computed so far (0 while waiting).
    :param remaining_outputs: output tokens still to generate.
    :param blocks: KV blocks it holds now.
    """

    seq: TokenSequence
    prompt_tokens: int
    computed: int
    remaining_outputs: int
    blocks: int

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_tokens


def _reuse(kv: KVCacheManager, seq: TokenSequence, ahead: set[bytes]) -> tuple[int, int]:
    """(blocks cached now, blocks cached once the requests ahead are admitted)."""
    limit = (seq.num_tokens - 1) // kv.block_size
    now = 0
    for digest in seq.block_hashes[:limit]:
        if kv.pool.lookup(digest) is None:
            break
        now += 1
    later = now
    for digest in seq.block_hashes[now:limit]:
        if digest not in ahead and kv.pool.lookup(digest) is None:
            break
        later += 1
    return now, later


def probe(
    seq: TokenSequence,
    *,
    kv: KVCacheManager,
    profile: LatencyProfile,
    shape: EngineShape,
    waiting: Sequence[QueuedWork],
    running: Sequence[QueuedWork],
    step_left_ms: float,
) -> EngineProbe:
    """The engine's answer for ``seq`` given its queue (docs/benchmarks.md, "The probe")."""
    size = shape.block_size
    ahead: set[bytes] = set()
    queued = 0
    for work in (*running, *waiting):
        if work.prefilling:
            ahead.update(work.seq.block_hashes[: work.prompt_tokens // size])
            queued += work.prompt_tokens - work.computed
    now_blocks, later_blocks = _reuse(kv, seq, ahead)
    cached, expected = now_blocks * size, later_blocks * size
    decoders = [w for w in running if not w.prefilling]
    free = kv.pool.num_free
    ttft = _prefill_ms(
        profile, shape, decoders, queued=queued, own=seq.num_tokens - expected, context=expected
    )
    # KV blocks: the queue's prompts and this one must fit, or wait for decoders to finish
    need = math.ceil(seq.num_tokens / size) - later_blocks
    need += sum(math.ceil(w.prompt_tokens / size) - w.blocks for w in waiting)
    if need > free and decoders:
        ttft += _kv_wait_ms(profile, decoders, need - free)
    return EngineProbe(
        prompt_tokens=seq.num_tokens,
        cached_tokens=cached,
        expected_cached_tokens=expected,
        num_running=len(running),
        num_waiting=len(waiting),
        queued_prefill_tokens=queued,
        free_blocks=free,
        cached_blocks=kv.pool.num_cached,
        num_blocks=len(kv.pool.blocks),
        expected_ttft_ms=ttft,
        step_left_ms=step_left_ms,
    )


def _prefill_ms(
    profile: LatencyProfile,
    shape: EngineShape,
    decoders: Sequence[QueuedWork],
    *,
    queued: int,
    own: int,
    context: int,
) -> float:
    """Steps until ``queued`` and then ``own`` prompt tokens are computed (FCFS chunks)."""
    contexts = [w.seq.num_tokens for w in decoders]
    budget = max(1, shape.max_num_batched_tokens - len(contexts))
    total, left, steps = 0.0, queued + max(1, own), 0
    while left > 0 and steps < _MAX_STEPS:
        chunk = min(left, budget)
        total += profile.step_ms([(chunk, context)], contexts)
        left -= chunk
        steps += 1
    return total


def _kv_wait_ms(profile: LatencyProfile, decoders: Sequence[QueuedWork], deficit: int) -> float:
    """Decode time until enough running requests finish to free ``deficit`` blocks."""
    contexts = [w.seq.num_tokens for w in decoders]
    step = profile.step_ms([], contexts)
    freed = 0
    for work in sorted(decoders, key=lambda w: w.remaining_outputs):
        freed += work.blocks
        if freed >= deficit:
            return step * work.remaining_outputs
    return step * max(w.remaining_outputs for w in decoders)
