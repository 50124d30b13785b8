"""The BlockIndex contract on every backend: the replica registry, apart from the blocks."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tests.tracker.contract import SEQ, matches, put, store
from tracker.core.index import BlockIndex, ReplicaRecord

# ------------------------------------------------------------------ registry


def record(replica: str, **fields: Any) -> ReplicaRecord:
    return ReplicaRecord(id=replica, model="llama", block_size=4, **fields)


async def test_register_list_and_deregister(index: BlockIndex) -> None:
    assert await index.replicas() == []
    before = time.time()
    await index.register(record("r1", url="http://h1:8000", events="tcp://h1:5557"))
    await index.register(record("r2", instance="boot-1"))
    listed = {r.id: r for r in await index.replicas()}
    assert set(listed) == {"r1", "r2"}
    assert listed["r1"].url == "http://h1:8000"
    assert listed["r1"].events == "tcp://h1:5557"
    assert listed["r2"].instance == "boot-1"
    for entry in listed.values():
        assert before - 1 <= entry.last_seen <= time.time() + 1
    await index.register(record("r1", url="http://h1:9000"))
    listed = {r.id: r for r in await index.replicas()}
    assert listed["r1"].url == "http://h1:9000"
    await index.deregister("r1")
    await index.deregister("never-registered")
    assert [r.id for r in await index.replicas()] == ["r2"]


async def test_reap_removes_only_stale_entries(index: BlockIndex) -> None:
    await index.register(record("short", ttl_s=0.05))
    await index.register(record("long", ttl_s=60))
    assert await index.reap() == []
    await asyncio.sleep(0.15)
    reaped = await index.reap()
    assert [r.id for r in reaped] == ["short"]
    assert [r.id for r in await index.replicas()] == ["long"]
    assert await index.reap() == []
    # A heartbeat brings it back.
    await index.register(record("short", ttl_s=0.05))
    assert {r.id for r in await index.replicas()} == {"short", "long"}


async def test_registry_and_blocks_are_independent(index: BlockIndex) -> None:
    await put(index, "r1", store(SEQ))
    await index.register(record("r1"))
    await index.deregister("r1")
    assert await matches(index, SEQ) == {"r1": (4, 4)}
