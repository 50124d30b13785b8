"""The simulated vLLM engine: its config, requests and their token streams, the
continuous-batching scheduler and the step loop (no HTTP; forward passes are sleeps).

How it schedules, when it publishes and what it outputs: docs/architecture.md, "Simulated
engine".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import msgspec

from publishers.config import EngineShape
from publishers.sim.block_hashes import TokenSequence, none_hash
from publishers.sim.cache import BlockPool, CachedBlock, KVCacheManager
from publishers.sim.latency import LatencyProfile, load_profile
from publishers.sim.probe import EngineProbe, QueuedWork, probe
from tracker.core.events import Event

__all__ = [
    "EngineConfig",
    "EngineStats",
    "EventSink",
    "GenerationRequest",
    "RequestStream",
    "SimulatedEngine",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class EngineConfig(EngineShape):
    """Shape and speed of a simulated engine (:class:`~publishers.config.EngineShape`), and
    what else it serves with.

    Attributes:
        model: served model name (informational).
        hash_seed: the ``PYTHONHASHSEED`` string the block-hash chain is seeded with.
        data_parallel_rank: rank of this engine (informational; the publisher stamps it).
        lookahead_tokens: tokens after each block folded into its hash, as vLLM 0.33 does
            with EAGLE-style drafting (``BlockStored.lookahead_token_ids``).
        max_model_len: longest prompt + output; a request reaching it finishes with
            "length" (default and upper bound: the cache capacity, as vLLM requires).
        offload_blocks: blocks of a CPU tier behind the GPU cache, as vLLM's offloading
            connector keeps (0: none); see :class:`publishers.sim.cache.OffloadTier`.
        offload_ms_per_token: time to load one token's KV back from the CPU tier (Llama-8B's
            128 KiB per token over a ~50 GB/s host link: 0.003 ms, a tenth of recomputing it).
    """

    model: str = "default"
    hash_seed: str = "0"
    data_parallel_rank: int = 0
    max_model_len: int | None = None
    lookahead_tokens: int = 0
    offload_blocks: int = 0
    offload_ms_per_token: float = 0.003

    def __post_init__(self) -> None:
        if self.lookahead_tokens < 0:
            raise ValueError("lookahead_tokens must be >= 0")
        if self.offload_blocks < 0 or not self.offload_ms_per_token >= 0:
            raise ValueError("offload_blocks and offload_ms_per_token must be >= 0")
        for name in ("block_size", "num_blocks", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.time_scale < 0:
            raise ValueError(f"time_scale must be >= 0, got {self.time_scale}")
        capacity = self.num_blocks * self.block_size
        if self.max_model_len is None:
            object.__setattr__(self, "max_model_len", capacity)
        elif not 0 < self.max_model_len <= capacity:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the cache ({capacity})")


class GenerationRequest(msgspec.Struct):
    """A tokenized generation request."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    lora_name: str | None = None
    cache_salt: str | None = None
    ignore_eos: bool = True


class RequestStream:
    """The output side of one request: token ids per engine step, then the finish reason.

    ``cached_tokens`` is set when the request is first scheduled (prefix-cache hits, in
    tokens); ``finish_reason`` is ``"length"``, ``"abort"`` or ``None`` while running.
    """

    def __init__(self, request_id: str, prompt_tokens: int) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0
        self.output_tokens = 0
        self.finish_reason: str | None = None
        self._chunks: asyncio.Queue[list[int] | None] = asyncio.Queue()
        self._first = asyncio.Event()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _push(self, tokens: list[int]) -> None:
        self.output_tokens += len(tokens)
        self._chunks.put_nowait(tokens)
        self._first.set()

    def _finish(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self._chunks.put_nowait(None)
            self._first.set()

    async def __aiter__(self) -> AsyncIterator[list[int]]:
        while (chunk := await self._chunks.get()) is not None:
            yield chunk
        self._chunks.put_nowait(None)  # a later iteration ends at once too

    async def wait_first_token(self) -> None:
        """Return once the first token exists, or the request ended without one."""
        await self._first.wait()


class EventSink(Protocol):
    """Receives the KV events of every engine step that produced some."""

    def publish(self, events: list[Event]) -> None: ...


class EngineStats(msgspec.Struct):
    """vLLM-style scheduler and prefix-cache gauges and counters (cache counters in tokens)."""

    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int = 0
    num_generated_tokens: int = 0


class _Request:
    """Scheduler-side state of one request."""

    __slots__ = ("admitted", "max_tokens", "num_computed", "rng", "seq", "stream")

    def __init__(self, stream: RequestStream, seq: TokenSequence, max_tokens: int) -> None:
        self.stream = stream
        self.seq = seq
        self.max_tokens = max_tokens
        self.num_computed = 0
        self.admitted = False
        self.rng = random.Random(str((seq.token_ids, seq.lora_name)))  # same prompt, same output

    @property
    def request_id(self) -> str:
        return self.stream.request_id

    @property
    def num_output(self) -> int:
        return self.seq.num_tokens - self.stream.prompt_tokens

    def next_token(self) -> int:
        return self.seq.token_ids[self.rng.randrange(self.stream.prompt_tokens)]


class SimulatedEngine:
    """A vLLM v1-like engine (FCFS continuous batching, chunked prefill, preemption by
    recompute) whose forward passes are sleeps of its latency profile's step time.

    Args:
        config: engine shape and speed.
        sink: where each step's KV events go (``None``: nowhere).
    """

    def __init__(self, config: EngineConfig, sink: EventSink | None = None) -> None:
        self.config = config
        self.profile: LatencyProfile = load_profile(config.profile, floor_ms=config.floor_ms)
        self._sink = sink
        self._pool = BlockPool(config.num_blocks, config.block_size, config.offload_blocks)
        self._kv = KVCacheManager(self._pool)
        self._root = none_hash(config.hash_seed)
        self._max_len = config.max_model_len or config.num_blocks * config.block_size
        self._requests: dict[str, _Request] = {}
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._lora_ids: dict[str, int] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self._stepping = False
        self._step_end = 0.0  # loop time at which the step in flight ends
        self._in_step: dict[str, int] = {}  # tokens the step in flight computes, per request
        self._loading = 0  # tokens the step being scheduled loads from the CPU tier
        self._queries = self._hits = self._preemptions = self._steps = self._generated = 0

    async def start(self) -> None:
        """Start the step loop on the running event loop."""
        if self._task is not None or self._stopped:
            raise RuntimeError("engine already started")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-steps")

    async def stop(self) -> None:
        """Stop stepping and end every in-flight request with ``finish_reason="abort"``.

        Events of an interrupted step still go to the sink, so what was published matches
        :meth:`cached_blocks`; stop the engine before closing its sink.
        """
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for request_id in list(self._requests):
            self.abort(request_id)
        events = self._pool.take_events()
        if events and self._sink is not None:
            self._sink.publish(events)

    def add_request(self, request: GenerationRequest) -> RequestStream:
        """Queue a request; raises ValueError if it is malformed, duplicated or too large."""
        if self._stopped:
            raise RuntimeError("engine stopped")
        prompt = request.prompt_token_ids
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        if not prompt:
            raise ValueError("the prompt is empty")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {request.max_tokens}")
        if len(prompt) > self._max_len:
            raise ValueError(f"the prompt ({len(prompt)} tokens) exceeds max_model_len")
        lora_id = None
        if request.lora_name is not None:
            lora_id = self._lora_ids.setdefault(request.lora_name, len(self._lora_ids) + 1)
        seq = TokenSequence(
            prompt, block_size=self.config.block_size, root=self._root, lora_id=lora_id,
            lora_name=request.lora_name, cache_salt=request.cache_salt,
            lookahead=self.config.lookahead_tokens,
        )  # fmt: skip
        stream = RequestStream(request.request_id, len(prompt))
        state = _Request(stream, seq, request.max_tokens)
        self._requests[request.request_id] = state
        self._waiting.append(state)
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """End a request (client gone): free its blocks, finish its stream with "abort"."""
        state = self._requests.get(request_id)
        if state is not None:
            self._finish(state, "abort")

    def _finish(self, state: _Request, reason: str) -> None:
        del self._requests[state.request_id]
        if state in self._running:
            self._running.remove(state)
        else:
            with contextlib.suppress(ValueError):
                self._waiting.remove(state)
        self._kv.free(state.request_id)
        state.stream._finish(reason)
        self._wake.set()

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached block, as vLLM: only when no block is in use.

        ``AllBlocksCleared`` is published with the next step's batch (vLLM's timing).
        """
        return self._pool.reset_prefix_cache()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_requests_running=len(self._running),
            num_requests_waiting=len(self._waiting),
            kv_cache_usage_perc=self._pool.usage(),
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
            num_preemptions=self._preemptions,
            num_steps=self._steps,
            num_generated_tokens=self._generated,
        )

    @property
    def idle(self) -> bool:
        """No request queued or running and no step in flight (all events published)."""
        return not self._requests and not self._stepping

    def probe(self, token_ids: list[int], cache_salt: str | None = None) -> EngineProbe:
        """What the scheduler would do with this prompt now (the benchmark oracle; not vLLM).

        Changes nothing; see :mod:`publishers.sim.probe`.
        """
        config = self.config
        seq = TokenSequence(
            token_ids,
            block_size=config.block_size,
            root=self._root,
            cache_salt=cache_salt,
            lookahead=config.lookahead_tokens,
        )

        def work(state: _Request) -> QueuedWork:
            # tokens to compute before the next output: all but the last sampled one
            target = state.seq.num_tokens - (1 if state.num_output else 0)
            return QueuedWork(
                state.seq,
                target,
                state.num_computed + self._in_step.get(state.request_id, 0),
                state.max_tokens - state.num_output,
                self._kv.num_blocks(state.request_id),
            )

        left = 0.0
        if self._stepping and config.time_scale > 0:
            loop_left = self._step_end - asyncio.get_running_loop().time()
            left = max(0.0, loop_left) * 1000.0 / config.time_scale
        return probe(
            seq,
            kv=self._kv,
            profile=self.profile,
            shape=config,
            waiting=[work(s) for s in self._waiting],
            running=[work(s) for s in self._running],
            step_left_ms=left,
        )

    def cached_blocks(self) -> dict[int, CachedBlock]:
        """Every block in the prefix-cache map (in use or free), by event hash."""
        return self._pool.cached_blocks()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not self._running and not self._waiting:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                started = loop.time()
                scheduled = self._schedule()
                if not scheduled:  # nothing fits until something finishes or is aborted
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                duration = self._step_ms(scheduled) * self.config.time_scale / 1000.0
                self._step_end = started + duration
                self._in_step = {state.request_id: count for state, count, _ in scheduled}
                self._stepping = True
                try:
                    await asyncio.sleep(max(0.0, started + duration - loop.time()))
                    self._update(scheduled)
                finally:
                    self._stepping = False
                    self._in_step = {}
        except Exception:
            logger.exception("simulated engine step loop crashed")
            for request_id in list(self._requests):
                self.abort(request_id)
            raise

    def _schedule(self) -> list[tuple[_Request, int, int]]:
        """Pick this step's work: ``(request, new tokens, computed tokens before)``."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[_Request, int, int]] = []
        preempted = False
        i = 0
        while i < len(self._running) and budget > 0:
            state = self._running[i]
            count = min(state.seq.num_tokens - state.num_computed, budget)
            fits = True
            while not self._kv.allocate_slots(
                state.request_id, state.seq, count, state.num_computed
            ):
                victim = self._running.pop()  # the most recently admitted request
                self._preempt(victim)
                preempted = True
                if victim is state:
                    fits = False
                    break
            if not fits:
                break
            scheduled.append((state, count, state.num_computed))
            budget -= count
            i += 1
        while (
            not preempted
            and self._waiting
            and budget > 0
            and len(self._running) < self.config.max_num_seqs
        ):
            state = self._waiting[0]
            hits = self._kv.get_computed_blocks(state.seq)
            loaded = self._kv.offloaded_blocks(state.seq, len(hits)) * self.config.block_size
            computed = len(hits) * self.config.block_size + loaded
            count = min(state.seq.num_tokens - computed, budget)
            if not self._kv.allocate_slots(state.request_id, state.seq, count, computed, hits):
                break
            self._loading += loaded
            self._waiting.popleft()
            self._running.append(state)
            state.num_computed = computed
            self._queries += state.seq.num_tokens
            self._hits += computed
            if not state.admitted:
                state.admitted = True
                state.stream.cached_tokens = computed
            scheduled.append((state, count, computed))
            budget -= count
        return scheduled

    def _preempt(self, state: _Request) -> None:
        self._kv.free(state.request_id)
        state.num_computed = 0
        self._waiting.appendleft(state)
        self._preemptions += 1

    def _step_ms(self, scheduled: list[tuple[_Request, int, int]]) -> float:
        loading, self._loading = self._loading * self.config.offload_ms_per_token, 0
        prefill: list[tuple[int, int]] = []
        decode: list[int] = []
        for state, count, before in scheduled:
            if count == 1 and state.num_output and before == state.seq.num_tokens - 1:
                decode.append(state.seq.num_tokens)
            else:
                prefill.append((count, before))
        return self.profile.step_ms(prefill, decode) + loading

    def _update(self, scheduled: list[tuple[_Request, int, int]]) -> None:
        """After the forward pass: sample, finish, publish the step's events, stream tokens."""
        self._steps += 1
        outputs: list[tuple[RequestStream, list[int]]] = []
        finished: list[_Request] = []
        for state, count, _ in scheduled:
            if state.stream.finish_reason:  # aborted during the forward pass
                continue
            state.num_computed += count
            if state.num_computed < state.seq.num_tokens:
                continue  # a prefill chunk that does not complete the prompt
            token = state.next_token()
            state.seq.extend([token])
            outputs.append((state.stream, [token]))
            if state.num_output >= state.max_tokens or state.seq.num_tokens >= self._max_len:
                finished.append(state)
        events = self._pool.take_events()
        if events and self._sink is not None:
            self._sink.publish(events)
        for stream, tokens in outputs:
            self._generated += len(tokens)
            stream._push(tokens)
        for state in finished:
            self._finish(state, "length")
