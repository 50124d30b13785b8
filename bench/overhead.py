"""What each router adds to a lone request: kvrouter (with Redis, embedded) and the real peers
against the engine itself, in front of the same two fast simulated engines.

Round after round the same kind of request, a group's cached system prompt and a new
question, goes one at a time straight to an engine and through each router in a shuffled
order. Reported per target: its TTFT, what it adds over the direct request of the same round
(a paired difference; p50, p90 and p99, real ms) and the router process's CPU per request (every
thread, from /proc). Method and results: docs/results.md ("Against the peers, one request at
a time").

    python -m bench.overhead [--rounds 300] [--peers smg,vllm-kv,vllm-cache] [--epp 1,2]
        [--no-epp-headers] [--no-envoy] [--prompt-tokens 8000] [--json FILE]

The gateway arms (:mod:`bench.gateway`): ``envoy`` is a real Envoy alone, the client naming
the round's engine (the direct request's) in ``x-gateway-destination-endpoint``;
``envoy+epp`` the same Envoy asking ``kvrouter epp`` over ext_proc, every response chunk
through the picker; ``-hdr`` with only the response headers shown to it. Each one's paired
difference over ``envoy`` is the picker's own time in a request's TTFT; the routers' own
decision time is read from their ``x-kvrouter-decision-ms`` answers.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import statistics
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NamedTuple

import aiohttp

from bench.dynamo.arm import DynamoArm
from bench.gateway import ENVOY, gateway_arms, start_gateway
from bench.peers import PEERS, Worker, executable, installed, named
from bench.proxy_load import cpu_of, cpu_parts, cpu_row, router_part
from bench.stack.config import StackConfig
from bench.stack.envoy import DESTINATION_HEADER
from bench.stack.layout import kvrouter_bin
from bench.stack.local import LocalStack
from bench.stack.ports import free_ports
from bench.workloads import text
from publishers.config import EngineShape
from router.http.proxy import DECISION_HEADER
from tracker.framework.cli import parse_argv
from tracker.framework.errors import ConfigError
from tracker.framework.settings import Settings, comma_list, setting

PATH: Final = "/v1/chat/completions"
DIRECT: Final = "direct"
QUESTION_CHARS: Final = 150
PROMPT_TOKENS: Final = 4_950  # a 4,800-token system prompt and the question


class Sample(NamedTuple):
    """One request: the milliseconds to its first content chunk, and the router's own
    decision time when it said (``x-kvrouter-decision-ms``)."""

    ttft_ms: float
    decision_ms: float | None = None


async def first_chunk(
    client: aiohttp.ClientSession,
    url: str,
    system: str,
    question: str,
    output_tokens: int = 64,
    *,
    headers: Mapping[str, str] | None = None,
) -> Sample:
    """Send one streamed chat request (with ``headers``); when its first content chunk came."""
    body = {
        "model": "default",
        "max_tokens": output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    }
    sent = time.perf_counter()
    first: float | None = None
    async with client.post(url + PATH, json=body, headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {await response.text()}")
        decision = response.headers.get(DECISION_HEADER)
        async for chunk in response.content.iter_any():
            if first is None and b'"choices":[{' in chunk:
                first = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{url}: the stream had no content chunk")
    return Sample((first - sent) * 1000, None if decision is None else float(decision))


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _spread(values: Sequence[float], key: str) -> dict[str, float]:
    """``{key}_p50_ms``, ``_p90_ms`` and ``_p99_ms`` of ``values``."""
    return {
        f"{key}_p50_ms": statistics.median(values),
        f"{key}_p90_ms": quantile(values, 0.9),
        f"{key}_p99_ms": quantile(values, 0.99),
    }


async def measure(
    targets: dict[str, str],
    engines: Sequence[str],
    *,
    rounds: int,
    groups: int,
    seed: int,
    pids: Mapping[str, Mapping[str, Sequence[int]]] | None = None,
    output_tokens: int = 64,
    prompt_tokens: int = PROMPT_TOKENS,
    pinned: Collection[str] = (),
    baselines: Mapping[str, str] | None = None,
) -> dict[str, dict[str, float]]:
    """Round after round, one request straight to an engine and one through each target.

    :param pids: a target's processes by part (``router``; ``epp`` and ``envoy``): a row's
        ``cpu_ms_per_request`` sums them, ``cpu_<part>_ms_per_request`` (not ``router``)
        is each one's.
    :param prompt_tokens: a request's system prompt and question (the builtin byte-level
        tokenizer: one token a character), of which the question is :data:`QUESTION_CHARS`.
    :param pinned: targets the client names the round's engine to (the direct request's)
        in ``x-gateway-destination-endpoint``: Envoy alone.
    :param baselines: a target's paired difference over another's (``added_over_<that>``),
        e.g. Envoy with the picker over Envoy alone: the picker's own time.
    """
    rng = random.Random(seed)
    system_chars = max(prompt_tokens - QUESTION_CHARS, 1)
    systems = [text(rng, system_chars) for _ in range(groups)]
    baselines = dict(baselines or {})
    times: dict[str, list[float]] = {name: [] for name in (DIRECT, *targets)}
    decisions: dict[str, list[float]] = {name: [] for name in targets}
    added: dict[str, list[float]] = {name: [] for name in targets}
    over: dict[str, list[float]] = {name: [] for name in baselines}
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)
    async with aiohttp.ClientSession(connector=connector) as client:
        for system in systems:  # every prefix on every engine: every request below hits
            for engine in engines:
                await first_chunk(client, engine, system, text(rng, QUESTION_CHARS))
        for url in targets.values():  # connections opened, tokenizer caches warm
            for system in systems:
                await first_chunk(client, url, system, text(rng, QUESTION_CHARS))
        parts = {name: dict(by_part) for name, by_part in (pids or {}).items() if by_part}
        cpu = {name: cpu_of(by_part) for name, by_part in parts.items()}
        for i in range(rounds):
            system = systems[i % groups]
            engine = engines[i % len(engines)]
            pin = {DESTINATION_HEADER: engine.removeprefix("http://")}
            order = [DIRECT, *targets]
            rng.shuffle(order)
            took: dict[str, float] = {}
            for name in order:
                url = engine if name == DIRECT else targets[name]
                sample = await first_chunk(
                    client,
                    url,
                    system,
                    text(rng, QUESTION_CHARS),
                    output_tokens,
                    headers=pin if name in pinned else None,
                )
                took[name] = sample.ttft_ms
                times[name].append(sample.ttft_ms)
                if sample.decision_ms is not None and name != DIRECT:
                    decisions[name].append(sample.decision_ms)
            for name in targets:
                added[name].append(took[name] - took[DIRECT])
            for name, base in baselines.items():
                over[name].append(took[name] - took[base])
        used = {name: cpu_of(by_part) for name, by_part in parts.items()}
    spent = {name: {part: used[name][part] - cpu[name][part] for part in cpu[name]} for name in cpu}
    report: dict[str, dict[str, float]] = {}
    for name, values in times.items():
        row = _spread(values, "ttft")
        if name in added:
            row |= _spread(added[name], "added")
        if name in over:
            row |= _spread(over[name], f"added_over_{baselines[name]}")
        if decisions.get(name):
            row |= _spread(decisions[name], "decision")
        report[name] = row | cpu_row(spent.get(name, {}), rounds)
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
        urls[name] = f"http://127.0.0.1:{port}"
        if isinstance(arm, DynamoArm):  # its frontend (process `name`) and its adapters
            arm.start(stack, [(name, port)])
            continue
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
    epp: str = setting(
        "1",
        "Envoy + kvrouter epp arms (Envoy carries the bytes, the pickers share Redis): "
        "pickers of each ('' for none)",
    )
    epp_headers: bool = setting(
        True, "each Envoy + epp arm again with only the response headers shown to the picker"
    )
    epp_tls: bool = setting(True, "Envoy reaches the pickers over TLS, as GIE gateways do")
    envoy: bool = setting(
        True,
        "an arm of Envoy alone, the client naming the round's engine in its header: the "
        "Envoy + epp arms' paired difference over it is the picker's own time",
    )
    prompt_tokens: int = setting(PROMPT_TOKENS, "per request: the system prompt and a question")
    seed: int = setting(1, "request order and question seed")
    json: str | None = setting(None, "write the report here too")

    def __post_init__(self) -> None:
        named(self.peers)  # an unknown arm is refused before anything starts
        if min(self.picker_counts, default=1) < 1:
            raise ConfigError("--epp takes positive integers")
        if self.prompt_tokens <= QUESTION_CHARS:
            raise ConfigError(f"--prompt-tokens must exceed the question's {QUESTION_CHARS}")

    @property
    def picker_counts(self) -> tuple[int, ...]:
        return comma_list(self.epp, int)


def engine_blocks(groups: int, prompt_tokens: int, block_size: int) -> int:
    """KV blocks per engine that hold every group's prompt and the questions between two
    requests of a group (the engine's LRU would otherwise evict the prompt due next)."""
    return max(EngineShape.num_blocks, groups * math.ceil(prompt_tokens / block_size) + 2048)


def render(report: dict[str, dict[str, float]]) -> str:
    """The report as a plain-text table, one line per target (then the paired differences
    over a baseline, and the parts of each target's CPU)."""
    lines = [
        f"{'target':<18} {'TTFT p50':>9} {'p90':>7} {'p99':>7} {'added p50':>10} {'p90':>7} "
        f"{'p99':>7} {'decision p50':>13} {'p99':>6} {'CPU/request':>12}  (real ms)"
    ]
    notes = []
    for name, row in report.items():
        added = (
            f"{row['added_p50_ms']:>+10.2f} {row['added_p90_ms']:>+7.2f} "
            f"{row['added_p99_ms']:>+7.2f}"
            if "added_p50_ms" in row
            else f"{'':>10} {'':>7} {'':>7}"
        )
        decision = (
            f"{row['decision_p50_ms']:>13.2f} {row['decision_p99_ms']:>6.2f}"
            if "decision_p50_ms" in row
            else f"{'':>13} {'':>6}"
        )
        cpu = f"{row['cpu_ms_per_request']:>12.2f}" if "cpu_ms_per_request" in row else ""
        lines.append(
            f"{name:<18} {row['ttft_p50_ms']:>9.2f} {row['ttft_p90_ms']:>7.2f} "
            f"{row['ttft_p99_ms']:>7.2f} {added} {decision} {cpu}"
        )
        for key in row:
            if key.startswith("added_over_") and key.endswith("_p50_ms"):
                base = key.removeprefix("added_over_").removesuffix("_p50_ms")
                spread = " / ".join(
                    f"{row[f'added_over_{base}_{q}_ms']:+.2f}" for q in ("p50", "p90", "p99")
                )
                notes.append(f"{name} over {base}, paired per round, p50 / p90 / p99: {spread}")
        parts = cpu_parts(row)
        if parts:
            notes.append(f"{name} CPU per request: {parts}")
    return "\n".join(lines + notes)


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_argv(
        OverheadSettings, argv, prog="python -m bench.overhead", description=__doc__
    )
    router_args = tuple(settings.router_args.split())
    peers = installed(settings.peers)
    gateways = gateway_arms(
        settings.picker_counts,
        headers_only=settings.epp_headers,
        envoy=settings.envoy,
        tls=settings.epp_tls,
    )
    config = StackConfig(
        replicas=2,
        routers=1,
        haproxy=False,
        time_scale=settings.time_scale,
        num_blocks=engine_blocks(settings.groups, settings.prompt_tokens, StackConfig.block_size),
        router_args=router_args,
        replica_args=("--replay-layout", "topic"),
    )
    with LocalStack(config).start() as stack:
        targets = {"kvrouter": stack.layout.router_urls[0]}
        pids = {"kvrouter": router_part(stack.processes.pid("router-0"))}
        if settings.embedded:
            targets[EMBEDDED] = start_kvrouter(stack, EMBEDDED, workers=None, extra=router_args)
            pids[EMBEDDED] = router_part(stack.processes.pid(EMBEDDED))
        targets |= start_peers(stack, peers)
        pids |= {name: router_part(stack.processes.pid(name)) for name in peers}
        for arm in gateways:
            targets[arm.name], pids[arm.name] = start_gateway(stack, arm, extra=router_args)
        alone = [arm.name for arm in gateways if arm.pickers == 0]
        baselines = {arm.name: ENVOY for arm in gateways if arm.pickers and alone}
        report = asyncio.run(
            measure(
                targets,
                stack.layout.replica_urls,
                rounds=settings.rounds,
                groups=settings.groups,
                seed=settings.seed,
                pids=pids,
                output_tokens=settings.output_tokens,
                prompt_tokens=settings.prompt_tokens,
                pinned=alone,
                baselines=baselines,
            )
        )
    print(render(report))
    if settings.json:
        meta: dict[str, Any] = {
            "rounds": settings.rounds,
            "time_scale": settings.time_scale,
            "prompt_tokens": settings.prompt_tokens,
            "cores": os.cpu_count(),
        }
        Path(settings.json).write_text(json.dumps({**meta, "targets": report}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
