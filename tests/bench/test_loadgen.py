"""The client: outside traffic (which conversations bypass the routers, and to which engine),
and agent sessions against a real simulated engine (closed-loop order, inherited history)."""

from __future__ import annotations

from collections import Counter

import pytest
from prometheus_client import CollectorRegistry

from bench.agents import AgentShape, agents
from bench.loadgen import LoadGenerator
from bench.workloads import Conversation, Turn
from publishers.sim.engine import EngineConfig, SimulatedEngine
from publishers.sim.server import create_app
from tracker.core.tokens import Tokenizer
from tracker.framework.http import HTTPServer, bind

ENGINES = ["http://e0", "http://e1", "http://e2", "http://e3"]


def conversations(n: int) -> list[Conversation]:
    return [Conversation(i, i % 7, None, (Turn("hi", 1),)) for i in range(n)]


def test_a_seeded_share_of_conversations_goes_straight_to_one_engine_each() -> None:
    gen = LoadGenerator("http://router", time_scale=1, bypass_urls=ENGINES, bypass_share=0.25)
    targets = [gen.target(c) for c in conversations(2000)]
    direct = [t for t in targets if t is not None]
    assert 0.22 < len(direct) / len(targets) < 0.28
    assert set(Counter(direct)) == set(ENGINES)
    again = LoadGenerator("http://router", time_scale=1, bypass_urls=ENGINES, bypass_share=0.25)
    assert [again.target(c) for c in conversations(2000)] == targets  # same for every policy
    other = LoadGenerator(
        "http://router", time_scale=1, bypass_urls=ENGINES, bypass_share=0.25, seed=2
    )
    assert [other.target(c) for c in conversations(2000)] != targets
    none = LoadGenerator("http://router", time_scale=1)
    assert all(none.target(c) is None for c in conversations(50))


def test_bypass_needs_engines_and_a_share_in_range() -> None:
    with pytest.raises(ValueError):
        LoadGenerator("http://router", time_scale=1, bypass_share=0.5)
    with pytest.raises(ValueError):
        LoadGenerator("http://router", time_scale=1, bypass_urls=ENGINES, bypass_share=1.5)


async def test_closed_loop_subagents_follow_the_answer_and_hit_the_parents_history() -> None:
    shape = AgentShape(
        sessions=2, turns=4, preamble_tokens=200, context_tokens=400, task_tokens=30,
        growth_tokens=100, output_tokens=8, think_s=1.0, fanout=3, fanout_every=2,
        subagent_turns=2, closed_loop=True,
    )  # fmt: skip
    workload = agents(shape, seed=1)
    time_scale = 0.01  # real seconds per simulated second, the engine's and the client's
    engine = SimulatedEngine(EngineConfig(time_scale=time_scale, num_blocks=1024))
    await engine.start()
    app = create_app(engine, Tokenizer.builtin(), model="default", registry=CollectorRegistry())
    server = HTTPServer(app, bind("127.0.0.1", 0), shutdown_timeout_s=1)
    await server.start()
    try:
        results = await LoadGenerator(f"http://127.0.0.1:{server.port}", time_scale=time_scale).run(
            workload
        )
    finally:
        await server.stop()
        await engine.stop()
    assert len(results) == workload.requests and all(r.ok for r in results)
    done = {(r.conversation, r.turn): r for r in results}

    def end(conversation: Conversation, turn: int) -> float:
        result = done[conversation.id, turn]
        assert result.e2e_s is not None
        return result.sent_s + result.e2e_s

    for session in workload.conversations:
        for fork in session.forks:
            parent = done[session.id, fork.after]
            for agent in fork.agents:
                first = done[agent.id, 0]
                assert first.sent_s >= end(session, fork.after)  # after the parent's answer
                # one engine: the parent's whole prompt is cached for every subagent
                assert first.cached_tokens >= parent.prompt_tokens // 16 * 16
                assert first.group == session.group
            resumed = done[session.id, fork.after + 1].sent_s
            assert resumed >= max(end(a, len(a.turns) - 1) for a in fork.agents)
