"""The scenario matrix's cells: the axes, the base scenario each axis varies one thing of, and
the settings of every cell (what ``kvrouter matrix`` runs; :mod:`bench.matrix` describes it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from bench.verdicts import Cell

AXES: Final = ("cache", "load", "routers", "bypass", "restart", "conversation")
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
# settle (1,024 blocks: smg's p95 was 54.7, 73.3 and 61.0 ms in three seeds' passes), and
# the best of three peers' noisy values sits below what each would give (4,096 blocks: the
# best peer's p95 52.3-53.4 pass by pass, 54.8 pooled). Those cells pool three seeds.
LIGHT_SEEDS: Final = 3


def cells(axes: Sequence[str] = AXES) -> list[Cell]:
    """The matrix (see :mod:`bench.matrix`), for the axes asked for."""
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
    return out
