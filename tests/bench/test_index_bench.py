"""The index benchmark's Redis capacity stage, run small against the session's redis-server."""

from __future__ import annotations

from bench.index_bench import redis_cpu_s, request_capacity
from tracker.core.redis_index import RedisIndex


async def test_router_requests_per_redis_core_second(redis_url: str) -> None:
    index = RedisIndex.from_url(redis_url)
    try:
        before = redis_cpu_s(redis_url)
        result = await request_capacity(
            index, redis_url, 64, new_share=0.1, concurrency=2, seconds=0.3
        )
    finally:
        await index.close()
    assert redis_cpu_s(redis_url) > before  # Redis did the work, and INFO cpu says so
    assert result["chain_blocks"] == 64
    assert result["requests_per_s"] > 0
    assert result["redis_cpu_ms_per_request"] > 0
    assert result["capacity_per_s"] > 0
    assert 0 < result["redis_cpu_share"] <= 1.5  # one Redis thread (plus its I/O)
