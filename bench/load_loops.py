"""Load on one target as streamed requests: a closed loop (a fixed number in flight) or an
open loop (Poisson arrivals at a fixed rate), and the level's samples (time to the first
chunk, gaps between chunks, errors)."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, Final

import aiohttp

from bench.proxy_load import Bodies, Target, one_stream

MAX_OPEN: Final = 2048  # open-loop requests in flight at most (bounded load)


@dataclass
class Level:
    """One level's samples."""

    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0

    async def sample(self, client: aiohttp.ClientSession, target: Target, body: Any) -> None:
        """Send one stream; record its first chunk and the gaps between chunks, or an error."""
        try:
            times = await one_stream(client, target, body)
        except (aiohttp.ClientError, TimeoutError):
            times = []
        if not times:
            self.errors += 1
            return
        self.ttft.append(times[0])
        self.gaps.extend(b - a for a, b in pairwise(times))


async def closed_streams(
    client: aiohttp.ClientSession,
    target: Target,
    bodies: Bodies,
    *,
    concurrency: int,
    seconds: float,
    output_tokens: int,
    into: Level | None = None,
) -> Level:
    """``concurrency`` streams in flight until ``seconds`` have passed (none starts after);
    the samples go ``into`` a level of earlier rounds when given."""
    level = into if into is not None else Level()
    deadline = time.monotonic() + seconds

    async def worker() -> None:
        while time.monotonic() < deadline:
            await level.sample(client, target, bodies.make(output_tokens, stream=True))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    level.seconds += time.perf_counter() - start
    return level


async def open_streams(
    client: aiohttp.ClientSession,
    target: Target,
    bodies: Bodies,
    *,
    rate: float,
    seconds: float,
    output_tokens: int,
    into: Level | None = None,
    round_: int = 0,
) -> Level:
    """Poisson arrivals at ``rate`` per second for ``seconds`` (seeded by the rate and the
    round: every target gets the same arrival times), each a stream of its own; waits for
    the last. The samples go ``into`` a level of earlier rounds when given."""
    level = into if into is not None else Level()
    inflight: set[asyncio.Task[None]] = set()
    arrivals = random.Random(int(rate * 1000) + 7919 * round_)
    start = time.perf_counter()
    at = arrivals.expovariate(rate)
    while at < seconds:
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if len(inflight) >= MAX_OPEN:
            level.errors += 1
        else:
            body = bodies.make(output_tokens, stream=True)
            task = asyncio.create_task(level.sample(client, target, body))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
        at += arrivals.expovariate(rate)
    await asyncio.gather(*inflight)
    level.seconds += time.perf_counter() - start
    return level
