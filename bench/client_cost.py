"""CPU per request of an asyncio HTTP client: httpx against aiohttp, against one engine.

The same non-streamed chat request at a fixed concurrency through each client, rounds
alternating, against one simulated engine; the client process's CPU per request and each
round's wall time say why the router's upstream client and the benchmarks' load generators
are aiohttp (docs/benchmarks.md, "Router on httpx").

    python -m bench.client_cost [--requests 2000] [--concurrency 32] [--rounds 2]
"""

from __future__ import annotations

import asyncio
import json
import resource
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx

from bench.stack.ports import free_ports
from router.fleet.upstream import KEEPALIVE_EXPIRY_S
from tracker.framework.cli import parse_argv
from tracker.framework.settings import Settings, setting

PATH = "/v1/chat/completions"
BODY = json.dumps(
    {"model": "default", "messages": [{"role": "user", "content": "x " * 500}], "max_tokens": 4}
).encode()
HEADERS = {"content-type": "application/json"}


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _closed_loop(
    send: Callable[[], Awaitable[None]], requests: int, concurrency: int
) -> None:
    remaining = iter(range(requests))

    async def worker() -> None:
        for _ in remaining:
            await send()

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _httpx(url: str, requests: int, concurrency: int) -> None:
    limits = httpx.Limits(max_connections=256, keepalive_expiry=KEEPALIVE_EXPIRY_S)
    async with httpx.AsyncClient(limits=limits, timeout=30.0, trust_env=False) as client:

        async def send() -> None:
            response = await client.post(url, content=BODY, headers=HEADERS)
            response.raise_for_status()

        await _closed_loop(send, requests, concurrency)


async def _aiohttp(url: str, requests: int, concurrency: int) -> None:
    connector = aiohttp.TCPConnector(limit=256, keepalive_timeout=KEEPALIVE_EXPIRY_S)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def send() -> None:
            async with session.post(url, data=BODY, headers=HEADERS) as response:
                response.raise_for_status()
                await response.read()

        await _closed_loop(send, requests, concurrency)


CLIENTS = {"httpx": _httpx, "aiohttp": _aiohttp}


Rounds = dict[str, list[dict[str, float]]]


async def measure(url: str, requests: int, concurrency: int, rounds: int) -> Rounds:
    """Each client's CPU per request and wall time, round after round."""
    out: Rounds = {name: [] for name in CLIENTS}
    for run in CLIENTS.values():  # warm the engine and each client's imports
        await run(url, 4 * concurrency, concurrency)
    for _ in range(rounds):
        for name, run in CLIENTS.items():
            cpu, start = _cpu_s(), time.perf_counter()
            await run(url, requests, concurrency)
            out[name].append(
                {
                    "cpu_ms_per_request": (_cpu_s() - cpu) / requests * 1e3,
                    "wall_s": time.perf_counter() - start,
                }
            )
    return out


@dataclass(frozen=True, kw_only=True)
class ClientCostSettings(Settings):
    """``python -m bench.client_cost``: how much each client is asked to send."""

    PART = "CLIENT_COST"

    requests: int = setting(2_000, "requests per client and round")
    concurrency: int = setting(32, "requests in flight")
    rounds: int = setting(2, "rounds, each client in turn")


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_argv(ClientCostSettings, argv, description=__doc__.split("\n")[0])
    port = free_ports(3)
    kvrouter = str(Path(sys.executable).with_name("kvrouter"))
    engine = subprocess.Popen(
        [
            *(kvrouter, "replica", "--port", str(port), "--log-level", "warning"),
            *("--events", f"tcp://127.0.0.1:{port + 1}", "--replay", f"tcp://127.0.0.1:{port + 2}"),
            *("--time-scale", "1", "--max-num-seqs", "512", "--floor-ms", "0.5"),
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or engine.poll() is not None:
                raise SystemExit("the engine did not start")
            time.sleep(0.2)
        results = asyncio.run(
            measure(url + PATH, settings.requests, settings.concurrency, settings.rounds)
        )
    finally:
        engine.terminate()
        engine.wait(10)
    for name, rounds in results.items():
        cpu = " / ".join(f"{r['cpu_ms_per_request']:.2f}" for r in rounds)
        wall = " / ".join(f"{r['wall_s']:.1f}" for r in rounds)
        print(f"{name:8} client CPU ms per request {cpu}   wall s {wall}")


if __name__ == "__main__":
    main()
