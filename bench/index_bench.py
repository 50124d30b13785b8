"""Index benchmark: ingest throughput, lookup latency and Redis memory per (block, replica).

Run: ``.venv/bin/python -m bench.index_bench`` (starts its own redis-server on loopback, or
pass ``--redis URL``). Reports one JSON document and a table; targets are from issue 2:
>= 100,000 blocks/s into Redis per tracker process, lookup p99 <= 1 ms for a 512-block chain
over 8 replicas, <= 100 bytes of Redis memory per (block, replica).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import redis as redis_sync

from bench.procs import RedisServer
from tracker.blocks import Namespace, block_keys
from tracker.events import (
    BlockStored,
    EventBatch,
    ExternalHash,
    WireEra,
    decode_batch,
    encode_batch,
)
from tracker.index import BlockIndex, MemoryIndex
from tracker.redis_index import RedisIndex

NAMESPACE = Namespace("bench-model", 16)


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


async def lookup_latency(
    index: BlockIndex, chain_blocks: int, replicas: int, iterations: int, seed: int
) -> dict[str, float]:
    """Latency of looking up a chain of ``chain_blocks`` that ``replicas`` hold to varying depth."""
    rng = random.Random(seed)
    bs = NAMESPACE.block_size
    tokens = [rng.randrange(128_000) for _ in range(chain_blocks * bs)]
    for r in range(replicas):
        depth = chain_blocks if r == 0 else rng.randrange(1, chain_blocks)
        hashes: list[ExternalHash] = [rng.getrandbits(64) for _ in range(depth)]
        batch = EventBatch(time.time(), [BlockStored(hashes, None, tokens[: depth * bs], bs)], 0)
        await index.apply(f"lookup-{r}", NAMESPACE, batch)
    keys = block_keys(tokens, NAMESPACE)
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


async def memory_per_block(url: str, blocks: int) -> float:
    """Redis bytes per block for ``blocks`` distinct blocks on ONE replica (no sharing)."""
    payloads, _ = workload(
        replicas=1, groups=blocks // 64, prefix_blocks=64, suffixes=0, suffix_blocks=0, seed=3
    )
    with redis_sync.Redis.from_url(url) as client:
        client.flushall()
        before = int(client.info("memory")["used_memory"])
    index = RedisIndex.from_url(url)
    await ingest(index, payloads)
    await index.close()
    with redis_sync.Redis.from_url(url) as client:
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


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    payloads, pairs = workload(
        replicas=args.replicas,
        groups=args.groups,
        prefix_blocks=args.prefix_blocks,
        suffixes=args.suffixes,
        suffix_blocks=args.suffix_blocks,
        seed=1,
    )
    results: dict[str, Any] = {"pairs": pairs, "replicas": args.replicas}
    results["block_keys_per_ms"] = key_chain_rate(4096)

    memory = MemoryIndex()
    seconds = await ingest(memory, payloads)
    results["embedded"] = {
        "ingest_blocks_per_s": pairs / seconds,
        "lookup": await lookup_latency(memory, 512, 8, args.iterations, 2),
    }

    server = None if args.redis else RedisServer().start()
    url = args.redis or server.url  # type: ignore[union-attr]
    try:
        with redis_sync.Redis.from_url(url) as client:
            client.flushall()
            before = int(client.info("memory")["used_memory"])
        index = RedisIndex.from_url(url)
        seconds = await ingest(index, payloads)
        with redis_sync.Redis.from_url(url) as client:
            after = int(client.info("memory")["used_memory"])
        lookup = await lookup_latency(index, 512, 8, args.iterations, 2)
        await index.close()
        results["redis"] = {
            "ingest_blocks_per_s": pairs / seconds,
            "lookup": lookup,
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


def report(results: dict[str, Any]) -> str:
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
    ]
    for n, value in red["bytes_per_block_one_replica"].items():
        rows.append(
            (f"  one replica, {int(n):,} unshared blocks: bytes/block", f"{value:.1f}", "-")
        )
    width = max(len(r[0]) for r in rows)
    lines = [f"{'metric':<{width}}  {'measured':>20}  target", "-" * (width + 36)]
    lines += [f"{name:<{width}}  {value:>20}  {target}" for name, value, target in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis", help="Redis URL (default: start a private redis-server)")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--groups", type=int, default=400)
    parser.add_argument("--prefix-blocks", type=int, default=128)
    parser.add_argument("--suffixes", type=int, default=8)
    parser.add_argument("--suffix-blocks", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--json", type=Path, default=Path("bench/results/index.json"))
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(report(results))
    print(f"\nwritten {args.json}")


if __name__ == "__main__":
    main()
