"""What each router adds to a lone request: kvrouter (with Redis, embedded) and the real peers
against the engine itself, in front of the same two fast simulated engines.

Round after round the same kind of request, a group's cached system prompt and a new
question, goes one at a time straight to an engine and through each router in a shuffled
order. Reported per target: its TTFT, what it adds over the direct request of the same round
(a paired difference; p50 and p90, real ms) and the router process's CPU per request (every
thread, from /proc). Method and results: docs/results.md ("Against the peers, one request at
a time").

    python -m bench.overhead [--rounds 300] [--peers smg,vllm-kv,vllm-cache] [--json FILE]
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import aiohttp

from bench.peers import PEERS, Worker, executable, installed, named
from bench.proxy_load import cpu_seconds
from bench.stack.config import StackConfig
from bench.stack.layout import kvrouter_bin
from bench.stack.local import LocalStack
from bench.stack.ports import free_ports
from bench.workloads import text
from tracker.framework.cli import parse_argv
from tracker.framework.settings import Settings, setting

PATH: Final = "/v1/chat/completions"
DIRECT: Final = "direct"


async def ttft_ms(
    client: aiohttp.ClientSession, url: str, system: str, question: str, output_tokens: int = 64
) -> float:
    """Send one streamed chat request; the milliseconds to its first content chunk."""
    body = {
        "model": "default",
        "max_tokens": output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    }
    sent = time.perf_counter()
    first: float | None = None
    async with client.post(url + PATH, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {await response.text()}")
        async for chunk in response.content.iter_any():
            if first is None and b'"choices":[{' in chunk:
                first = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{url}: the stream had no content chunk")
    return (first - sent) * 1000


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(
    targets: dict[str, str],
    engines: Sequence[str],
    *,
    rounds: int,
    groups: int,
    seed: int,
    pids: dict[str, int | None] | None = None,
    output_tokens: int = 64,
) -> dict[str, dict[str, float]]:
    rng = random.Random(seed)
    systems = [text(rng, 4_800) for _ in range(groups)]
    times: dict[str, list[float]] = {name: [] for name in (DIRECT, *targets)}
    added: dict[str, list[float]] = {name: [] for name in targets}
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)
    async with aiohttp.ClientSession(connector=connector) as client:
        for system in systems:  # every prefix on every engine: every request below hits
            for engine in engines:
                await ttft_ms(client, engine, system, text(rng, 150))
        for url in targets.values():  # connections opened, tokenizer caches warm
            for system in systems:
                await ttft_ms(client, url, system, text(rng, 150))
        pids = {name: pid for name, pid in (pids or {}).items() if pid is not None}
        cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
        for i in range(rounds):
            system = systems[i % groups]
            order = [DIRECT, *targets]
            rng.shuffle(order)
            took: dict[str, float] = {}
            for name in order:
                url = engines[i % len(engines)] if name == DIRECT else targets[name]
                took[name] = await ttft_ms(client, url, system, text(rng, 150), output_tokens)
                times[name].append(took[name])
            for name in targets:
                added[name].append(took[name] - took[DIRECT])
        cpu = {name: cpu_seconds(pid) - cpu[name] for name, pid in pids.items()}
    report: dict[str, dict[str, float]] = {}
    for name, values in times.items():
        row = {"ttft_p50_ms": statistics.median(values), "ttft_p90_ms": quantile(values, 0.9)}
        if name in added:
            row["added_p50_ms"] = statistics.median(added[name])
            row["added_p90_ms"] = quantile(added[name], 0.9)
        if name in cpu:
            row["cpu_ms_per_request"] = cpu[name] * 1000 / rounds
        report[name] = row
    return report


EMBEDDED: Final = "kvrouter-embedded"
LOCAL_INDEX: Final = "kvrouter-local"


def start_kvrouter(
    stack: LocalStack,
    name: str,
    *,
    workers: int | None,
    extra: Sequence[str] = (),
    local_index: bool = False,
) -> str:
    """One more ``kvrouter router`` in front of the stack's engines, started under the stack's
    control (process name = ``name``) and serving once it routes to every engine; its URL.

    With ``workers`` it shares the stack's Redis (index, load) with that many processes, or
    with ``local_index`` the load only, each process keeping its own index from the engines'
    events; ``workers=None`` is the embedded mode: one process whose own tracker reads the
    engines' events, as each peer keeps an index of its own.
    """
    port = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    config = stack.config
    replicas = [flag for spec in stack.layout.replica_specs() for flag in ("--replica", spec)]
    if workers is None:
        index = replicas
    else:
        assert stack.layout.redis_url is not None
        index = ["--redis", stack.layout.redis_url, "--workers", str(workers)]
        if local_index:
            index += ["--local-index", *replicas]
    argv = [
        kvrouter_bin(), "router", "--port", str(port), "--router-id", name,
        "--model", config.model, "--block-size", str(config.block_size), *index, *extra,
    ]  # fmt: skip
    stack.processes.spawn(name, argv, f"{url}/health")
    stack.wait_knows_replicas(name, f"{url}/health", 30.0)
    return url


def start_peers(stack: LocalStack, names: Sequence[str]) -> dict[str, str]:
    """One instance of each named peer router in front of the stack's engines, started
    under the stack's control (process name = peer name); their base URLs by name."""
    workers = [Worker(url, events, replay) for url, events, replay in stack.layout.endpoints()]
    base = free_ports(2 * len(names)) if names else 0
    urls: dict[str, str] = {}
    for i, name in enumerate(names):
        arm = PEERS[name]
        port = base + 2 * i
        binary = executable(arm.binary)
        if binary is None:
            raise RuntimeError(f"{name}: {arm.binary} is not installed ({arm.package})")
        argv = arm.argv(
            binary,
            port=port,
            metrics_port=port + 1,
            workers=workers,
            block_size=stack.config.block_size,
            model=stack.config.model,
        )
        stack.processes.spawn(name, argv, f"http://127.0.0.1:{port}{arm.ready_path}")
        urls[name] = f"http://127.0.0.1:{port}"
    return urls


@dataclass(frozen=True, kw_only=True)
class OverheadSettings(Settings):
    """``python -m bench.overhead``: rounds, requests and the arms measured."""

    PART = "OVERHEAD"

    rounds: int = setting(300, "requests per target")
    groups: int = setting(10, "system prompts")
    output_tokens: int = setting(64, "tokens per answer")
    time_scale: float = setting(0.001, "engines' time scale")
    peers: str = setting("smg,vllm-kv,vllm-cache", "peer arms ('' for none)")
    router_args: str = setting("", "extra kvrouter router flags")
    embedded: bool = setting(
        True, "a kvrouter arm with its own index (one process, no Redis), as each peer has"
    )
    seed: int = setting(1, "request order and question seed")
    json: str | None = setting(None, "write the report here too")

    def __post_init__(self) -> None:
        named(self.peers)  # an unknown arm is refused before anything starts


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_argv(
        OverheadSettings, argv, prog="python -m bench.overhead", description=__doc__
    )
    router_args = tuple(settings.router_args.split())
    peers = installed(settings.peers)
    config = StackConfig(
        replicas=2,
        routers=1,
        haproxy=False,
        time_scale=settings.time_scale,
        router_args=router_args,
        replica_args=("--replay-layout", "topic"),
    )
    with LocalStack(config).start() as stack:
        targets = {"kvrouter": stack.layout.router_urls[0]}
        pids = {"kvrouter": stack.processes.pid("router-0")}
        if settings.embedded:
            targets[EMBEDDED] = start_kvrouter(stack, EMBEDDED, workers=None, extra=router_args)
            pids[EMBEDDED] = stack.processes.pid(EMBEDDED)
        targets |= start_peers(stack, peers)
        pids |= {name: stack.processes.pid(name) for name in peers}
        report = asyncio.run(
            measure(
                targets,
                stack.layout.replica_urls,
                rounds=settings.rounds,
                groups=settings.groups,
                seed=settings.seed,
                pids=pids,
                output_tokens=settings.output_tokens,
            )
        )
    print(
        f"{'target':<18} {'TTFT p50':>9} {'p90':>7} {'added p50':>10} {'p90':>7} "
        f"{'CPU/request':>12}  (real ms)"
    )
    for name, row in report.items():
        extra = (
            f"{row['added_p50_ms']:>+10.2f} {row['added_p90_ms']:>+7.2f}"
            if "added_p50_ms" in row
            else f"{'':>10} {'':>7}"
        )
        cpu = f"{row['cpu_ms_per_request']:>12.2f}" if "cpu_ms_per_request" in row else ""
        print(f"{name:<18} {row['ttft_p50_ms']:>9.2f} {row['ttft_p90_ms']:>7.2f} {extra} {cpu}")
    if settings.json:
        meta: dict[str, Any] = {"rounds": settings.rounds, "time_scale": settings.time_scale}
        Path(settings.json).write_text(json.dumps({**meta, "targets": report}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
