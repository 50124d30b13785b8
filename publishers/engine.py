"""The simulated vLLM engine: requests, the continuous-batching scheduler and the step loop.

Scheduling follows vLLM v1 (FCFS): a step's token budget goes to running requests first (one
decode token, or the next prefill chunk), then to waiting ones, which reuse their longest cached
prefix; a request that cannot get a block preempts the most recently admitted one (recompute),
and nothing is admitted in a step that preempted. A step sleeps ``step_ms * time_scale``,
samples a token for each request whose prompt is computed, publishes the step's KV events (one
batch, after the forward pass, as vLLM >= 0.11.1) and then streams the tokens. Outputs are
synthetic but greedy-like: drawn from the prompt's own ids by an RNG seeded with the prompt, so
every replica produces the same tokens (and blocks) for it; there is no EOS, a request ends at
``max_tokens`` or ``max_model_len`` ("length"). ``AllBlocksCleared`` rides with the next step's
batch, as in vLLM: an idle engine announces a reset only when new work arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import deque
from typing import Protocol

import msgspec

from publishers.block_hashes import TokenSequence, none_hash
from publishers.cache import BlockPool, CachedBlock, KVCacheManager
from publishers.engine_config import EngineConfig
from publishers.generation import GenerationRequest, RequestStream
from publishers.latency import LatencyProfile, load_profile
from publishers.probe import EngineProbe, QueuedWork, probe
from tracker.core.events import Event

__all__ = ["EngineStats", "EventSink", "SimulatedEngine"]

logger = logging.getLogger(__name__)


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
    """A vLLM-like engine whose forward passes are sleeps; see the module docstring.

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

        Changes nothing; see :mod:`publishers.probe`.
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
