"""LoRA adapters end to end: engines serve an adapter under its own name (as vLLM does), the
router learns it from their ``/v1/models``, and a request for it is matched against the blocks
the engine published for that adapter — never against the base model's blocks."""

from __future__ import annotations

import httpx
import pytest

from router.http.proxy import PREDICTED_HEADER, REPLICA_HEADER
from tests.router.harness import base_url, engines, router, wait_until

pytestmark = pytest.mark.timeout(60)
PROMPT = "You are the adapter's assistant. " * 40 + "Question: why?"


async def _ask(client: httpx.AsyncClient, model: str, salt: str | None = None) -> tuple[int, int]:
    body: dict[str, object] = {"model": model, "prompt": PROMPT, "max_tokens": 4}
    if salt is not None:
        body["cache_salt"] = salt
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return int(response.headers[PREDICTED_HEADER]), int(cached)


@pytest.mark.parametrize("era", ["v0.33.0", "v0.25.1"])  # extra keys with and without the name
async def test_adapter_requests_match_the_adapters_blocks(era: str) -> None:
    async with (
        engines(2, time_scale=0.01, lora_modules=("sql",), era=era) as fleet,
        # no predict-on-route: every match must come from the engines' own events
        router(replica=fleet.specs, predict_ttl_s=0) as service,
        httpx.AsyncClient(base_url=base_url(service), timeout=30) as client,
    ):
        await wait_until(lambda: all(r.adapters for r in service.router.replicas.all()))
        models = {card["id"] for card in (await client.get("/v1/models")).json()["data"]}
        assert models == {"sim", "sql"}

        assert await _ask(client, "sql") == (0, 0)
        await wait_until(lambda: _indexed(client))
        where = (await client.post("/index", json={"model": "sql", "prompt": PROMPT})).json()
        holders = {r for r, m in where["replicas"].items() if m["matched_blocks"] > 0}
        assert len(holders) == 1
        predicted, cached = await _ask(client, "sql")
        assert predicted == cached > 0  # the router's keys are the tracker's keys
        # the base model's keys differ: its first request is cold, and predicted so
        assert await _ask(client, "sim") == (0, 0)
        # a cache salt separates it again, for the adapter as for the base model
        assert await _ask(client, "sql", salt="tenant-2") == (0, 0)
        await wait_until(lambda: _indexed(client, salt="tenant-2"))
        predicted, cached = await _ask(client, "sql", salt="tenant-2")
        assert predicted == cached > 0


async def _indexed(client: httpx.AsyncClient, salt: str | None = None) -> bool:
    query: dict[str, object] = {"model": "sql", "prompt": PROMPT}
    if salt is not None:
        query["cache_salt"] = salt
    where = (await client.post("/index", json=query)).json()
    return any(m["matched_blocks"] for m in where["replicas"].values())


async def test_an_adapter_no_replica_serves_is_a_404() -> None:
    async with (
        engines(1, time_scale=0.01) as fleet,
        router(replica=fleet.specs) as service,
        httpx.AsyncClient(base_url=base_url(service), timeout=30) as client,
    ):
        response = await client.post("/v1/completions", json={"model": "sql", "prompt": "x"})
        assert response.status_code == 404
        assert "sql" in response.json()["error"]["message"]
        assert REPLICA_HEADER not in response.headers
