"""The scenario matrix's cells: the axes, the base scenario each axis varies one thing of, and
every cell (:class:`Cell`: its label on its axis and its ``kvrouter bench`` settings)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final


@dataclass(frozen=True)
class Cell:
    """One scenario: a label on its axis and the ``kvrouter bench`` settings that make it.

    :param events: only event-driven state knows the truth here (several routers, eviction
        pressure, outside traffic, restarts): kvrouter must beat the best peer outright.
    :param seeds: passes, each with the workload and arrivals of its own seed (the bench's
        seed, then the next ones), every policy in each; the cell's numbers pool them.
    """

    axis: str
    label: str
    settings: dict[str, Any]
    events: bool = False
    seeds: int = 1

    @property
    def digest(self) -> str:
        """Of what is run: cells of equal settings (on two axes) share one run."""
        run = self.settings if self.seeds == 1 else {**self.settings, "seeds": self.seeds}
        return hashlib.sha256(json.dumps(run, sort_keys=True).encode()).hexdigest()[:8]

    @property
    def key(self) -> str:
        """Names the result file."""
        return f"{_slug(self.axis)}-{_slug(self.label)}-{self.digest}"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


AXES: Final = (
    "cache",
    "load",
    "routers",
    "bypass",
    "restart",
    "conversation",
    "agents",
    "trace",
)
# 10 groups x 32: 3 % of the requests are their group's first (cold), so TTFT p95 measures
# the hits and what delays them, p99 the cold prefills (with 5 % cold, p95 sat on the edge
# and one extra miss moved it by half)
BASE: Final[dict[str, Any]] = {
    "workload": "gsp",
    "replicas": 4,
    "groups": 10,
    "prompts_per_group": 32,
    "system_tokens": 4800,
    "question_tokens": 150,
    "output_tokens": 64,
}
BASE_RATE: Final = 8.0  # req/s: light on a roomy cache, beyond cache-blind at 400 blocks
PRESSURE: Final = 700  # blocks: the 10 prefixes (3,010 blocks) do not fit in 4 x 700
# Where the caches hold every prefix at light load, every prefix-aware router keeps each
# group home and the verdict turns on a few milliseconds of p95, which one pass does not
# settle, and the best of three peers' noisy values sits below what each would give: those
# cells pool three seeds (docs/benchmarks.md, "Seeds").
LIGHT_SEEDS: Final = 3
# Coding agents (--workload agents), sized to run in two to three minutes per arm on a 2-core
# host: 8 sessions (two per engine) of 12 turns, prompts from 18k tokens (a 3k preamble shared
# by all, 15k of own repository context) to ~39k, 1.5k-token tool results, 64-token answers,
# 2 s tool time, one burst of subagents after turn 6 of each session (2 turns each), open loop
# so that every policy gets the same sends. A session's history ends near 2,400 blocks, the 8
# of them near 19,500: 8,192 blocks per engine hold them 1.7 times over (roomy); 5,120 just
# hold two sessions per engine, until a burst's subagents add their own ~115 blocks each (32
# of them overflow their home: spill or queue); 3,072 hold 0.6 of them (pressure). 7 req/s
# paces the session starts (rate / requests per session): the base's sessions (28 requests
# each) start at 0.25/s, last ~36 s, so most of them overlap while their bursts (~6 s each)
# mostly do not; fan-out 32 (76 requests a session) starts them 2.7 times further apart, so
# that its bursts do not pile up either: with its sessions at 0.25/s too, its 8 bursts came
# within ~30 s of each other, 12 req/s against 5.2 of ideal capacity, and every policy
# queued for seconds (kvrouter's TTFT p50 12.5 s, round-robin's 14.7 s). The last planned
# send comes 53 simulated s in (fan-out 1: 36, fan-out 32: 70; seed 1); time scale 2.
AGENTS_BASE: Final[dict[str, Any]] = {
    "workload": "agents",
    "replicas": 4,
    "num_blocks": 5120,
    "time_scale": 2.0,
    "agents_sessions": 8,
    "agents_turns": 12,
    "agents_preamble_tokens": 3000,
    "agents_context_tokens": 15000,
    "agents_task_tokens": 200,
    "agents_growth_tokens": 1500,
    "agents_output_tokens": 64,
    "agents_think_s": 2.0,
    "agents_fanout": 8,
    "agents_fanout_every": 6,
    "agents_subagent_turns": 2,
    "rate": 7.0,
}


# Mooncake's public conversation trace (issue 41): its first 600 requests, ~14k-token prompts
# from 1k to 121k, in bursts of ~10 every 3 s, replayed on 8 engines whose caches never
# evict (17 % load at 1x), at time scale 1 (the routers' own milliseconds count in full).
# scripts/fetch-trace downloads it; without it the cells replay a generated trace of the same
# bursts and length quantiles (bench/traces/synthesize.py --profile mooncake).
MOONCAKE: Final = "bench/traces/data/conversation_trace.jsonl"
MOONCAKE_LIKE: Final = "bench/traces/synthetic_mooncake_conversation.jsonl"
TRACE_SPEEDS: Final = (1.0, 2.0, 4.0)
ROOT: Final = Path(__file__).resolve().parents[2]


def mooncake_trace(root: Path = ROOT) -> tuple[str, bool]:
    """The trace the trace axis replays (a path from the repository's root) and whether it is
    the real one."""
    return (MOONCAKE, True) if (root / MOONCAKE).is_file() else (MOONCAKE_LIKE, False)


def _agents(**changes: Any) -> dict[str, Any]:
    """An agents cell: the base with ``changes``."""
    return {**AGENTS_BASE, **changes}


def cells(axes: Sequence[str] = AXES) -> list[Cell]:
    """The matrix's cells on the axes asked for."""
    base = {**BASE, "rate": BASE_RATE}
    pressure = {**base, "num_blocks": PRESSURE}
    out: list[Cell] = []
    if "cache" in axes:
        for blocks, label in ((4096, "4096 roomy"), (1024, "1024"), (700, "700"), (400, "400")):
            settings = {**base, "num_blocks": blocks}
            seeds = LIGHT_SEEDS if blocks >= 1024 else 1
            out.append(Cell("cache", label, settings, events=blocks < 1024, seeds=seeds))
    if "load" in axes:
        for load in (0.25, 0.5, 0.75, 1.0):
            settings = {**BASE, "num_blocks": 1024, "load": load}
            seeds = LIGHT_SEEDS if load <= 0.25 else 1
            out.append(Cell("load", f"{load:.0%}", settings, seeds=seeds))
    if "routers" in axes:
        for routers in (1, 2, 4):
            settings = pressure if routers == 1 else {**pressure, "routers": routers}
            out.append(Cell("routers", str(routers), settings, events=True))
    if "bypass" in axes:
        out.append(Cell("bypass", "25%", {**pressure, "bypass": 0.25}, events=True))
    if "restart" in axes:
        restart = {**pressure, "restart_engine_at_s": 15.0}
        out.append(Cell("restart", "engine at 15 s", restart, events=True))
    if "conversation" in axes:
        chat = {
            "workload": "multiturn",
            "replicas": 4,
            "users": 32,
            "rounds": 6,
            "system_tokens": 1000,
            "context_tokens": 2000,
            "question_tokens": 64,
            "output_tokens": 400,
            "think_s": 3.0,
            "num_blocks": 1024,
            "rate": 8.0,
        }
        trace = {
            "workload": "trace",
            "trace": "bench/traces/synthetic_conversation.jsonl",
            "max_requests": 300,
            "replicas": 8,
            "num_blocks": 58_000,
            "time_scale": 1.0,
        }
        # 16 users x ~365 blocks at their last turn: 4 per engine fit in 2,048 blocks when
        # each stays on one engine; 32 users in 1,024 blocks need twice the fleet's KV
        fits = {**chat, "users": 16, "num_blocks": 2048}
        out += [
            Cell("conversation", "multi-turn", fits),
            Cell("conversation", "multi-turn 2x KV", chat),
            Cell("conversation", "trace", trace),
        ]
    if "agents" in axes:
        # kvrouter must win outright on bursts, pressure and several routers (issue 40);
        # without subagents (fan-out 1) a tie with the best peer meets the goal. Roomy, every
        # prefix-aware router keeps each session home and p95 is the 12th-slowest of 224
        # requests, set by which sessions share an engine and whose turns meet a newcomer's
        # cold prefill (one pass, 2026-12-07: kvrouter 93.7 % / 124 / 374 ms, smg 93.7 % /
        # 118 / 306, the gap a newcomer placed beside a session about to send), so the cell
        # pools seeds as the light cells do
        out += [
            Cell("agents", "8192 roomy", _agents(num_blocks=8192), events=True, seeds=LIGHT_SEEDS),
            Cell("agents", "5120, fan-out 8, 1 router (base)", _agents(), events=True),
            Cell("agents", "3072 pressure", _agents(num_blocks=3072), events=True),
            Cell("agents", "4 routers", _agents(routers=4), events=True),
            Cell("agents", "fan-out 1", _agents(agents_fanout=1)),
            Cell("agents", "fan-out 32", _agents(agents_fanout=32), events=True),
        ]
    if "trace" in axes:
        path, real = mooncake_trace()
        replay = {
            "workload": "trace",
            "trace": path,
            "max_requests": 600,
            "replicas": 8,
            "num_blocks": 32_768,
            "time_scale": 1.0,
        }
        for speed in TRACE_SPEEDS:
            label = f"Mooncake {speed:g}x" if real else f"Mooncake-like {speed:g}x"
            out.append(Cell("trace", label, {**replay, "speedup": speed}))
    return out
