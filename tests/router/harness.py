"""Real parts for router tests: simulated engines, routers, trackers; in-process or processes."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from publishers.config import ReplicaSettings
from publishers.sim.engine import SimulatedEngine
from publishers.sim.fleet import FleetService
from router.config import RouterSettings
from router.service import RouterService
from tests.procs import KVROUTER, free_ports, kvrouter_env

SYSTEM = "You are a careful assistant who answers in full sentences and cites sources. " * 16


def chat(system: str, user: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return {"model": "sim", "messages": messages, "max_tokens": 4, **extra}


@dataclass
class Engines:
    """Simulated engines with consecutive HTTP, event and replay ports."""

    fleet: FleetService
    http: int
    events: int
    replay: int
    prefix: str = "replica-"

    @property
    def ports(self) -> tuple[int, int, int]:
        return self.http, self.events, self.replay

    @property
    def count(self) -> int:
        return self.fleet.settings.count

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.http + i}"

    def spec(self, i: int) -> str:
        """The ``--replica`` spec of engine ``i``."""
        return (
            f"{self.prefix}{i}=tcp://127.0.0.1:{self.events + i},"
            f"replay=tcp://127.0.0.1:{self.replay + i},url={self.url(i)}"
        )

    @property
    def specs(self) -> tuple[str, ...]:
        return tuple(self.spec(i) for i in range(self.count))

    def engine(self, i: int) -> SimulatedEngine:
        return self.fleet.replicas[i].engine

    def running(self) -> int:
        return sum(
            r.engine.stats().num_requests_running + r.engine.stats().num_requests_waiting
            for r in self.fleet.replicas
        )


@contextlib.asynccontextmanager
async def engines(
    count: int = 2, *, ports: tuple[int, int, int] | None = None, **overrides: Any
) -> AsyncIterator[Engines]:
    """``count`` in-process simulated engines (fast clock, model ``sim``).

    :param ports: first HTTP, event and replay ports (default: free ones).
    """
    http, events, replay = ports or (free_ports(count), free_ports(count), free_ports(count))
    options: dict[str, Any] = {"model": "sim", "time_scale": 0.01, "num_blocks": 2048}
    options.update(overrides)
    settings = ReplicaSettings(
        count=count,
        port=http,
        events=f"tcp://*:{events}",  # vLLM's rule: a wildcard binds
        replay=f"tcp://127.0.0.1:{replay}",
        **options,
    )
    fleet = FleetService(settings)
    await fleet.start()
    try:
        yield Engines(fleet, http, events, replay, settings.id_prefix)
    finally:
        await fleet.stop()


def router_settings(**overrides: Any) -> RouterSettings:
    options: dict[str, Any] = {
        "port": 0,
        "model": "sim",
        "health_interval_s": 0.2,
        "health_timeout_s": 0.5,
        "metrics_interval_s": 0.2,
        "shutdown_timeout_s": 3.0,
    }
    options.update(overrides)
    return RouterSettings(**options)


@contextlib.asynccontextmanager
async def router(**overrides: Any) -> AsyncIterator[RouterService]:
    """An in-process router (real uvicorn on a free port)."""
    service = RouterService(router_settings(**overrides))
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


def base_url(service: RouterService) -> str:
    return f"http://127.0.0.1:{service.port}"


async def wait_until(
    check: Callable[[], Awaitable[bool] | bool], within: float = 10.0, interval: float = 0.05
) -> None:
    deadline = time.monotonic() + within
    while True:
        result = check()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(interval)


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` in a /metrics page."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


class Process:
    """A ``kvrouter`` subcommand as a real process, logging to a file."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.args = args
        self.log_path = log
        self._log = log.open("ab")
        self.proc = subprocess.Popen(
            [str(KVROUTER), *args], stdout=self._log, stderr=subprocess.STDOUT, env=kvrouter_env()
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            self.proc.send_signal(sig)

    async def wait(self, within: float = 20.0) -> int:
        deadline = time.monotonic() + within
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.args[0]} still running; log:\n{self.log()}")
            await asyncio.sleep(0.05)
        return self.proc.returncode

    def close(self) -> None:
        if self.alive:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self._log.close()


async def wait_healthy(url: str, proc: Process | None = None, within: float = 30.0) -> None:
    """Until ``GET url/health`` answers 200 (the process must stay alive)."""
    async with httpx.AsyncClient(timeout=1.0) as client:

        async def ok() -> bool:
            if proc is not None and not proc.alive:
                raise RuntimeError(f"{proc.args[0]} exited; log:\n{proc.log()}")
            try:
                return (await client.get(f"{url}/health")).status_code == 200
            except httpx.TransportError:
                return False

        await wait_until(ok, within)


def slow_fleet(redis_url: str, tmp_path: Path) -> tuple[Process, Process]:
    """Two simulated replicas (1 s prefill floor, so streams overlap) and a tracker on
    ``redis_url``, as real processes: the fleet the multi-router tests put routers in front of."""
    http, events, replay = free_ports(2), free_ports(2), free_ports(2)
    replica = Process(
        [
            "replica", "--count", "2", "--port", str(http),
            "--events", f"tcp://*:{events}", "--replay", f"tcp://*:{replay}",
            "--model", "sim", "--redis", redis_url, "--time-scale", "0.01",
            "--floor-ms", "1000", "--heartbeat-s", "0.5", "--ttl-s", "3",
        ],
        tmp_path / "replica.log",
    )  # fmt: skip
    tracker = Process(["tracker", "--redis", redis_url, "--http-port", "0"], tmp_path / "t.log")
    return replica, tracker
