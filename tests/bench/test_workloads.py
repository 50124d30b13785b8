"""Benchmark workloads: determinism by seed, exact token lengths, Mooncake prefix semantics."""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
from pathlib import Path

import pytest

from bench.agents import AgentShape, agents
from bench.capacity import WorkloadShape, capacity, measure_shape, ttft_floors
from bench.loadgen import AGENT_HEADER, SESSION_HEADER, request_parts
from bench.workloads import (
    TRACE_BLOCK_TOKENS,
    Conversation,
    Request,
    Workload,
    block_text,
    history,
    messages,
    mooncake,
    multi_turn,
    no_sharing,
    shared_prefix,
    trace_prompt,
    walk,
    with_poisson_arrivals,
)
from publishers.config import EngineShape
from tracker.core.tokens import Tokenizer

TOKENIZER = Tokenizer.builtin()
CHATML_SYSTEM_USER = 29  # template tokens around a system + user conversation


def gsp(seed: int = 1, **overrides: int) -> Workload:
    shape = dict(
        groups=4, prompts_per_group=3, system_tokens=100, question_tokens=20, output_tokens=8
    )
    shape.update(overrides)
    return shared_prefix(seed=seed, **shape)


def test_same_seed_same_workload_other_seed_other_text() -> None:
    assert gsp(1) == gsp(1)
    assert gsp(1) != gsp(2)
    arrivals = [with_poisson_arrivals(gsp(1), 5.0, seed=3) for _ in range(2)]
    assert arrivals[0] == arrivals[1]


def test_shared_prefix_groups_and_exact_token_lengths() -> None:
    workload = shared_prefix(
        groups=4,
        prompts_per_group=3,
        system_tokens=100,
        question_tokens=20,
        output_tokens=8,
        seed=1,
    )
    assert workload.requests == 12
    by_group: dict[int, set[str | None]] = {}
    for conversation in workload.conversations:
        by_group.setdefault(conversation.group, set()).add(conversation.system)
        ids = TOKENIZER.chat_token_ids(messages(conversation, 0, []))
        assert len(ids) == 100 + 20 + CHATML_SYSTEM_USER
        assert conversation.turns[0].max_tokens == 8
    assert len(by_group) == 4 and all(len(s) == 1 for s in by_group.values())
    assert [c.group for c in workload.conversations] != sorted(
        c.group for c in workload.conversations
    )


def test_no_sharing_prompts_share_no_block() -> None:
    workload = no_sharing(
        requests=20, system_tokens=64, question_tokens=16, output_tokens=4, seed=1
    )
    firsts = {
        tuple(TOKENIZER.chat_token_ids(messages(c, 0, []))[:16]) for c in workload.conversations
    }
    assert len(firsts) == 20
    shape = measure_shape(workload, 16, TOKENIZER)
    assert shape.shared_blocks == 0 and shape.ideal_hit_rate == 0.0


def test_multi_turn_turns_carry_the_history() -> None:
    workload = multi_turn(
        users=2, rounds=3, system_tokens=50, context_tokens=40, question_tokens=10,
        output_tokens=5, think_s=1.0, seed=1,
    )  # fmt: skip
    conversation = workload.conversations[0]
    third = messages(conversation, 2, ["answer one", "answer two"])
    assert [m["role"] for m in third] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    assert third[2]["content"] == "answer one"
    assert len(third[1]["content"]) == 40 + 1 + 10  # context, newline, question
    assert len(conversation.think_s) == 2
    assert workload.conversations[0].system == workload.conversations[1].system


def test_trace_prompts_have_the_exact_length_and_share_leading_blocks() -> None:
    a = trace_prompt(1200, [7, 8, 9])
    b = trace_prompt(1100, [7, 8, 10])
    c = trace_prompt(600, [1, 8])
    assert (len(a), len(b), len(c)) == (1200, 1100, 600)
    assert a[:1024] == b[:1024] and a[1024:1100] != b[1024:1100]
    assert a[:512] != c[:512] and a[512:600] == c[512:600] == block_text(8)[:88]
    assert len(block_text(3)) == TRACE_BLOCK_TOKENS
    assert len(trace_prompt(1500, [1])) == 1500  # fewer ids than blocks: filled, unshared


def test_mooncake_replay_keeps_timestamps_with_speedup_and_cap(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    records = [
        {"timestamp": 1000, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 3000, "input_length": 700, "output_length": 6, "hash_ids": [1, 3]},
        {"timestamp": 5000, "input_length": 600, "output_length": 7, "hash_ids": [4, 5]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    workload = mooncake(path, speedup=2.0, max_requests=2, seed=0)
    assert workload.timed and workload.requests == 2
    starts = [c.start_s for c in workload.conversations]
    assert starts == [0.0, 1.0]
    first, second = (c.turns[0] for c in workload.conversations)
    assert (len(first.user), len(second.user)) == (1024, 700)
    assert first.user[:512] == second.user[:512] and first.user[512:] != second.user[512:700]
    assert all(c.raw for c in workload.conversations)
    # another slice: from the second record on, its own clock starting at 0
    later = mooncake(path, speedup=1.0, max_requests=5, seed=0, skip=1)
    assert [c.start_s for c in later.conversations] == [0.0, 2.0]
    assert later.conversations[0].turns[0].user == second.user
    assert later.params["from"] == 1
    with pytest.raises(ValueError, match="skip"):
        mooncake(path, speedup=1.0, max_requests=None, seed=0, skip=-1)
    path.write_text('{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="input_length"):
        mooncake(path, speedup=1.0, max_requests=None, seed=0)


def test_the_bundled_synthetic_trace_replays() -> None:
    path = Path(__file__).parents[2] / "bench" / "traces" / "synthetic_mooncake_sample.jsonl"
    workload = mooncake(path, speedup=1.0, max_requests=50, seed=0)
    assert workload.requests == 50
    assert measure_shape(workload, 16, TOKENIZER).ideal_hit_rate > 0.3


def test_poisson_arrivals_average_the_rate() -> None:
    workload = with_poisson_arrivals(gsp(1, groups=50, prompts_per_group=20), 10.0, seed=1)
    starts = [c.start_s for c in workload.conversations]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert starts == sorted(starts) and starts[0] == 0.0
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.1)


def test_capacity_sharing_raises_what_the_fleet_can_serve() -> None:
    engine = EngineShape(profile="llama-8b", num_blocks=4096, block_size=16)
    workload = shared_prefix(
        groups=64, prompts_per_group=16, system_tokens=2048, question_tokens=128,
        output_tokens=256, seed=1,
    )  # fmt: skip
    shape = measure_shape(workload, 16, TOKENIZER)
    assert shape.prompt_tokens == 2048 + 128 + CHATML_SYSTEM_USER
    # each group's 2,064-token prefix (129 blocks with its template tokens) is new once
    assert shape.unique_tokens == pytest.approx(2205 - 2064 + 2064 * 64 / 1024)
    assert shape.shared_blocks == 64 * 129
    fleet = capacity(shape, engine, 8)
    assert fleet.ideal_rps > 3 * fleet.blind_rps > 0


def test_capacity_counts_the_cache_that_prefixes_leave_to_running_requests() -> None:
    # 4 engines x 1,024 blocks; the 10 prefixes of the matrix fill 3,010 blocks, 73 % of the
    # fleet's cache, so the requests that run share the remaining 27 % (until 2026-12 the
    # ideal counted at most half of each cache as prefixes, and overstated this fleet 2.1x)
    engine = EngineShape(profile="llama-8b", num_blocks=1024, block_size=16)

    def shape(shared_blocks: int) -> WorkloadShape:
        return WorkloadShape(320, 4979.0, 64.0, 313.5, shared_blocks, 15.0)

    roomy, full = capacity(shape(2048), engine, 4), capacity(shape(3010), engine, 4)
    assert full.ideal_limit == "kv_cache"
    # 460 vs 220 free blocks per engine: the fleet runs about half as many requests at once
    assert 1.8 < roomy.ideal_rps / full.ideal_rps < 2.4
    # prefixes that do not fit at all: the ideal keeps fewer, never worse than keeping none
    tiny = EngineShape(profile="llama-8b", num_blocks=400, block_size=16)
    starved = capacity(shape(3010), tiny, 4)
    assert starved.ideal_rps >= starved.blind_rps > 0


# a small agents shape: bursts of 3 subagents after turns 1 and 3 of 6
AGENTS = AgentShape(
    sessions=3, turns=6, preamble_tokens=300, context_tokens=500, task_tokens=40,
    growth_tokens=200, output_tokens=20, think_s=2.0, fanout=3, fanout_every=2,
    subagent_turns=2,
)  # fmt: skip


def _planned(conversation: Conversation) -> list[Request]:
    def unplanned(_: object) -> str:
        raise AssertionError("an open-loop conversation plans its answers")

    return list(walk(conversation, unplanned))


def _ids(request: Request) -> list[int]:
    return TOKENIZER.chat_token_ids(request.messages, add_generation_prompt=True)


def test_agent_sessions_share_a_preamble_and_their_prompts_grow_every_turn() -> None:
    workload = agents(AGENTS, seed=1)
    assert workload.requests == AGENTS.requests == 3 * (6 + 2 * 3 * 2)
    assert len({c.system for c in workload.conversations}) == 1
    assert len(workload.conversations[0].system or "") == 300
    firsts = []
    for session in workload.conversations:
        own = [r for r in _planned(session) if r.conversation is session]
        lengths = [len(_ids(r)) for r in own]
        # each turn adds the answer and a tool result of 1/4 to 7/4 of 200 tokens
        growth = [b - a for a, b in itertools.pairwise(lengths)]
        assert all(10 + 50 <= g <= 30 + 350 + 30 for g in growth), growth
        for before, after in itertools.pairwise(own):  # the history only grows
            assert after.messages[: len(before.messages)] == before.messages
        assert len(session.turns[0].user) == 500 + 1 + 40  # context, newline, task
        firsts.append(session.turns[0].user)
    assert len(set(firsts)) == 3  # each session its own repository context
    shape = measure_shape(workload, 16, TOKENIZER)
    assert shape.requests == workload.requests and 0.7 < shape.ideal_hit_rate < 1.0


def test_a_fanout_burst_starts_at_once_from_the_parent_history() -> None:
    session = agents(AGENTS, seed=1).conversations[0]
    assert [f.after for f in session.forks] == [1, 3]
    requests = _planned(session)
    parent = {r.turn: r for r in requests if r.conversation is session}
    for fork in session.forks:
        base = history(session, fork.after, session.answers)
        inherited = _ids(parent[fork.after])  # the parent's prompt, its generation prompt too
        starts = set()
        for agent in fork.agents:
            first = next(r for r in requests if r.conversation is agent and r.turn == 0)
            assert first.messages[: len(base)] == base
            assert first.messages[len(base)] == {"role": "user", "content": agent.turns[0].user}
            ids = _ids(first)
            assert ids[: len(inherited)] == inherited and len(ids) > len(inherited)
            starts.add(agent.at_s[0])
            # subagents keep the parent's session key; each has its own agent id
            assert agent.key == session.key and agent.agent not in (None, session.agent)
        assert len(starts) == 1  # all at once, a think time after the parent's turn
        (start,) = starts
        assert start == session.at_s[fork.after] + fork.think_s
        last = max(a.at_s[-1] for a in fork.agents)
        assert session.at_s[fork.after + 1] == last + session.think_s[fork.after]
    texts = [a.turns[0].user for f in session.forks for a in f.agents]
    assert len(set(texts)) == len(texts)  # every subagent its own task


def test_agents_are_seeded_and_keep_their_plan_under_arrivals() -> None:
    assert agents(AGENTS, seed=1) == agents(AGENTS, seed=1)
    assert agents(AGENTS, seed=1) != agents(AGENTS, seed=2)
    workload = with_poisson_arrivals(agents(AGENTS, seed=1), 4.0, seed=1)
    starts = [c.start_s for c in workload.conversations]
    assert starts[0] == 0.0 and starts == sorted(starts) and len(set(starts)) == 3
    # a session moves as a whole: its subagents' plans are relative to its start
    assert workload.conversations[1].forks == agents(AGENTS, seed=1).conversations[1].forks
    floors = ttft_floors(workload, EngineShape(num_blocks=4096, block_size=16), TOKENIZER)
    assert len(floors) == workload.requests
    keys = {c.key for c in workload.conversations}
    assert len(keys) == 3 and None not in keys
    anonymous = agents(dataclasses.replace(AGENTS, key=False), seed=1)
    assert all(c.key is None and c.agent is None for c in _every(anonymous))


def _every(workload: Workload) -> list[Conversation]:
    out = []
    for session in workload.conversations:
        out.append(session)
        out += [a for f in session.forks for a in f.agents]
    return out


def test_closed_loop_agents_follow_their_answers_in_causal_order() -> None:
    shape = dataclasses.replace(AGENTS, closed_loop=True)
    session = agents(shape, seed=1).conversations[0]
    assert not session.at_s and not session.answers  # no plan: each waits for its answer
    order = [(r.conversation.id, r.turn) for r in walk(session, lambda t: "x" * t.max_tokens)]
    subagents = [a.id for f in session.forks for a in f.agents]
    first, second = subagents[:3], subagents[3:]
    me = session.id
    assert order == [
        (me, 0), (me, 1),
        *[(a, t) for a in first for t in (0, 1)],
        (me, 2), (me, 3),
        *[(a, t) for a in second for t in (0, 1)],
        (me, 4), (me, 5),
    ]  # fmt: skip
    # the open loop sends the same texts after the same think times: only the plan differs
    assert _unplanned(agents(AGENTS, seed=1)) == agents(shape, seed=1).conversations


def _unplanned(workload: Workload) -> tuple[Conversation, ...]:
    def strip(c: Conversation) -> Conversation:
        forks = tuple(
            dataclasses.replace(f, agents=tuple(strip(a) for a in f.agents)) for f in c.forks
        )
        return dataclasses.replace(c, answers=(), at_s=(), forks=forks)

    return tuple(strip(c) for c in workload.conversations)


def test_every_agent_request_carries_its_session_key_and_agent_id() -> None:
    session = agents(AGENTS, seed=1).conversations[1]
    agent = session.forks[0].agents[2]
    body, headers = request_parts(agent, 0, [{"role": "user", "content": "x"}])
    assert body["prompt_cache_key"] == session.key == headers[SESSION_HEADER]
    assert headers[AGENT_HEADER] == agent.agent != session.agent
    plain = gsp().conversations[0]
    body, headers = request_parts(plain, 0, messages(plain, 0, []))
    assert "prompt_cache_key" not in body and not headers


def test_agent_shapes_refuse_what_cannot_run() -> None:
    with pytest.raises(ValueError, match="fanout"):
        AgentShape(fanout=0)
    with pytest.raises(ValueError, match="output_tokens"):
        AgentShape(output_tokens=1)
    assert AgentShape(fanout=1).bursts == 0 and AgentShape(fanout=8, turns=32).bursts == 3
