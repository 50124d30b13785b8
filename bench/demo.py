"""``kvrouter demo``: start the stack locally, send a shared-prefix workload, show what happened.

Starts redis-server, simulated engines, the tracker, two routers and haproxy on loopback
(or, with ``--embedded``, one router with its in-process tracker and no Redis), sends groups
of requests that share a long system prompt through the entry point, and prints where each
group landed and how many prompt tokens the engines served from their prefix cache.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

import httpx

from bench.stack import LocalStack, StackConfig
from tracker.cli import Command
from tracker.config import LogSettings
from tracker.settings import setting


@dataclass(frozen=True, kw_only=True)
class DemoSettings(LogSettings):
    """``kvrouter demo``: the local stack and a short shared-prefix workload."""

    PART = "DEMO"

    embedded: bool = setting(False, "one router with its in-process tracker, no Redis/haproxy")
    replicas: int = setting(4, "simulated engines")
    groups: int = setting(6, "groups of requests sharing a system prompt")
    per_group: int = setting(6, "requests per group")
    prefix_tokens: int = setting(3000, "length of each group's shared system prompt")
    time_scale: float = setting(1.0, "engine time scale (1.0 = H200 speed, 0.1 = 10x faster)")
    seed: int = setting(1, "workload seed")


@dataclass
class Outcome:
    group: int
    replica: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float


def _prompt(rng: random.Random, tokens: int) -> str:
    # The default tokenizer is byte-level: one ASCII character is one token.
    words = ["kv", "cache", "prefix", "router", "block", "event", "replica", "token"]
    text = ""
    while len(text) < tokens:
        text += rng.choice(words) + " "
    return text[:tokens]


async def _one(client: httpx.AsyncClient, group: int, system: str, question: str) -> Outcome:
    body: dict[str, Any] = {
        "model": "default",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft, replica = 0.0, "?"
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        replica = response.headers.get("x-kvrouter-replica", "?")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if not ttft:
                ttft = time.perf_counter() - start
            chunk = httpx.Response(200, content=line[6:]).json()
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return Outcome(
        group, replica, usage.get("prompt_tokens", 0), details.get("cached_tokens", 0), ttft
    )


async def workload(url: str, settings: DemoSettings) -> list[Outcome]:
    rng = random.Random(settings.seed)
    systems = [_prompt(rng, settings.prefix_tokens) for _ in range(settings.groups)]
    outcomes: list[Outcome] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        # Round 1: one request per group (cold), round 2+: the rest, concurrently.
        for round_ in range(settings.per_group):
            outcomes += await asyncio.gather(
                *(
                    _one(client, g, systems[g], f"Question {round_} about group {g}?")
                    for g in range(settings.groups)
                )
            )
    return outcomes


def report(outcomes: list[Outcome]) -> str:
    by_group: dict[int, Counter[str]] = defaultdict(Counter)
    for o in outcomes:
        by_group[o.group][o.replica] += 1
    lines = ["group  replicas used (requests)"]
    lines += [f"{g:>5}  {dict(c)}" for g, c in sorted(by_group.items())]
    prompt = sum(o.prompt_tokens for o in outcomes)
    cached = sum(o.cached_tokens for o in outcomes)
    warm = [o for o in outcomes if o.cached_tokens]
    cold = [o for o in outcomes if not o.cached_tokens]
    lines.append("")
    lines.append(
        f"engine-reported prefix-cache hit rate: {cached / max(prompt, 1):.1%} "
        f"({cached:,} of {prompt:,} prompt tokens)"
    )
    if warm and cold:
        lines.append(
            f"median TTFT: {statistics.median(o.ttft_s for o in cold) * 1000:.0f} ms cold, "
            f"{statistics.median(o.ttft_s for o in warm) * 1000:.0f} ms with a cached prefix "
            "(simulated time, scaled)"
        )
    return "\n".join(lines)


def run(settings: DemoSettings) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    config = StackConfig(
        replicas=settings.replicas,
        routers=1 if settings.embedded else 2,
        redis=not settings.embedded,
        haproxy=not settings.embedded,
        time_scale=settings.time_scale,
        num_blocks=8192,
    )
    stack = LocalStack(config)
    print(f"starting the stack in {stack.workdir} ...")
    with stack:
        print(f"  entry point {stack.entry_url}  (routers: {', '.join(stack.router_urls)})")
        print(f"  engines {', '.join(stack.replica_urls)}")
        if stack.redis_url:
            print(f"  redis {stack.redis_url}")
        outcomes = asyncio.run(workload(stack.entry_url, settings))
        print()
        print(report(outcomes))
    return 0


DEMO = Command("demo", "start the stack locally and show prefix-aware routing", DemoSettings, run)
