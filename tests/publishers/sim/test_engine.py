"""The simulated engine: scheduling, prefix reuse, preemption and the events it publishes."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from publishers.sim.cache import CachedBlock
from publishers.sim.engine import EngineConfig, GenerationRequest, RequestStream, SimulatedEngine
from tracker.core.event_codec import WireEra, decode_batch, encode_batch
from tracker.core.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch


class RecordingSink:
    """Keeps every published batch, after a round trip through the v0.24 wire codec."""

    def __init__(self) -> None:
        self.batches: list[list[Event]] = []

    def publish(self, events: list[Event]) -> None:
        payload = encode_batch(EventBatch(0.0, events, 0), WireEra.V0_24_0)
        self.batches.append(decode_batch(payload).events)

    @property
    def events(self) -> list[Event]:
        return [e for batch in self.batches for e in batch]

    def stored(self) -> list[BlockStored]:
        return [e for e in self.events if isinstance(e, BlockStored)]

    def removed(self) -> list[int]:
        return [h for e in self.events if isinstance(e, BlockRemoved) for h in e.block_hashes]  # type: ignore[misc]


class Reference:
    """A consumer that knows nothing but the events: follows hashes, counts physical copies."""

    def __init__(self) -> None:
        self.copies: Counter[int] = Counter()
        self.blocks: dict[int, CachedBlock] = {}

    def apply(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                size = event.block_size
                for i, h in enumerate(event.block_hashes):
                    assert isinstance(h, int) and (parent is None or isinstance(parent, int))
                    extra = event.extra_keys[i] if event.extra_keys else None
                    self.blocks[h] = CachedBlock(
                        parent_hash=parent,
                        token_ids=tuple(event.token_ids[i * size : (i + 1) * size]),
                        lora_name=event.lora_name,
                        extra_keys=None if extra is None else tuple(extra),
                    )
                    self.copies[h] += 1
                    parent = h
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    assert isinstance(h, int)
                    self.copies[h] -= 1
                    if self.copies[h] == 0:
                        del self.copies[h], self.blocks[h]
            elif isinstance(event, AllBlocksCleared):
                self.copies.clear()
                self.blocks.clear()


EngineFactory = Callable[..., SimulatedEngine]


@pytest.fixture
async def make_engine() -> AsyncIterator[EngineFactory]:
    engines: list[SimulatedEngine] = []

    def factory(sink: RecordingSink | None = None, **overrides: Any) -> SimulatedEngine:
        settings: dict[str, Any] = {"time_scale": 0.0, "num_blocks": 256, **overrides}
        engine = SimulatedEngine(EngineConfig(**settings), sink)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        await engine.stop()


def request(rid: str, prompt: list[int], max_tokens: int = 1, **kw: Any) -> GenerationRequest:
    return GenerationRequest(request_id=rid, prompt_token_ids=prompt, max_tokens=max_tokens, **kw)


async def collect(stream: RequestStream) -> list[int]:
    out: list[int] = []
    async for chunk in stream:
        out.extend(chunk)
    return out


async def until_idle(engine: SimulatedEngine) -> None:
    while not engine.idle:  # noqa: ASYNC110 - polling a test-only condition
        await asyncio.sleep(0.001)


async def test_prefix_reuse_reports_cached_tokens(make_engine: EngineFactory) -> None:
    engine = make_engine()
    await engine.start()
    base = list(range(1000, 1064))  # 4 blocks of 16
    first = engine.add_request(request("a", base))
    await collect(first)
    assert first.cached_tokens == 0
    second = engine.add_request(request("b", [*base[:48], 7, 8, 9, 10]))
    same = engine.add_request(request("c", base))
    await collect(second)
    await collect(same)
    assert second.cached_tokens == 48
    assert same.cached_tokens == 48  # the last prompt token is always recomputed
    stats = engine.stats()
    assert stats.prefix_cache_queries == 64 + 52 + 64
    assert stats.prefix_cache_hits == 96


async def test_outputs_fill_blocks_with_a_parent_chain(make_engine: EngineFactory) -> None:
    sink = RecordingSink()
    engine = make_engine(sink)
    await engine.start()
    stream = engine.add_request(request("a", list(range(16)), max_tokens=33))
    chunks = [chunk async for chunk in stream]
    assert [len(c) for c in chunks] == [1] * 33
    assert stream.finish_reason == "length"
    outputs = [t for c in chunks for t in c]
    events = sink.stored()
    # prompt block at prefill, then one event per block filled by generated tokens
    assert [e.token_ids for e in events] == [list(range(16)), outputs[:16], outputs[16:32]]
    assert events[0].parent_block_hash is None
    for prev, nxt in itertools.pairwise(events):
        assert nxt.parent_block_hash == prev.block_hashes[-1]
    assert all(e.medium == "GPU" and e.block_size == 16 for e in events)
    assert len(engine.cached_blocks()) == 3
    # steps without a newly full block publish nothing
    assert len(sink.batches) == 3


async def test_outputs_are_deterministic_per_prompt(make_engine: EngineFactory) -> None:
    one, two = make_engine(), make_engine()
    await one.start()
    await two.start()
    prompt = list(range(40, 90))
    a = await collect(one.add_request(request("x", prompt, max_tokens=20)))
    b = await collect(two.add_request(request("y", prompt, max_tokens=20)))
    assert a == b
    assert set(a) <= set(prompt)


async def test_duplicate_prefix_is_stored_twice(make_engine: EngineFactory) -> None:
    sink = RecordingSink()
    engine = make_engine(sink)
    prompt = list(range(500, 532))  # block-aligned: the second request recomputes block 1
    streams = [engine.add_request(request(r, prompt)) for r in ("a", "b")]
    await engine.start()
    for s in streams:
        await collect(s)
    [batch] = sink.batches  # both admitted in the same step
    hashes = [h for e in batch if isinstance(e, BlockStored) for h in e.block_hashes]
    counts = Counter(hashes)
    assert sorted(counts.values()) == [1, 2]
    assert [s.cached_tokens for s in streams] == [0, 16]


async def test_eviction_precedes_the_store_that_caused_it(make_engine: EngineFactory) -> None:
    sink = RecordingSink()
    engine = make_engine(sink, num_blocks=4, block_size=4)
    await engine.start()
    await collect(engine.add_request(request("a", list(range(16)))))  # fills all 4 blocks
    a_hashes = sink.stored()[0].block_hashes
    sink.batches.clear()
    await collect(engine.add_request(request("b", [9, 9, 9, 9, 9])))  # needs 2 blocks
    [batch] = sink.batches
    assert [type(e).__name__ for e in batch] == ["BlockRemoved", "BlockRemoved", "BlockStored"]
    # a's blocks are evicted leaf first
    assert [h for e in batch[:2] if isinstance(e, BlockRemoved) for h in e.block_hashes] == [
        a_hashes[3],
        a_hashes[2],
    ]


async def test_preemption_under_a_tiny_cache(make_engine: EngineFactory) -> None:
    sink = RecordingSink()
    engine = make_engine(sink, num_blocks=6, block_size=4)
    prompts = {"a": list(range(8)), "b": list(range(100, 108))}
    streams = {
        rid: engine.add_request(request(rid, p, max_tokens=12)) for rid, p in prompts.items()
    }
    await engine.start()
    outputs = {rid: await collect(s) for rid, s in streams.items()}
    assert engine.stats().num_preemptions >= 1
    assert all(s.finish_reason == "length" for s in streams.values())
    alone = make_engine(num_blocks=64, block_size=4)
    await alone.start()
    for rid, prompt in prompts.items():
        assert outputs[rid] == await collect(alone.add_request(request(rid, prompt, max_tokens=12)))
    assert streams["b"].cached_tokens == 0  # fixed at first scheduling, not at the re-admission
    await until_idle(engine)
    reference = Reference()
    reference.apply(sink.events)
    assert reference.blocks == engine.cached_blocks()


async def test_abort_frees_blocks_and_ends_the_stream(make_engine: EngineFactory) -> None:
    engine = make_engine(time_scale=0.001)
    await engine.start()
    stream = engine.add_request(request("a", list(range(100)), max_tokens=10_000))
    await stream.wait_first_token()
    assert engine.stats().kv_cache_usage_perc > 0
    engine.abort("a")
    tokens = await collect(stream)
    assert 0 < len(tokens) < 10_000
    assert stream.finish_reason == "abort"
    stats = engine.stats()
    assert (stats.num_requests_running, stats.num_requests_waiting) == (0, 0)
    assert stats.kv_cache_usage_perc == 0
    engine.abort("a")  # unknown ids are ignored
    engine.add_request(request("a", [1, 2, 3]))  # the id is free again


async def test_reset_prefix_cache_semantics(make_engine: EngineFactory) -> None:
    sink = RecordingSink()
    engine = make_engine(sink, time_scale=0.001)
    await engine.start()
    stream = engine.add_request(request("a", list(range(64)), max_tokens=200))
    await stream.wait_first_token()
    assert not await engine.reset_prefix_cache()  # blocks in use
    await collect(stream)
    await until_idle(engine)
    assert engine.cached_blocks()
    published = len(sink.batches)
    assert await engine.reset_prefix_cache()
    assert engine.cached_blocks() == {}
    await asyncio.sleep(0.01)
    assert len(sink.batches) == published  # vLLM: an idle engine does not publish the clear
    await collect(engine.add_request(request("b", list(range(64)))))
    first = sink.batches[published]
    assert isinstance(first[0], AllBlocksCleared)
    assert isinstance(first[1], BlockStored) and first[1].parent_block_hash is None


async def test_lora_and_salt_are_exported(make_engine: EngineFactory) -> None:
    sink = RecordingSink()
    engine = make_engine(sink)
    await engine.start()
    prompt = list(range(32))
    await collect(engine.add_request(request("a", prompt, lora_name="ad", cache_salt="s")))
    [event] = sink.stored()
    assert event.lora_name == "ad"
    assert event.lora_id == 1
    assert event.extra_keys == [["ad", "s"], ["ad"]]
    plain = engine.add_request(request("b", prompt))
    await collect(plain)
    assert plain.cached_tokens == 0  # different extra keys, different hashes


async def test_rejects_bad_requests(make_engine: EngineFactory) -> None:
    engine = make_engine(num_blocks=4, block_size=4)
    engine.add_request(request("a", [1, 2]))
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request(request("a", [1, 2]))
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        engine.add_request(request("big", list(range(17))))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(request("e", []))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request(request("z", [1], max_tokens=0))


async def test_generation_stops_at_max_model_len(make_engine: EngineFactory) -> None:
    engine = make_engine(num_blocks=4, block_size=4)
    await engine.start()
    full = engine.add_request(request("full", list(range(16)), max_tokens=50))
    assert len(await collect(full)) == 1
    assert full.finish_reason == "length"
    grows = engine.add_request(request("grows", [1, 2, 3], max_tokens=50))
    assert len(await collect(grows)) == 16 - 3
    with pytest.raises(ValueError, match="exceeds the cache"):
        EngineConfig(num_blocks=4, block_size=4, max_model_len=17)
    assert EngineConfig(num_blocks=4, block_size=4).max_model_len == 16


async def test_stop_aborts_in_flight_requests(make_engine: EngineFactory) -> None:
    sink = RecordingSink()
    engine = make_engine(sink, time_scale=1.0, block_size=4)
    await engine.start()
    running = engine.add_request(request("a", list(range(20)), max_tokens=100_000))
    await running.wait_first_token()
    late = engine.add_request(request("w", list(range(50, 90))))
    while engine.stats().num_requests_running < 2:  # noqa: ASYNC110 - wait for admission
        await asyncio.sleep(0.001)
    await engine.stop()  # in the middle of the step that prefills "w"
    assert late.finish_reason == "abort"
    assert any(e.token_ids[0] == 50 for e in sink.stored())
    reference = Reference()
    reference.apply(sink.events)
    assert reference.blocks == engine.cached_blocks()
    assert running.finish_reason == "abort"
    assert len(await collect(running)) > 0
    assert await collect(running) == []  # iterating a finished stream ends at once
    with pytest.raises(RuntimeError):
        engine.add_request(request("b", [1]))


async def test_step_time_follows_the_latency_profile(make_engine: EngineFactory) -> None:
    engine = make_engine(time_scale=0.1, num_blocks=1024, profile="llama-70b")
    await engine.start()
    expected = engine.profile.step_ms([(2048, 0)], []) * 0.1 / 1000
    started = time.perf_counter()
    stream = engine.add_request(request("a", list(range(2048))))
    await stream.wait_first_token()
    elapsed = time.perf_counter() - started
    assert expected * 0.95 < elapsed < expected + 0.25


async def test_chunked_prefill_and_token_budget(make_engine: EngineFactory) -> None:
    sink = RecordingSink()
    engine = make_engine(sink, max_num_batched_tokens=32, max_num_seqs=2)
    streams = [
        engine.add_request(request(f"r{i}", list(range(i * 100, i * 100 + 80)))) for i in range(3)
    ]
    await engine.start()
    for s in streams:
        await collect(s)
    # 80-token prompts in 32-token chunks: each chunk stores the blocks it completes
    first = [e for e in sink.stored() if e.token_ids[0] < 100]
    assert [len(e.block_hashes) for e in first] == [2, 2, 1]
    assert engine.stats().num_steps >= 8


@pytest.mark.parametrize("seed", range(6))
async def test_events_reproduce_the_cache(make_engine: EngineFactory, seed: int) -> None:
    rng = random.Random(seed)
    sink = RecordingSink()
    engine = make_engine(
        sink,
        num_blocks=rng.choice([12, 24, 64]),
        block_size=rng.choice([2, 4]),
        max_num_batched_tokens=rng.choice([8, 16, 64]),
        max_num_seqs=rng.choice([2, 4, 8]),
        time_scale=0.0001,
    )
    await engine.start()
    stems = [[rng.randrange(50) for _ in range(rng.randrange(4, 16))] for _ in range(3)]
    streams: list[RequestStream] = []
    for i in range(40):
        prompt = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(1, 8))]
        lora = rng.choice([None, None, "ad"])
        streams.append(
            engine.add_request(request(f"q{i}", prompt, rng.randrange(1, 12), lora_name=lora))
        )
        if rng.random() < 0.2:
            engine.abort(f"q{rng.randrange(i + 1)}")
        if rng.random() < 0.3:
            await asyncio.sleep(0.0005)
        if rng.random() < 0.05:
            await until_idle(engine)
            assert await engine.reset_prefix_cache()
    for s in streams:
        await collect(s)
    # a reset while idle is only announced with the next step's batch
    await collect(engine.add_request(request("flush", [1, 2, 3])))
    await until_idle(engine)
    reference = Reference()
    reference.apply(sink.events)
    assert reference.blocks == engine.cached_blocks()
    assert sum(reference.copies.values()) == sum(
        1 for b in engine._pool.blocks if b.digest is not None
    )
