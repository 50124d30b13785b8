"""One fleet, one workload, every routing policy in turn: the benchmark's orchestration.

The fleet is a :class:`~bench.stack.LocalStack` started once: simulated engines, redis-server,
the tracker and the router(s) (or, embedded, one router with its in-process tracker). For
each policy the harness

1. empties every engine's prefix cache (``POST /reset_prefix_cache``; vLLM publishes
   ``AllBlocksCleared`` with the *next* step's batch, so each engine then gets a 2-token
   request, too short to fill a block) and checks, with the simulation-only probe, that no
   block is cached any more;
2. restarts the router(s) with ``--policy`` set (``kvrouter`` is ``--policy ttft``), waits
   until they route to every engine, and until the index holds no block of any engine;
3. replays the same workload (same arrivals) through the entry point, collecting
   :class:`~bench.loadgen.Result` per request.

So every policy starts cold, with the same fleet, the same arrivals and the same proxy path.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx

from bench.loadgen import LoadGenerator, Result
from bench.stack import LocalStack, StackConfig, StackError
from bench.workloads import Workload

POLICY_FLAGS: Final = {
    "round-robin": "round-robin",
    "least-load": "least-load",
    "seed": "seed",
    "sglang": "sglang",
    "kvrouter": "ttft",
    "oracle": "oracle",
}
POLICIES: Final = tuple(POLICY_FLAGS)
# Real-time router guards sized for a shared benchmark machine, where the router's event loop
# and Redis are descheduled for tens of ms at a time (docs/benchmarks.md); deployments keep
# the defaults (10 ms index budget, 1 s connect timeout). Later --router-args win.
BENCH_ROUTER_ARGS: Final = ("--lookup-timeout-ms", "100", "--connect-timeout-s", "10")
_SETTLE_TIMEOUT_S: Final = 60.0
_PREDICTIONS_EXPIRE_S: Final = 3.5  # a router's predictions outlive it (--predict-ttl-s 3)


@dataclass(frozen=True)
class FleetConfig:
    """The fleet every policy runs on."""

    replicas: int = 8
    routers: int = 1
    redis: bool = True
    time_scale: float = 10.0
    num_blocks: int = 4096
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    profile: str = "llama-8b"
    router_args: tuple[str, ...] = ()
    replica_args: tuple[str, ...] = ()
    workdir: Path | None = None

    def stack(self) -> StackConfig:
        return StackConfig(
            replicas=self.replicas,
            routers=self.routers if self.redis else 1,
            redis=self.redis,
            haproxy=self.redis and self.routers > 1,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            profile=self.profile,
            time_scale=self.time_scale,
            max_num_batched_tokens=self.max_num_batched_tokens,
            router_args=(*BENCH_ROUTER_ARGS, *self.router_args),
            replica_args=self.replica_args,
            workdir=self.workdir,
        )


@dataclass
class PolicyRun:
    """One policy's pass over the workload."""

    policy: str
    results: list[Result]
    wall_s: float
    started_at: float = field(default_factory=time.time)
    router_stats: dict[str, float] = field(default_factory=dict)
    engine_stats: dict[str, float] = field(default_factory=dict)


class Hooks:
    """Progress callbacks (the terminal UI); the defaults do nothing."""

    def stage(self, message: str) -> None:
        """A setup step is starting."""

    def policy_started(self, policy: str, requests: int) -> None:
        """A policy's pass begins."""

    def result(self, policy: str, result: Result) -> None:
        """A request finished."""

    def policy_done(self, run: PolicyRun) -> None:
        """A policy's pass ended."""


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM as Ctrl-C: unwind, so the stack's processes are stopped, not orphaned."""
    raise KeyboardInterrupt


class Harness:
    """Runs ``workload`` through each of ``policies`` on one fleet (see the module docstring)."""

    def __init__(
        self,
        fleet: FleetConfig,
        workload: Workload,
        policies: tuple[str, ...],
        hooks: Hooks | None = None,
    ) -> None:
        unknown = [p for p in policies if p not in POLICY_FLAGS]
        if unknown:
            raise ValueError(f"unknown policies {unknown}; known: {list(POLICY_FLAGS)}")
        self.fleet = fleet
        self.workload = workload
        self.policies = policies
        self.hooks = hooks or Hooks()
        self.stack = LocalStack(fleet.stack())
        self._last_end = 0.0
        self._last_policy = ""

    def run(self) -> list[PolicyRun]:
        """Start the fleet, run every policy, stop the fleet (also on SIGTERM or Ctrl-C)."""
        self.hooks.stage(f"starting {self.fleet.replicas} engines in {self.stack.workdir}")
        runs = []
        previous = signal.signal(signal.SIGTERM, _interrupt)
        try:
            with self.stack:
                for policy in self.policies:
                    runs.append(self.run_policy(policy))
        finally:
            signal.signal(signal.SIGTERM, previous)
        return runs

    def run_policy(self, policy: str) -> PolicyRun:
        """Reset the caches, switch the routers to ``policy``, replay the workload."""
        self.hooks.stage(f"{policy}: emptying the engines' prefix caches")
        asyncio.run(self._reset_caches())
        self.hooks.stage(f"{policy}: restarting the router(s)")
        self._switch(policy)
        asyncio.run(self._settle())
        if self._last_policy == "kvrouter":
            time.sleep(max(0.0, self._last_end + _PREDICTIONS_EXPIRE_S - time.monotonic()))
        self.hooks.policy_started(policy, self.workload.requests)
        generator = LoadGenerator(
            self.stack.entry_url,
            time_scale=self.fleet.time_scale,
            on_result=lambda r: self.hooks.result(policy, r),
        )
        before = asyncio.run(self._engine_counters())
        started = time.monotonic()
        results = asyncio.run(generator.run(self.workload))
        self._last_end = time.monotonic()
        self._last_policy = policy
        run = PolicyRun(policy, results, self._last_end - started)
        run.router_stats = asyncio.run(self._router_stats())
        after = asyncio.run(self._engine_counters())
        run.engine_stats = {k: after[k] - before.get(k, 0.0) for k in after}
        self.hooks.policy_done(run)
        return run

    # ------------------------------------------------------------------ steps

    def _routers(self) -> list[str]:
        return [name for name in self.stack.names() if name.startswith("router-")]

    def _switch(self, policy: str) -> None:
        for name in self._routers():
            self.stack.kill(name, signal.SIGTERM)
            self.stack.restart(name, extra_args=("--policy", POLICY_FLAGS[policy]))

    async def _reset_caches(self) -> None:
        async with httpx.AsyncClient(timeout=30.0) as client:
            for url in self.stack.replica_urls:
                await self._reset_one(client, url)

    async def _reset_one(self, client: httpx.AsyncClient, url: str) -> None:
        deadline = time.monotonic() + _SETTLE_TIMEOUT_S
        tiny = {"model": "default", "prompt": "hi", "max_tokens": 1}
        while True:
            (await client.post(f"{url}/reset_prefix_cache")).raise_for_status()
            (await client.post(f"{url}/v1/completions", json=tiny)).raise_for_status()
            probe = (await client.post(f"{url}/kvrouter/probe", json={"token_ids": []})).json()
            if probe["cached_blocks"] == 0:
                return
            if time.monotonic() > deadline:
                raise StackError(f"{url} still caches {probe['cached_blocks']} blocks")
            await asyncio.sleep(0.2)  # blocks still in use: requests of the last run draining

    async def _settle(self) -> None:
        """Every router routes to every engine and the index holds no block."""
        want = self.fleet.replicas
        deadline = time.monotonic() + _SETTLE_TIMEOUT_S
        urls = [f"http://127.0.0.1:{port}" for port in self.stack.router_ports]
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                ready = [await self._healthy(client, url) >= want for url in urls]
                blocks = await self._indexed_blocks(client)
                entry = await self._healthy(client, self.stack.entry_url)
                if all(ready) and entry >= want and blocks == 0:
                    return
                if time.monotonic() > deadline:
                    raise StackError(
                        f"fleet not settled after {_SETTLE_TIMEOUT_S}s: routers ready {ready}, "
                        f"{blocks} blocks still indexed"
                    )
                await asyncio.sleep(0.2)

    async def _engine_counters(self) -> dict[str, float]:
        """vLLM counters summed over the engines (the pass's share is a difference)."""
        wanted = {
            "vllm:num_preemptions_total": "preemptions",
            "vllm:prefix_cache_queries_total": "prefix_cache_queries",
            "vllm:prefix_cache_hits_total": "prefix_cache_hits",
        }
        return await self._scrape(self.stack.replica_urls, wanted)

    async def _scrape(self, urls: list[str], wanted: dict[str, str]) -> dict[str, float]:
        stats = dict.fromkeys(wanted.values(), 0.0)
        async with httpx.AsyncClient(timeout=10.0) as client:
            for url in urls:
                with contextlib.suppress(httpx.HTTPError):
                    text = (await client.get(f"{url}/metrics")).text
                    for line in text.splitlines():
                        name, _, value = line.rpartition(" ")
                        key = name if name in wanted else name.split("{", 1)[0]
                        if key in wanted:
                            stats[wanted[key]] += float(value)
        return stats

    async def _router_stats(self) -> dict[str, float]:
        """Summed over the routers: index fallbacks, retries, upstream errors, and the mean
        decision time per stage (``stage_<name>_ms``)."""
        wanted = {
            "kvrouter_router_fallbacks_total": "index_fallbacks",
            "kvrouter_router_retries_total": "retries",
            "kvrouter_router_upstream_errors_total": "upstream_errors",
            "kvrouter_router_stream_errors_total": "stream_errors",
        }
        stages = ("tokenize", "hash", "lookup", "score", "probe", "total")
        for stage in stages:
            key = f'kvrouter_router_decision_seconds_%s{{stage="{stage}"}}'
            wanted[key % "sum"] = f"_{stage}_sum"
            wanted[key % "count"] = f"_{stage}_count"
        raw = await self._scrape(self.stack.router_urls, wanted)
        stats = {k: v for k, v in raw.items() if not k.startswith("_")}
        for stage in stages:
            if raw[f"_{stage}_count"]:
                stats[f"stage_{stage}_ms"] = 1000 * raw[f"_{stage}_sum"] / raw[f"_{stage}_count"]
        return stats

    @staticmethod
    async def _healthy(client: httpx.AsyncClient, url: str) -> int:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
            body: Any = (await client.get(f"{url}/health")).json()
            return int(body["replicas"]["healthy"])
        return -1

    async def _indexed_blocks(self, client: httpx.AsyncClient) -> int:
        """Blocks the index holds over every engine (-1: not known yet)."""
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
            if self.stack.redis_url is not None:
                body: Any = (
                    await client.get(f"http://127.0.0.1:{self.stack.tracker_port}/health")
                ).json()
                replicas = body["replicas"]
                if len(replicas) < self.fleet.replicas:
                    return -1
                return sum(int(r["blocks"]) for r in replicas.values())
            text = (await client.get(f"{self.stack.router_urls[0]}/metrics")).text
            lines = [
                line
                for line in text.splitlines()
                if line.startswith("kvrouter_tracker_replica_blocks{")
            ]
            if len(lines) < self.fleet.replicas:
                return -1
            return sum(int(float(line.rsplit(" ", 1)[1])) for line in lines)
        return -1
