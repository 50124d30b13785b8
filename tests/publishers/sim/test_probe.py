"""The simulation-only probe the benchmark's oracle reads: real reuse, queue and expected TTFT."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client import CollectorRegistry

from publishers.sim.engine import EngineConfig, GenerationRequest, SimulatedEngine
from publishers.sim.latency import load_profile
from publishers.sim.server import create_app
from tracker.core.tokens import Tokenizer
from tracker.framework.http import HTTPServer, bind

PROMPT = list(range(100)) * 10  # 1,000 tokens: 62 full blocks


@pytest.fixture
async def engine() -> AsyncIterator[SimulatedEngine]:
    engine = SimulatedEngine(EngineConfig(time_scale=0.01, num_blocks=512))
    await engine.start()
    yield engine
    await engine.stop()


async def finish(engine: SimulatedEngine, rid: str, prompt: list[int], tokens: int = 2) -> None:
    async for _ in engine.add_request(GenerationRequest(rid, prompt, tokens)):
        pass


async def test_cached_tokens_are_what_the_scheduler_would_reuse(engine: SimulatedEngine) -> None:
    cold = engine.probe(PROMPT)
    assert (cold.cached_tokens, cold.prompt_tokens, cold.cached_blocks) == (0, 1000, 0)
    await finish(engine, "a", PROMPT)
    warm = engine.probe(PROMPT)
    assert warm.cached_tokens == warm.expected_cached_tokens == 992  # 62 full blocks
    assert engine.probe(PROMPT[:500] + [7] * 100).cached_tokens == 496  # up to the divergence
    assert warm.expected_ttft_ms < cold.expected_ttft_ms
    stream = engine.add_request(GenerationRequest("b", PROMPT, 1))
    async for _ in stream:
        pass
    assert stream.cached_tokens == warm.cached_tokens  # the probe told the truth


async def test_requests_queued_ahead_count_as_future_cache_and_as_queue() -> None:
    engine = SimulatedEngine(EngineConfig(time_scale=1.0))  # slow: nothing runs meanwhile
    await engine.start()
    try:
        idle = engine.probe(PROMPT)
        engine.add_request(GenerationRequest("a", PROMPT, 4))
        queued = engine.probe(PROMPT)
        assert queued.num_waiting + queued.num_running == 1
        assert queued.cached_tokens == 0
        assert queued.expected_cached_tokens == 992  # admitted first, FCFS, caches the prefix
        assert queued.queued_prefill_tokens == 1000
        other = engine.probe([5] * 1000)
        assert other.expected_cached_tokens == 0
        assert other.expected_ttft_ms > idle.expected_ttft_ms  # waits for "a"'s prefill
    finally:
        await engine.stop()


async def test_expected_ttft_follows_the_latency_profile(engine: SimulatedEngine) -> None:
    profile = load_profile("llama-8b")
    probe = engine.probe(PROMPT)
    assert probe.expected_ttft_ms == pytest.approx(profile.step_ms([(1000, 0)], []))
    assert probe.step_left_ms == 0.0


async def test_the_probe_changes_nothing(engine: SimulatedEngine) -> None:
    await finish(engine, "a", PROMPT)
    before = engine.stats()
    for _ in range(3):
        engine.probe(PROMPT)
    assert engine.stats() == before


async def test_http_probe_and_reset(engine: SimulatedEngine) -> None:
    app = create_app(engine, Tokenizer.builtin(), model="m", registry=CollectorRegistry())
    server = HTTPServer(app, bind("127.0.0.1", 0), shutdown_timeout_s=1)
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
            await finish(engine, "a", PROMPT)
            answer = (await client.post("/kvrouter/probe", json={"token_ids": PROMPT})).json()
            assert answer["cached_tokens"] == 992 and answer["num_blocks"] == 512
            assert set(answer) >= {"num_running", "num_waiting", "queued_prefill_tokens"}
            await client.post("/reset_prefix_cache")
            answer = (await client.post("/kvrouter/probe", json={})).json()
            assert answer["cached_blocks"] == 0
            bad = await client.post("/kvrouter/probe", json={"token_ids": "nope"})
            assert bad.status_code == 400
    finally:
        await server.stop()
