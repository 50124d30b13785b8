"""Engine ↔ index consistency: what the tracker indexes equals what the engines really cache.

Simulated engines (real paged caches under eviction pressure) publish over real ZeroMQ
sockets; a real tracker service consumes them into a RedisIndex on a real redis-server. At
quiescence, each replica's blocks in Redis must equal the engine's actual prefix-cache
content translated into kvrouter block keys — exactly, with nothing missing and nothing
stale — including after a live message was lost and had to be replayed.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from publishers.sim.cache import CachedBlock
from publishers.sim.engine import EngineConfig, GenerationRequest, SimulatedEngine
from publishers.zmq import ZmqEventPublisher
from tracker.core.blocks import Namespace, block_keys, own_extra_keys
from tracker.core.keys import NamespaceKeys, bucket_entries
from tracker.core.redis_index import RedisIndex
from tracker.ingest.config import TrackerSettings
from tracker.ingest.service import TrackerService

NAMESPACE = Namespace("consistency-model", 16)


@dataclass
class Replica:
    id: str
    engine: SimulatedEngine
    publisher: ZmqEventPublisher


def expected_keys(blocks: dict[int, CachedBlock]) -> set[int]:
    """kvrouter keys of every block in an engine's prefix cache (full token prefix per block)."""
    keys: dict[int, int] = {}

    def key_of(engine_hash: int) -> int:
        if engine_hash in keys:
            return keys[engine_hash]
        block = blocks[engine_hash]
        parent = None if block.parent_hash is None else key_of(block.parent_hash)
        ns = Namespace(NAMESPACE.model, NAMESPACE.block_size, block.lora_name)
        extra = own_extra_keys(
            block.lora_name, None if block.extra_keys is None else [block.extra_keys]
        )
        keys[engine_hash] = block_keys(list(block.token_ids), ns, parent=parent, extra_keys=extra)[
            0
        ]
        return keys[engine_hash]

    return {key_of(h) for h in blocks}


async def indexed_keys(client: aioredis.Redis, index: RedisIndex, replica: str) -> set[int]:
    """Every block key whose Redis bucket lists ``replica``."""
    rid = await index.writer.rid(replica, NAMESPACE)
    nk = NamespaceKeys(NAMESPACE)
    held: set[int] = set()
    async for bucket in client.scan_iter(match=f"{nk.block_prefix}*", count=1000):
        for field, value in (await client.hgetall(bucket)).items():
            if any(entry == rid for entry, _ in bucket_entries(value)):
                held.add(int.from_bytes(field, "big"))
    return held


@pytest.fixture
async def fleet() -> AsyncIterator[list[Replica]]:
    replicas = []
    for i in range(2):
        publisher = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        config = EngineConfig(
            model=NAMESPACE.model,
            block_size=16,
            num_blocks=96,
            time_scale=0.001,
            max_num_batched_tokens=512,
        )
        engine = SimulatedEngine(config, publisher)
        await engine.start()
        replicas.append(Replica(f"engine-{i}", engine, publisher))
    yield replicas
    for replica in replicas:
        await replica.engine.stop()
        replica.publisher.close()


async def drive(replicas: list[Replica], rng: random.Random, requests: int) -> None:
    """Shared prefixes, distinct suffixes, more distinct blocks than the caches hold."""
    prefixes = [
        [rng.randrange(1, 50_000) for _ in range(16 * rng.randint(2, 12))] for _ in range(8)
    ]

    async def one(n: int) -> None:
        replica = rng.choice(replicas)
        prompt = rng.choice(prefixes) + [
            rng.randrange(1, 50_000) for _ in range(rng.randint(1, 60))
        ]
        stream = replica.engine.add_request(
            GenerationRequest(
                f"req-{n}",
                prompt,
                max_tokens=rng.randint(1, 40),
                lora_name="adapter-a" if n % 3 == 0 else None,
            )
        )
        async for _ in stream:
            pass

    for start in range(0, requests, 8):
        await asyncio.gather(*(one(n) for n in range(start, min(requests, start + 8))))


async def quiesce(index: RedisIndex, replicas: list[Replica]) -> None:
    async with asyncio.timeout(20):
        while True:
            done = [
                # published, not next_seq: a batch still queued in the publisher's thread has
                # changed the engine's cache already
                await index.last_seq(r.id, NAMESPACE) == r.publisher.published - 1
                for r in replicas
            ]
            if all(done):
                await index.flush()
                return
            await asyncio.sleep(0.02)


async def start_tracker(index: RedisIndex, replicas: list[Replica]) -> TrackerService:
    settings = TrackerSettings(
        replica=tuple(
            f"{r.id}={r.publisher.endpoint},replay={r.publisher.replay_endpoint}" for r in replicas
        ),
        model=NAMESPACE.model,
        block_size=NAMESPACE.block_size,
        http_port=0,
        discover=False,
    )
    service = TrackerService(settings, index, CollectorRegistry())
    await service.start()
    await asyncio.sleep(0.2)  # SUB sockets connect; earlier batches come back through replay
    return service


async def assert_consistent(
    index: RedisIndex, client: aioredis.Redis, replicas: list[Replica]
) -> None:
    await quiesce(index, replicas)
    for replica in replicas:
        expected = expected_keys(replica.engine.cached_blocks())
        assert expected, "the workload should leave blocks cached"
        assert await indexed_keys(client, index, replica.id) == expected, replica.id


@pytest.fixture
async def tracked(
    redis_url: str, fleet: list[Replica]
) -> AsyncIterator[tuple[RedisIndex, aioredis.Redis, TrackerService]]:
    """A tracker service consuming the fleet into a RedisIndex, and a raw client to inspect it."""
    index = RedisIndex.from_url(redis_url)
    client = aioredis.Redis.from_url(redis_url)
    service = await start_tracker(index, fleet)
    yield index, client, service
    await service.stop()
    await index.close()
    await client.aclose()


async def test_index_equals_engine_caches_under_eviction(
    fleet: list[Replica], tracked: tuple[RedisIndex, aioredis.Redis, TrackerService]
) -> None:
    index, client, _ = tracked
    await drive(fleet, random.Random(7), 120)
    assert any(len(r.engine.cached_blocks()) >= 80 for r in fleet), (
        "the caches should be under eviction pressure"
    )
    await assert_consistent(index, client, fleet)


async def test_a_lost_message_is_replayed_and_the_index_converges(
    fleet: list[Replica], tracked: tuple[RedisIndex, aioredis.Redis, TrackerService]
) -> None:
    index, client, service = tracked
    rng = random.Random(11)
    await drive(fleet, rng, 40)
    fleet[0].publisher.drop_live(1)
    await drive(fleet, rng, 40)
    await assert_consistent(index, client, fleet)
    gaps = service.registry.get_sample_value(
        "kvrouter_tracker_gaps_total", {"replica": fleet[0].id}
    )
    assert gaps is not None and gaps >= 1
    replays = service.registry.get_sample_value("kvrouter_tracker_replays_total", {"outcome": "ok"})
    assert replays is not None and replays >= 1
