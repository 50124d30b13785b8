"""What each router costs as load rises, up to saturation: kvrouter (with Redis, as
``--workers N``, with ``--local-index``, embedded) and the real peers (:mod:`bench.peers`)
against the engines themselves, all in front of the same two simulated engines.

Per level and target, a closed loop (``--concurrency``: that many streams in flight) or an
open loop (``--rates``: Poisson arrivals, the same for every target, at most ``MAX_OPEN`` in
flight), cut into ``--rounds`` turns over the targets. Reported per target and level:
requests/s, time to the first chunk and what it adds over the engines' own, the gap between
chunks, the router's CPU per request, errors. Method and results: docs/benchmarks.md
("Rising load against the peers").

    python -m bench.saturation [--concurrency 1,8,32,128] [--rates 100,200,400,600]
        [--seconds 6] [--rounds 3] [--workers 1,2] [--no-local-index] [--no-embedded]
        [--peers smg,vllm-kv,vllm-cache] [--epp 1,2] [--no-epp-headers] [--no-envoy]
        [--json FILE]

The gateway arms (:mod:`bench.gateway`): ``envoy+epp`` is a real Envoy asking ``kvrouter
epp`` over ext_proc where each request goes, every response chunk through the picker (Envoy's
FULL_DUPLEX_STREAMED response body, the stack's default); ``-hdr``, the picker shown only the
response headers; ``-pN``, N pickers; ``envoy``, Envoy alone (round robin). Their CPU is
reported per part, the pickers' and Envoy's.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any, Final

import aiohttp

from bench.gateway import gateway_arms, start_gateway
from bench.overhead import EMBEDDED, LOCAL_INDEX, start_kvrouter, start_peers
from bench.peers import installed, named
from bench.proxy_load import (
    Bodies,
    Target,
    cpu_of,
    cpu_parts,
    cpu_row,
    cpu_seconds,
    fast_engines,
    one_stream,
    percentile,
    router_part,
)
from bench.stack.local import LocalStack
from router.fleet.upstream import KEEPALIVE_EXPIRY_S
from tracker.framework.cli import parse_argv
from tracker.framework.errors import ConfigError
from tracker.framework.settings import Settings, comma_list, setting

DIRECT: Final = "direct"
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


@dataclass(frozen=True)
class Plan:
    """Shape of the measurement (bounded: levels x targets x ``seconds``)."""

    concurrency: tuple[int, ...] = (1, 8, 32, 128)
    rates: tuple[float, ...] = ()
    seconds: float = 6.0
    rounds: int = 3
    warmup_s: float = 1.0
    output_tokens: int = 16
    groups: int = 8
    step_ms: float = 1.0
    time_scale: float = 0.001


def level_name(level: int | float, *, rate: bool) -> str:
    """A level's key in the report: ``"32"`` (streams) or ``"400/s"`` (offered rate)."""
    return f"{level:g}/s" if rate else str(level)


async def drive(
    targets: dict[str, list[str]], pids: Mapping[str, Mapping[str, Sequence[int]]], plan: Plan
) -> dict[str, dict[str, dict[str, float]]]:
    """Every level, every target; rows by target, then by level (as a string).

    ``pids``: a target's processes by part (``router``; a gateway's ``epp`` and ``envoy``),
    whose CPU is read from /proc: a row's ``cpu_ms_per_request`` sums the parts, and each
    part other than ``router`` has its own ``cpu_<part>_ms_per_request``.

    A level's ``seconds`` per target are cut into ``plan.rounds`` rounds that visit the
    targets in turn, each round starting one target further on: a spell of outside load on
    the host (these benchmarks share it with everything) falls on every target alike instead
    of on whichever one was being measured.
    """
    bodies = Bodies(plan.groups)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_EXPIRY_S)
    timeout = aiohttp.ClientTimeout(total=60.0)
    report: dict[str, dict[str, dict[str, float]]] = {name: {} for name in targets}
    steps = [(c, False) for c in plan.concurrency] + [(r, True) for r in plan.rates]
    names = list(targets)
    seconds = plan.seconds / plan.rounds
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        for level, is_rate in steps:
            runs = {name: Level() for name in names}
            cpu: dict[str, dict[str, float]] = {name: {} for name in names}
            client_cpu = dict.fromkeys(names, 0.0)
            for round_ in range(plan.rounds):
                turn = round_ % len(names)
                for name in names[turn:] + names[:turn]:
                    target = Target(name, targets[name])
                    if round_ == 0:
                        # connections opened, every group's prefix cached, caches warm
                        await closed_streams(
                            client,
                            target,
                            bodies,
                            concurrency=8 if is_rate else int(level),
                            seconds=plan.warmup_s,
                            output_tokens=plan.output_tokens,
                        )
                    before = cpu_of(pids.get(name, {}))
                    mine = cpu_seconds(None)
                    if is_rate:
                        await open_streams(
                            client,
                            target,
                            bodies,
                            rate=level,
                            seconds=seconds,
                            output_tokens=plan.output_tokens,
                            into=runs[name],
                            round_=round_,
                        )
                    else:
                        await closed_streams(
                            client,
                            target,
                            bodies,
                            concurrency=int(level),
                            seconds=seconds,
                            output_tokens=plan.output_tokens,
                            into=runs[name],
                        )
                    client_cpu[name] += cpu_seconds(None) - mine
                    for part, used in cpu_of(pids.get(name, {})).items():
                        cpu[name][part] = cpu[name].get(part, 0.0) + used - before[part]
            for name, run in runs.items():
                done = max(1, len(run.ttft))
                row = {
                    "requests": float(len(run.ttft)),
                    "errors": float(run.errors),
                    "rps": len(run.ttft) / run.seconds,
                    "ttft_p50_ms": percentile(run.ttft, 50) * 1e3,
                    "ttft_p95_ms": percentile(run.ttft, 95) * 1e3,
                    "ttft_p99_ms": percentile(run.ttft, 99) * 1e3,
                    "gap_p50_ms": percentile(run.gaps, 50) * 1e3,
                    "gap_p99_ms": percentile(run.gaps, 99) * 1e3,
                    "client_cpu_ms_per_request": client_cpu[name] * 1e3 / done,
                }
                row |= cpu_row(cpu[name], done)
                report[name][level_name(level, rate=is_rate)] = row
    for name, levels in report.items():
        for key, row in levels.items():
            base = report[DIRECT].get(key)
            if name != DIRECT and base is not None:
                row["added_p50_ms"] = row["ttft_p50_ms"] - base["ttft_p50_ms"]
                row["added_p95_ms"] = row["ttft_p95_ms"] - base["ttft_p95_ms"]
                row["added_p99_ms"] = row["ttft_p99_ms"] - base["ttft_p99_ms"]
    return report


def saturation(levels: dict[str, dict[str, float]]) -> float:
    """A target's best requests/s over the levels."""
    return max((row["rps"] for row in levels.values()), default=0.0)


def render(report: dict[str, dict[str, dict[str, float]]]) -> str:
    """The report as a plain-text table, one line per target and level."""
    lines = [
        f"{'target':<18} {'level':>7} {'req/s':>7} {'TTFT p50':>9} {'p95':>8} {'p99':>8} "
        f"{'added p50':>10} {'p99':>8} {'gap p99':>8} {'CPU/req':>8} {'errors':>6}  (real ms)"
    ]
    for name, levels in report.items():
        for level, row in levels.items():
            added = (
                f"{row['added_p50_ms']:>+10.2f} {row['added_p99_ms']:>+8.2f}"
                if "added_p50_ms" in row
                else f"{'':>10} {'':>8}"
            )
            cpu = f"{row['cpu_ms_per_request']:>8.2f}" if "cpu_ms_per_request" in row else " " * 8
            parts = cpu_parts(row)
            lines.append(
                f"{name:<18} {level:>7} {row['rps']:>7.0f} {row['ttft_p50_ms']:>9.2f} "
                f"{row['ttft_p95_ms']:>8.2f} {row['ttft_p99_ms']:>8.2f} {added} "
                f"{row['gap_p99_ms']:>8.2f} {cpu} "
                f"{int(row['errors']):>6}" + (f"  (CPU: {parts})" if parts else "")
            )
    lines.append("saturation (best req/s): " + ", ".join(
        f"{name} {saturation(levels):.0f}" for name, levels in report.items()
    ))  # fmt: skip
    return "\n".join(lines)


@dataclass(frozen=True, kw_only=True)
class SaturationSettings(Settings):
    """``python -m bench.saturation``: the levels, their length and the arms measured."""

    PART = "SATURATION"

    concurrency: str = setting(",".join(map(str, Plan.concurrency)), "streams in flight, per level")
    rates: str = setting(
        ",".join(map(str, Plan.rates)),
        "open-loop levels: Poisson arrivals per second (after those)",
    )
    seconds: float = setting(Plan.seconds, "per level and target")
    rounds: int = setting(Plan.rounds, "turns over the targets per level")
    output_tokens: int = setting(Plan.output_tokens, "tokens per stream")
    step_ms: float = setting(Plan.step_ms, "engine step (real)")
    workers: str = setting("1,2", "kvrouter arms with Redis: --workers of each ('' for none)")
    embedded: bool = setting(
        True, "a kvrouter arm with its own index (one process, no Redis), as each peer has"
    )
    local_index: bool = setting(
        True, "a kvrouter arm with its own index and the load shared through Redis"
    )
    peers: str = setting("smg,vllm-kv,vllm-cache", "peer arms ('' for none)")
    epp: str = setting(
        "1",
        "Envoy + kvrouter epp arms (Envoy carries the bytes, the pickers share Redis): "
        "pickers of each ('' for none)",
    )
    epp_headers: bool = setting(
        True, "each Envoy + epp arm again with only the response headers shown to the picker"
    )
    epp_tls: bool = setting(True, "Envoy reaches the pickers over TLS, as GIE gateways do")
    envoy: bool = setting(True, "an arm of Envoy alone (no picker), round robin over the engines")
    router_args: str = setting("", "extra kvrouter router flags")
    json: str | None = setting(None, "write the report here too")

    def __post_init__(self) -> None:
        named(self.peers)  # an unknown arm is refused before anything starts
        levels, rates, workers = self.levels, self.rate_levels, self.worker_counts
        positive = (
            min(levels, default=1) >= 1 and min((*workers, *self.picker_counts), default=1) >= 1
        )
        if not (levels or rates) or not positive:
            raise ConfigError("--concurrency, --workers and --epp take positive integers")
        if self.rounds < 1 or self.seconds <= 0:
            raise ConfigError("--rounds and --seconds must be positive")
        if rates and not all(0 < r < math.inf for r in rates):
            raise ConfigError("--rates takes positive numbers")

    @property
    def levels(self) -> tuple[int, ...]:
        return comma_list(self.concurrency, int)

    @property
    def rate_levels(self) -> tuple[float, ...]:
        return comma_list(self.rates, float)

    @property
    def worker_counts(self) -> tuple[int, ...]:
        return comma_list(self.workers, int)

    @property
    def picker_counts(self) -> tuple[int, ...]:
        return comma_list(self.epp, int)


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_argv(
        SaturationSettings, argv, prog="python -m bench.saturation", description=__doc__
    )
    extra = settings.router_args.split()
    peers = installed(settings.peers)
    gateways = gateway_arms(
        settings.picker_counts,
        headers_only=settings.epp_headers,
        envoy=settings.envoy,
        tls=settings.epp_tls,
    )
    levels, rates, workers = settings.levels, settings.rate_levels, settings.worker_counts
    plan = Plan(
        concurrency=levels,
        rates=rates,
        seconds=settings.seconds,
        rounds=settings.rounds,
        output_tokens=settings.output_tokens,
        step_ms=settings.step_ms,
    )
    # one process per engine; vllm-kv needs the replay's topic layout
    config = fast_engines(
        plan.step_ms,
        plan.time_scale,
        routers=0,
        replica_args=("--replay-layout", "topic"),
        replica_processes=True,
    )
    with LocalStack(config).start() as stack:
        targets: dict[str, list[str]] = {DIRECT: stack.layout.replica_urls}
        pids: dict[str, dict[str, list[int]]] = {}

        for count in workers:
            name = f"kvrouter-w{count}"
            targets[name] = [start_kvrouter(stack, name, workers=count, extra=extra)]
            pids[name] = router_part(stack.processes.pid(name))
        if settings.local_index:
            targets[LOCAL_INDEX] = [
                start_kvrouter(stack, LOCAL_INDEX, workers=1, extra=extra, local_index=True)
            ]
            pids[LOCAL_INDEX] = router_part(stack.processes.pid(LOCAL_INDEX))
        if settings.embedded:
            targets[EMBEDDED] = [start_kvrouter(stack, EMBEDDED, workers=None, extra=extra)]
            pids[EMBEDDED] = router_part(stack.processes.pid(EMBEDDED))
        for name, url in start_peers(stack, peers).items():
            targets[name] = [url]
            pids[name] = router_part(stack.processes.pid(name))
        for arm in gateways:
            url, pids[arm.name] = start_gateway(stack, arm, extra=extra)
            targets[arm.name] = [url]
        report = asyncio.run(drive(targets, pids, plan))
    print(render(report))
    if settings.json:
        meta: dict[str, Any] = {
            "plan": {
                **plan.__dict__,
                "concurrency": list(plan.concurrency),
                "rates": list(plan.rates),
            },
            "cores": os.cpu_count(),
            "saturation": {name: saturation(levels) for name, levels in report.items()},
        }
        Path(settings.json).write_text(json.dumps({**meta, "targets": report}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
