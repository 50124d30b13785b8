"""TrackerService: HTTP endpoints, registry discovery, fencing, reaping and lifecycle."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest
import redis
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tests.factories import SMALL
from tests.procs import free_port
from tests.tracker.publisher import EventPublisher
from tests.tracker.tracking import (
    A_TOKENS,
    ANY,
    ROOTS,
    block_a,
    held,
    root,
    sample,
    settings,
    wait_until,
)
from tracker.core.blocks import Namespace
from tracker.core.index import BlockIndex, ReplicaRecord
from tracker.core.memory_index import MemoryIndex
from tracker.core.redis_index import RedisIndex
from tracker.ingest.service import TrackerService, static_targets
from tracker.ingest.streams import ReplicaTarget


@pytest.fixture
async def publisher(zctx: zmq.asyncio.Context) -> AsyncIterator[EventPublisher]:
    pub = await EventPublisher(zctx, ANY).start()
    yield pub
    await pub.close()


@pytest.fixture
async def make_service() -> AsyncIterator[Callable[..., Any]]:
    """Starts tracker services; stops them at teardown. A test that also takes
    ``redis_index`` names it first: the services must stop before the index closes (a
    service still writing to a closed client leaks its connection)."""
    services: list[TrackerService] = []

    async def make(index: BlockIndex, **overrides: Any) -> TrackerService:
        service = TrackerService(settings(**overrides), index, CollectorRegistry())
        await service.start()
        services.append(service)
        return service

    yield make
    for service in services:
        await service.stop()


def _blocks(service: TrackerService, replica: str) -> int | None:
    stream = service.subscriber.get(replica)
    return None if stream is None else stream.applier.blocks


async def _empty(placements: Awaitable[dict[str, int]]) -> bool:
    return not await placements


def record(pub: EventPublisher, **fields: Any) -> ReplicaRecord:
    values: dict[str, Any] = {
        "id": "r9",
        "model": SMALL.model,
        "block_size": SMALL.block_size,
        "events": pub.endpoint,
        "instance": "a",
        "ttl_s": 30.0,
    }
    values.update(fields)
    return ReplicaRecord(**values)


def test_static_targets_take_namespace_from_spec_or_settings() -> None:
    config = settings(
        replica=(
            "r1=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558",
            "r2=tcp://h:1,model=x,block_size=8",
        ),
    )
    assert static_targets(config) == [
        ReplicaTarget("r1", SMALL, "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"),
        ReplicaTarget("r2", Namespace("x", 8), "tcp://h:1"),
    ]


async def test_metrics_and_health_endpoints(make_service: Any, publisher: EventPublisher) -> None:
    service = await make_service(
        MemoryIndex(), replica=(f"r1={publisher.endpoint}",), http_port=free_port()
    )
    await publisher.wait_subscribed()
    await publisher.publish(block_a())
    stream = service.subscriber.get("r1")
    assert stream is not None
    await wait_until(lambda: stream.applier.last == 0)

    base = f"http://127.0.0.1:{service.http_port}"
    async with httpx.AsyncClient(base_url=base) as client:
        health = await client.get("/health")
        scraped = await client.get("/metrics")
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "ok"
    assert body["index"]["reachable"] is True
    assert body["replicas"]["r1"]["last_seq"] == 0
    assert body["replicas"]["r1"]["blocks"] == 2
    assert body["replicas"]["r1"]["mode"] == "connect"

    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(scraped.text)
        for s in family.samples
    }
    assert samples[("kvrouter_tracker_events_total", (("type", "BlockStored"),))] == 1
    assert samples[("kvrouter_tracker_replica_blocks", (("replica", "r1"),))] == 2
    assert samples[("kvrouter_tracker_replicas", ())] == 1
    assert samples[("kvrouter_tracker_resets_total", (("cause", "seq_reset"),))] == 0


async def test_registry_discovery_fencing_and_reaping(
    redis_index: RedisIndex, make_service: Any, publisher: EventPublisher
) -> None:
    service = await make_service(redis_index, reap_interval_s=0.05)
    await redis_index.register(record(publisher))
    await wait_until(lambda: service.subscriber.get("r9") is not None, what="discovery")
    await publisher.wait_subscribed()
    await publisher.publish(block_a())
    await wait_until(lambda: held(redis_index, A_TOKENS), what="blocks applied")
    assert await held(redis_index, A_TOKENS) == {"r9": 2}

    await redis_index.register(record(publisher, instance="b"))  # the engine restarted
    await wait_until(
        lambda: (
            sample(service.registry, "kvrouter_tracker_resets_total", cause="instance_change") == 1
        )
    )
    await wait_until(lambda: _blocks(service, "r9") == 0)
    assert await held(redis_index, A_TOKENS) == {}
    await publisher.publish(root("D"))
    await wait_until(lambda: held(redis_index, ROOTS["D"][0]), what="new blocks applied")

    await redis_index.register(record(publisher, instance="b", ttl_s=0.2))  # then goes silent
    await wait_until(lambda: service.subscriber.get("r9") is None, what="expiry")
    await wait_until(lambda: _empty(held(redis_index, ROOTS["D"][0])), what="blocks forgotten")
    assert sample(service.registry, "kvrouter_tracker_resets_total", cause="expired") == 1
    assert sample(service.registry, "kvrouter_tracker_replicas") == 0
    assert await redis_index.replicas() == []


async def test_deregistered_replica_is_forgotten_once_missing_for_its_ttl(
    make_service: Any, publisher: EventPublisher
) -> None:
    index = MemoryIndex()
    service = await make_service(index, reap_interval_s=0.05)
    await index.register(record(publisher, ttl_s=1.5))
    await wait_until(lambda: service.subscriber.get("r9") is not None)
    await publisher.wait_subscribed()
    await publisher.publish(block_a())
    await wait_until(lambda: held(index, A_TOKENS))

    await index.deregister("r9")
    gone = time.monotonic()
    await asyncio.sleep(0.5)  # missing, not gone yet: a Redis restarted empty looks the same
    assert service.subscriber.get("r9") is not None
    assert await held(index, A_TOKENS) == {"r9": 2}
    await wait_until(lambda: service.subscriber.get("r9") is None)
    assert time.monotonic() - gone >= 1.5
    await wait_until(lambda: _empty(held(index, A_TOKENS)), what="blocks forgotten")


async def test_a_registry_emptied_and_refilled_keeps_the_replica_and_its_blocks(
    make_service: Any, publisher: EventPublisher
) -> None:
    index = MemoryIndex()
    service = await make_service(index, reap_interval_s=0.05)
    await index.register(record(publisher))
    await wait_until(lambda: service.subscriber.get("r9") is not None)
    await publisher.wait_subscribed()
    await publisher.publish(block_a())
    await wait_until(lambda: held(index, A_TOKENS))
    stream = service.subscriber.get("r9")

    await index.deregister("r9")  # what a Redis restart without persistence does
    await asyncio.sleep(0.3)
    await index.register(record(publisher))  # the replica's next heartbeat
    await asyncio.sleep(0.3)
    assert service.subscriber.get("r9") is stream
    assert await held(index, A_TOKENS) == {"r9": 2}
    assert sample(service.registry, "kvrouter_tracker_resets_total", cause="expired") == 0


async def test_unusable_registry_records_are_skipped(
    make_service: Any, publisher: EventPublisher
) -> None:
    index = MemoryIndex()
    service = await make_service(index, reap_interval_s=0.05)
    await index.register(record(publisher, id="bad-endpoint", events="tcp://*:5557"))
    await index.register(record(publisher, id="no-endpoint", events=None))
    await index.register(record(publisher))
    await wait_until(lambda: service.subscriber.get("r9") is not None)
    await publisher.wait_subscribed()
    await publisher.publish(block_a())
    await wait_until(lambda: held(index, A_TOKENS))
    assert set(service.subscriber.status()) == {"r9"}
    assert (await service.health())["status"] == "ok"


async def test_static_replica_expiry_clears_but_keeps_tracking(
    make_service: Any, publisher: EventPublisher
) -> None:
    index = MemoryIndex()
    service = await make_service(index, replica=(f"r9={publisher.endpoint}",), reap_interval_s=0.05)
    await publisher.wait_subscribed()
    await publisher.publish(block_a())
    await wait_until(lambda: held(index, A_TOKENS))
    await index.register(record(publisher, ttl_s=0.1))
    await wait_until(
        lambda: sample(service.registry, "kvrouter_tracker_resets_total", cause="expired") == 1
    )
    await wait_until(lambda: _blocks(service, "r9") == 0)
    assert await held(index, A_TOKENS) == {}
    await publisher.publish(root("D"))  # still tracked
    await wait_until(lambda: held(index, ROOTS["D"][0]))


async def test_run_returns_zero_when_stopped() -> None:
    service = TrackerService(settings(http_port=free_port()), MemoryIndex(), CollectorRegistry())
    task = asyncio.create_task(service.run())
    await wait_until(lambda: service.http_port is not None)
    async with httpx.AsyncClient() as client:
        response = await client.get(f"http://127.0.0.1:{service.http_port}/health")
    assert response.json() == {
        "status": "ok",
        "role": "active",
        "index": {"backend": "MemoryIndex", "reachable": True, "writes_pending": False},
        "replicas": {},
    }
    service.request_stop()
    async with asyncio.timeout(5):
        assert await task == 0


async def test_run_returns_one_when_startup_fails(zctx: zmq.asyncio.Context) -> None:
    taken = zctx.socket(zmq.PUB)
    try:
        taken.bind("tcp://127.0.0.1:*")
        endpoint = taken.getsockopt_string(zmq.LAST_ENDPOINT)
        service = TrackerService(settings(bind=endpoint), MemoryIndex(), CollectorRegistry())
        async with asyncio.timeout(5):
            assert await service.run() == 1
    finally:
        taken.close(linger=0)


@pytest.fixture
def eviction_policy(redis_url: str) -> Iterator[Callable[[str], None]]:
    """Sets the session redis-server's maxmemory-policy; noeviction again afterwards."""
    client = redis.Redis.from_url(redis_url)

    def set_policy(policy: str) -> None:
        client.config_set("maxmemory-policy", policy)

    yield set_policy
    set_policy("noeviction")
    client.close()


@pytest.mark.parametrize("policy", ["allkeys-lru", "allkeys-lfu", "allkeys-random"])
async def test_a_redis_that_would_evict_index_keys_is_refused_at_start(
    redis_url: str,
    eviction_policy: Callable[[str], None],
    policy: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    eviction_policy(policy)
    index = RedisIndex.from_url(redis_url)
    try:
        service = TrackerService(settings(http_port=free_port()), index, CollectorRegistry())
        async with asyncio.timeout(5):
            assert await service.run() == 1
    finally:
        await index.close()
    errors = [str(getattr(r, "error", "")) for r in caplog.records]
    why = next(e for e in errors if f"maxmemory-policy is {policy}" in e)
    assert "set 'maxmemory-policy noeviction'" in why  # and what to do about it


async def test_redis_memory_in_health_and_metrics_budget_and_a_policy_changed_later(
    redis_index: RedisIndex, make_service: Any, eviction_policy: Callable[[str], None]
) -> None:
    # volatile-* policies evict only keys with a TTL (leases, load), never the index's
    eviction_policy("volatile-lru")
    service = await make_service(redis_index, http_port=free_port(), memory_check_s=0.05)
    base = f"http://127.0.0.1:{service.http_port}"
    async with httpx.AsyncClient(base_url=base) as client:
        body = (await client.get("/health")).json()
        assert body["status"] == "ok"
        memory = body["index"]["memory"]
        assert memory["policy"] == "volatile-lru" and memory["problem"] is None
        assert memory["used_bytes"] > 0 and memory["budget_bytes"] == 0

        eviction_policy("allkeys-lru")  # an operator changes it while the tracker runs

        async def degraded() -> bool:
            response = await client.get("/health")
            return response.status_code == 503

        await wait_until(degraded)
        problem = (await client.get("/health")).json()["index"]["memory"]["problem"]
        assert "allkeys-lru" in problem
        assert sample(service.registry, "kvrouter_tracker_redis_evicting_policy") == 1
        assert sample(service.registry, "kvrouter_tracker_redis_memory_used_bytes") > 0
        eviction_policy("noeviction")

        async def healthy() -> bool:
            return (await client.get("/health")).status_code == 200

        await wait_until(healthy)


async def test_redis_memory_over_the_budget_degrades_health(
    redis_index: RedisIndex, make_service: Any
) -> None:
    # a budget of 1 KiB: any redis-server uses more than that
    service = await make_service(redis_index, http_port=free_port(), memory_budget_mb=1 / 1024)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.http_port}") as client:
        response = await client.get("/health")
    assert response.status_code == 503
    memory = response.json()["index"]["memory"]
    assert memory["budget_bytes"] == 1024
    assert "over the index's budget of 0.000976562 MiB" in memory["problem"]
    assert sample(service.registry, "kvrouter_tracker_redis_memory_budget_bytes") == 1024
    assert sample(service.registry, "kvrouter_tracker_redis_memory_used_bytes") > 1024
    assert service.registry.get_sample_value("kvrouter_tracker_redis_evicting_policy") == 0


def test_memory_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="memory_budget_mb"):
        settings(memory_budget_mb=-1)
    with pytest.raises(ValueError, match="memory_check_s"):
        settings(memory_check_s=0)
