"""One fleet, one workload, every routing policy in turn: the benchmark's orchestration.

:class:`Harness` starts the fleet (a :class:`~bench.stack.local.LocalStack`) once and starts
every policy alike: the engines' prefix caches emptied and checked empty, the routers
restarted with the policy (or a real peer's own instances on their ports, :mod:`bench.peers`)
and the index empty; then it replays the workload with the same arrivals and collects a
:class:`~bench.loadgen.Result` per request. The method: docs/benchmarks.md, "The fleet".
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Final

import httpx

from bench.dynamo.arm import DynamoArm
from bench.fleet import FleetConfig
from bench.loadgen import LoadGenerator, Result
from bench.peers import PEERS, PeerArm, Worker, executable
from bench.stack.local import LocalStack
from bench.stack.processes import StackError
from bench.workloads import Workload
from router.baselines import BASELINES
from router.baselines import POLICIES as ROUTER_POLICIES

KVROUTER: Final = ROUTER_POLICIES[0]  # kvrouter's own policy, first in the registry (ttft)
BOUND: Final = "oracle"  # reads the engines' real caches: the upper bound, run last in-router
POLICY_FLAGS: Final = {name: name for name in BASELINES if name != BOUND} | {
    "kvrouter": KVROUTER,
    BOUND: BOUND,
}
"""The benchmark's in-router arms, by name: the router's baselines (:mod:`router.baselines`)
and kvrouter's own policy, each with the ``--policy`` the routers run it with."""
POLICIES: Final = (*POLICY_FLAGS, *PEERS)
"""Every arm of the benchmark: the in-router ones, then the real peers (:mod:`bench.peers`)."""
_SETTLE_TIMEOUT_S: Final = 60.0
_PREDICTIONS_EXPIRE_S: Final = 3.5  # a router's predictions outlive it (--predict-ttl-s 3)


@dataclass
class PolicyRun:
    """One policy's pass over the workload."""

    policy: str
    results: list[Result]
    wall_s: float
    started_at: float = field(default_factory=time.time)
    router_stats: dict[str, float] = field(default_factory=dict)
    engine_stats: dict[str, float] = field(default_factory=dict)
    engine_requests: dict[str, int] = field(default_factory=dict)


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
        unknown = [p for p in policies if p not in POLICIES]
        if unknown:
            raise ValueError(f"unknown policies {unknown}; known: {list(POLICIES)}")
        if fleet.gateway is not None and any(p in PEERS for p in policies):
            raise ValueError("a peer is a proxy: behind a gateway only pickers can be asked")
        self.fleet = fleet
        self.workload = workload
        self.policies = policies
        self.hooks = hooks or Hooks()
        self.stack = LocalStack(fleet.stack())
        self._last_end = 0.0
        self._last_policy = ""
        self._peers: list[str] = []

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
            self.stack.layout.entry_url,
            time_scale=self.fleet.time_scale,
            on_result=lambda r: self.hooks.result(policy, r),
            bypass_urls=self.stack.layout.replica_urls,
            bypass_share=self.fleet.bypass_share,
            seed=self.fleet.seed,
        )
        before = asyncio.run(self._engine_counters())
        served = asyncio.run(self._engine_requests())
        started = time.monotonic()
        results = asyncio.run(self._replay(generator))
        self._last_end = time.monotonic()
        self._last_policy = policy
        run = PolicyRun(policy, results, self._last_end - started)
        if policy not in PEERS:
            run.router_stats = asyncio.run(self._router_stats())
        after = asyncio.run(self._engine_counters())
        run.engine_stats = {k: after[k] - before.get(k, 0.0) for k in after}
        now = asyncio.run(self._engine_requests())
        run.engine_requests = {k: int(now[k] - served.get(k, 0)) for k in now}
        self.hooks.policy_done(run)
        return run

    async def _replay(self, generator: LoadGenerator) -> list[Result]:
        """The workload through ``generator``, with the engine restart when one is set."""
        at_s = self.fleet.restart_engine_at_s
        if at_s is None:
            return await generator.run(self.workload)
        restart = asyncio.create_task(self._restart_engine(at_s * self.fleet.time_scale))
        try:
            return await generator.run(self.workload)
        finally:
            await restart

    async def _restart_engine(self, delay_s: float) -> None:
        """SIGKILL the second engine (the first if there is one) ``delay_s`` into the pass and
        start it again: it comes back empty, with a new instance id."""
        await asyncio.sleep(delay_s)
        name = f"replica-{min(1, self.fleet.replicas - 1)}"
        self.hooks.stage(f"restarting {name} (SIGKILL)")
        await asyncio.to_thread(self.stack.processes.kill, name)
        await asyncio.to_thread(self.stack.processes.restart, name)

    # ------------------------------------------------------------------ steps

    def _routers(self) -> list[str]:
        """The routers' processes (endpoint pickers behind a gateway) the stack runs."""
        running = set(self.stack.processes.names())
        return [name for name in self.stack.layout.router_names if name in running]

    def _switch(self, policy: str) -> None:
        for name in self._peers:
            self.stack.processes.retire(name)
        self._peers = []
        for name in self._routers():
            self.stack.processes.kill(name, signal.SIGTERM)
        if policy in PEERS:
            self._start_peers(PEERS[policy])
            return
        for name in self._routers():
            self.stack.processes.restart(name, extra_args=("--policy", POLICY_FLAGS[policy]))

    def _start_peers(self, arm: PeerArm | DynamoArm) -> None:
        """The peer's own instances on the routers' ports (each its own metrics port)."""
        if isinstance(arm, DynamoArm):  # its frontends, and an adapter per engine
            routers = self.stack.layout.router_ports
            self._peers = arm.start(self.stack, [(f"peer-{i}", p) for i, p in enumerate(routers)])
            return
        binary = executable(arm.binary)
        if binary is None:
            raise StackError(f"{arm.name}: {arm.binary} is not installed ({arm.package})")
        workers = [
            Worker(url, events, replay) for url, events, replay in self.stack.layout.endpoints()
        ]
        ports = zip(self.stack.layout.router_ports, self.stack.layout.spare_ports, strict=True)
        for i, (port, metrics_port) in enumerate(ports):
            name = f"peer-{i}"
            argv = arm.argv(
                binary,
                port=port,
                metrics_port=metrics_port,
                workers=workers,
                block_size=self.fleet.block_size,
                model=self.stack.config.model,
            )
            self._peers.append(name)
            self.stack.processes.spawn(name, argv, f"http://127.0.0.1:{port}{arm.ready_path}")

    async def _reset_caches(self) -> None:
        async with httpx.AsyncClient(timeout=30.0) as client:
            if self.fleet.vllm is not None:
                await self._reset_vllm(client)
                return
            for url in self.stack.layout.replica_urls:
                await self._reset_one(client, url)

    async def _reset_engine(self, client: httpx.AsyncClient, url: str) -> None:
        """Empty one engine's prefix cache, then send it a request too short to fill a
        block: an engine publishes what its block pool queued (``AllBlocksCleared`` too)
        only when its scheduler steps, as vLLM does."""
        tiny = {"model": self.stack.config.model, "prompt": "hi", "max_tokens": 1}
        (await client.post(f"{url}/reset_prefix_cache")).raise_for_status()
        (await client.post(f"{url}/v1/completions", json=tiny)).raise_for_status()

    async def _reset_vllm(self, client: httpx.AsyncClient) -> None:
        """Real vLLM has no probe, and refuses to reset while requests hold blocks (the
        last run's draining): reset until the index, which follows its events, holds
        nothing."""
        deadline = time.monotonic() + _SETTLE_TIMEOUT_S
        while True:
            for url in self.stack.layout.replica_urls:
                await self._reset_engine(client, url)
            await asyncio.sleep(0.5)  # the events reach the index
            blocks = await self._indexed_blocks(client)
            if blocks == 0:
                return
            if time.monotonic() > deadline:
                raise StackError(f"the engines' caches still hold {blocks} indexed blocks")

    async def _reset_one(self, client: httpx.AsyncClient, url: str) -> None:
        deadline = time.monotonic() + _SETTLE_TIMEOUT_S
        while True:
            await self._reset_engine(client, url)
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
        urls = [f"http://127.0.0.1:{port}" for port in self.stack.layout.router_ports]
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                if self._peers:  # their readiness was checked at start; haproxy must see them
                    ready = [await self._answers(client, url) for url in urls]
                    entry = want if await self._answers(client, self.stack.layout.entry_url) else -1
                elif self.fleet.gateway is not None:
                    # through Envoy every path reaches an engine (the picker picks one on
                    # load): the pickers say on their own ports what they route to, and a
                    # GET through Envoy says that it reaches a picker again
                    ready = [await self._healthy(client, url) >= want for url in urls]
                    entry = want if await self._answers(client, self.stack.layout.entry_url) else -1
                else:
                    ready = [await self._healthy(client, url) >= want for url in urls]
                    entry = await self._healthy(client, self.stack.layout.entry_url)
                # embedded, a peer took the router's place (and its index went with it): the
                # engines' own probes said they were empty
                embedded_peer = bool(self._peers) and self.stack.layout.redis_url is None
                blocks = 0 if embedded_peer else await self._indexed_blocks(client)
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
        return await self._scrape(self.stack.layout.replica_urls, wanted)

    async def _engine_requests(self) -> dict[str, float]:
        """Requests each engine finished so far (``vllm:request_success``), by engine id."""
        out = {}
        for replica, url in zip(
            self.stack.layout.replica_ids, self.stack.layout.replica_urls, strict=True
        ):
            counts = await self._scrape([url], {"vllm:request_success_total": "done"})
            out[replica] = counts["done"]
        return out

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
        raw = await self._scrape(self.stack.layout.router_urls, wanted)
        stats = {k: v for k, v in raw.items() if not k.startswith("_")}
        for stage in stages:
            if raw[f"_{stage}_count"]:
                stats[f"stage_{stage}_ms"] = 1000 * raw[f"_{stage}_sum"] / raw[f"_{stage}_count"]
        return stats

    @staticmethod
    async def _answers(client: httpx.AsyncClient, url: str) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return (await client.get(f"{url}/health")).status_code == 200
        return False

    @staticmethod
    async def _healthy(client: httpx.AsyncClient, url: str) -> int:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
            body: Any = (await client.get(f"{url}/health")).json()
            return int(body["replicas"]["healthy"])
        return -1

    async def _indexed_blocks(self, client: httpx.AsyncClient) -> int:
        """Blocks the index holds over every engine (-1: not known yet)."""
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
            if self.stack.layout.redis_url is not None:
                body: Any = (
                    await client.get(f"http://127.0.0.1:{self.stack.layout.tracker_port}/health")
                ).json()
                replicas = body["replicas"]
                if len(replicas) < self.fleet.replicas:
                    return -1
                return sum(int(r["blocks"]) for r in replicas.values())
            text = (await client.get(f"{self.stack.layout.router_urls[0]}/metrics")).text
            lines = [
                line
                for line in text.splitlines()
                if line.startswith("kvrouter_tracker_replica_blocks{")
            ]
            if len(lines) < self.fleet.replicas:
                return -1
            return sum(int(float(line.rsplit(" ", 1)[1])) for line in lines)
        return -1
