"""A new prefix's second request, sent while its first is still prefilling, joins it.

Two simulated engines in real time (their prefill is an H200's: a ~2,000-token prompt takes
~90 ms) behind one router seeded with that speed. The second request of each new system
prompt arrives while the first prefills at home: waiting there for that prefill and
prefilling the prompt again on the idle engine are within a few percent by the estimate, and
the idle engine only looked cheaper while the queue counted the home's prefill as not
begun. A copy there costs a whole prefill of cache that the caches will want back; both must
land on one engine, and the second must find the prompt cached.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from router.http.proxy import REPLICA_HEADER
from tests.router.harness import base_url, chat, engines, router, wait_until

pytestmark = pytest.mark.timeout(60)


def _system(group: int) -> str:
    return f"{group} " * 3 + f"Rule {group}: answer briefly and cite the source. " * 60


async def test_the_second_request_of_a_new_prefix_waits_for_its_first_at_home() -> None:
    async with (
        engines(2, time_scale=1.0) as fleet,
        router(replica=fleet.specs, predict_ttl_s=5.0) as service,
        httpx.AsyncClient(base_url=base_url(service), timeout=20) as client,
    ):
        for group in range(4):
            system = _system(group)
            first = asyncio.create_task(
                client.post("/v1/chat/completions", json=chat(system, "first"))
            )
            # the second comes while the first prefills (~90 ms), however busy the host
            await wait_until(lambda: fleet.running() > 0, within=5.0, interval=0.001)
            second = await client.post("/v1/chat/completions", json=chat(system, "second"))
            answer = await first
            assert answer.status_code == second.status_code == 200
            assert second.headers[REPLICA_HEADER] == answer.headers[REPLICA_HEADER], group
            cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached > 1500, group
