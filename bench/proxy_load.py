"""Proxy throughput and per-chunk latency: the same requests through one router or direct.

Starts a :class:`~bench.stack.local.LocalStack` (two simulated engines, Redis, the tracker,
one router) and drives it from this process: a closed loop of non-streamed requests, and
streams timestamped chunk by chunk, each straight to the engines and through the router, with
every process's CPU per request read from /proc (the router benchmark's proxy part;
docs/results.md, "The proxy").
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import re
import resource
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import count, pairwise
from pathlib import Path
from typing import Any, Final

import aiohttp

from bench.stack.config import StackConfig
from bench.stack.local import LocalStack
from router.fleet.upstream import KEEPALIVE_EXPIRY_S

ROUTER: Final = "router"  # a target's CPU part when it is one router (and its children)

MODEL: Final = "default"
PATH: Final = "/v1/chat/completions"
SYSTEM_CHARS: Final = 1_000  # the builtin tokenizer is byte-level: one character, one token
PROCESSES: Final = ("router-0", "replicas", "tracker", "redis")
_TICKS: Final = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProxySettings:
    """Shape of the proxy measurement (bounded in requests and seconds)."""

    requests: int = 2_000
    concurrency: int = 32
    max_tokens: int = 4
    rounds: int = 2
    round_timeout_s: float = 30.0
    streams: int = 50
    stream_tokens: int = 64
    loaded_streams: int = 128
    stream_concurrency: int = 32
    time_scale: float = 0.001
    step_ms: float = 1.0
    groups: int = 8
    workers: int = 1  # router processes (``kvrouter router --workers``)

    @classmethod
    def quick(cls) -> ProxySettings:
        return replace(cls(), requests=400, rounds=1, streams=15, loaded_streams=64)


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of ``samples``."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)] if ordered else math.nan


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds so far of a process and its live descendants (``kvrouter
    router --workers N`` serves from its children), or of this process for ``None``."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    total = 0.0
    for member in _process_tree(pid):
        try:
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # exited meanwhile
            continue
        total += (int(fields[11]) + int(fields[12])) / _TICKS
    return total


def cpu_of(parts: Mapping[str, Sequence[int]]) -> dict[str, float]:
    """CPU seconds so far of each part of a target (its processes' trees, summed), e.g. a
    gateway's pickers and its Envoy."""
    return {part: sum(map(cpu_seconds, members)) for part, members in parts.items()}


def router_part(pid: int | None) -> dict[str, list[int]]:
    """A target that is one router process (and its children) as its CPU parts."""
    return {ROUTER: [pid]} if pid is not None else {}


def cpu_row(spent: Mapping[str, float], requests: int) -> dict[str, float]:
    """CPU ms per request from each part's CPU seconds: ``cpu_ms_per_request`` sums the
    parts, and each part but a lone router's has its own ``cpu_<part>_ms_per_request``;
    empty without parts."""
    if not spent:
        return {}
    row = {"cpu_ms_per_request": sum(spent.values()) * 1000 / requests}
    for part, seconds in spent.items():
        if part != ROUTER:
            row[f"cpu_{part}_ms_per_request"] = seconds * 1000 / requests
    return row


def cpu_parts(row: Mapping[str, float]) -> str:
    """A row's CPU per part for people, ``epp 3.94 + envoy 1.36`` ("" without parts)."""
    return " + ".join(
        f"{key.removeprefix('cpu_').removesuffix('_ms_per_request')} {value:.2f}"
        for key, value in row.items()
        if key.startswith("cpu_") and key != "cpu_ms_per_request"
    )


def _process_tree(pid: int) -> list[int]:
    """``pid`` and every live descendant (``/proc/PID/task/TID/children``)."""
    tree, pending = [], [pid]
    while pending:
        member = pending.pop()
        tree.append(member)
        for children in Path(f"/proc/{member}/task").glob("*/children"):
            try:
                pending.extend(int(child) for child in children.read_text().split())
            except FileNotFoundError:
                continue
    return tree


class CpuMeter:
    """CPU seconds spent by each process of the stack (and the load generator) in a span."""

    def __init__(self, stack: LocalStack) -> None:
        self.pids: dict[str, int | None] = {name: stack.processes.pid(name) for name in PROCESSES}
        self.pids["client"] = None
        self._start = self._read()

    def _read(self) -> dict[str, float]:
        return {name: cpu_seconds(pid) for name, pid in self.pids.items()}

    def ms_per(self, requests: int) -> dict[str, float]:
        end = self._read()
        return {k: (end[k] - self._start[k]) / max(requests, 1) * 1e3 for k in end}


@dataclass
class Bodies:
    """Chat requests in groups sharing a system prompt, each with its own question."""

    groups: int
    rng: random.Random = field(default_factory=lambda: random.Random(23))

    def __post_init__(self) -> None:
        words = ("kv", "cache", "prefix", "router", "block", "event", "replica", "token")
        self.systems = [
            " ".join(self.rng.choice(words) for _ in range(SYSTEM_CHARS // 6))[:SYSTEM_CHARS]
            for _ in range(self.groups)
        ]
        self._ids = count()

    def make(self, max_tokens: int, *, stream: bool = False) -> dict[str, Any]:
        n = next(self._ids)
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": self.systems[n % self.groups]},
                {"role": "user", "content": f"Question {n}: what happens to block {n * 7}?"},
            ],
            "max_tokens": max_tokens,
        }
        if stream:
            body["stream"] = True
        return body


@dataclass
class Target:
    """Where requests go: the router, or the engines round-robin."""

    name: str
    urls: list[str]
    _next: count[int] = field(default_factory=count)

    def url(self) -> str:
        return self.urls[next(self._next) % len(self.urls)] + PATH


async def closed_loop(
    client: aiohttp.ClientSession,
    target: Target,
    bodies: list[dict[str, Any]],
    settings: ProxySettings,
    stack: LocalStack,
) -> dict[str, Any]:
    """Send ``bodies`` with ``concurrency`` requests in flight: requests/s, latency, CPU."""
    queue = iter(bodies)
    latencies: list[float] = []
    errors = 0
    deadline = time.monotonic() + settings.round_timeout_s

    async def worker() -> None:
        nonlocal errors
        for body in queue:
            if time.monotonic() > deadline:
                return
            start = time.perf_counter()
            async with client.post(target.url(), json=body) as response:
                await response.read()
            if response.status == 200:
                latencies.append(time.perf_counter() - start)
            else:
                errors += 1

    cpu = CpuMeter(stack)
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(settings.concurrency)))
    elapsed = time.perf_counter() - start
    return {
        "requests": len(latencies),
        "errors": errors,
        "seconds": elapsed,
        "rps": len(latencies) / elapsed,
        "latency_p50_ms": percentile(latencies, 50) * 1e3,
        "latency_p99_ms": percentile(latencies, 99) * 1e3,
        "cpu_ms_per_request": cpu.ms_per(len(latencies)),
    }


async def one_stream(
    client: aiohttp.ClientSession, target: Target, body: dict[str, Any]
) -> list[float]:
    """Arrival times of a stream's chunks, from the request's start (seconds)."""
    start = time.perf_counter()
    times: list[float] = []
    async with client.post(target.url(), json=body) as response:
        response.raise_for_status()
        async for raw in response.content:  # line by line
            line = raw.rstrip(b"\r\n")
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                times.append(time.perf_counter() - start)
    return times


async def streams(
    client: aiohttp.ClientSession,
    target: Target,
    bodies: list[dict[str, Any]],
    concurrency: int,
) -> dict[str, Any]:
    """Time to first chunk and gaps between chunks, ``concurrency`` streams at a time."""
    queue = iter(bodies)
    runs: list[list[float]] = []

    async def worker() -> None:
        for body in queue:
            runs.append(await one_stream(client, target, body))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    first = [r[0] for r in runs if r]
    last = [r[-1] for r in runs if r]
    gaps = [b - a for r in runs for a, b in pairwise(r)]
    return {
        "streams": len(runs),
        "chunks_mean": statistics.fmean(len(r) for r in runs),
        "first_chunk_p50_ms": percentile(first, 50) * 1e3,
        "first_chunk_p99_ms": percentile(first, 99) * 1e3,
        "last_chunk_p50_ms": percentile(last, 50) * 1e3,
        "gap_p50_ms": percentile(gaps, 50) * 1e3,
        "gap_p99_ms": percentile(gaps, 99) * 1e3,
    }


def decision_mean_ms(metrics: str) -> float | None:
    """Mean total decision time the router itself recorded, from its /metrics text."""
    values = {}
    for part in ("sum", "count"):
        pattern = rf'^kvrouter_router_decision_seconds_{part}\{{stage="total"\}} (\S+)$'
        match = re.search(pattern, metrics, re.MULTILINE)
        if match is None:
            return None
        values[part] = float(match.group(1))
    return values["sum"] / values["count"] * 1e3 if values["count"] else None


async def drive(stack: LocalStack, settings: ProxySettings) -> dict[str, Any]:
    router, direct = (
        Target("router", stack.layout.router_urls),
        Target("direct", stack.layout.replica_urls),
    )
    bodies = Bodies(settings.groups)
    # idle connections close before the servers' 5 s keep-alive timeout closes them under us
    connector = aiohttp.TCPConnector(limit=256, keepalive_timeout=KEEPALIVE_EXPIRY_S)
    out: dict[str, Any] = {"router": {}, "direct": {}}
    timeout = aiohttp.ClientTimeout(total=60.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        for target in (direct, router):  # warm connections, caches and the tracker's index
            warm = [bodies.make(settings.max_tokens) for _ in range(4 * settings.concurrency)]
            await closed_loop(client, target, warm, settings, stack)
        plan = (
            ("stream_c1", 1, settings.streams),
            ("stream_loaded", settings.stream_concurrency, settings.loaded_streams),
        )
        for label, concurrency, n in plan:
            for target in (direct, router):
                batch = [bodies.make(settings.stream_tokens, stream=True) for _ in range(n)]
                out[target.name][label] = await streams(client, target, batch, concurrency)
        rounds: dict[str, list[dict[str, Any]]] = {"router": [], "direct": []}
        for _ in range(settings.rounds):
            for target in (direct, router):
                batch = [bodies.make(settings.max_tokens) for _ in range(settings.requests)]
                rounds[target.name].append(
                    await closed_loop(client, target, batch, settings, stack)
                )
        for name, results in rounds.items():
            out[name]["throughput"] = max(results, key=lambda r: r["rps"])
            out[name]["throughput_rounds"] = results
        async with client.get(stack.layout.router_urls[0] + "/metrics") as response:
            metrics = await response.text()
    out["router_decision_mean_ms"] = decision_mean_ms(metrics)
    return out


def fast_engines(
    step_ms: float,
    time_scale: float,
    *,
    routers: int,
    router_args: Sequence[str] = (),
    replica_args: Sequence[str] = (),
    replica_processes: bool = False,
) -> StackConfig:
    """Two simulated engines whose every step takes ``step_ms`` real milliseconds (the floor
    dominates: streams chunk at that pace, and the engines are not the bottleneck), with Redis
    and the tracker, and ``routers`` kvrouter routers: the data-path benchmarks' stack."""
    return StackConfig(
        replicas=2,
        routers=routers,
        redis=True,
        haproxy=False,
        time_scale=time_scale,
        num_blocks=16_384,
        router_args=tuple(router_args),
        replica_args=("--max-num-seqs", "512", "--floor-ms", str(step_ms / time_scale),
                      *replica_args),
        replica_processes=replica_processes,
    )  # fmt: skip


def measure(settings: ProxySettings) -> dict[str, Any]:
    """Start the stack, drive it, stop it; the results with the setup."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    config = fast_engines(
        settings.step_ms,
        settings.time_scale,
        routers=1,
        router_args=("--workers", str(settings.workers)),
    )
    with LocalStack(config) as stack:
        results = asyncio.run(drive(stack, settings))
    results["setup"] = {
        "engines": "2 simulated engines in one `kvrouter replica` process",
        "router": f"one `kvrouter router --redis --workers {settings.workers}` (index and shared "
        "load in redis-server)",
        "step_ms": settings.step_ms,
        "prompt_tokens": SYSTEM_CHARS + 60,
        "max_tokens": settings.max_tokens,
        "concurrency": settings.concurrency,
        "stream_tokens": settings.stream_tokens,
        "stream_concurrency": settings.stream_concurrency,
        "cores": os.cpu_count(),
    }
    return results


def proxy_table(results: dict[str, Any]) -> str:
    """Direct vs router, side by side."""
    d, r = results["direct"], results["router"]
    setup = results["setup"]
    loaded = f"c{setup['stream_concurrency']}"

    def row(name: str, key: str, sub: str, fmt: str = "{:.2f}") -> tuple[str, str, str, str]:
        a, b = d[key][sub], r[key][sub]
        return name, fmt.format(a), fmt.format(b), fmt.format(b - a)

    rows = [
        row(f"requests/s (c{setup['concurrency']}, non-streamed)", "throughput", "rps", "{:.0f}"),
        row("latency p50 (ms)", "throughput", "latency_p50_ms", "{:.1f}"),
        row("latency p99 (ms)", "throughput", "latency_p99_ms", "{:.1f}"),
        row("stream c1: first chunk p50 (ms)", "stream_c1", "first_chunk_p50_ms"),
        row("stream c1: first chunk p99 (ms)", "stream_c1", "first_chunk_p99_ms"),
        row("stream c1: chunk gap p50 (ms)", "stream_c1", "gap_p50_ms"),
        row("stream c1: chunk gap p99 (ms)", "stream_c1", "gap_p99_ms"),
        row("stream c1: last chunk p50 (ms)", "stream_c1", "last_chunk_p50_ms"),
        row(f"stream {loaded}: first chunk p50 (ms)", "stream_loaded", "first_chunk_p50_ms"),
        row(f"stream {loaded}: chunk gap p50 (ms)", "stream_loaded", "gap_p50_ms"),
        row(f"stream {loaded}: chunk gap p99 (ms)", "stream_loaded", "gap_p99_ms"),
        row(f"stream {loaded}: last chunk p50 (ms)", "stream_loaded", "last_chunk_p50_ms"),
    ]
    cpu_d, cpu_r = d["throughput"]["cpu_ms_per_request"], r["throughput"]["cpu_ms_per_request"]
    for name in ("router-0", "replicas", "tracker", "redis", "client"):
        a, b = cpu_d[name], cpu_r[name]
        rows.append((f"CPU ms per request: {name}", f"{a:.2f}", f"{b:.2f}", f"{b - a:.2f}"))
    width = max(len(x[0]) for x in rows)
    lines = [f"{'proxy':<{width}}  {'direct':>9}  {'router':>9}  {'added':>9}"]
    lines += [f"{a:<{width}}  {b:>9}  {c:>9}  {e:>9}" for a, b, c, e in rows]
    mean = results.get("router_decision_mean_ms")
    if mean is not None:
        lines.append(f"router's own decision time (mean, all requests): {mean:.2f} ms")
    return "\n".join(lines)
