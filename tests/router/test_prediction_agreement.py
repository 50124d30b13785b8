"""The router's predicted cached tokens vs what the engines report, on a shared-prefix workload.

Four groups of eight chat requests; each group shares a ~1.5k-token system prompt. After one
warm-up request per group, groups run concurrently, the requests of a group one after
another (steady state: each request finds its group's prefix computed). Per response the
router's ``x-kvrouter-cached-tokens-predicted`` is compared with the engine's
``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from router.http.proxy import PREDICTED_HEADER, REPLICA_HEADER
from tests.router.harness import base_url, engines, metric, router

pytestmark = pytest.mark.timeout(60)
GROUPS = 4
PER_GROUP = 8


def _system(group: int) -> str:
    return f"[tenant {group}] " + f"Policy {group}: answer briefly and cite the handbook. " * 28


async def _one(client: httpx.AsyncClient, group: int, i: int) -> tuple[int, int, str]:
    messages = [
        {"role": "system", "content": _system(group)},
        {"role": "user", "content": f"question {i} of tenant {group}: " + "why? " * i},
    ]
    body = {"model": "sim", "messages": messages, "max_tokens": 8}
    if i % 2:  # half of them streamed, reading the usage chunk
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = [line async for line in response.aiter_lines() if line.startswith("data: {")]
            usage = json.loads(lines[-1][6:])["usage"]
            headers = response.headers
    else:
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        usage, headers = response.json()["usage"], response.headers
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return int(headers[PREDICTED_HEADER]), cached, headers[REPLICA_HEADER]


async def test_predictions_agree_with_engine_cached_tokens() -> None:
    async with (
        engines(4, time_scale=0.05) as fleet,
        router(replica=fleet.specs) as service,
        httpx.AsyncClient(base_url=base_url(service), timeout=30) as client,
    ):
        for g in range(GROUPS):  # warm-up: each group's first request, one at a time
            await _one(client, g, 0)

        async def group(g: int) -> list[tuple[int, int, str]]:
            return [await _one(client, g, i) for i in range(1, PER_GROUP)]

        results = await asyncio.gather(*(group(g) for g in range(GROUPS)))
        page = (await client.get("/metrics")).text
    steady = [r for rows in results for r in rows]
    agree = sum(predicted == cached for predicted, cached, _ in steady)
    ratio = agree / len(steady)
    hit_tokens = sum(cached for _, cached, _ in steady)
    print(
        f"\nprediction agreement: {agree}/{len(steady)} = {ratio:.3f} "
        f"(engine-reported cached tokens {hit_tokens}, "
        f"predicted {sum(p for p, _, _ in steady)})"
    )
    assert ratio >= 0.9
    # the prefixes really were reused (a request may leave a busy replica for a cold one
    # when the policy expects that to be as fast)
    assert sum(cached > 1000 for _, cached, _ in steady) >= 0.75 * len(steady)
    assert metric(page, "kvrouter_router_cache_predictions_total", outcome="agree") >= agree
    assert metric(page, "kvrouter_router_hash_mismatch", model="sim") == 0
