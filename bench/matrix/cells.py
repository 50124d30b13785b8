"""The scenario matrix's cells: the axes, the base scenario each axis varies one thing of, and
every cell (:class:`Cell`: its label on its axis and its ``kvrouter bench`` settings)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
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
# settle, and the best of three peers' noisy values sits below what each would give: those
# cells pool three seeds (docs/benchmarks.md, "Seeds").
LIGHT_SEEDS: Final = 3


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
    return out
