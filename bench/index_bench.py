"""Index benchmark: ingest throughput, lookup latency, Redis memory per (block, replica), and
what one Redis primary serves (blocks applied and router requests per Redis core-second).

Run: ``.venv/bin/python -m bench.index_bench`` (starts its own redis-server on loopback, or
pass ``--redis URL``). Reports one JSON document and a table; the targets:
>= 100,000 blocks/s into Redis per tracker process, lookup p99 <= 1 ms for a 512-block chain
over 8 replicas, <= 100 bytes of Redis memory per (block, replica).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from bench.stack.redis_servers import RedisServer, sync_redis
from tracker.core.backends import open_index
from tracker.core.blocks import Namespace, block_keys
from tracker.core.event_codec import WireEra, decode_batch, encode_batch
from tracker.core.events import BlockStored, EventBatch, ExternalHash
from tracker.core.index import BlockIndex, Route
from tracker.core.keys import home_anchors
from tracker.core.redis_index import RedisIndex
from tracker.framework.cli import parse_argv
from tracker.framework.settings import Settings, setting

NAMESPACE = Namespace("bench-model", 16)
CAPACITY_CASES: Final = (
    (128, 0.1, True),
    (128, 1.0, False),
    (512, 0.1, True),
    (512, 1.0, False),
    (6400, 0.02, True),  # a growing session: ~2k new tokens of 100k
    (6400, 0.1, True),
    (6400, 1.0, False),
)
"""(prompt blocks, share of them new, held by a replica): hits and misses of 2k-100k tokens."""


def workload(
    *, replicas: int, groups: int, prefix_blocks: int, suffixes: int, suffix_blocks: int, seed: int
) -> tuple[dict[str, list[bytes]], int]:
    """Encoded event batches per replica, shaped like vLLM prefill events.

    Each group is a shared prefix of ``prefix_blocks`` blocks stored on a few replicas, plus
    ``suffixes`` distinct continuations of ``suffix_blocks`` blocks each on one of them.
    Returns the payloads per replica and the number of (block, replica) pairs stored.
    """
    rng = random.Random(seed)
    bs = NAMESPACE.block_size
    out: dict[str, list[bytes]] = {f"replica-{r}": [] for r in range(replicas)}
    pairs = 0
    for group in range(groups):
        prefix = [rng.randrange(128_000) for _ in range(prefix_blocks * bs)]
        holders = rng.sample(sorted(out), k=min(replicas, 1 + group % 3))
        for replica in holders:
            hashes: list[ExternalHash] = [rng.getrandbits(64) for _ in range(prefix_blocks)]
            events: list[Any] = [BlockStored(hashes, None, prefix, bs, medium="GPU")]
            for _ in range(suffixes):
                suffix = [rng.randrange(128_000) for _ in range(suffix_blocks * bs)]
                own: list[ExternalHash] = [rng.getrandbits(64) for _ in range(suffix_blocks)]
                events.append(BlockStored(own, hashes[-1], suffix, bs, medium="GPU"))
                pairs += suffix_blocks
            pairs += prefix_blocks
            batch = EventBatch(time.time(), events, 0)
            out[replica].append(encode_batch(batch, WireEra.V0_24_0))
    return out, pairs


async def ingest(index: BlockIndex, payloads: dict[str, list[bytes]]) -> float:
    """Decode and apply every batch, one task per replica as the tracker does; returns seconds."""

    async def consume(replica: str, batches: list[bytes]) -> None:
        for seq, payload in enumerate(batches):
            await index.apply(replica, NAMESPACE, decode_batch(payload), seq=seq)

    start = time.perf_counter()
    await asyncio.gather(*(consume(r, p) for r, p in payloads.items()))
    return time.perf_counter() - start


async def place_chain(
    index: BlockIndex, chain_blocks: int, replicas: int, rng: random.Random, prefix: str
) -> list[int]:
    """A random prompt of ``chain_blocks`` blocks, stored whole on ``{prefix}-0`` and to a
    random depth on the other replicas; returns its block keys."""
    bs = NAMESPACE.block_size
    tokens = [rng.randrange(128_000) for _ in range(chain_blocks * bs)]
    for r in range(replicas):
        depth = chain_blocks if r == 0 else rng.randrange(1, chain_blocks)
        hashes: list[ExternalHash] = [rng.getrandbits(64) for _ in range(depth)]
        batch = EventBatch(time.time(), [BlockStored(hashes, None, tokens[: depth * bs], bs)], 0)
        await index.apply(f"{prefix}-{r}", NAMESPACE, batch)
    return block_keys(tokens, NAMESPACE)


async def lookup_latency(
    index: BlockIndex, chain_blocks: int, replicas: int, iterations: int, seed: int
) -> dict[str, float]:
    """Latency of looking up a chain of ``chain_blocks`` that ``replicas`` hold to varying depth."""
    keys = await place_chain(index, chain_blocks, replicas, random.Random(seed), "lookup")
    samples = []
    for _ in range(iterations):
        start = time.perf_counter()
        matches = await index.lookup(NAMESPACE, keys)
        samples.append(time.perf_counter() - start)
    assert matches[f"lookup-{0}"].blocks == chain_blocks, matches
    samples.sort()
    return {
        "p50_ms": samples[len(samples) // 2] * 1e3,
        "p99_ms": samples[int(len(samples) * 0.99)] * 1e3,
        "mean_ms": statistics.fmean(samples) * 1e3,
    }


def redis_cpu_s(url: str) -> float:
    """CPU seconds the redis-server process has used (user + system), from ``INFO cpu``."""
    with sync_redis(url) as client:
        info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def request_capacity(
    index: RedisIndex,
    url: str,
    chain_blocks: int,
    *,
    new_share: float,
    concurrency: int,
    seconds: float,
    held: bool = True,
) -> dict[str, float]:
    """What one Redis primary serves of the router's per-request work: the lookup with every
    router's load (one ``EVALSHA``) and the routing write (one more: predictions for the
    ``new_share`` of the prompt's blocks the chosen replica does not hold yet, as the router
    predicts only those, and the home claim at the chain's anchors), for a prompt of
    ``chain_blocks`` blocks that 8 replicas hold to varying depth (replica 0 whole), or, not
    ``held``, that no replica holds (a miss: the lookup stops at the first block).

    The lookups run for half of ``seconds``, then the routing writes, each with its own Redis
    CPU from ``INFO cpu`` (the client here shares the machine, so requests/s is what this
    client reached; ``capacity_per_s`` is what one Redis core would serve: requests over
    Redis CPU seconds)."""
    rng = random.Random(chain_blocks)
    if held:
        keys = await place_chain(index, chain_blocks, 8, rng, "capacity")
    else:
        await place_chain(index, chain_blocks, 8, rng, "capacity")  # other prompts, cached
        keys = [rng.getrandbits(64) for _ in range(chain_blocks)]
    anchors = [keys[p] for p in home_anchors(len(keys))]
    new = keys[len(keys) - max(1, round(len(keys) * new_share)) :]
    loop = asyncio.get_running_loop()

    async def timed(step: Callable[[int], Awaitable[object]]) -> tuple[int, float, float]:
        done = 0
        deadline = loop.time() + seconds / 2

        async def client(n: int) -> None:
            nonlocal done
            while loop.time() < deadline:
                await step(n)
                done += 1

        cpu, start = redis_cpu_s(url), time.perf_counter()
        await asyncio.gather(*(client(n) for n in range(concurrency)))
        return done, time.perf_counter() - start, redis_cpu_s(url) - cpu

    looked, lookup_wall, lookup_cpu = await timed(
        lambda n: index.survey(NAMESPACE, keys, load_except=f"bench-router-{n}")
    )
    routed, route_wall, route_cpu = await timed(
        lambda n: index.route(NAMESPACE, Route(f"capacity-{n % 8}", new, 3.0, anchors, 60.0))
    )
    per_request = lookup_cpu / looked + route_cpu / routed
    wall = lookup_wall / looked + route_wall / routed
    return {
        "chain_blocks": chain_blocks,
        "held": held,
        "new_share": new_share,
        "new_blocks": len(new),
        "requests_per_s": 1 / wall,
        "lookup_redis_cpu_ms": lookup_cpu * 1e3 / looked,
        "route_redis_cpu_ms": route_cpu * 1e3 / routed,
        "redis_cpu_ms_per_request": per_request * 1e3,
        "capacity_per_s": 1 / per_request if per_request > 0 else float("inf"),
        "lookups_per_redis_core_s": looked / lookup_cpu if lookup_cpu > 0 else float("inf"),
        "redis_cpu_share": (lookup_cpu + route_cpu) / (lookup_wall + route_wall),
    }


async def memory_per_block(url: str, blocks: int) -> float:
    """Redis bytes per block for ``blocks`` distinct blocks on ONE replica (no sharing)."""
    payloads, _ = workload(
        replicas=1, groups=blocks // 64, prefix_blocks=64, suffixes=0, suffix_blocks=0, seed=3
    )
    with sync_redis(url) as client:
        client.flushall()
        before = int(client.info("memory")["used_memory"])
    index = open_index(url)
    await ingest(index, payloads)
    await index.close()
    with sync_redis(url) as client:
        after = int(client.info("memory")["used_memory"])
        client.flushall()
    return (after - before) / (blocks // 64 * 64)


def key_chain_rate(blocks: int) -> float:
    """Block keys hashed per millisecond (the router runs this on every request)."""
    tokens = list(range(blocks * NAMESPACE.block_size))
    start = time.perf_counter()
    for _ in range(10):
        block_keys(tokens, NAMESPACE)
    return blocks * 10 / ((time.perf_counter() - start) * 1e3)


@dataclass(frozen=True, kw_only=True)
class IndexBenchSettings(Settings):
    """``python -m bench.index_bench``: the workload's size and how long each stage runs."""

    PART = "INDEX_BENCH"

    redis: str | None = setting(None, "Redis URL (default: start a private redis-server)")
    replicas: int = setting(8, "replicas the blocks are stored on")
    groups: int = setting(400, "shared prefixes")
    prefix_blocks: int = setting(128, "blocks of each shared prefix")
    suffixes: int = setting(8, "continuations of each prefix")
    suffix_blocks: int = setting(16, "blocks of each continuation")
    iterations: int = setting(2000, "lookups timed per index")
    concurrency: int = setting(4, "router requests in flight (capacity stage)")
    seconds: float = setting(5.0, "length of each capacity run")
    max_chain_blocks: int = setting(6400, "longest prompt of the capacity runs, in blocks")
    capacity_only: bool = setting(False, "run the capacity stage alone (no ingest, no memory)")
    json: str = setting("bench/results/index.json", "where the JSON document goes")


async def capacity_runs(
    index: RedisIndex, url: str, settings: IndexBenchSettings
) -> list[dict[str, float]]:
    """Every capacity case of :data:`CAPACITY_CASES` up to ``settings.max_chain_blocks``."""
    return [
        await request_capacity(
            index,
            url,
            blocks,
            new_share=share,
            concurrency=settings.concurrency,
            seconds=settings.seconds,
            held=held,
        )
        for blocks, share, held in CAPACITY_CASES
        if blocks <= settings.max_chain_blocks
    ]


async def capacity_alone(
    settings: IndexBenchSettings, payloads: dict[str, list[bytes]]
) -> list[dict[str, float]]:
    """The capacity stage over the fleet workload's index, nothing else."""
    server = None if settings.redis else RedisServer().start()
    url = settings.redis or server.url  # type: ignore[union-attr]
    try:
        with sync_redis(url) as client:
            client.flushall()
        index = open_index(url)
        await ingest(index, payloads)
        assert isinstance(index, RedisIndex)
        requests = await capacity_runs(index, url, settings)
        await index.close()
        return requests
    finally:
        if server is not None:
            server.close()


async def main_async(settings: IndexBenchSettings) -> dict[str, Any]:
    payloads, pairs = workload(
        replicas=settings.replicas,
        groups=settings.groups,
        prefix_blocks=settings.prefix_blocks,
        suffixes=settings.suffixes,
        suffix_blocks=settings.suffix_blocks,
        seed=1,
    )
    results: dict[str, Any] = {"pairs": pairs, "replicas": settings.replicas}
    if settings.capacity_only:
        results["requests"] = await capacity_alone(settings, payloads)
        return results
    results["block_keys_per_ms"] = key_chain_rate(4096)

    memory = open_index(None)
    seconds = await ingest(memory, payloads)
    results["embedded"] = {
        "ingest_blocks_per_s": pairs / seconds,
        "lookup": await lookup_latency(memory, 512, 8, settings.iterations, 2),
    }

    server = None if settings.redis else RedisServer().start()
    url = settings.redis or server.url  # type: ignore[union-attr]
    try:
        with sync_redis(url) as client:
            client.flushall()
            before = int(client.info("memory")["used_memory"])
        index = open_index(url)
        cpu = redis_cpu_s(url)
        seconds = await ingest(index, payloads)
        ingest_cpu = redis_cpu_s(url) - cpu
        with sync_redis(url) as client:
            after = int(client.info("memory")["used_memory"])
        lookup = await lookup_latency(index, 512, 8, settings.iterations, 2)
        assert isinstance(index, RedisIndex)
        capacity = await capacity_runs(index, url, settings)
        await index.close()
        results["redis"] = {
            "ingest_blocks_per_s": pairs / seconds,
            "ingest_redis_cpu_us_per_block": ingest_cpu * 1e6 / pairs,
            "ingest_capacity_blocks_per_s": pairs / ingest_cpu if ingest_cpu > 0 else None,
            "lookup": lookup,
            "requests": capacity,
            "bytes_per_block_replica": (after - before) / pairs,
            "used_memory_delta_bytes": after - before,
            "bytes_per_block_one_replica": {
                str(n): await memory_per_block(url, n) for n in (10_000, 100_000, 1_000_000)
            },
        }
    finally:
        if server is not None:
            server.close()
    return results


def capacity_rows(requests: Sequence[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """The capacity stage's rows: Redis CPU of the lookup and of the routing write."""
    rows = []
    for cap in requests:
        case = "a hit" if cap.get("held", True) else "a miss"
        rows.append(
            (
                f"router request, {cap['chain_blocks']:,}-block prompt, {case}, "
                f"{cap['new_share']:.0%} new: Redis CPU ms lookup + route = total / "
                "requests per Redis core-second",
                f"{cap.get('lookup_redis_cpu_ms', 0):.3f} + {cap.get('route_redis_cpu_ms', 0):.3f}"
                f" = {cap['redis_cpu_ms_per_request']:.3f} / {cap['capacity_per_s']:,.0f}",
                ">= 1,000 at 6,400 blocks" if cap["chain_blocks"] >= 6400 else "-",
            )
        )
    return rows


def report(results: dict[str, Any]) -> str:
    if "requests" in results:  # the capacity stage alone
        return _table(capacity_rows(results["requests"]))
    emb, red = results["embedded"], results["redis"]
    rows = [
        ("block keys hashed per ms", f"{results['block_keys_per_ms']:,.0f}", "thousands"),
        ("ingest, embedded (blocks/s)", f"{emb['ingest_blocks_per_s']:,.0f}", "-"),
        ("ingest, Redis (blocks/s)", f"{red['ingest_blocks_per_s']:,.0f}", ">= 100,000"),
        (
            "lookup 512 blocks x 8 replicas, embedded p50/p99 (ms)",
            f"{emb['lookup']['p50_ms']:.3f} / {emb['lookup']['p99_ms']:.3f}",
            "-",
        ),
        (
            "lookup 512 blocks x 8 replicas, Redis p50/p99 (ms)",
            f"{red['lookup']['p50_ms']:.3f} / {red['lookup']['p99_ms']:.3f}",
            "p99 <= 1",
        ),
        ("Redis bytes per (block, replica)", f"{red['bytes_per_block_replica']:.1f}", "<= 100"),
        (
            "ingest: Redis CPU per block (us) / blocks per Redis core-second",
            f"{red['ingest_redis_cpu_us_per_block']:.2f} / "
            f"{red['ingest_capacity_blocks_per_s'] or 0:,.0f}",
            "-",
        ),
    ]
    rows += capacity_rows(red["requests"])
    for n, value in red["bytes_per_block_one_replica"].items():
        rows.append(
            (f"  one replica, {int(n):,} unshared blocks: bytes/block", f"{value:.1f}", "-")
        )
    return _table(rows)


def _table(rows: Sequence[tuple[str, str, str]]) -> str:
    width = max(len(r[0]) for r in rows)
    lines = [f"{'metric':<{width}}  {'measured':>24}  target", "-" * (width + 40)]
    lines += [f"{name:<{width}}  {value:>24}  {target}" for name, value, target in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_argv(IndexBenchSettings, argv, description=__doc__.split("\n")[0])
    results = asyncio.run(main_async(settings))
    path = Path(settings.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print(report(results))
    print(f"\nwritten {settings.json}")


if __name__ == "__main__":
    main()
